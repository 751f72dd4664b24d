"""Running text, future effects (``extract --skips`` on a text task, methods §9): how
much skipping block l at the positions before a split point changes what later blocks do and what
the model predicts after it.

Tables:

- ``text_skips``: per (model, task, sublayer, skipped block l, affected block j): ``n`` (rows:
  documents x split points), ``rel_change_max`` (the maximum over split points and documents, as
  the depth-efficiency paper plots its heatmap) and ``rel_change_mean``; ``relative_depth`` of
  the skipped block (l + 1) / L.
- ``text_skip_output``: per (model, task, sublayer, skipped block l): ``n``, ``out_change_max``
  (the paper's bars) and ``out_change_mean``, with ``relative_depth``.

``sublayer`` says what was skipped: ``block`` (attention and MLP), ``attn`` or ``mlp``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.markdown import fmt, markdown_table
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    map_partitions,
    register,
)
from layerdiv.analyze.text import TEXT_KIND, batches, combine, sums, tag, with_table
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY

SKIP_ROWS = 1 << 20
"""Rows of ``future_effects`` / ``future_output`` read at once."""


def _with_string_sublayer(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.with_columns(pl.col("sublayer").cast(pl.String))


def effects_table(info: PartitionInfo) -> pl.DataFrame:
    """``text_skips`` of one partition: rel_change(l, j) = max over p >= t of ||d'_j - d_j|| /
    max(||d_j||, 1e-6) (methods §9, stored per document and split point), its maximum
    and mean over split points and documents per (sublayer, l, j)."""
    keys = ["sublayer", "skipped", "block"]
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
    parts = with_table(ctx.parts, "future_effects", ctx.notes, "future effects")
    if not parts:
        return {}
    pairs = list(map_partitions(lambda p: (effects_table(p), output_table(p)), parts))
    return {
        "text_skips": pl.concat([e for e, _ in pairs]),
        "text_skip_output": pl.concat([o for _, o in pairs]),
    }


# --- report ----------------------------------------------------------------------------------


def skips_figure(
    effects: pl.DataFrame, output: pl.DataFrame, path: Path, names: dict[str, str]
) -> Path:
    """Per model (one row of panels each): the skipped x affected heatmap of the maximum
    rel_change (whole blocks skipped), and the out_change bars per skipped block (maximum, and
    the mean as a line), over the model's text tasks."""
    models = sorted(effects["model"].unique())
    fig = plots.new_figure(figsize=(11, 4.2 * len(models)), layout="constrained")
    axes = fig.subplots(len(models), 2, squeeze=False)
    for (ax_map, ax_bar), model in zip(axes, models, strict=True):
        sub = effects.filter((pl.col("model") == model) & (pl.col("sublayer") == "block"))
        blocks = int(sub["block"].max()) + 1  # type: ignore[arg-type]
        grid = np.full((blocks, blocks), np.nan)
        agg = sub.group_by("skipped", "block").agg(pl.col("rel_change_max").max())
        grid[agg["skipped"].to_numpy(), agg["block"].to_numpy()] = agg["rel_change_max"]
        image = ax_map.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
        fig.colorbar(image, ax=ax_map, label="max rel_change")
        ax_map.set_xlabel("affected block j")
        ax_map.set_ylabel("skipped block l")
        ax_map.set_title(f"{names.get(model, model)}: effect on later blocks", fontsize=10)
        out = (
            output.filter(pl.col("model") == model)
            .group_by("sublayer", "skipped")
            .agg(pl.col("out_change_max").max(), pl.col("out_change_mean").mean())
            .sort("sublayer", "skipped")
        )
        width = 0.8 / max(out["sublayer"].n_unique(), 1)
        for i, (sublayer, bars) in enumerate(out.group_by("sublayer", maintain_order=True)):
            x = bars["skipped"].to_numpy() + i * width
            ax_bar.bar(x, bars["out_change_max"], width, label=f"{sublayer[0]} (max)")
            ax_bar.plot(x, bars["out_change_mean"], "k.", markersize=3)
        ax_bar.set_xlabel("skipped block l")
        ax_bar.set_ylabel("||p' − p||₂ after the split (dots: mean)")
        ax_bar.set_title("Effect on the output distribution", fontsize=10)
        ax_bar.legend(fontsize=7)
        ax_bar.grid(alpha=0.3, axis="y")
    fig.suptitle("Running text: future effects of skipping a block (methods §9)", fontsize=11)
    return plots.save(fig, path)


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
    rows = [
        [
            ctx.names.get(r["model"], r["model"]),
            r["task"],
            r["sublayer"],
            str(r["skipped"]),
            fmt(r["out_change_max"], digits=3),
            fmt(r["out_change_mean"], digits=3),
        ]
        for r in top.iter_rows(named=True)
    ]
    header = ["Model", "Task", "Skipped", "Block l", "max out_change", "mean out_change"]
    return "\n\n".join(
        p
        for p in [
            "Block l's output replaced by its input at the positions before a split point t, the "
            "rest of the model run on (methods §9): rel_change(l, j) is the largest "
            "relative change of block j's update after t, out_change(l) the largest L2 distance "
            "between the next-token distributions after t. The heatmap and bars show the maximum "
            "over split points and documents, as the depth-efficiency paper plots them. The "
            "table names, per sublayer, the skipped block with the largest out_change.",
            markdown_table(header, rows),
            plots.figure_link(
                ctx,
                "text_skips.png",
                "Future effects",
                lambda p: skips_figure(effects, output, p, names),
            ),
        ]
        if p
    )


register(
    Analysis(
        name="text_skips",
        title="Running text: future effects of skipping a block",
        methods=("future-effects",),
        tables=tables,
        report=report,
        kinds=(TEXT_KIND,),
    )
)
