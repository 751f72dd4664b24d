"""Running text, effective depth (methods §15): three scalars per (model, revision, task) that say
at which block the model is done, from the cosines of the geometry (methods §9) and the final
logit lens (``extract --lens``), each with a bootstrap interval over documents.

With L blocks and l = 0..L-1 (the lens at the block inputs h_0..h_(L-1); its layer L, the output,
never enters a maximum or a search):

- ``cos``: c(l) = the mean of the token-weighted means of ``cos_attn``, ``cos_mlp`` and
  ``cos_layer`` of block l; ED = the last l < L-1 with c(l) < 0 and c(l+1) >= 0;
- ``kl``: ED = the first l < L-1 whose lens KL (mean over a document's positions, then over
  documents) is below 0.1 x its largest over l = 0..L-1;
- ``top5``: ED = the first l < L-1 whose lens top-5 overlap exceeds 0.2;
- ``ratio`` = (ED + 1) / L. No such l: ``ed`` and ``ratio`` null (the follow-up's code gives -1
  for the lens measures there).

The interval: :data:`~layerdiv.analyze.stats.RESAMPLES` resamples of the documents (seeded), each
recomputing the per-block means from its documents' sums (the cosines: token sums and counts; the
lens: per-document means) and then the scalar; the 2.5 and 97.5 percentiles of the ratio over the
resamples that have one (none where the data themselves have no crossing, or below
:data:`~layerdiv.analyze.stats.MIN_INTERVAL_N` documents).

Under every lens a partition holds (methods §17: the logit lens, and each learned lens stored with
``--lens-ls`` / ``--lens-tuned``), ED_KL and ED_top5 are computed from that lens's table, with the
same resamples of the documents.

Table ``effective_depth``: per (model, revision, task, ``measure``, ``lens``): ``lens`` the lens
that ED_KL and ED_top5 read (``logit``, ``ls``, ``tuned``; null for ED_cos), ``step`` (the
revision's training step, null where unknown), ``n_blocks`` L, ``n_documents``, ``ed``, ``ratio``,
``ci_low``, ``ci_high``, ``defined`` (the share of resamples with a crossing) and ``margin`` (how
far the data clear the rule at ED, under that lens: for ``cos`` the smaller of -c(ED) and
c(ED+1), for ``kl`` 0.1 - kl(ED) / max kl, for ``top5`` overlap(ED) - 0.2; null without ED): a
small margin means a slightly different sample could move ED far.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import with_table
from layerdiv.analyze.markdown import fmt, key_rows, markdown_table, model_label, verdict
from layerdiv.analyze.overlap import one_verdict
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    NoData,
    ReportContext,
    map_partitions,
)
from layerdiv.analyze.stats import (
    LEVEL,
    MIN_INTERVAL_N,
    RESAMPLES,
    percentile_interval,
    resample_weights,
)
from layerdiv.analyze.text import (
    BATCH_TOKENS,
    DOTS,
    GEOMETRY,
    LENS,
    LENS_ROWS,
    TEXT_KIND,
    batches,
    check_token_order,
    document_means,
    token_dots,
    token_geometry,
)
from layerdiv.measurements.lens import readout_of, stored_lenses
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY, MODEL_KEY, SERIES

COSINES = ("cos_attn", "cos_mlp", "cos_layer")
"""The cosines whose block means c(l) averages (methods §15)."""
KL_FRACTION = 0.1
"""ED_KL: the first block whose KL is below this fraction of its largest (methods §15)."""
TOP5_LEVEL = 0.2
"""ED_top5: the first block whose top-5 overlap exceeds this (methods §15)."""
MEASURES = ("cos", "kl", "top5")
"""The three effective depths, in table and figure order."""
TITLES = {
    "cos": "ED_cos (update cosines cross zero)",
    "kl": "ED_KL (lens KL below 0.1 x max)",
    "top5": "ED_top5 (lens top-5 overlap > 0.2)",
}

NO_CROSSING = "no crossing"
"""The legend entry of the marks, on the x axis, of partitions whose measure has no crossing."""

WIDE = 3
"""Models (or revisions) beyond which the ratio figure's panels stack, one per row."""

SCHEMA = {
    **dict.fromkeys(KEY, pl.String),
    "measure": pl.String,
    "lens": pl.String,
    "step": pl.Int64,
    "n_blocks": pl.Int64,
    "n_documents": pl.Int64,
    "ed": pl.Int64,
    "ratio": pl.Float64,
    "ci_low": pl.Float64,
    "ci_high": pl.Float64,
    "defined": pl.Float64,
    "margin": pl.Float64,
}
"""The columns of ``effective_depth``."""


# --- the three scalars, for a batch of per-block mean profiles (rows: the data, then resamples) --


def _first(hit: np.ndarray) -> np.ndarray:
    """Per row of ``hit`` (rows, n) the first column that is True, NaN where none is."""
    return np.where(hit.any(axis=1), hit.argmax(axis=1), np.nan)


def ed_cos(c: np.ndarray) -> np.ndarray:
    """ED_cos of block profiles c (rows, L): the last l < L-1 with c(l) < 0 and c(l+1) >= 0
    (methods §15), NaN where there is none (an undefined c(l), NaN, never crosses)."""
    with np.errstate(invalid="ignore"):
        cross = (c[:, :-1] < 0) & (c[:, 1:] >= 0)
    last = cross.shape[1] - 1 - _first(cross[:, ::-1])
    return np.where(cross.any(axis=1), last, np.nan)


def ed_kl(kl: np.ndarray) -> np.ndarray:
    """ED_KL of lens KL profiles (rows, L) over the block inputs: the first l < L-1 with
    kl(l) < 0.1 max_l kl(l) (methods §15), NaN where there is none."""
    with np.errstate(invalid="ignore"):
        return _first(kl[:, :-1] < KL_FRACTION * np.nanmax(kl, axis=1, keepdims=True))


def ed_top5(top5: np.ndarray) -> np.ndarray:
    """ED_top5 of lens top-5 overlap profiles (rows, L): the first l < L-1 with overlap(l) > 0.2
    (methods §15), NaN where there is none."""
    with np.errstate(invalid="ignore"):
        return _first(top5[:, :-1] > TOP5_LEVEL)


# --- per-document sums of one partition ---------------------------------------------------------

_COSINE_ROWS = [GEOMETRY.index(c) for c in COSINES]


def cosine_sums(info: PartitionInfo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of ``info``'s ``token_blocks``: the documents (D,), and per document, cosine of
    :data:`COSINES` and block the sum over its tokens where the cosine is defined and their count
    (D, 3, L) each (methods §9's per-token geometry), read in batches of whole tokens."""
    blocks = info.manifest.n_blocks
    docs, sums, counts = [], [], []
    last = -1
    for batch in info.batches(
        "token_blocks", ["doc", "pos", "block", *DOTS], BATCH_TOKENS * blocks
    ):
        _, dots = token_dots(batch, blocks, info.where)
        last = check_token_order(batch, blocks, last, info.where)
        cos = token_geometry(dots)[_COSINE_ROWS]  # (3, L, tokens)
        doc = np.asarray(batch.column("doc").to_numpy(zero_copy_only=False)[::blocks])
        starts = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]])  # tokens come by document
        defined = np.isfinite(cos)
        docs.append(doc[starts])
        sums.append(np.add.reduceat(np.where(defined, cos, 0.0), starts, axis=2))
        counts.append(np.add.reduceat(defined, starts, axis=2))
    if not docs:
        raise NoData(f"{info.where} has no token_blocks rows")
    # a document split over two batches: its two parts add up
    found, where = np.unique(np.concatenate(docs), return_inverse=True)
    total = np.zeros((len(found), 3, blocks))
    count = np.zeros((len(found), 3, blocks))
    np.add.at(total, where, np.concatenate(sums, axis=2).transpose(2, 0, 1))
    np.add.at(count, where, np.concatenate(counts, axis=2).transpose(2, 0, 1))
    return found, total, count


def lens_means(
    info: PartitionInfo, docs: np.ndarray, table: str = "token_lens"
) -> tuple[np.ndarray, np.ndarray]:
    """Of ``info``'s lens ``table``, per document of ``docs`` (D,) and layer l = 0..L-1 the
    means over its positions of ``kl`` and ``top5_overlap`` (D, 2, L; methods §9), and whether the
    document has lens rows (D,)."""
    blocks = info.manifest.n_blocks
    frames = batches(info, table, ["doc", "layer", *LENS], LENS_ROWS)
    means = document_means(frames).filter(pl.col("layer") < blocks)
    doc = means["doc"].to_numpy()
    index = np.searchsorted(docs, doc)
    known = (index < len(docs)) & (docs[np.minimum(index, len(docs) - 1)] == doc)
    values = np.zeros((len(docs), 2, blocks))
    present = np.zeros(len(docs), dtype=bool)
    layer = means["layer"].to_numpy()[known]
    for k, column in enumerate(("kl_mean", "top5_overlap_mean")):
        values[index[known], k, layer] = means[column].to_numpy()[known]
    present[index[known]] = True
    return values, present


# --- one partition -----------------------------------------------------------------------------


SCALARS = {"cos": ed_cos, "kl": ed_kl, "top5": ed_top5}
"""Each measure's scalar of its block profiles."""


def block_profiles(
    weights: np.ndarray,
    cos_sum: np.ndarray,
    cos_count: np.ndarray,
    lens: np.ndarray | None,
    present: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """Per measure, the block profiles (rows, L) of each row of document ``weights`` (rows, D):
    the per-block means recomputed from the weighted documents (c(l) token-weighted from
    ``cos_sum`` and ``cos_count`` (D, 3, L); the lens, where given, the weighted mean of the
    per-document means ``lens`` (D, 2, L) of the documents ``present``: KL and top-5 overlap)."""
    blocks = cos_sum.shape[-1]
    with np.errstate(invalid="ignore", divide="ignore"):
        c = (weights @ cos_sum.reshape(len(cos_sum), -1)) / (
            weights @ cos_count.reshape(len(cos_count), -1)
        )
        out = {"cos": c.reshape(-1, 3, blocks).mean(axis=1)}
        if lens is not None and present is not None:
            w = weights * present
            means = (w @ lens.reshape(len(lens), -1)) / w.sum(axis=1, keepdims=True)
            kl, top5 = means.reshape(-1, 2, blocks).transpose(1, 0, 2)
            out |= {"kl": kl, "top5": top5}
    return out


def depths(
    weights: np.ndarray,
    cos_sum: np.ndarray,
    cos_count: np.ndarray,
    lens: np.ndarray | None,
    present: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """The effective depths (methods §15) of each row of :func:`block_profiles` (the same
    arguments); NaN where a row has none."""
    profiles = block_profiles(weights, cos_sum, cos_count, lens, present)
    return {m: SCALARS[m](v) for m, v in profiles.items()}


def margin(measure: str, profile: np.ndarray, ed: float) -> float | None:
    """How far one block profile clears its measure's rule at ED (see the module docstring);
    None without ED."""
    if not np.isfinite(ed):
        return None
    at = int(ed)
    if measure == "cos":
        return float(min(-profile[at], profile[at + 1]))
    if measure == "kl":
        return float(KL_FRACTION - profile[at] / np.nanmax(profile))
    return float(profile[at] - TOP5_LEVEL)


def partition_depth(info: PartitionInfo, lens: bool) -> pl.DataFrame:
    """The ``effective_depth`` rows of one text partition (without ``step``); ``lens``: whether
    to read its lenses (:func:`~layerdiv.measurements.lens.stored_lenses`) for ED_KL and
    ED_top5, each under the same resamples of the documents."""
    blocks = info.manifest.n_blocks
    docs, cos_sum, cos_count = cosine_sums(info)
    weights, ones = resample_weights(len(docs)), np.ones((1, len(docs)))
    # ED_cos once, without a lens; ED_KL and ED_top5 under each lens the partition holds
    sources: list[tuple[str | None, np.ndarray | None, np.ndarray | None]] = [(None, None, None)]
    sources += [(k, *lens_means(info, docs, t)) for k, t in (stored_lenses(info) if lens else [])]
    found = []
    for kind, means, present in sources:
        profiles = block_profiles(ones, cos_sum, cos_count, means, present)  # the data's own
        samples = depths(weights, cos_sum, cos_count, means, present)
        measures = MEASURES[1:] if kind else MEASURES[:1]
        found += [(kind, m, SCALARS[m](profiles[m]), samples[m], profiles[m][0]) for m in measures]
    rows = []
    for name, measure, ed, sampled, profile in found:
        ratio = (sampled + 1) / blocks
        # no interval around an estimate that does not exist (``defined`` still tells how many
        # resamples found a crossing), nor from fewer than MIN_INTERVAL_N documents
        given = np.isfinite(ed[0]) and len(docs) >= MIN_INTERVAL_N
        low, high = percentile_interval(ratio if given else np.full(1, np.nan))
        rows.append(
            {
                **dict(info.key.items()),
                "measure": measure,
                "lens": name,
                "n_blocks": blocks,
                "n_documents": len(docs),
                "ed": None if np.isnan(ed[0]) else int(ed[0]),
                "ratio": None if np.isnan(ed[0]) else float((ed[0] + 1) / blocks),
                "ci_low": None if np.isnan(low) else float(low),
                "ci_high": None if np.isnan(high) else float(high),
                "defined": float(np.isfinite(ratio).mean()),
                "margin": margin(measure, profile, ed[0]),
            }
        )
    schema = {k: v for k, v in SCHEMA.items() if k != "step"}
    return pl.DataFrame(rows, schema=schema)


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: ``effective_depth`` of every text partition (ED_cos), with
    ED_KL and ED_top5 where it holds the final lens; notes name the others."""
    lensed = {
        p.where
        for p in with_table(
            ctx.parts, "token_lens", ctx.notes, "Lens effective depth (ED_KL, ED_top5)"
        )
    }
    other = [
        p.key.label for p in ctx.parts if p.where in lensed and readout_of(p.manifest) != "final"
    ]
    if other:
        ctx.notes.append(
            f"No lens effective depth (ED_KL, ED_top5) for {', '.join(other)}: they hold the "
            "last-block lens; methods §15 reads the final one (`layerdiv extract --lens`)."
        )
    final = {p.where for p in ctx.parts if p.where in lensed and readout_of(p.manifest) == "final"}
    frames = map_partitions(lambda p: partition_depth(p, p.where in final), ctx.parts)
    steps = ctx.store.models().select(*MODEL_KEY, "step")
    table = (
        pl.concat(list(frames))
        .join(steps, on=[*MODEL_KEY], how="left")
        .select(list(SCHEMA))
        .cast(SCHEMA)  # type: ignore[arg-type]
        .sort(*KEY, pl.col("measure").replace_strict(MEASURES, range(len(MEASURES))), "lens")
    )
    return {"effective_depth": table}


# --- report ------------------------------------------------------------------------------------


def _yrange(table: pl.DataFrame) -> tuple[float, float]:
    """The ratio axis: 0 to 1 and every interval's upper end, with a margin each side (the
    marks of :data:`NO_CROSSING` stand at 0)."""
    highs = [v for v in table["ci_high"].to_list() if v is not None and math.isfinite(v)]
    return -0.06, max([1.0, *highs]) + 0.05


def ratio_figure(table: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """One panel per measure: each model's (ED + 1) / L with its bootstrap interval, a colour per
    task (and lens, where a partition holds several: methods §17), models side by side (methods
    §15)."""
    models = sorted(table["model"].unique())
    labels = [names.get(m, m) for m in models]
    lensed = table.filter(pl.col("lens").is_not_null())
    several = lensed.select(pl.col("lens").n_unique()).item() > 1
    tasks = [(t, lens) for t in sorted(table["task"].unique())
             for lens in (sorted(lensed["lens"].unique()) if several else [None])]  # fmt: skip
    color = dict(zip(tasks, plots.colors(len(tasks)), strict=False))
    panels = []
    for measure in MEASURES:
        rows = table.filter(pl.col("measure") == measure, pl.col("ratio").is_not_null())
        panel = plots.Panel(
            TITLES[measure], xlabel="model", ylabel="(ED + 1) / L", yrange=_yrange(table)
        )
        for task, lens in tasks:
            sub = rows.filter(pl.col("task") == task)
            if lens is not None and measure != "cos":
                sub = sub.filter(pl.col("lens") == lens)
            elif lens is not None and lens != "logit":
                continue  # ED_cos reads no lens: once per task
            sub = sub.sort(pl.col("model").replace_strict(models, range(len(models))))
            if sub.height:
                panel.series.append(
                    plots.Series(
                        task if lens is None or measure == "cos" else f"{task} · {lens} lens",
                        [labels[models.index(m)] for m in sub["model"]],
                        sub["ratio"].to_list(),
                        color=color[(task, lens)],
                        line=False,
                        interval=plots.interval_ends(sub),
                    )
                )
        none = table.filter(pl.col("measure") == measure, pl.col("ratio").is_null())
        if none.height:  # on the axis, so that a panel without any crossing keeps its models
            lacking = sorted(set(none["model"]), key=models.index)
            panel.series.append(
                plots.Series(NO_CROSSING, [labels[models.index(m)] for m in lacking],
                             [0.0] * len(lacking), color="grey", marker="x", line=False)
            )  # fmt: skip
            panel.notes.append(f"x: {none.height} partition(s) without a crossing (no value)")
        panels.append(panel)
    wide = len(models) > WIDE  # the labels side by side need a panel of the figure's width
    return plots.Figure(
        "Effective depth (methods §15)",
        panels,
        cols=1 if wide else 3,
        panel_size=(max(4.2, 1.2 * len(models)), 3.2) if wide else (4.2, 3.6),
        caption=f"bars: bootstrap {LEVEL:g}% interval over documents ({RESAMPLES} resamples)",
    )


def step_figure(table: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """One panel per measure: (ED + 1) / L with its interval against the training step, a line per
    (model, task) through its revisions with a recorded step (the logit lens's ED_KL, ED_top5)."""
    logit = pl.col("lens").is_null() | (pl.col("lens") == "logit")
    known = table.filter(pl.col("step").is_not_null(), pl.col("ratio").is_not_null(), logit)
    models = sorted(known["model"].unique())
    color = plots.model_colors(models)
    tasks = sorted(known["task"].unique())
    dashes: list[plots.Dash] = ["solid", "dash", "dot", "dashdot"]
    panels = []
    for measure in MEASURES:
        panel = plots.Panel(
            TITLES[measure], xlabel="training step", ylabel="(ED + 1) / L", yrange=_yrange(known)
        )
        rows = known.filter(pl.col("measure") == measure).sort("step")
        for (model, task), sub in rows.group_by(*SERIES, maintain_order=True):
            panel.series.append(
                plots.Series(
                    f"{names.get(str(model), str(model))} · {task}",
                    sub["step"].to_list(),
                    sub["ratio"].to_list(),
                    color=color[str(model)],
                    dash=dashes[tasks.index(task) % len(dashes)],
                    interval=plots.interval_ends(sub),
                    hover=[f"revision {r}" for r in sub["revision"]],
                )
            )
        panels.append(panel)
    return plots.Figure("Effective depth against the training step (methods §15)", panels, cols=3,
                        panel_size=(4.2, 3.6))  # fmt: skip


def several_steps(table: pl.DataFrame) -> bool:
    """Whether some (model, task) has more than one revision with a recorded step."""
    known = table.filter(pl.col("step").is_not_null())
    return bool(known.group_by(*SERIES).agg(pl.col("step").n_unique() > 1)["step"].any())


DEFINED = 0.95
"""The share of resamples with a crossing below which an interval over them states no confidence
(a resample without one has no effective depth at all): the verdict cannot tell."""
THIN = {"cos": 0.01, "kl": 0.01, "top5": 0.02}
"""A margin (module docstring) below this is called thin: a tenth of the rule's scale (a cosine
of 0.1, the KL fraction 0.1, the overlap level 0.2)."""
HALF = 0.5
"""The verdict's threshold: done by the middle of the stack, (ED + 1) / L below it."""
WHY = (
    "The three need not agree: *cos* reads the residual stream's own updates (where they stop "
    "erasing), *kl* and *top5* read a lens (the final logit lens, or a learned one), which "
    "measures when the stream has become readable by the output layer, not when the model stops "
    "computing; *kl* is relative to the largest KL, so an early block with a huge KL makes it "
    "fall early, and *top5* needs only 1 of 5 top tokens in common, so it can fire on a frequent "
    "token; a measure with no crossing has no value at all."
)


def ed_verdicts(table: pl.DataFrame, manifests: pl.DataFrame, names: dict[str, str]) -> str:
    """Per (model, revision, task) (one per set of tasks with the same documents), measure and
    lens: the verdict on "done by the middle of the stack", (ED + 1) / L below :data:`HALF` with
    its interval over documents; *cannot tell* where fewer than :data:`DEFINED` of the resamples
    have a crossing (the interval is then of those alone); the margin named, called thin below
    :data:`THIN`."""
    judged, note = one_verdict(table, manifests)
    lines = []
    for r in judged.iter_rows(named=True):
        who = f"{names.get(r['model'], r['model'])}, {r['task']}, ED_{r['measure']}" + (
            f" ({r['lens']} lens)" if r["lens"] else ""
        )
        thin = r["margin"] is not None and r["margin"] < THIN[r["measure"]]
        margin = "" if r["margin"] is None else (
            f" (margin {r['margin']:.3g} past the rule{', thin' if thin else ''})")  # fmt: skip
        finding = f"{who}: the model is done by the middle of the stack{margin}"
        if r["ed"] is not None and r["defined"] < DEFINED:
            lines.append(
                f"- **Verdict: cannot tell.** {finding}: only {r['defined']:.0%} of the "
                f"resamples of the documents have a crossing, so an interval over them states no "
                f"confidence (n = {r['n_documents']} documents)."
            )
            continue
        interval = (r["ci_low"], r["ci_high"]) if r["ed"] is not None else None
        lines.append("- " + verdict(finding, "(ED + 1) / L", r["ratio"], interval,
                                    r["n_documents"], HALF, min_n=MIN_INTERVAL_N,
                                    unit="documents", above=False, digits=3))  # fmt: skip
    return "\n".join([*lines, *([note] if note else [])])


def report(ctx: ReportContext) -> str:
    """The effective-depth section: the table of the three measures with their intervals, the
    ratios per model and, where a model has several revisions, against the training step."""
    table = ctx.tables.get("effective_depth")
    if table is None or not table.height:
        return ""
    names = plots.short_names(ctx.names)
    rows = key_rows(
        table,
        ctx.names,
        lambda r: [
            r["measure"],
            r["lens"] or "",
            str(r["n_documents"]),
            "none" if r["ed"] is None else f"{r['ed']} of {r['n_blocks']}",
            fmt(r["ratio"], digits=3),
            f"[{fmt(r['ci_low'], digits=3)}, {fmt(r['ci_high'], digits=3)}] over "
            + fmt(r["defined"], scale=100, digits=0)
            + "% of resamples",
            fmt(r["margin"], digits=3),
        ],
    )
    header = ["Model", "Task", "Measure", "Lens", "Documents", "ED (block)", "(ED + 1) / L",
              f"{LEVEL:g}% CI (resamples with a crossing)", "Margin past the rule"]  # fmt: skip
    apart = table.with_columns(model_label())  # a model's revisions side by side
    return "\n\n".join(
        p
        for p in [
            "Three effective depths from tables the running-text analyses already read (the "
            'follow-up "What Affects the Effective Depth of LLMs?"): *cos*, the last block '
            "where the mean of the attention, MLP and layer update cosines with the stream "
            "turns from negative to non-negative; *kl*, the first block whose lens KL to "
            f"the output falls below {KL_FRACTION:g} of its largest; *top5*, the first block "
            f"whose lens top-5 overlap with the output exceeds {TOP5_LEVEL:g}; both under each "
            "lens stored (the final logit lens, and each learned lens: methods §17), each with "
            "its own margin and verdict. The ratio "
            "(ED + 1) / L places it in the stack; the interval is a bootstrap over documents "
            f"({RESAMPLES} resamples, the per-block means recomputed from each), over the "
            "resamples that have a crossing, with their share beside it: where it is well "
            "below 100% the interval is of those resamples alone and no confidence interval. "
            "The margin says how far the data clear the rule at ED (−c(ED) and c(ED+1) for "
            f"cos, {KL_FRACTION:g} − KL(ED) / max KL, overlap(ED) − {TOP5_LEVEL:g}); a thin "
            f"margin means a slightly different sample could move ED far. {WHY} The verdict: "
            f"done by the middle of the stack, (ED + 1) / L below {HALF:g} (the depth-efficiency "
            "paper's reading that the second half adds little), over documents; it cannot tell "
            f"where fewer than {DEFINED:.0%} of the resamples have a crossing.",
            markdown_table(header, rows),
            ed_verdicts(table, ctx.tables["manifests"], ctx.names),
            plots.figure_link(
                ctx, "effective_depth.png", "Effective depth", lambda: ratio_figure(apart, names)
            ),
            plots.figure_link(
                ctx,
                "effective_depth_steps.png",
                "Effective depth against the training step",
                lambda: step_figure(table, names),
            )
            if several_steps(table)
            else "",
        ]
        if p
    )


ANALYSIS = Analysis(
    name="effective_depth",
    title="Running text: effective depth",
    methods=(15,),
    tables=tables,
    report=report,
    kinds=(TEXT_KIND,),
    by_revision=True,
    order=130,
)
