"""Running text, depth scores per document group (methods §10): the depth-efficiency paper's
layer-effect and logit-effect depth scores per group (e.g. ``hops``, ``level``; the task's
``group_field``), computed its way and per document with bootstrap intervals.

From whole-block and sublayer skips (``future_effects``, ``future_output``) and the documents'
``group``; with L blocks, l the skipped block and j the affected one (0-based):

- the paper's aggregation: M(l, j) = max over the group's documents and split points of
  rel_change(l, j); layer effect e(l) = sum_j M(l, j) / max(L - 1 - l, 1); logit effect
  o(l) = max over the same of out_change(l);
- per document: e_doc(l) and o_doc(l), the same from the document's maxima over its split points;
- depth score of a profile v: sum_l l v(l) / sum_l v(l) (undefined when v is 0 everywhere: such a
  document is left out of the mean and counted apart); relative depth score (score + 1) / L.

Tables:

- ``text_group_scores``: per (model, task, sublayer, group, ``effect`` = ``layer`` or ``logit``):
  ``n_documents``, ``n_scored`` (documents whose score is defined), ``paper_score`` (from M and o),
  ``mean_score`` with ``mean_low``/``mean_high`` (bootstrap 95% percentile interval over
  documents), and ``paper_relative``/``mean_relative``.
- ``text_group_slope``: per (model, task, sublayer, ``effect``) of partitions whose groups are all
  numbers: ``n_scored``, ``n_groups``, the least-squares ``slope`` of per-document score against
  the group value, with ``slope_low``/``slope_high`` (bootstrap 95% percentile interval over
  documents). Does the depth used rise with hops or level?
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import tag
from layerdiv.analyze.markdown import fmt, key_rows, markdown_table
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    map_partitions,
)
from layerdiv.analyze.stats import (
    LEVEL,
    MIN_INTERVAL_N,
    RESAMPLES,
    SEED,
    bootstrap_mean,
    depth_score,
    percentile_interval,
)
from layerdiv.analyze.text import TEXT_KIND, batches
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY

SKIP_ROWS = 1 << 20
"""Rows of ``future_effects`` / ``future_output`` read at once."""
EFFECTS = ("layer", "logit")
"""The two profiles scored: the layer effect e(l) and the logit effect o(l)."""


def layer_effect(rel: np.ndarray) -> np.ndarray:
    """e(l) = sum_j M(l, j) / max(L - 1 - l, 1) of rel_change maxima (..., L, L) (methods §10)."""
    blocks = rel.shape[-1]
    return rel.sum(-1) / np.maximum(blocks - 1 - np.arange(blocks), 1)


def _interval(samples: np.ndarray) -> tuple[float, float]:
    """The bootstrap percentile interval of ``samples`` (resamples whose statistic is undefined,
    NaN, left out)."""
    low, high = percentile_interval(samples)
    return float(low), float(high)


def _slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slopes of y on x along the last axis; NaN where x does not vary."""
    xc = x - x.mean(-1, keepdims=True)
    var = (xc * xc).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(var > 0, (xc * (y - y.mean(-1, keepdims=True))).sum(-1) / var, np.nan)


def bootstrap_slope(
    x: np.ndarray, y: np.ndarray, resamples: int = RESAMPLES
) -> tuple[float, float, float]:
    """The least-squares slope of ``y`` on ``x`` and its bootstrap 95% percentile interval over
    the (x, y) pairs (NaN below :data:`MIN_INTERVAL_N` pairs)."""
    if len(x) < 2:
        return np.nan, np.nan, np.nan
    if len(x) < MIN_INTERVAL_N:
        return float(_slopes(x, y)), np.nan, np.nan
    rng = np.random.default_rng(SEED)
    pick = rng.integers(0, len(x), (resamples, len(x)))
    return (float(_slopes(x, y)), *_interval(_slopes(x[pick], y[pick])))


def _group_order(groups: np.ndarray) -> tuple[list[Any], np.ndarray | None]:
    """The distinct groups (numerically sorted when all are numbers, nulls last) and each
    document's group as a number (None unless every group is one)."""
    names = list(dict.fromkeys(groups.tolist()))
    try:
        values = np.array([float(g) for g in groups.tolist()])
    except (TypeError, ValueError):
        return sorted(names, key=lambda g: (g is None, str(g))), None
    return sorted(names, key=float), values


def group_scores(
    rel: np.ndarray, out: np.ndarray, groups: np.ndarray, resamples: int = RESAMPLES
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The group rows and slope rows (see the module docstring) of one sublayer's documents:
    ``rel`` (docs, L, L) each document's maximum over its split points of rel_change(l, j),
    ``out`` (docs, L) of out_change(l), ``groups`` (docs,) their group (strings or None)."""
    blocks = out.shape[-1]
    # per document (methods §10): e_doc(l), o_doc(l) and their depth scores
    profiles = {"layer": layer_effect(rel), "logit": out}
    scores = {effect: depth_score(v) for effect, v in profiles.items()}
    order, values = _group_order(groups)
    group_rows, slope_rows = [], []
    for effect in EFFECTS:
        for group in order:
            mine = np.array([g == group for g in groups])
            # the paper's: maxima over the group's documents (and split points) first
            top = layer_effect(rel[mine].max(0)) if effect == "layer" else out[mine].max(0)
            paper = float(depth_score(top))
            s = scores[effect][mine]
            s = s[np.isfinite(s)]
            mean, low, high = bootstrap_mean(s, resamples)
            group_rows.append(
                {
                    "group": group,
                    "effect": effect,
                    "n_documents": int(mine.sum()),
                    "n_scored": len(s),
                    "paper_score": paper,
                    "mean_score": mean,
                    "mean_low": low,
                    "mean_high": high,
                    "paper_relative": (paper + 1) / blocks,
                    "mean_relative": (mean + 1) / blocks,
                }
            )
        if values is not None:
            ok = np.isfinite(scores[effect])
            slope, low, high = bootstrap_slope(values[ok], scores[effect][ok], resamples)
            slope_rows.append(
                {
                    "effect": effect,
                    "n_scored": int(ok.sum()),
                    "n_groups": len(np.unique(values[ok])),
                    "slope": slope,
                    "slope_low": low,
                    "slope_high": high,
                }
            )
    return group_rows, slope_rows


GROUP_SCHEMA = {
    "sublayer": pl.String,
    "group": pl.String,
    "effect": pl.String,
    "n_documents": pl.Int64,
    "n_scored": pl.Int64,
    **dict.fromkeys(
        ["paper_score", "mean_score", "mean_low", "mean_high", "paper_relative", "mean_relative"],
        pl.Float64,
    ),
}
SLOPE_SCHEMA = {
    "sublayer": pl.String,
    "effect": pl.String,
    "n_scored": pl.Int64,
    "n_groups": pl.Int64,
    **dict.fromkeys(["slope", "slope_low", "slope_high"], pl.Float64),
}


def maxima(frames: Iterable[pl.DataFrame], keys: list[str], column: str) -> pl.DataFrame:
    """Per ``keys`` the maximum ``<column>_max`` of ``column`` over ``frames`` (batches of
    ``future_effects`` or ``future_output`` rows): per document, the maximum over split points."""
    name = f"{column}_max"
    part = [f.group_by(keys).agg(pl.col(column).cast(pl.Float64).max().alias(name)) for f in frames]
    return (
        pl.concat(part)
        .group_by(keys)
        .agg(pl.col(name).max())
        .with_columns(pl.col("sublayer").cast(pl.String))
    )


EFFECT_KEYS = ["sublayer", "doc", "skipped", "block"]
OUTPUT_KEYS = ["sublayer", "doc", "skipped"]


def frame_tables(
    rel: pl.DataFrame, out: pl.DataFrame, documents: pl.DataFrame, blocks: int
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The group and slope rows of one partition from its per-document maxima (:func:`maxima`
    of ``future_effects`` over :data:`EFFECT_KEYS` and of ``future_output`` over
    :data:`OUTPUT_KEYS`), its ``documents`` (doc, group) and its number of blocks."""
    group_rows, slope_rows = [], []
    for (sublayer,), sub_out in out.group_by("sublayer", maintain_order=True):
        docs = np.unique(sub_out["doc"].to_numpy())
        sub_rel = rel.filter(pl.col("sublayer") == sublayer)
        r = np.zeros((len(docs), blocks, blocks))
        r[
            np.searchsorted(docs, sub_rel["doc"].to_numpy()),
            sub_rel["skipped"].to_numpy(),
            sub_rel["block"].to_numpy(),
        ] = sub_rel["rel_change_max"].to_numpy()
        o = np.zeros((len(docs), blocks))
        o[np.searchsorted(docs, sub_out["doc"].to_numpy()), sub_out["skipped"].to_numpy()] = (
            sub_out["out_change_max"].to_numpy()
        )
        group = (
            pl.DataFrame({"doc": docs}, schema={"doc": documents.schema["doc"]})
            .join(documents, on="doc", how="left")
            .sort("doc")["group"]
            .to_numpy()
        )
        g, s = group_scores(r, o, group)
        group_rows += [{"sublayer": sublayer, **row} for row in g]
        slope_rows += [{"sublayer": sublayer, **row} for row in s]
    return pl.DataFrame(group_rows, schema=GROUP_SCHEMA), pl.DataFrame(
        slope_rows, schema=SLOPE_SCHEMA
    )


def partition_tables(info: PartitionInfo) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``text_group_scores`` and ``text_group_slope`` of one partition, its skip tables read
    batch by batch."""
    total = (  # the scores are of the total effects (methods §10; local rows are not)
        f.filter(pl.col("mode").cast(pl.String) == "total").drop("mode")
        for f in batches(info, "future_effects", [*EFFECT_KEYS, "mode", "rel_change"], SKIP_ROWS)
    )
    rel = maxima(total, EFFECT_KEYS, "rel_change")
    out = maxima(
        batches(info, "future_output", [*OUTPUT_KEYS, "out_change"], SKIP_ROWS),
        OUTPUT_KEYS,
        "out_change",
    )
    documents = info.scan("documents").select("doc", "group").collect()
    groups, slopes = frame_tables(rel, out, documents, info.manifest.n_blocks)
    return tag(groups, info), tag(slopes, info)


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: both tables of the partitions extracted with ``--skips``."""
    pairs = list(map_partitions(partition_tables, ctx.parts))
    return {
        "text_group_scores": pl.concat([g for g, _ in pairs]),
        "text_group_slope": pl.concat([s for _, s in pairs]),
    }


# --- report ----------------------------------------------------------------------------------


def groups_figure(scores: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """Per (model, task) and effect (whole-block skips) one panel: the paper's depth score per
    group as bars, ours (mean of per-document scores) as points with their bootstrap 95%
    intervals."""
    block = scores.filter(pl.col("sublayer") == "block")
    panels = []
    for key in block.select(*KEY).unique(maintain_order=True).iter_rows(named=True):
        model, task = key["model"], key["task"]
        mine = block.join(pl.DataFrame([key]), on=[*KEY], how="semi")
        for effect in EFFECTS:
            sub = mine.filter(pl.col("effect") == effect)
            groups = [
                f"{'all' if g is None else g} (n = {n})"
                for g, n in zip(sub["group"], sub["n_scored"], strict=True)
            ]
            paper = plots.Series("paper (maxima first)", groups, sub["paper_score"].to_list(),
                                 color="#bbbbbb", bar=True)  # fmt: skip
            ours = plots.Series(
                "mean of documents, 95% CI",
                groups,
                sub["mean_score"].to_list(),
                color="#1f77b4",
                line=False,
                interval=(sub["mean_low"].to_list(), sub["mean_high"].to_list()),
            )
            panels.append(
                plots.Panel(
                    f"{names.get(model, model)}, {task}: {effect} effect",
                    [paper, ours],
                    xlabel="group",
                    ylabel="depth score (block)",
                )
            )
    return plots.Figure(
        "Depth score per group, the paper's and per document (methods §10)",
        panels,
        caption=f"n: documents scored; no interval below n = {MIN_INTERVAL_N}",
    )


def interval(low: float | None, high: float | None, digits: int) -> str:
    """`` [low, high]`` of a bootstrap interval; "" where there is none (too few documents)."""
    if low is None or high is None or np.isnan(low) or np.isnan(high):
        return ""
    return f" [{fmt(low, digits=digits)}, {fmt(high, digits=digits)}]"


def report(ctx: ReportContext) -> str:
    """The group section: both scores per group, the slopes, and the figure."""
    if "text_group_scores" not in ctx.tables:
        return "No text partition was extracted with `--skips` (see the notes above)."
    scores, slopes = ctx.tables["text_group_scores"], ctx.tables["text_group_slope"]
    names = plots.short_names(ctx.names)

    rows = key_rows(
        scores.sort(*KEY, "sublayer", "effect"),
        ctx.names,
        lambda r: [
            r["sublayer"],
            r["effect"],
            str(r["group"]),
            str(r["n_scored"]),
            fmt(r["paper_score"], digits=2),
            fmt(r["mean_score"], digits=2) + interval(r["mean_low"], r["mean_high"], 2),
        ],
    )
    slope_rows = key_rows(
        slopes.sort(*KEY, "sublayer", "effect"),
        ctx.names,
        lambda r: [
            r["sublayer"],
            r["effect"],
            str(r["n_scored"]),
            fmt(r["slope"], digits=3) + interval(r["slope_low"], r["slope_high"], 3),
        ],
    )
    header = ["Model", "Task", "Skipped", "Effect", "Group", "Documents", "Paper", "Mean [95% CI]"]
    slope_header = ["Model", "Task", "Skipped", "Effect", "Documents", "Slope [95% CI]"]
    return "\n\n".join(
        p
        for p in [
            "Depth scores sum_l l v(l) / sum_l v(l) per document group (the task's group field, "
            "methods §10), of the layer effect e(l) (mean over later blocks of rel_change) and "
            "the logit effect o(l) (out_change). *Paper*: maxima over the group's documents and "
            "split points first, then the score, as the depth-efficiency paper computes it. "
            f"*Mean*: the mean of per-document scores with a bootstrap {LEVEL:g}% percentile "
            f"interval over documents ({RESAMPLES} resamples; none below {MIN_INTERVAL_N} scored "
            "documents, where resampling says nothing about the spread). *Documents*: those "
            "whose score is defined.",
            markdown_table(header, rows),
            "The slope of the per-document score against the group value, with its bootstrap "
            "interval: does the depth used rise with the group?"
            if slope_rows
            else "The groups are not all numbers: no slope of the score against them.",
            markdown_table(slope_header, slope_rows) if slope_rows else "",
            plots.figure_link(
                ctx,
                "text_groups.png",
                "Depth score per group",
                lambda: groups_figure(scores, names),
            ),
        ]
        if p
    )


ANALYSIS = Analysis(
    name="text_groups",
    title="Running text: depth scores per document group",
    methods=(10,),
    tables=tables,
    report=report,
    kinds=(TEXT_KIND,),
    needs=("future_output",),
    order=120,
)
