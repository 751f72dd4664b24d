"""Models compared on relative depth: where in its stack each model does what, side by side, from
the tables the other analyses computed (methods §3, §13-16), with each paper's findings per model
and what confounds the comparison. Only what every compared model has is shown: a (task,
quantity) that one model lacks is left out, and with fewer than two models the analysis gives
nothing.

Table ``model_comparison``: per (model, revision, task, ``quantity``), quantities in
:data:`QUANTITIES` order: ``n_blocks`` L, ``n_units`` (what the value is over: documents, or a
choice task's instances), ``value``, ``ci_low`` and ``ci_high`` (the source table's 95% interval,
null where it gives none). Every quantity but ``sink_rate`` is a relative depth in [0, 1]:

- ``ed_cos``, ``ed_kl``, ``ed_top5``: the effective depth ratio (ED + 1) / L (``effective_depth``,
  methods §15; null: no crossing);
- ``decided``: the mean relative decided-at depth over every token (``decided_depth``, §16);
- ``igrad_block``, ``igrad_attn``, ``igrad_mlp``: the relative depth score of |IG| per site
  (``igrad_depth``, §13);
- ``erasure``: the relative depth score of the erasure effects (``erasure_depth`` and
  ``choice_erasure_depth``, §14);
- ``saturation``: the share j / (2L + 1) of the components at which accuracy saturates
  (``saturation``, §3);
- ``sink_rate``: the share of heads that are attention sinks (``sink_rate``, §16).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.analyses.depth import decay_verdicts
from layerdiv.analyze.analyses.paper import correlation_verdicts, submodularity_verdicts
from layerdiv.analyze.markdown import DASH, Judged, fmt, judged, markdown_table
from layerdiv.analyze.metrics import METRICS
from layerdiv.analyze.overlap import independent
from layerdiv.analyze.registry import Analysis, Context, ReportContext
from layerdiv.analyze.stats import LEVEL
from layerdiv.measurements.heads.report import beat_verdicts
from layerdiv.measurements.skips.analysis import skip_verdicts
from layerdiv.schemas import SUBLAYERS
from layerdiv.store.key import KEY, MODEL_KEY

SITE_NAMES = {"block": "block outputs", "attn": "attention outputs", "mlp": "MLP outputs"}
"""What each igrad site (``igrad_sites``) attributes to."""

QUANTITIES = {
    "ed_cos": "ED_cos: update cosines cross zero",
    "ed_kl": "ED_KL: lens KL below 0.1 x max",
    "ed_top5": "ED_top5: lens top-5 overlap > 0.2",
    "decided": "decided-at depth (mean over tokens)",
    **{f"igrad_{site}": f"|IG| depth score, {SITE_NAMES[site]}" for site in SUBLAYERS},
    "erasure": "erasure depth score",
    "saturation": "accuracy saturates (j / components)",
    "sink_rate": "sink rate (share of heads)",
}
"""Each quantity of ``model_comparison`` and what it is, in table and figure order."""

SCHEMA = {
    **dict.fromkeys(KEY, pl.String),
    "quantity": pl.String,
    "n_blocks": pl.Int64,
    "n_units": pl.Int64,
    "value": pl.Float64,
    "ci_low": pl.Float64,
    "ci_high": pl.Float64,
}
"""The columns of ``model_comparison``."""

SOURCES: dict[str, tuple[str, ...]] = {
    "effective_depth": ("ratio", "ci_low", "ci_high", "n_documents"),
    "decided_depth": ("mean", "ci_low", "ci_high", "n_documents"),
    "igrad_depth": ("relative", "relative_low", "relative_high", "n_documents"),
    "erasure_depth": ("relative", "relative_low", "relative_high", "n_documents"),
    "choice_erasure_depth": ("relative", "relative_low", "relative_high", "n_documents"),
    "sink_rate": ("sink_rate", "ci_low", "ci_high", "n_units"),
}
"""Per source table, its value, interval and count columns."""


def _quantity(table: str) -> pl.Expr:
    """The ``quantity`` of the rows of source ``table``."""
    if table == "effective_depth":
        return "ed_" + pl.col("measure")
    if table == "igrad_depth":
        return "igrad_" + pl.col("sublayer")
    if table.endswith("erasure_depth"):
        return pl.lit("erasure")
    return pl.lit({"decided_depth": "decided", "sink_rate": "sink_rate"}[table])


def comparison(prior: Mapping[str, pl.DataFrame], blocks: pl.DataFrame) -> pl.DataFrame:
    """``model_comparison`` from the tables of the analyses run before (``prior``) and the blocks
    L and instances of the selected partitions (``blocks``: key, ``n_blocks``, ``n_done``): every
    model's row of a (task, quantity) that each model with any of them has (a model with states
    only is no part of it), none with fewer than two such models."""
    frames = []
    for table, (value, low, high, n) in SOURCES.items():
        if table not in prior:
            continue
        rows = prior[table]
        if table == "decided_depth":
            rows = rows.filter(pl.col("group") == "all")
        frames.append(
            rows.select(
                *KEY,
                _quantity(table).alias("quantity"),
                pl.col(n).alias("n_units"),
                pl.col(value).alias("value"),
                pl.col(low).alias("ci_low"),
                pl.col(high).alias("ci_high"),
            )
        )
    if "saturation" in prior:
        frames.append(
            prior["saturation"]
            .join(blocks, on=[*KEY])
            .select(
                *KEY,
                pl.lit("saturation").alias("quantity"),
                pl.col("n_done").alias("n_units"),
                pl.col("saturation_fraction").alias("value"),
                pl.lit(None, pl.Float64).alias("ci_low"),
                pl.lit(None, pl.Float64).alias("ci_high"),
            )
        )
    if not frames:
        return pl.DataFrame(schema=SCHEMA)
    long = pl.concat([f.cast({"n_units": pl.Int64}) for f in frames], how="vertical_relaxed")
    long = long.join(blocks.select(*KEY), on=[*KEY], how="semi")
    models = long.select(*MODEL_KEY).unique().height  # a model with none of them is left out
    if models < 2:
        return pl.DataFrame(schema=SCHEMA)
    shared = long.filter(pl.struct(*MODEL_KEY).n_unique().over("task", "quantity") == models)
    order = pl.col("quantity").replace_strict(
        list(QUANTITIES), range(len(QUANTITIES)), default=len(QUANTITIES)
    )
    return (
        shared.join(blocks.select(*KEY, "n_blocks"), on=[*KEY])
        .select(list(SCHEMA))
        .cast(SCHEMA)  # type: ignore[arg-type]
        .sort("task", order, *MODEL_KEY)
    )


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: ``model_comparison`` of the selected partitions."""
    blocks = pl.DataFrame(
        [
            {**dict(p.key.items()), "n_blocks": p.manifest.n_blocks, "n_done": p.n_done}
            for p in ctx.parts
        ],
        schema={**dict.fromkeys(KEY, pl.String), "n_blocks": pl.Int64, "n_done": pl.Int64},
    )
    return {"model_comparison": comparison(prior, blocks)}


# --- report ------------------------------------------------------------------------------------


def shared(
    frame: pl.DataFrame, models: Sequence[str], by: Sequence[str] = ("task",)
) -> pl.DataFrame:
    """The rows of ``frame`` (of ``models`` only) whose values of ``by`` every one of ``models``
    has: what a side-by-side figure or table can show."""
    mine = frame.filter(pl.col("model").is_in(list(models)))
    return mine.filter(pl.col("model").n_unique().over(*by) == len(models))


def _names(ctx: ReportContext, models: Sequence[str]) -> dict[str, str]:
    short = plots.short_names(ctx.names)
    return {m: short.get(m, m) for m in models}


def table1(ctx: ReportContext, models: Sequence[str]) -> str:
    """Table 1 side by side: per task that every model has (its independent tasks), each metric
    of the full stack per model, in the estimator's units."""
    frame = ctx.tables["scores"].filter(pl.col("estimator") == ctx.estimator)
    frame = shared(independent(frame, ctx.tables["manifests"]), models)
    if not frame.height:
        return ""
    names = _names(ctx, models)
    header = ["Task"] + [
        f"{metric.title} ({metric.unit(ctx.estimator).label}), {names[m]}"
        for metric in METRICS.values()
        for m in models
    ]
    rows = []
    for task in sorted(frame["task"].unique()):
        row = [task]
        for metric in METRICS.values():
            unit = metric.unit(ctx.estimator)
            for m in models:
                sub = frame.filter(pl.col("task") == task, pl.col("model") == m)
                row.append(fmt(sub[metric.name][0], unit.scale, unit.digits))
        rows.append(row)
    return markdown_table(header, rows)


def curves_figure(ctx: ReportContext, models: Sequence[str]) -> plots.Figure | None:
    """The layer-addition curves on relative depth j / (2L + 1): a panel per (metric, task), a
    line per model (the independent tasks every model has)."""
    curves = ctx.tables["curves"].filter(pl.col("estimator") == ctx.estimator)
    curves = shared(independent(curves, ctx.tables["manifests"]), models)
    if not curves.height:
        return None
    names, color = _names(ctx, models), plots.model_colors(models)
    tasks = sorted(curves["task"].unique())
    panels = []
    for metric in ("accuracy", "bias", "diversity"):
        unit = METRICS[metric].unit(ctx.estimator)
        for task in tasks:
            panel = plots.Panel(f"{METRICS[metric].title}, {task}", xlabel="relative depth j / J",
                                ylabel=unit.label, xrange=(0, 1.02))  # fmt: skip
            for m in models:
                sub = curves.filter(pl.col("task") == task, pl.col("model") == m).sort("j")
                panel.series.append(
                    plots.Series(
                        names[m],
                        sub["relative_depth"].to_list(),
                        (sub[metric] * unit.scale).to_list(),
                        color=color[m],
                        marker=None,
                    )
                )
            panels.append(panel)
    return plots.Figure(
        "Layer-addition curves on relative depth (methods §3)",
        panels,
        cols=len(tasks),
        panel_size=(4.0, 2.9),
        caption=f"the first j of J components; estimator {ctx.estimator}",
    )


def depth_figure(table: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """A panel per quantity of ``model_comparison``: each model's value with its interval, a
    colour per task."""
    tasks = sorted(table["task"].unique())
    color = dict(zip(tasks, plots.colors(len(tasks)), strict=False))
    panels = []
    for quantity, title in QUANTITIES.items():
        rows = table.filter(pl.col("quantity") == quantity)
        if not rows.height:
            continue
        relative = quantity != "sink_rate"
        panel = plots.Panel(title, xlabel="model", yrange=(0, 1.05),
                            ylabel="relative depth" if relative else "share")  # fmt: skip
        for task in tasks:
            sub = rows.filter(pl.col("task") == task, pl.col("value").is_not_null())
            if sub.height:
                panel.series.append(
                    plots.Series(
                        task,
                        [names[m] for m in sub["model"]],
                        sub["value"].to_list(),
                        color=color[task],
                        line=False,
                        interval=plots.interval_ends(sub),
                    )
                )
        if none := rows.filter(pl.col("value").is_null()).height:
            panel.notes.append(f"{none} without a value (no crossing) not drawn")
        panels.append(panel)
    return plots.Figure("Where each model does what, on relative depth", panels, cols=3,
                        panel_size=(3.8, 3.2),
                        caption=f"bars: the source table's {LEVEL:g}% interval")  # fmt: skip


def depth_table(table: pl.DataFrame, names: dict[str, str]) -> str:
    """``model_comparison`` as a table: a row per (quantity, task), a cell per model."""
    rows = []
    for (quantity, task), sub in table.group_by("quantity", "task", maintain_order=True):
        cells = []
        for m in names:
            r = sub.filter(pl.col("model") == m).row(0, named=True)
            interval = (
                f" [{fmt(r['ci_low'], digits=2)}, {fmt(r['ci_high'], digits=2)}]"
                if r["ci_low"] is not None
                else ""
            )
            value = "none" if r["value"] is None else fmt(r["value"], digits=2)
            cells.append(f"{value}{interval} (n = {r['n_units']}, L = {r['n_blocks']})")
        rows.append([QUANTITIES[str(quantity)], str(task), *cells])
    return markdown_table(["Quantity", "Task", *names.values()], rows)


def per_block_figure(
    title: str,
    frames: Sequence[tuple[str, pl.DataFrame, str, str]],
    names: dict[str, str],
    yscale: plots.Scale = "linear",
    caption: str = "",
) -> plots.Figure | None:
    """Panels of per-block profiles on relative depth, a line per model: for each (panel title,
    rows with ``relative_depth``, the y column, its label) one panel per task of the rows (rows
    every model has, :func:`shared`); None where no panel has data."""
    models, color = list(names), plots.model_colors(list(names))
    panels = []
    for name, rows, y, label in frames:
        rows = shared(rows, models)
        for task in sorted(rows["task"].unique()):
            panel = plots.Panel(f"{name}, {task}", xlabel="relative depth", ylabel=label,
                                yscale=yscale, xrange=(0, 1.02))  # fmt: skip
            for m in models:
                sub = rows.filter(pl.col("task") == task, pl.col("model") == m)
                sub = sub.sort("relative_depth")
                has = "ci_low" in sub.columns
                panel.series.append(
                    plots.Series(
                        names[m],
                        sub["relative_depth"].to_list(),
                        sub[y].to_list(),
                        color=color[m],
                        marker=None,
                        interval=plots.interval_ends(sub) if has else None,
                    )
                )
            panels.append(panel)
    if not panels:
        return None
    return plots.Figure(title, panels, cols=min(3, len(panels)), panel_size=(4.2, 3.2),
                        caption=caption)  # fmt: skip


def _relative(table: pl.DataFrame, column: str, offset: int) -> pl.DataFrame:
    """``table`` with ``relative_depth`` = (``column`` + ``offset``) / L, L the blocks of the
    partition (the largest block index + 1)."""
    blocks = pl.col("block").max().over(*KEY) + 1
    return table.with_columns(((pl.col(column) + offset) / blocks).alias("relative_depth"))


PAPERS = {
    "correlation": "Diversity of layers (reference paper)",
    "submodularity": "Diversity of layers (reference paper)",
    "decay": "Inverse-depth paper",
    "halves": "Depth-efficiency paper",
    "skips": "Depth-efficiency paper",
    "heads": "LLMDecomp (heads)",
}
"""The paper of each group of findings :func:`findings` collects."""

HOLDS = {
    "agrees": "holds",
    "does not agree": "does not hold",
    "cannot tell": "cannot tell",
    "too few to tell": "too few to tell",
}
"""A verdict's outcome as the findings table says it."""

MODEL = "the model"
"""What the findings' texts call the model (the same text for every model: one row each)."""


def findings(ctx: ReportContext, model: str) -> list[tuple[str, Judged]]:
    """Each paper's findings on ``model`` (paper, verdict), by the report sections' own verdicts
    (:func:`~layerdiv.analyze.markdown.judged`) on its rows alone."""
    tables = {k: v.filter(pl.col("model") == model) if "model" in v.columns else v
              for k, v in ctx.tables.items()}  # fmt: skip
    one = replace(ctx, tables=tables, names={model: MODEL})
    sources: dict[str, Callable[[], str]] = {}
    if "correlations" in tables:
        sources["correlation"] = lambda: correlation_verdicts(one)
    if "depth_curves" in tables and tables["depth_fits"].height:
        sources["submodularity"] = lambda: submodularity_verdicts(one)
    if "depth_decay" in tables:
        sources["decay"] = lambda: decay_verdicts(tables, one.names)
    if "skip_halves" in tables:
        sources["skips"] = lambda: skip_verdicts(tables, one.names)
    if "head_summary" in tables:
        sources["heads"] = lambda: beat_verdicts(tables["head_summary"], one.names)
    out = []
    for source, run in sources.items():
        with judged() as found:
            run()
        for j in found:  # decay_verdicts also judges the depth-efficiency paper's halves
            paper = "halves" if source == "decay" and j.statistic != "β" else source
            out.append((PAPERS[paper], replace(j, finding=j.finding.removeprefix(MODEL + ", ")
                                               .removeprefix(MODEL + ": "))))  # fmt: skip
    return out


def _link(ctx: ReportContext, file: str, caption: str, figure: plots.Figure) -> str:
    return plots.figure_link(ctx, file, caption, lambda: figure)


def _finding(text: str) -> tuple[str, str]:
    """A verdict's finding without its closing parenthesis (what it says of one model, e.g. its
    fit's R² or its head count), and that parenthesis's text."""
    base, _, detail = text.partition(" (")
    return base, detail.removesuffix(")")


def _judged_cell(j: Judged) -> str:
    interval = (
        f" [{fmt(j.interval[0], digits=j.digits)}, {fmt(j.interval[1], digits=j.digits)}]"
        if j.interval is not None
        else ""
    )
    detail = "; ".join(["n = " + str(j.n), *[d for d in [_finding(j.finding)[1]] if d]])
    return f"{HOLDS[j.outcome]}: {fmt(j.value, digits=j.digits)}{interval} ({detail})"


def findings_table(ctx: ReportContext, names: dict[str, str]) -> str:
    """A row per finding that every model has a verdict on (on a task that is no other's subset,
    :mod:`~layerdiv.analyze.overlap`): the paper, the finding (with its task), the test, and per
    model whether it holds, with the statistic."""
    per_model = {m: {(p, _finding(j.finding)[0]): j for p, j in findings(ctx, m)} for m in names}
    covered = (  # a subset task's finding that its larger task has too: the larger's only
        ctx.tables["manifests"].filter(pl.col("subset_of").is_not_null())
        .select("task", "subset_of").explode("subset_of").unique().iter_rows()
    )  # fmt: skip
    for sub, larger in covered:
        for found in per_model.values():
            for paper, finding in list(found):
                if finding.startswith(f"{sub}: ") and (
                    (paper, finding.replace(f"{sub}: ", f"{larger}: ", 1)) in found
                ):
                    del found[paper, finding]
    keys = [  # the findings every model has data on
        k
        for k in next(iter(per_model.values()))
        if all(k in f and f[k].n > 0 for f in per_model.values())
    ]
    keys.sort(key=lambda k: list(PAPERS.values()).index(k[0]))
    rows = []
    for paper, finding in keys:
        j = next(iter(per_model.values()))[(paper, finding)]
        side = ">" if j.above else "<"
        test = (f"{j.statistic} {side} {fmt(j.threshold, digits=j.digits)}, {LEVEL:g}% interval "
                f"wholly on one side; at least {j.min_n} {j.unit}")  # fmt: skip
        rows.append([paper, finding, test, *(_judged_cell(per_model[m][(paper, finding)])
                                             for m in names)])  # fmt: skip
    if not rows:
        return ""
    return markdown_table(["Paper", "Finding", "Test", *names.values()], rows)


def provenance(ctx: ReportContext, names: dict[str, str]) -> str:
    """Per model: its parameters, blocks and how its weights were made (the manifests'
    ``weights``: quantization, base or instruct, licence), and the comparisons these confound."""
    manifests = ctx.tables["manifests"]
    lines, kinds = [], {}
    for m, label in names.items():
        rows = manifests.filter(pl.col("model") == m)
        if not rows.height:
            continue
        r = rows.row(0, named=True)
        weights = next((w for w in rows["weights"] if w), None)
        kind = (
            "an instruct model" if weights and "instruct model" in weights
            else "a base model" if weights and "base model" in weights
            else "base or instruct not recorded"
        )  # fmt: skip
        kinds[m] = kind
        made = weights or "as loaded (no conversion recorded)"
        lines.append(f"- **{label}** ({r['model_id']}): {r['n_params'] / 1e6:.0f}M parameters, "
                     f"{r['n_attn']} blocks, {kind}; weights: {made}.")  # fmt: skip
    confounds = [
        "Relative depth puts stacks of different lengths on one axis; it does not make the "
        "blocks alike (different widths, vocabularies and training).",
    ]
    if len(set(kinds.values())) > 1:
        confounds.append(
            "Base and instruct models differ in training as well as in family: a difference on "
            "the choice tasks (their prompts end in a question and `Answer:`), in the decided-at "
            "depth or in the findings may come from instruction tuning, not from the family."
        )
    quantized = [m for m in kinds if "dequantized" in str(
        manifests.filter(pl.col("model") == m)["weights"].drop_nulls().first() or "")]  # fmt: skip
    if quantized:
        confounds.append(
            "Quantized weights dequantized to float32 (the types above) are not the released "
            "float weights, and the types differ between the models: small quantities (late "
            "blocks' updates, lens KL near the output, per-head attention shares near the sink "
            "threshold) carry different rounding noise, so small differences between the models "
            "there are not evidence of a difference between the released models."
        )
    confounds.append(
        "Tokenizers differ: a running-text task cut to the same number of tokens covers different "
        "text, and the lens KL and top-5 overlap (ED_KL, ED_top5, decided-at depth) are taken "
        "over vocabularies of different sizes."
    )
    return (
        "\n".join(lines)
        + "\n\nWhat confounds the comparison:\n\n"
        + "\n".join(f"- {c}" for c in confounds)
    )


def report(ctx: ReportContext) -> str:
    """The comparison section: provenance and confounds, Table 1 and the curves side by side,
    the relative depths with their intervals, the per-block profiles (sinks, the first token's
    norm, |IG| shares, erasure), and each paper's findings per model."""
    table = ctx.tables.get("model_comparison")
    models = sorted(ctx.tables["manifests"]["model"].unique()) if table is not None else []
    models = [m for m in models if table is not None and m in set(table["model"])]
    if table is None or len(models) < 2:
        return ""
    names = _names(ctx, models)
    t = ctx.tables
    curves = curves_figure(ctx, models) if "curves" in t else None
    profiles = [
        ("sink share of the block's heads", _relative(t["sink_blocks"], "block", 1), "sink_rate",
         "share of heads")
    ] if "sink_blocks" in t else []  # fmt: skip
    shares = t.get("igrad_share")
    profiles += [
        (f"|IG| share, {SITE_NAMES[site]}", site_rows, "share", "share of |IG|")
        for site in SUBLAYERS
        if shares is not None and (site_rows := shares.filter(pl.col("sublayer") == site)).height
    ]
    erasure = [
        (name, t[table_name], "effect", "effect (L2, probabilities)")
        for name, table_name in (
            ("erasure, text", "erasure_layers"),
            ("erasure, choice", "choice_erasure_layers"),
        )
        if table_name in t
    ]
    bos = [("||h_l(0)|| / mean ||h_l(p)||", _relative(t["bos_norm"], "block", 0), "ratio",
            "ratio")] if "bos_norm" in t else []  # fmt: skip
    figures = [
        ("compare_curves.png", "Layer-addition curves on relative depth", curves),
        ("compare_depth.png", "Relative depths", depth_figure(table, names) if table.height
         else None),
        ("compare_sinks_igrad.png", "Sinks and |IG| on relative depth",
         per_block_figure("Attention sinks and |IG| per block on relative depth",
                          profiles, names)),
        ("compare_bos_norm.png", "The first token's norm on relative depth",
         per_block_figure("The first token's norm on relative depth (block inputs h_l, l / L)",
                          bos, names, yscale="log")),
        ("compare_erasure.png", "Erasure profile on relative depth",
         per_block_figure("Residual erasure per state on relative depth (state l / L)", erasure,
                          names, caption=f"bars: bootstrap {LEVEL:g}% interval over documents")),
    ]  # fmt: skip
    links = [_link(ctx, file, caption, figure) for file, caption, figure in figures if figure]
    parts = [
        f"{' and '.join(names.values())} side by side on relative depth: a block's place in its "
        "own stack (l / L), so that stacks of different lengths share one axis. Only what every "
        "model has is shown (tasks, quantities, profiles); the counts n are those of this store.",
        provenance(ctx, names),
        "### Table 1 side by side",
        table1(ctx, models) if "scores" in t else "",
        "### Where each model is done",
        "Effective depths (methods §15), the decided-at depth (§16), the depth scores of the "
        "attribution maps (§13-14), the saturation of accuracy (§3) and the sink rate (§16), "
        f"with the source tables' {LEVEL:g}% intervals (bootstrap over documents or instances; "
        f"none from too few). {DASH} or none: no crossing.",
        depth_table(table, names) if table.height else "",
        "### Each paper's findings per model",
        "Every verdict of the sections above on each model's rows alone: *holds* where the "
        f"statistic's {LEVEL:g}% interval lies wholly on the finding's side of the threshold, "
        "*does not hold* wholly on the other, *cannot tell* where it spans it.",
        findings_table(ctx, names),
        "### Figures",
        *links,
    ]
    return "\n\n".join(p for p in parts if p)


ANALYSIS = Analysis(
    name="compare",
    title="Models compared on relative depth",
    methods=(3, 13, 14, 15, 16),
    tables=tables,
    report=report,
    kinds=("choice", "text"),
    after=(
        "paper",
        "depth",
        "skips",
        "heads",
        "effective_depth",
        "decided_depth",
        "igrad",
        "erasure",
        "choice_erasure",
        "sinks",
        "bos_norm",
    ),
    order=900,
)
