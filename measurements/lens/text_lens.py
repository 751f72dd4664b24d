"""Running text, logit lens (``extract --lens``, methods §9): per (model, task, layer),
how far the lens distribution p_l at block input l is from the model's output.

Table ``text_lens``: per (model, task, lens, layer l = 0..L; l = L is the model's own output):
``relative_depth`` l / L, ``n_documents``, and the means of ``kl`` = KL(p_l || p_L),
``top5_overlap`` = |top5(p_l) & top5(p_L)| / 5 and ``ce`` = -log p_l(next token): the mean over
the positions of a document first, then over documents (a document's last position has no
``ce``); ``uniform_ce`` = log V, the uniform distribution's cross-entropy. ``lens`` is the
logit lens's readout recorded in the manifest (``final`` or ``last-block``), or the learned lens
a partition also holds (``ls``, ``tuned``: ``--lens-ls``, ``--lens-tuned``, methods §17), a row
per layer of each: lenses are never averaged together.

Table ``text_lens_law`` (partitions extracted with ``--lens last-block``, methods §12,
within one model): per (model, task) the fit delta_ce(l) = c l^-alpha on log-log axes, with
delta_ce(l) = ce at block input l minus the model's own ce, over l = 1..L-1: ``c``, ``alpha``,
``r2`` (on the log scale) and ``n_layers`` (the l whose delta_ce is positive, those fitted).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import by_model
from layerdiv.analyze.law import power_fit
from layerdiv.analyze.markdown import fmt, markdown_table
from layerdiv.analyze.overlap import lone_subsets
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    map_partitions,
)
from layerdiv.analyze.text import (
    LENS,
    LENS_ROWS,
    TEXT_KIND,
    batches,
    document_means,
    text_vs_last_token,
)
from layerdiv.measurements.lens import learned_table, readout_of
from layerdiv.measurements.lens.analysis import lens_tag
from layerdiv.schemas import LEARNED_LENS_KINDS
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY


def lens_table(doc_means: pl.DataFrame, blocks: int) -> pl.DataFrame:
    """Per layer: the means over documents of the per-document means (methods §9: then
    over documents), ``n_documents`` and ``relative_depth`` l / L."""
    return (
        doc_means.group_by("layer")
        .agg(
            pl.col("doc").n_unique().alias("n_documents"),
            *(pl.col(f"{c}_mean").mean().alias(c) for c in LENS),
        )
        .with_columns(
            pl.col("layer").cast(pl.Int16), (pl.col("layer") / blocks).alias("relative_depth")
        )
        .select("layer", "relative_depth", "n_documents", *LENS)
        .sort("layer")
    )


def partition_lens(info: PartitionInfo) -> pl.DataFrame:
    """``text_lens`` of one text partition, read batch by batch: its logit lens, then each
    learned lens it holds."""
    tables = [(readout_of(info.manifest), "token_lens")]
    tables += [(k, learned_table(k)) for k in LEARNED_LENS_KINDS if learned_table(k) in info.tables]
    return pl.concat(
        lens_tag(lens_table(document_means(batches(info, t, ["doc", "layer", *LENS], LENS_ROWS)),
                            info.manifest.n_blocks), info, lens)
        for lens, t in tables
    )  # fmt: skip


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: ``text_lens`` of the text partitions extracted with
    ``--lens``; a note names the others."""
    parts = ctx.parts
    table = pl.concat(list(map_partitions(partition_lens, parts)))
    last_block = [dict(p.key.items()) for p in parts if readout_of(p.manifest) == "last-block"]
    if not last_block:
        return {"text_lens": table}
    keys = pl.DataFrame(last_block, schema=dict.fromkeys(KEY, pl.String))
    last = table.filter(pl.col("lens") == "last-block").join(keys, on=[*KEY])
    return {"text_lens": table, "text_lens_law": lens_law(last)}


def delta_ce(table: pl.DataFrame) -> pl.DataFrame:
    """Per (partition key, layer l = 1..L-1) of ``text_lens``: ``delta_ce`` = ce at l minus ce
    at L, the model's own (methods §12; ``ce`` is already a mean over documents of
    per-document means, and every layer has the same positions, so this is the mean of the
    differences)."""
    last = pl.col("layer").max().over(*KEY)
    own = table.filter(pl.col("layer") == last).select(*KEY, pl.col("ce").alias("own"))
    return (
        table.join(own, on=[*KEY])
        .filter(pl.col("layer").is_between(1, last - 1))
        .select(*KEY, "layer", (pl.col("ce") - pl.col("own")).alias("delta_ce"))
        .sort(*KEY, "layer")
    )


LAW_SCHEMA = {
    **dict.fromkeys(KEY, pl.String),
    "c": pl.Float64,
    "alpha": pl.Float64,
    "r2": pl.Float64,
    "n_layers": pl.Int64,
}
"""The columns of ``text_lens_law``."""


def lens_law(table: pl.DataFrame) -> pl.DataFrame:
    """``text_lens_law`` from the ``text_lens`` rows of ``--lens last-block`` partitions:
    delta_ce(l) = c l^-alpha fitted on log-log axes (methods §12, within one model)."""
    rows = []
    for key, sub in delta_ce(table).group_by(*KEY, maintain_order=True):
        layer, delta = sub["layer"].to_numpy().astype(float), sub["delta_ce"].to_numpy()
        c, alpha, r2 = power_fit(layer, delta)
        n = int(((layer > 0) & (delta > 0)).sum())
        rows.append((*key, c, alpha, r2, n))
    return pl.DataFrame(rows, schema=LAW_SCHEMA, orient="row")


def lens_law_figure(table: pl.DataFrame, law: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """delta_ce(l) against l on log-log axes per partition of ``law``, with the fitted
    c l^-alpha (methods §12, within one model)."""
    last = table.filter(pl.col("lens") == "last-block")
    deltas = delta_ce(last.join(law.select(*KEY), on=[*KEY]))
    series = []
    for color, row in zip(plots.colors(law.height), law.iter_rows(named=True), strict=False):
        sub = deltas.filter(pl.all_horizontal(pl.col(k) == row[k] for k in KEY))
        shown = sub.filter(pl.col("delta_ce") > 0)
        label = " ".join([names.get(row[KEY[0]], row[KEY[0]]), *(row[k] for k in KEY[1:])])
        grid = np.linspace(1, max(float(sub["layer"].max() or 1), 1.0), 50)  # type: ignore[arg-type]
        fit = row["c"] * grid ** -row["alpha"]
        series += [
            plots.Series(label, shown["layer"].to_list(), shown["delta_ce"].to_list(),
                         color=color, line=False),
            plots.Series(f"{label}: fit, alpha = {row['alpha']:.2f}, {plots.r2_text(row['r2'])}",
                         grid.tolist(), fit.tolist(), color=color, marker=None),
        ]  # fmt: skip
    panel = plots.Panel(
        "delta_ce(l) = c l^-alpha",
        series,
        xlabel="block input l",
        ylabel="ce of the last-block lens minus the model's (nats)",
        xscale="log",
        yscale="log",
    )
    return plots.Figure("Within one model: the depth law (methods §12)", [panel], cols=1)


# --- report ----------------------------------------------------------------------------------

PANELS = (
    ("kl", "KL(p_l || p_L) (nats)"),
    ("top5_overlap", "top-5 overlap with the output"),
    ("ce", "cross-entropy on the next token (nats)"),
)


_LAYER = ["layer", "relative_depth"]
_LENS_MEANS = [*LENS, "uniform_ce"]
"""What the figure averages over a model's tasks, per layer (each lens readout apart: readouts are
never averaged together)."""

LEARNED = (
    " Lenses `ls` and `tuned`: learned lenses (methods §17), the same block inputs read after a "
    "per-block affine translator; the section on the logit and learned lenses sets them side by "
    "side with intervals."
)
"""The sentence of the section where a partition holds a learned lens."""

UNIFORM = (
    "A lens can be worse than uniform: reading an early state h_l through the final norm and "
    "unembedding, which were trained on the last layer's states, gives a confident distribution "
    "over the wrong tokens, and a confident wrong distribution costs more than the uniform one's "
    "log V nats."
)


def lens_spec(
    table: pl.DataFrame,
    last: pl.DataFrame | None,
    manifests: pl.DataFrame,
    names: dict[str, str],
) -> plots.Figure:
    """KL, top-5 overlap and cross-entropy of the lens against relative depth (mean over a
    model's text tasks of one readout), models overlaid; dashed, where the model has choice tasks
    extracted with ``--lens`` with the same readout: the same at their last prompt token
    (``lens_curves``, the gold option's first token). The cross-entropy panel draws the uniform
    baseline log V."""
    text = by_model(table, manifests, _LAYER, _LENS_MEANS, by=["lens"])
    spec = text_vs_last_token(
        [(column, column, label) for column, label in PANELS],
        text,
        None if last is None else by_model(last, manifests, _LAYER, _LENS_MEANS, by=["lens"]),
        names,
        "relative depth l / L",
        "Logit lens at every block input (methods §9)",
        by="lens",
    )
    baselines = sorted({v for v in text["uniform_ce"].drop_nulls()})
    spec.panels[-1].yscale = "log"  # the embedding's lens costs ten times the later layers'
    spec.panels[-1].lines += [
        plots.RefLine(v, label=f"uniform: log V = {v:.1f} nats", dash="dot") for v in baselines
    ]
    spec.caption = (
        "every token of running text (solid), the last prompt token of the choice "
        "tasks (dashed); dotted: the uniform distribution's cross-entropy log V"
    )
    if last is not None and (lone := lone_subsets(last, manifests, by=["lens"])):
        spec.caption += f". Dashed: {lone}"
    return spec


def report(ctx: ReportContext) -> str:
    """The logit-lens section: per (model, task) the lens at mid-depth and the output's
    cross-entropy, and the lens figure."""
    if "text_lens" not in ctx.tables:
        return "No text partition was extracted with `--lens` (see the notes above)."
    table = ctx.tables["text_lens"]
    names = plots.short_names(ctx.names)
    rows = []
    for _key, sub in table.sort(*KEY, "lens", "layer").group_by(*KEY, "lens", maintain_order=True):
        model, task, lens = sub["model"][0], sub["task"][0], sub["lens"][0]
        mid = sub.filter(pl.col("layer") == sub["layer"].max() // 2)  # type: ignore[operator]
        out = sub.tail(1)
        rows.append(
            [
                ctx.names.get(str(model), str(model)),
                str(task),
                str(lens),
                str(out["n_documents"][0]),
                fmt(mid["kl"][0], digits=3),
                fmt(mid["top5_overlap"][0], digits=3),
                fmt(mid["ce"][0], digits=3),
                fmt(out["ce"][0], digits=3),
                fmt(out["uniform_ce"][0], digits=3),
            ]
        )
    header = [
        "Model",
        "Task",
        "Lens",
        "Documents",
        "KL at L/2 (nats)",
        "top-5 overlap at L/2",
        "CE at L/2 (nats)",
        "CE of the model (nats)",
        "Uniform log V (nats)",
    ]
    return "\n\n".join(
        p
        for p in [
            "The model's own final norm and unembedding read at every block input h_l (layer L is "
            "the model's output). Means over the positions of each "
            "document, then over documents; where the same model has choice tasks extracted "
            "with `--lens`, the figure draws their last prompt token beside (dashed: where the "
            "answer is decided against the average token). The dotted line is the uniform "
            f"distribution's cross-entropy log V (V the vocabulary). {UNIFORM}"
            + (LEARNED if table["lens"].is_in(LEARNED_LENS_KINDS).any() else ""),
            markdown_table(header, rows),
            plots.figure_link(
                ctx,
                "text_lens.png",
                "Logit lens",
                lambda: lens_spec(
                    table, ctx.tables.get("lens_curves"), ctx.tables["manifests"], names
                ),
            ),
            *law_section(ctx, table, names),
        ]
        if p
    )


def law_section(ctx: ReportContext, table: pl.DataFrame, names: dict[str, str]) -> list[str]:
    """The within-model depth law of the ``--lens last-block`` partitions: its table and figure
    (nothing when there are none)."""
    law = ctx.tables.get("text_lens_law")
    if law is None or not law.height:
        return []
    rows = [
        [ctx.names.get(r[KEY[0]], r[KEY[0]]), *(r[k] for k in KEY[1:]), fmt(r["c"], digits=3),
         fmt(r["alpha"], digits=3), fmt(r["r2"], digits=3), str(r["n_layers"])]
        for r in law.iter_rows(named=True)
    ]  # fmt: skip
    return [
        "Within one model (methods §12): the cross-entropy of the last-block lens at "
        "block input l minus the model's own, fitted as c l^-alpha on log-log axes over "
        "l = 1..L-1 (the inverse-depth paper's law has alpha near 1 across models).",
        markdown_table(
            [
                "Model",
                *(k.capitalize() for k in KEY[1:]),
                "c",
                "alpha",
                "r2 (log)",
                "layers fitted",
            ],
            rows,
        ),
        plots.figure_link(
            ctx,
            "text_lens_law.png",
            "Within-model depth law",
            lambda: lens_law_figure(table, law, names),
        ),
    ]


ANALYSIS = Analysis(
    name="text_lens",
    title="Running text: logit lens",
    methods=("logit-lens",),
    tables=tables,
    report=report,
    kinds=(TEXT_KIND,),
    needs=("token_lens",),
    order=90,
)
