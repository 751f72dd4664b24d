"""Attention sinks and the first token's norm (methods §16).

``sinks`` (partitions extracted with ``--sinks``, both task kinds), from the ``sinks`` table's
sink(l, h) per unit (document, or a choice task's instance):

- ``sink_heads``: per (model, revision, task, block, head) the mean of sink(l, h) over units and
  whether it exceeds :data:`EPSILON` (a sink head);
- ``sink_blocks``: per block the share of its heads that are sinks and their mean sink(l, h);
- ``sink_rate``: per (model, revision, task) the share of (l, h) that are sinks, with the
  :data:`~layerdiv.analyze.stats.LEVEL` percentile interval of
  :data:`~layerdiv.analyze.stats.RESAMPLES` seeded bootstrap resamples of the units (each
  recomputing every head's mean, then the share; none below
  :data:`~layerdiv.analyze.stats.MIN_INTERVAL_N` units); and the same over the units of at
  least :data:`MIN_TOKENS` tokens alone (``n_long``, ``long_rate``, ``long_low``, ``long_high``;
  ``median_tokens`` the units' median length), what the verdict reads: on a short prompt even
  uniform attention puts much weight on the first token.

``bos_norm`` (every text partition: the stored h.h of methods §9, no ``--sinks`` needed): per
block, the mean over documents of ||h_l|| at position 0, of the mean ||h_l|| over positions
1..T-1, and their ratio.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import tag, unit_lengths
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
from layerdiv.analyze.text import TEXT_KIND
from layerdiv.schemas.kinds import KINDS
from layerdiv.store import PartitionInfo, StoreError
from layerdiv.store.key import KEY

EPSILON = 0.3
"""A head is a sink where its mean attention on the first token exceeds this (methods §16, as Gu
et al.)."""

MIN_TOKENS = 32
"""The shortest prompt (tokens T) whose units the sinks verdict reads: uniform attention over
positions 0..p puts 1/(p + 1) on the first token, a mean over p = 1..T-1 of (H_T - 1) / (T - 1)
(H_T the harmonic number): 0.19 at T = 13, 0.10 at T = 32, a third of :data:`EPSILON`."""

WIDE = 4
"""Partitions per row of the heatmap figure."""


# --- sinks -------------------------------------------------------------------------------------


def sink_array(info: PartitionInfo) -> tuple[np.ndarray, int, int]:
    """``info``'s sink(l, h) as (units, L x H) float64 (blocks, then heads), and L and H."""
    frame = info.scan("sinks").sort("doc", "block", "head").collect()
    if not frame.height:
        raise NoData(f"{info.where} has no sinks rows")
    units, blocks, heads = (frame[c].n_unique() for c in ("doc", "block", "head"))
    if frame.height != units * blocks * heads:
        raise StoreError(
            f"{info.where}: sinks rows are not every block and head of every unit; re-extract it "
            "with --overwrite"
        )
    return frame["bos_attention"].to_numpy().astype(np.float64).reshape(units, -1), blocks, heads


def sink_rates(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row of unit ``weights`` (rows, units): the share of heads (columns of ``values``,
    (units, L x H)) whose weighted mean sink(l, h) exceeds :data:`EPSILON` (methods §16)."""
    means = (weights @ values) / weights.sum(axis=1, keepdims=True)
    return np.asarray((means > EPSILON).mean(axis=1))


FLOATS = ("sink_rate", "ci_low", "ci_high", "median_tokens", "long_rate", "long_low", "long_high")
"""The float columns of ``sink_rate``."""


def rate_interval(values: np.ndarray) -> tuple[float | None, float | None, float | None]:
    """The sink rate of the units ``values`` (units, L x H) and its bootstrap interval over
    them (none below :data:`~layerdiv.analyze.stats.MIN_INTERVAL_N` units, no rate without)."""
    units = len(values)
    if not units:
        return None, None, None
    rate = float(sink_rates(np.ones((1, units)), values)[0])
    if units < MIN_INTERVAL_N:
        return rate, None, None
    low, high = percentile_interval(sink_rates(resample_weights(units), values))
    return rate, float(low), float(high)


def partition_sinks(info: PartitionInfo) -> dict[str, pl.DataFrame]:
    """The ``sink_rate`` row and the ``sink_heads`` rows of one partition."""
    values, blocks, heads = sink_array(info)
    units = len(values)
    rate, low, high = rate_interval(values)
    docs = info.scan("sinks").select("doc").unique().sort("doc").collect()
    length = docs.join(unit_lengths(info).collect(), on="doc", how="left")["n_tokens"]
    long = (length.fill_null(0) >= MIN_TOKENS).to_numpy()
    long_rate, long_low, long_high = rate_interval(values[long])
    means = values.mean(axis=0)
    rates = pl.DataFrame(
        {
            "n_blocks": [blocks],
            "n_heads": [heads],
            "n_units": [units],
            "sink_rate": [rate],
            "ci_low": [low],
            "ci_high": [high],
            "median_tokens": [length.median()],
            "n_long": [int(long.sum())],
            "long_rate": [long_rate],
            "long_low": [long_low],
            "long_high": [long_high],
        },
        schema_overrides=dict.fromkeys(FLOATS, pl.Float64),
    )
    per_head = pl.DataFrame(
        {
            "block": np.repeat(np.arange(blocks), heads),
            "head": np.tile(np.arange(heads), blocks),
            "bos_attention": means,
            "sink": means > EPSILON,
        }
    )
    return {"sink_rate": tag(rates, info), "sink_heads": tag(per_head, info)}


def sink_tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: ``sink_rate``, ``sink_heads`` and ``sink_blocks`` of every
    partition with the ``sinks`` table."""
    found = list(map_partitions(partition_sinks, ctx.parts))
    rates = pl.concat([f["sink_rate"] for f in found]).sort(*KEY)
    per_head = pl.concat([f["sink_heads"] for f in found]).sort(*KEY, "block", "head")
    per_block = (
        per_head.group_by(*KEY, "block")
        .agg(
            pl.col("sink").mean().alias("sink_rate"),  # the share of block l's heads (methods §16)
            pl.col("bos_attention").mean(),
        )
        .sort(*KEY, "block")
    )
    return {"sink_rate": rates, "sink_heads": per_head, "sink_blocks": per_block}


def partition_label(row: Mapping[str, object], names: Mapping[str, str]) -> str:
    """``model · task`` of a row of a table with the key columns."""
    return f"{names.get(str(row['model']), row['model'])} · {row['task']}"


def sink_figure(
    rates: pl.DataFrame, per_block: pl.DataFrame, names: dict[str, str]
) -> plots.Figure:
    """The sink rate of each (model, task) with its interval (top), and per block (below)."""
    overall = plots.Panel(
        "Sink rate", xlabel="model · task", ylabel="share of heads", yrange=(-0.03, 1.03)
    )
    blocks = plots.Panel(
        f"Per block: share of heads with mean attention on the first token > {EPSILON:g}",
        xlabel="block",
        ylabel="share of heads",
        yrange=(-0.03, 1.03),
    )
    keys = rates.select(*KEY).rows(named=True)
    for key, color in zip(keys, plots.colors(len(keys)), strict=False):
        label = partition_label(key, names)
        rate = rates.filter(*(pl.col(c) == v for c, v in key.items()))
        ends = plots.interval_ends(rate)
        overall.series.append(
            plots.Series(label, [label], rate["sink_rate"].to_list(), color=color, line=False,
                         interval=ends)
        )  # fmt: skip
        rows = per_block.filter(*(pl.col(c) == v for c, v in key.items()))
        blocks.series.append(
            plots.Series(label, rows["block"].to_list(), rows["sink_rate"].to_list(), color=color)
        )
    return plots.Figure(
        "Attention sinks (methods §16)",
        [overall, blocks],
        cols=1,
        panel_size=(9.0, 3.2),
        caption=f"bars: bootstrap {LEVEL:g}% interval over units ({RESAMPLES} resamples)",
    )


def heatmap_figure(per_head: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """One block x head heatmap of the mean attention on the first token per (model, task)."""
    panels = []
    for key, rows in per_head.group_by(*KEY, maintain_order=True):
        blocks = sorted(rows["block"].unique())
        heads = sorted(rows["head"].unique())
        cells = dict(zip(zip(rows["block"], rows["head"], strict=True), rows["bos_attention"],
                         strict=True))  # fmt: skip
        z = plots.grid(cells, blocks, heads)
        hover = [[f"block {b}, head {h}: {cells[(b, h)]:.3f}" for h in heads] for b in blocks]
        heat = plots.Heatmap(z, heads, blocks, "mean attention on the first token", zmin=0.0,
                             zmax=1.0, hover=hover, origin="lower")  # fmt: skip
        label = partition_label(dict(zip(KEY, key, strict=True)), names)
        panels.append(plots.Panel(label, heatmap=heat, xlabel="head", ylabel="block"))
    return plots.Figure(
        "Mean attention on the first token per head (methods §16)",
        panels,
        cols=min(WIDE, len(panels)),
        panel_size=(4.2, 4.2),
        caption=f"a sink head: above {EPSILON:g}",
    )


def sink_verdicts(rates: pl.DataFrame, manifests: pl.DataFrame, names: dict[str, str]) -> str:
    """Per (model, revision, task), one per set of tasks with the same units: the verdict on Gu
    et al.'s finding that attention sinks emerge (the sink rate above 0, its interval over the
    units), read over the units of at least :data:`MIN_TOKENS` tokens alone; none where fewer
    than :data:`~layerdiv.analyze.stats.MIN_INTERVAL_N` are that long."""
    judged, note = one_verdict(rates, manifests)
    lines = []
    for r in judged.iter_rows(named=True):
        who = f"{names.get(r['model'], r['model'])}, {r['task']}"
        if r["n_long"] < MIN_INTERVAL_N:
            lines.append(
                f"- **No verdict: prompts too short.** {who}: {r['n_long']} of {r['n_units']} "
                f"units have at least {MIN_TOKENS} tokens (median {fmt(r['median_tokens'])}); "
                "on shorter prompts uniform attention alone puts much of its weight on the first "
                "token, so the sink rate says little about sinks."
            )
            continue
        lines.append("- " + verdict(
            f"{who}: attention sinks emerge (units of at least {MIN_TOKENS} tokens)",
            "sink rate", r["long_rate"], (r["long_low"], r["long_high"]), r["n_long"], 0.0,
            min_n=MIN_INTERVAL_N, unit="units", digits=3))  # fmt: skip
    return "\n".join([*lines, *([note] if note else [])])


def sinks_report(ctx: ReportContext) -> str:
    """The sinks section: the sink rate per (model, task) with its interval, the rate per block
    and the heatmaps."""
    rates = ctx.tables.get("sink_rate")
    if rates is None or not rates.height:
        return ""
    names = plots.short_names(ctx.names)
    rows = key_rows(
        rates,
        ctx.names,
        lambda r: [
            str(r["n_units"]),
            f"{r['n_blocks']} x {r['n_heads']}",
            fmt(r["sink_rate"], digits=3),
            f"[{fmt(r['ci_low'], digits=3)}, {fmt(r['ci_high'], digits=3)}]",
            fmt(r["median_tokens"]),
            str(r["n_long"]),
        ],
    )
    header = ["Model", "Task", "Units", "Blocks x heads", "Sink rate", f"{LEVEL:g}% CI",
              "Median tokens", f"Units ≥ {MIN_TOKENS} tokens"]  # fmt: skip
    per_block = ctx.tables["sink_blocks"].with_columns(model_label())
    per_head = ctx.tables["sink_heads"].with_columns(model_label())
    labelled = rates.with_columns(model_label())
    return "\n\n".join(
        [
            "For every unit (a document; a choice task's prompt), block l and query head h, "
            "sink(l, h) is the mean over positions 1..T-1 of the attention weight on the first "
            f"token, as the model computes it. A head is a sink where its mean over units exceeds "
            f"{EPSILON:g}; the sink rate is the share of sink heads among all (l, h), its interval "
            f"a bootstrap over units ({RESAMPLES} resamples; none below {MIN_INTERVAL_N} units). "
            f"The minimum prompt length: uniform attention alone puts (H_T − 1) / (T − 1) on "
            f"the first token (0.19 at T = 13), so the verdict (Gu et al.: sinks emerge, a "
            f"sink rate above 0) reads only the units of at least {MIN_TOKENS} tokens (0.10 "
            "there) and is not given where fewer than "
            f"{MIN_INTERVAL_N} are that long.",
            markdown_table(header, rows),
            sink_verdicts(rates, ctx.tables["manifests"], ctx.names),
            plots.figure_link(
                ctx,
                "sinks.png",
                "Attention sinks per block",
                lambda: sink_figure(labelled, per_block, names),
            ),
            plots.figure_link(
                ctx,
                "sinks_heads.png",
                "Attention on the first token per head",
                lambda: heatmap_figure(per_head, names),
            ),
        ]
    )


SINKS = Analysis(
    name="sinks",
    title="Attention sinks",
    methods=(16,),
    tables=sink_tables,
    report=sinks_report,
    kinds=tuple(KINDS),
    needs=("sinks",),
    order=180,
)


# --- the first token's norm --------------------------------------------------------------------


def partition_bos_norm(info: PartitionInfo) -> pl.DataFrame:
    """Per block of one text partition: over its documents of two or more tokens, the mean of
    ||h_l|| at position 0 (``bos_norm``) and of the mean ||h_l|| over positions 1..T-1
    (``rest_norm``), from the stored h.h (methods §9, §16), and their ratio."""
    norm = pl.col("hh").cast(pl.Float64).sqrt()
    per_doc = (
        info.scan("token_blocks")
        .group_by("doc", "block")
        .agg(
            norm.filter(pl.col("pos") == 0).first().alias("bos_norm"),
            norm.filter(pl.col("pos") > 0).mean().alias("rest_norm"),
        )
        .drop_nulls()  # a document of one token has no later position
    )
    frame = (
        per_doc.group_by("block")
        .agg(pl.len().alias("n_documents"), pl.col("bos_norm", "rest_norm").mean())
        .with_columns((pl.col("bos_norm") / pl.col("rest_norm")).alias("ratio"))
        .sort("block")
        .collect()
    )
    if not frame.height:
        raise NoData(f"{info.where} has no document of two or more tokens")
    return tag(frame, info)


def bos_norm_tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: ``bos_norm`` of every text partition."""
    frames = map_partitions(partition_bos_norm, ctx.parts)
    return {"bos_norm": pl.concat(list(frames)).sort(*KEY, "block")}


def bos_norm_figure(table: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """Per (model, task) against the block: ||h_l|| at position 0 and the mean over the later
    positions (left), and their ratio (right)."""
    norms = plots.Panel("||h_l||", xlabel="block", ylabel="norm", yscale="log")
    ratio = plots.Panel("Position 0 against the later positions", xlabel="block",
                        ylabel="||h_l(0)|| / mean ||h_l(p)||, p >= 1", yscale="log")  # fmt: skip
    ratio.lines.append(plots.RefLine(1.0, dash="dot", color="gray"))
    keys = table.select(*KEY).unique(maintain_order=True).rows(named=True)
    for key, color in zip(keys, plots.colors(len(keys)), strict=False):
        rows = table.filter(*(pl.col(c) == v for c, v in key.items()))
        label, blocks = partition_label(key, names), rows["block"].to_list()
        norms.series.append(plots.Series(f"{label}: position 0", blocks,
                                         rows["bos_norm"].to_list(), color=color))  # fmt: skip
        norms.series.append(plots.Series(f"{label}: positions 1..T-1", blocks,
                                         rows["rest_norm"].to_list(), color=color, dash="dash",
                                         marker=None))  # fmt: skip
        ratio.series.append(plots.Series(f"{label}: position 0", blocks, rows["ratio"].to_list(),
                                         color=color, legend=False))  # fmt: skip
    return plots.Figure(
        "The first token's residual norm (methods §16)",
        [norms, ratio],
        caption="means over documents; dashed: the mean over positions 1..T-1",
    )


def bos_norm_report(ctx: ReportContext) -> str:
    """The BOS norm section: the largest ratio per (model, task) and the figure."""
    table = ctx.tables.get("bos_norm")
    if table is None or not table.height:
        return ""
    top = (
        table.sort("ratio", descending=True, nulls_last=True)
        .group_by(*KEY, maintain_order=True)
        .first()
        .sort(*KEY)
    )
    rows = key_rows(
        top,
        ctx.names,
        lambda r: [
            str(r["n_documents"]),
            str(r["block"]),
            fmt(r["bos_norm"], digits=2),
            fmt(r["rest_norm"], digits=2),
            fmt(r["ratio"], digits=2),
        ],
    )
    header = ["Model", "Task", "Documents", "Block of the largest ratio", "||h_l(0)||",
              "mean ||h_l(p)||, p >= 1", "Ratio"]  # fmt: skip
    labelled = table.with_columns(model_label())
    return "\n\n".join(
        [
            "The norm of the residual stream at the first token against the mean over the later "
            "positions, per block (the block's input h_l), from the stored h.h of every token: a "
            "first token whose state grows far larger than the others' is the usual companion of "
            "attention sinks (means over documents of two or more tokens).",
            markdown_table(header, rows),
            plots.figure_link(
                ctx,
                "bos_norm.png",
                "The first token's residual norm",
                lambda: bos_norm_figure(labelled, plots.short_names(ctx.names)),
            ),
        ]
    )


BOS_NORM = Analysis(
    name="bos_norm",
    title="Running text: the first token's norm",
    methods=(16,),
    tables=bos_norm_tables,
    report=bos_norm_report,
    kinds=(TEXT_KIND,),
    order=190,
)
