"""Running text, future effects (``extract --skips`` on a text task, methods §9): how
much skipping block l at the positions before a split point changes what later blocks do and what
the model predicts after it.

Tables:

- ``text_skips``: per (model, task, sublayer, mode, skipped block l, affected block j): ``n`` (rows:
  documents x split points), ``rel_change_max`` (the maximum over split points and documents, as
  the depth-efficiency paper plots its heatmap) and ``rel_change_mean``; ``relative_depth`` of
  the skipped block (l + 1) / L.
- ``text_skip_output``: per (model, task, sublayer, skipped block l): ``n``, ``out_change_max``
  (the paper's bars) and ``out_change_mean``, with ``relative_depth``.

``sublayer`` says what was skipped: ``block`` (attention and MLP), ``attn`` or ``mlp``;
``mode`` how the model ran on (methods §10): ``total`` (every later block computes from the
changed stream) or ``local`` (``--skip-mode local``: each later block reads the clean stream minus
block l's update, the direct effect only). Total minus local is what the blocks between l and j
pass on: the indirect part of the effect.
"""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import tag
from layerdiv.analyze.markdown import fmt, key_rows, markdown_table
from layerdiv.analyze.overlap import independent
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    map_partitions,
)
from layerdiv.analyze.text import TEXT_KIND, batches, combine, sums
from layerdiv.schemas import MODES
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY

SKIP_ROWS = 1 << 20
"""Rows of ``future_effects`` / ``future_output`` read at once."""


def _with_string_sublayer(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.with_columns(pl.col(c).cast(pl.String) for c in ("sublayer", "mode") if c in frame)


def effects_table(info: PartitionInfo) -> pl.DataFrame:
    """``text_skips`` of one partition: rel_change(l, j) = max over p >= t of ||d'_j - d_j|| /
    max(||d_j||, 1e-6) (methods §9, stored per document and split point; local: §10), its
    maximum and mean over split points and documents per (sublayer, mode, l, j)."""
    keys = ["sublayer", "mode", "skipped", "block"]
    frames = batches(info, "future_effects", [*keys, "rel_change"], SKIP_ROWS)
    table = combine(
        (sums(_with_string_sublayer(f), keys, ["rel_change"]) for f in frames), keys, ["rel_change"]
    )
    return tag(_depth(table, info.manifest.n_blocks), info)


def output_table(info: PartitionInfo) -> pl.DataFrame:
    """``text_skip_output`` of one partition: out_change(l) = max over p >= t of
    ||softmax(z'_p) - softmax(z_p)||_2 (methods §9), its maximum and mean over split
    points and documents per (sublayer, l)."""
    keys = ["sublayer", "skipped"]
    frames = batches(info, "future_output", [*keys, "out_change"], SKIP_ROWS)
    table = combine(
        (sums(_with_string_sublayer(f), keys, ["out_change"]) for f in frames), keys, ["out_change"]
    )
    return tag(_depth(table, info.manifest.n_blocks), info)


def _depth(table: pl.DataFrame, blocks: int) -> pl.DataFrame:
    return table.with_columns(
        pl.col("skipped").cast(pl.Int16), ((pl.col("skipped") + 1) / blocks).alias("relative_depth")
    )


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: both tables of the partitions extracted with ``--skips``."""
    pairs = list(map_partitions(lambda p: (effects_table(p), output_table(p)), ctx.parts))
    return {
        "text_skips": pl.concat([e for e, _ in pairs]),
        "text_skip_output": pl.concat([o for _, o in pairs]),
    }


# --- report ----------------------------------------------------------------------------------


LINEAR = "future_linear"
"""The option (``analyze(..., options={"future_linear": True})``) that draws the heatmap on the
depth-efficiency paper's linear colour scale instead of the default log scale."""


def _cell(skipped: int, block: int, last: int, cells: dict[tuple[int, int], float]) -> str:
    """Hover text of one cell of the future-effects heatmap."""
    where = f"skip block {skipped}, block {block}: "
    if skipped == last:
        return where + "0 by construction (no later block)"
    if block <= skipped:
        return where + "0 by construction (not after the skipped block)"
    value = cells.get((skipped, block))
    return where + ("—" if value is None else f"max rel_change {value:.3g}")


TITLES = {"total": "", "local": " (local: direct only)"}
"""What each mode's heatmap title adds (methods §10; total minus local is the indirect part)."""


def _heatmap(sub: pl.DataFrame, title: str, linear: bool) -> plots.Panel:
    """The skipped x affected heatmap of the maximum rel_change of ``sub`` (one model, one
    mode, whole blocks skipped)."""
    blocks = int(sub["block"].max()) + 1  # type: ignore[arg-type]
    agg = sub.group_by("skipped", "block").agg(pl.col("rel_change_max").max())
    cells = {(i, j): v for i, j, v in agg.iter_rows()}
    last = blocks - 1
    # blocks j <= l (and every block of the last row) are unchanged by construction: no cell, so
    # that their zeros (or rounding noise) take no part of the colour scale
    z = [[cells.get((i, j)) if i < j else None for j in range(blocks)] for i in range(blocks)]
    hover = [[_cell(i, j, last, cells) for j in range(blocks)] for i in range(blocks)]
    heat = plots.Heatmap(
        z,
        list(range(blocks)),
        list(range(blocks)),
        "max rel_change" + ("" if linear else " (log scale)"),
        log=not linear,
        hover=hover,
        origin="lower",
    )
    return plots.Panel(
        title,
        heatmap=heat,
        xlabel="affected block j",
        ylabel="skipped block l",
        notes=[f"row l = {last}: no later block, 0 by construction"],
    )


def skips_spec(
    effects: pl.DataFrame, output: pl.DataFrame, names: dict[str, str], linear: bool = False
) -> plots.Figure:
    """Per model (one row of panels each): the skipped x affected heatmap of the maximum
    rel_change (whole blocks skipped; with ``--skip-mode local`` the local one beside it), and the
    out_change bars per skipped block (maximum; the
    mean as a second bar), over the model's text tasks.

    The heatmap's colours are log10 of rel_change by default: a few cells near the embedding,
    whose denominator ||d_j|| is near zero, are orders of magnitude above the rest, and on a
    linear scale (the paper's, with ``linear``) they swamp the contrast between the halves. The
    last block's row is empty: no block follows it, so its future effect is 0 by construction."""
    panels = []
    for model in sorted(effects["model"].unique()):
        name = names.get(model, model)
        sub = effects.filter((pl.col("model") == model) & (pl.col("sublayer") == "block"))
        for mode in sorted(sub["mode"].unique(), key=MODES.index):
            title = f"{name}: effect on later blocks" + TITLES[mode]
            panels.append(_heatmap(sub.filter(pl.col("mode") == mode), title, linear))
        out = (
            output.filter(pl.col("model") == model)
            .group_by("sublayer", "skipped")
            .agg(pl.col("out_change_max").max(), pl.col("out_change_mean").mean())
            .sort("sublayer", "skipped")
        )
        bars = plots.Panel(
            "Effect on the output distribution",
            xlabel="skipped block l",
            ylabel="||p' − p||₂ after the split",
        )
        sublayers = out["sublayer"].unique(maintain_order=True).to_list()
        palette = plots.colors(2 * len(sublayers))
        for i, sublayer in enumerate(sublayers):
            rows = out.filter(pl.col("sublayer") == sublayer)
            x = rows["skipped"].to_list()
            bars.series += [
                plots.Series(
                    f"{sublayer} (max)",
                    x,
                    rows["out_change_max"].to_list(),
                    color=palette[2 * i],
                    bar=True,
                ),
                plots.Series(
                    f"{sublayer} (mean)",
                    x,
                    rows["out_change_mean"].to_list(),
                    color=palette[2 * i + 1],
                    bar=True,
                ),
            ]
        panels.append(bars)
    scale = (
        "linear colour scale (the paper's)"
        if linear
        else "log colour scale: a few cells near the embedding swamp a linear one"
    )
    return plots.Figure(
        "Running text: future effects of skipping a block (methods §9)",
        panels,
        panel_size=(5.6, 4.0),
        caption=scale,
    )


def report(ctx: ReportContext) -> str:
    """The future-effects section: per (model, task, sublayer) the block whose skip changes the
    output most, and the figure."""
    if "text_skips" not in ctx.tables:
        return "No text partition was extracted with `--skips` (see the notes above)."
    effects, output = ctx.tables["text_skips"], ctx.tables["text_skip_output"]
    names = plots.short_names(ctx.names)
    top = (
        output.sort("out_change_max", descending=True)
        .group_by(*KEY, "sublayer", maintain_order=True)
        .first()
        .sort(*KEY, "sublayer")
    )
    rows = key_rows(
        top,
        ctx.names,
        lambda r: [
            r["sublayer"],
            str(r["skipped"]),
            fmt(r["out_change_max"], digits=3),
            fmt(r["out_change_mean"], digits=3),
        ],
    )
    header = ["Model", "Task", "Skipped", "Block l", "max out_change", "mean out_change"]
    return "\n\n".join(
        p
        for p in [
            "Block l's output replaced by its input at the positions before a split point t, the "
            "rest of the model run on (methods §9): rel_change(l, j) is the largest "
            "relative change of block j's update after t, out_change(l) the largest L2 distance "
            "between the next-token distributions after t. The heatmap and bars show the maximum "
            "over split points and documents, as the depth-efficiency paper plots them, but the "
            "heatmap's colours are on a log scale: a few cells near the embedding, where the "
            "denominator ||d_j|| is near zero, are orders of magnitude above the rest and swamp "
            "the contrast between the halves on the paper's linear scale (`analyze(..., "
            f"options={{'{LINEAR}': True}})` draws that). The last block's row is empty: no "
            "block follows it, so its future effect is 0 by construction. The table names, per "
            "sublayer, the skipped block with the largest out_change.",
            markdown_table(header, rows),
            plots.figure_link(
                ctx,
                "text_skips.png",
                "Future effects",
                lambda: skips_spec(
                    independent(effects, ctx.tables["manifests"], by=["sublayer", "mode"]),
                    independent(output, ctx.tables["manifests"], by=["sublayer"]),
                    names,
                    bool(ctx.options.get(LINEAR)),
                ),
            ),
        ]
        if p
    )


ANALYSIS = Analysis(
    name="text_skips",
    title="Running text: future effects of skipping a block",
    methods=("future-effects",),
    tables=tables,
    report=report,
    kinds=(TEXT_KIND,),
    needs=("future_effects",),
    options={
        LINEAR: "draw the future-effects heatmap on the paper's linear colour scale (default: log)"
    },
    order=100,
)
