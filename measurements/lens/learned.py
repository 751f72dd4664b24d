"""Running text, the lenses side by side (methods §17): per block, the logit lens and each learned
lens a partition holds (``extract --lens-ls FILE``, ``--lens-tuned FILE``) on the same tokens,
with bootstrap intervals over documents; and whether each depth finding (decided-at depth, ED_KL,
ED_top5) holds under every lens stored.

Table ``lens_comparison``: per (model, revision, task, ``lens``, ``layer`` l = 0..L): ``lens``
``logit`` (the final logit lens, ``token_lens``) or a learned kind (``ls``, ``tuned``);
``relative_depth`` l / L, ``n_documents``, ``held_out`` (a learned lens: whether its translators
were fitted on another task than this one, the manifest's record; null for the logit lens), and
for each of ``kl``, ``top5_overlap`` and ``ce`` its mean (over a document's positions, then over
documents, as ``text_lens``) with ``<column>_low`` / ``<column>_high``, the bootstrap 95%
percentile interval over documents (:data:`~layerdiv.analyze.stats.RESAMPLES` seeded resamples,
the same for every lens of a partition; none from fewer than
:data:`~layerdiv.analyze.stats.MIN_INTERVAL_N` documents).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import tag
from layerdiv.analyze.markdown import fmt, key_rows, markdown_table
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
from layerdiv.analyze.text import LENS, LENS_ROWS, TEXT_KIND, batches, document_means
from layerdiv.measurements.lens import stored_lenses, translators_of
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY

LABELS = {"kl": "KL(p_l || p_L) (nats)", "top5_overlap": "top-5 overlap with the output",
          "ce": "cross-entropy on the next token (nats)"}  # fmt: skip
"""Each compared column of :data:`~layerdiv.analyze.text.LENS` and its axis label."""


def lens_intervals(means: pl.DataFrame, docs: np.ndarray, weights: np.ndarray) -> pl.DataFrame:
    """Per layer of the per-document means ``means`` (``document_means``' frame) of documents
    ``docs`` (sorted): each column's mean over the documents that have it, and its bootstrap
    interval from the resample ``weights`` (resamples, D) of ``docs``."""
    layers = int(means["layer"].max()) + 1  # type: ignore[arg-type]
    row = np.searchsorted(docs, means["doc"].to_numpy())
    layer = means["layer"].to_numpy()
    out: dict[str, object] = {"layer": np.arange(layers, dtype=np.int16)}
    present = np.zeros((len(docs), layers), dtype=bool)
    present[row, layer] = True
    out["n_documents"] = present.sum(axis=0)
    for c in LENS:
        x = np.full((len(docs), layers), np.nan)
        x[row, layer] = means[f"{c}_mean"].to_numpy().astype(float)
        have = np.isfinite(x)
        value = np.where(have, x, 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[c] = value.sum(axis=0) / have.sum(axis=0)  # the mean over documents
            sampled = (weights @ value) / (weights @ have)
        enough = have.sum(axis=0) >= MIN_INTERVAL_N
        low, high = percentile_interval(np.where(enough, sampled, np.nan))
        out[f"{c}_low"], out[f"{c}_high"] = low, high
    return pl.DataFrame(out).fill_nan(None)


def partition_comparison(info: PartitionInfo) -> pl.DataFrame:
    """``lens_comparison`` of one text partition: each lens it holds, the same resamples."""
    lenses = stored_lenses(info)
    frames = {
        lens: document_means(batches(info, table, ["doc", "layer", *LENS], LENS_ROWS))
        for lens, table in lenses
    }
    docs = np.unique(np.concatenate([f["doc"].to_numpy() for f in frames.values()]))
    weights = resample_weights(len(docs))
    blocks = info.manifest.n_blocks
    out = []
    for lens, means in frames.items():
        fitted = translators_of(info.manifest, lens).get("task")
        held_out = None if lens == "logit" else fitted != info.key.task
        out.append(
            lens_intervals(means, docs, weights).select(
                pl.lit(lens).alias("lens"),
                "layer",
                (pl.col("layer") / blocks).alias("relative_depth"),
                "n_documents",
                pl.lit(held_out, pl.Boolean).alias("held_out"),
                *(c for name in LENS for c in (name, f"{name}_low", f"{name}_high")),
            )
        )
    return tag(pl.concat(out), info)


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: ``lens_comparison`` of the text partitions that hold a learned
    lens (none without: the learned lenses are optional)."""
    parts = [p for p in ctx.parts if any(lens != "logit" for lens, _ in stored_lenses(p))]
    if not parts:
        raise NoData("no text partition holds a learned lens")
    return {"lens_comparison": pl.concat(list(map_partitions(partition_comparison, parts)))}


# --- report ------------------------------------------------------------------------------------


def comparison_figure(table: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """Three panels (KL, top-5 overlap, cross-entropy against relative depth): a line per
    (model, task, lens) with its interval over documents, the output (layer L) left out."""
    keys = table.select(*KEY, "lens").unique(maintain_order=True).rows()
    color = dict(zip(keys, plots.colors(len(keys)), strict=False))
    panels = []
    for column, label in LABELS.items():
        panel = plots.Panel(label, xlabel="relative depth l / L", ylabel=label)
        for key in keys:
            sub = table.filter(
                *(pl.col(c) == v for c, v in zip([*KEY, "lens"], key, strict=True)),
                pl.col("relative_depth") < 1,
            ).sort("layer")
            model, task, lens = names.get(key[0], key[0]), key[2], key[3]
            panel.series.append(
                plots.Series(
                    f"{model} · {task} · {lens}",
                    sub["relative_depth"].to_list(),
                    sub[column].to_list(),
                    color=color[key],
                    interval=(sub[f"{column}_low"].to_list(), sub[f"{column}_high"].to_list()),
                )
            )
        panels.append(panel)
    return plots.Figure(
        "The logit lens and the learned lenses on the same tokens (methods §17)",
        panels,
        cols=3,
        caption=f"bars: bootstrap {LEVEL:g}% interval over documents ({RESAMPLES} resamples)",
    )


def held_out_notes(table: pl.DataFrame, names: Mapping[str, str]) -> list[str]:
    """A line per learned lens scored on the task its translators were fitted on."""
    fitted = table.filter(pl.col("held_out").not_()).select(*KEY, "lens").unique()
    return [
        f"**Not held out:** the {r['lens']} lens of {names.get(r['model'], r['model'])} was "
        f"fitted on task {r['task']} itself; its numbers there are in-sample, not a held-out "
        "claim (methods §17)."
        for r in fitted.sort(*KEY, "lens").iter_rows(named=True)
    ]


def summary_rows(table: pl.DataFrame, names: Mapping[str, str]) -> list[list[str]]:
    """Per (model, task, lens): whether held out, the means over blocks 0..L-1 of KL, top-5
    overlap and cross-entropy, and at how many blocks its KL is below the logit lens's."""
    blocks = table.filter(pl.col("relative_depth") < 1)
    logit = blocks.filter(pl.col("lens") == "logit").select(*KEY, "layer", logit_kl="kl")
    joined = blocks.join(logit, on=[*KEY, "layer"], how="left")
    summary = (
        joined.group_by(*KEY, "lens", maintain_order=True)
        .agg(
            pl.col("held_out").first(),
            *(pl.col(c).mean() for c in LENS),
            (pl.col("kl") < pl.col("logit_kl")).sum().alias("below"),
            pl.col("logit_kl").is_not_null().sum().alias("compared"),
            pl.len().alias("n_blocks"),
        )
        .sort(*KEY, "lens")
    )
    return key_rows(
        summary,
        names,
        lambda r: [
            r["lens"],
            "" if r["held_out"] is None else ("yes" if r["held_out"] else "**no**"),
            fmt(r["kl"], digits=3),
            fmt(r["top5_overlap"], digits=3),
            fmt(r["ce"], digits=3),
            "" if r["lens"] == "logit" else f"{r['below']} of {r['compared']}",
        ],
    )


def agreement(base: Mapping[str, Any], other: Mapping[str, Any], column: str) -> bool | None:
    """Whether a depth finding under another lens (``other``'s row) agrees with the logit lens's
    (``base``): both without a value (no crossing), or both intervals given and overlapping;
    None where it cannot be told (an interval missing, the values not equal)."""
    a, b = base[column], other[column]
    if a is None or b is None:
        return a is None and b is None
    ends = (base["ci_low"], base["ci_high"], other["ci_low"], other["ci_high"])
    if any(e is None for e in ends):
        return True if a == b else None
    return bool(ends[0] <= ends[3] and ends[2] <= ends[1])


def verdicts(ctx: ReportContext, lenses: pl.DataFrame) -> list[str]:
    """Per (model, task) holding a learned lens, a line per depth finding (decided-at depth of all
    tokens, ED_KL, ED_top5): its value and interval under each lens, and whether it holds under
    every lens stored (:func:`agreement` with the logit lens's)."""
    found = []
    decided = ctx.tables.get("decided_depth")
    if decided is not None:
        found.append(("decided-at depth (all tokens)", decided.filter(pl.col("group") == "all"),
                      "mean"))  # fmt: skip
    ed = ctx.tables.get("effective_depth")
    if ed is not None:
        found += [(f"ED_{m.upper() if m == 'kl' else m}", ed.filter(pl.col("measure") == m),
                   "ratio") for m in ("kl", "top5")]  # fmt: skip
    lines = []
    pairs = lenses.select(*KEY).unique().sort(*KEY).rows()
    for key in pairs:
        where = [pl.col(c) == v for c, v in zip(KEY, key, strict=True)]
        label = f"{ctx.names.get(key[0], key[0])} · {key[2]}"
        for name, frame, column in found:
            rows = {r["lens"]: r for r in frame.filter(*where).iter_rows(named=True)}
            if "logit" not in rows or len(rows) < 2:
                continue
            cells = [
                f"{lens} {fmt(r[column], digits=3)} [{fmt(r['ci_low'], digits=3)}, "
                f"{fmt(r['ci_high'], digits=3)}]"
                for lens, r in sorted(rows.items())
            ]
            told = {lens: agreement(rows["logit"], r, column) for lens, r in rows.items()}
            differ = [lens for lens, agrees in sorted(told.items()) if agrees is False]
            unknown = [lens for lens, agrees in sorted(told.items()) if agrees is None]
            if differ:
                verdict = (
                    f"**differs under the {', '.join(differ)} lens** (intervals apart, or a "
                    "crossing under one lens only)"
                )
            elif unknown:
                verdict = f"cannot be told under the {', '.join(unknown)} lens (no interval)"
            else:
                verdict = "**holds under every lens stored**"
            lines.append(f"- {label}, {name}: {'; '.join(cells)}: {verdict}.")
    return lines


def report(ctx: ReportContext) -> str:
    """The learned-lens section: the held-out notes, the per-lens summary, the figure and the
    verdicts on the depth findings."""
    table = ctx.tables.get("lens_comparison")
    if table is None or not table.height:
        return ""
    header = ["Model", "Task", "Lens", "Held out", "Mean KL (nats)", "Mean top-5 overlap",
              "Mean CE (nats)", "Blocks with KL below the logit lens's"]  # fmt: skip
    lines = verdicts(ctx, table)
    return "\n\n".join(
        p
        for p in [
            "The logit lens and each learned lens stored (methods §17: least squares `ls`, tuned "
            "lens `tuned`; `layerdiv fit-lens`, `extract --lens-ls/--lens-tuned`) read the same "
            "block inputs h_l through the model's final norm and unembedding, a learned lens "
            "after its translator A_l h_l + b_l. Means over blocks 0..L-1 of the per-block means "
            "(over a document's positions, then over documents); the figure's bars are bootstrap "
            f"{LEVEL:g}% intervals over documents.",
            *held_out_notes(table, ctx.names),
            markdown_table(header, summary_rows(table, ctx.names)),
            plots.figure_link(
                ctx,
                "lens_comparison.png",
                "Logit and learned lenses",
                lambda: comparison_figure(table, plots.short_names(ctx.names)),
            ),
            "Depth findings under each lens (value [95% interval]); a finding holds where every "
            "learned lens's interval overlaps the logit lens's (or neither has a crossing):\n\n"
            + "\n".join(lines)
            if lines
            else "",
        ]
        if p
    )


ANALYSIS = Analysis(
    name="lens_comparison",
    title="Running text: logit and learned lenses",
    methods=(17,),
    tables=tables,
    report=report,
    kinds=(TEXT_KIND,),
    needs=("token_lens",),
    order=145,
)
