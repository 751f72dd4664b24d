"""Choice tasks, logit lens at the last prompt token (``extract --lens`` on a choice task,
methods §9): per (model, task, lens, layer), the means over instances of the ``lens``
table. Running text draws these beside its own lens curves (:mod:`.text_lens`, dashed).

Table ``lens_curves``: per (model, task, lens, layer l = 0..L; l = L is the model's own output):
``relative_depth`` l / L, ``n_instances``, the means over instances of ``kl`` = KL(p_l || p_L),
``top5_overlap`` = |top5(p_l) & top5(p_L)| / 5 and ``ce`` = -log p_l(first token of the gold
option), and ``uniform_ce`` = log V, the cross-entropy of the uniform distribution over the
vocabulary (null where the manifest does not record V). ``lens`` is the readout the partition was
extracted with (``final`` or ``last-block``): partitions of different readouts are never averaged
together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import polars as pl

from layerdiv.analyze.frames import tag
from layerdiv.analyze.registry import Analysis, Context, map_partitions
from layerdiv.measurements.lens import readout_of
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY

LENS = ("kl", "top5_overlap", "ce")
"""Per-instance lens columns of the ``lens`` table (schemas ``LENS``)."""


def lens_tag(frame: pl.DataFrame, info: PartitionInfo, lens: str | None = None) -> pl.DataFrame:
    """``frame`` with the partition's key columns and ``lens`` (the readout recorded in its
    manifest, or the learned lens ``lens``) first, and its uniform baseline ``uniform_ce`` =
    log V (methods §9)."""
    m = info.manifest
    uniform = math.log(m.vocab_size) if m.vocab_size else None
    return tag(frame, info).select(
        *KEY,
        pl.lit(lens or readout_of(m), pl.String).alias("lens"),
        pl.exclude(*KEY),
        pl.lit(uniform, pl.Float64).alias("uniform_ce"),
    )


def partition_curves(info: PartitionInfo) -> pl.DataFrame:
    """``lens_curves`` of one choice partition: per layer, the means over its instances
    (methods §9) and ``relative_depth`` l / L."""
    blocks = info.manifest.n_blocks
    frame = (
        info.scan("lens")
        .group_by("layer")
        .agg(pl.col("instance").n_unique().alias("n_instances"), *(pl.col(c).mean() for c in LENS))
        .with_columns(
            pl.col("layer").cast(pl.Int16), (pl.col("layer") / blocks).alias("relative_depth")
        )
        .select("layer", "relative_depth", "n_instances", *LENS)
        .sort("layer")
        .collect()
    )
    return lens_tag(frame, info)


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: ``lens_curves`` of the choice partitions extracted with
    ``--lens`` (none without: the lens is optional on choice tasks)."""
    return {"lens_curves": pl.concat(list(map_partitions(partition_curves, ctx.parts)))}


ANALYSIS = Analysis(
    name="lens_curves",
    title="Logit lens at the last prompt token",
    tables=tables,
    needs=("lens",),
    order=70,
)
