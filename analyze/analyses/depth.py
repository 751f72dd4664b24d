"""How depth is used (methods §7): residual-stream geometry per component and per block and the
decay of block update size with depth, from the cache alone. (The Gram-matrix angles of
``extract --gram`` and the layer-skip effects of ``extract --skips`` are their own analyses:
:mod:`.gram`, :mod:`.skips`.)

Tables (one row per model, task and component / block / partition):

- ``geometry``: per component c (attention and MLP apart), means over instances and their standard
  deviations of ``rel_contribution`` = ||z_c|| / ||r_(c-1)||, ``cos_residual`` = cos(z_c, r_(c-1)),
  ``angle_deg`` = arccos cos(r_(c-1), r_c) and ``cos_prev`` = cos(z_c, z_(c-1)); ``relative_depth``
  = c / L.
- ``geometry_blocks``: the same for block l (its attention and MLP outputs together, z_l = z_a +
  z_m), exact from the stored columns because z_a . z_m is the lag-1 term ``cos_prev`` of the MLP;
  ``cos_attn_mlp`` is that cosine. (The cosine between consecutive *block* updates needs lag-2 and
  lag-3 terms: it is in ``gram_blocks``.)
- ``depth_decay``: per partition, the fit of mean block ``rel_contribution`` = a * l^(-beta) on
  log-log axes with beta's bootstrap interval over instances (``beta_low``, ``beta_high``,
  ``n_units``: the instances resampled and the mean profile refitted, never the blocks) and
  first-half / second-half means of every ``geometry`` column.
- ``geometry_halves``: per partition and instance, the instance's mean ``rel_contribution`` over
  the first half's components without the embedding and block 0 (``rel_first``) and over the
  second half's (``rel_second``) and their difference: the unit the halves' verdict resamples.

||r_c|| comes from the stored prefix scale: ||r|| = sqrt(d) sqrt(prefix_rms^2 - eps) for RMSNorm.
LayerNorm models store the standard deviation of r, the norm of the *centred* stream, while
``out_norm`` and the cosines are of the uncentred vectors; mixing the two would describe neither, so
for LayerNorm models the columns that need ||r|| (``rel_contribution``, ``angle_deg`` and every
block column but ``cos_attn_mlp``) are left empty and a note says so; ``cos_residual`` and
``cos_prev`` are exact there, and ``--gram`` gives every angle exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import by_model, instance_means, listing, selected, tag
from layerdiv.analyze.markdown import DASH, fmt, markdown_table, verdict
from layerdiv.analyze.overlap import left_out, one_verdict
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    map_partitions,
    partition_engine,
)
from layerdiv.analyze.stats import (
    MIN_INTERVAL_N,
    POWER_FIT_SCHEMA,
    Interval,
    degrees,
    power_law_fit,
    resampled_power_law,
    unit_mean,
)
from layerdiv.errors import LayerdivError
from layerdiv.store import PartitionInfo, Store
from layerdiv.store.key import KEY

POSITION_NOTE = (
    "Both companion papers average over all token positions of running text; layerdiv measures at "
    "the last prompt token, where the answer is decided."
)

GEOMETRY = ("rel_contribution", "cos_residual", "angle_deg", "cos_prev")
"""Per-component geometry columns (methods §7)."""

BLOCK_GEOMETRY = ("rel_contribution", "cos_residual", "angle_deg", "cos_attn_mlp")
"""Per-block geometry columns (attention and MLP of a block together)."""


class DepthError(LayerdivError, ValueError):
    """An analysis of depth use asks for data the selected partitions do not hold."""


# --- per-instance geometry from the components table -------------------------------------------


def _has_cos_prev(info: PartitionInfo) -> bool:
    return info.manifest.schema_version >= 2


def _exact_norms(info: PartitionInfo) -> bool:
    """||r|| follows from prefix_rms (RMSNorm, hidden size known); see the module docstring."""
    return info.manifest.norm != "layer" and info.manifest.hidden_size is not None


def _eps(info: PartitionInfo) -> float:
    """The final norm's eps (0 for manifests written before it was recorded: eps is far below
    rms^2 of a residual stream, so ||r|| changes by a relative eps / (2 rms^2))."""
    return info.manifest.norm_eps or 0.0


def component_map(info: PartitionInfo) -> pl.DataFrame:
    """Per component of the manifest: name, kind, layer, ``block`` (1-based, in execution order:
    every attention component opens one; 0 for the embedding) and ``relative_depth`` = c / L."""
    comps = info.manifest.components
    return pl.DataFrame(
        {
            "component": range(len(comps)),
            "name": [c.name for c in comps],
            "kind": [c.kind for c in comps],
            "layer": [c.layer for c in comps],
            "block": np.cumsum([c.kind == "attn" for c in comps]),
            "relative_depth": np.arange(len(comps)) / len(comps),
        },
        schema_overrides={"component": pl.Int16, "layer": pl.Int16, "block": pl.Int32},
    )


def paired_blocks(info: PartitionInfo) -> bool:
    """Whether every block is one attention component directly followed by the MLP component of
    the same layer (what the block geometry assumes)."""
    comps = [c for c in info.manifest.components if c.kind in ("attn", "mlp")]
    pairs = list(zip(comps[::2], comps[1::2], strict=False))
    return len(comps) % 2 == 0 and all(
        a.kind == "attn" and m.kind == "mlp" and a.layer == m.layer for a, m in pairs
    )


def component_rows(info: PartitionInfo) -> pl.DataFrame:
    """Per (instance, component) of attention and MLP, sorted: the geometry of methods §7,
    with the norms ``r_prev`` = ||r_(c-1)|| and ``r_norm`` = ||r_c|| the block level needs and
    ``is_attn``."""
    d = float(info.manifest.hidden_size or 0)
    # ||r_c|| = sqrt(d) * sqrt(prefix_rms^2 - eps) (methods §7; RMSNorm only).
    r_norm = (
        (d * (pl.col("prefix_rms").cast(pl.Float64) ** 2 - _eps(info))).clip(0.0).sqrt()
        if _exact_norms(info)
        else pl.lit(None, pl.Float64)
    )
    kinds = [c.kind for c in info.manifest.components]
    is_attn = pl.Series([k == "attn" for k in kinds])
    residual = pl.Series([k in ("attn", "mlp") for k in kinds])
    norm, prev, cos_res = pl.col("out_norm"), pl.col("r_prev"), pl.col("cos_residual")
    return (
        info.scan("components")
        .filter(pl.col("option") == 0)
        .select(
            "instance",
            "component",
            pl.col("out_norm").cast(pl.Float64),
            pl.col("cos_residual").cast(pl.Float64),
            pl.col("cos_prev").cast(pl.Float64),
            r_norm.alias("r_norm"),
        )
        .sort("instance", "component")
        # the row before component c > 0 is c - 1 of the same instance (component 0 is dropped)
        .with_columns(pl.col("r_norm").shift(1).alias("r_prev"))
        .filter(pl.lit(residual).gather(pl.col("component")))
        .with_columns(
            pl.lit(is_attn).gather(pl.col("component")).alias("is_attn"),
            # rel_contribution = ||z_c|| / ||r_(c-1)||
            (norm / prev).alias("rel_contribution"),
            # cos(r_(c-1), r_c) = (||r_(c-1)||^2 + z_c . r_(c-1)) / (||r_(c-1)|| ||r_c||)
            degrees((prev**2 + cos_res * norm * prev) / (prev * pl.col("r_norm"))).alias(
                "angle_deg"
            ),
        )
        .collect()
    )


def block_rows(rows: pl.DataFrame) -> pl.DataFrame:
    """Per (instance, MLP component m): the geometry of block z_l = z_a + z_m, exact from the
    component rows (methods §7; blocks must be :func:`paired_blocks`). With a = m - 1 the
    attention component and r_(a-1) the stream before the block: z_a . z_m = cos_prev_m ||z_a||
    ||z_m|| (the lag-1 term), ||z_l||^2 = ||z_a||^2 + ||z_m||^2 + 2 z_a . z_m, and z_l . r_(a-1) =
    cos_res_a ||z_a|| ||r_(a-1)|| + cos_res_m ||z_m|| ||r_a|| - z_a . z_m (r_a = r_(a-1) + z_a)."""
    # In the sorted rows every MLP row directly follows the attention row of its block.
    na, nm, r0 = pl.col("out_norm").shift(1), pl.col("out_norm"), pl.col("r_prev").shift(1)
    dot_am = pl.col("cos_prev") * na * nm
    dot_r = (
        pl.col("cos_residual").shift(1) * na * r0
        + pl.col("cos_residual") * nm * pl.col("r_prev")
        - dot_am
    )
    norm = (na**2 + nm**2 + 2 * dot_am).clip(0.0).sqrt()
    return (
        rows.lazy()
        .select(
            "instance",
            "component",
            "is_attn",
            (norm / r0).alias("rel_contribution"),
            (dot_r / (norm * r0)).alias("cos_residual"),
            degrees((r0**2 + dot_r) / (r0 * pl.col("r_norm"))).alias("angle_deg"),
            pl.col("cos_prev").alias("cos_attn_mlp"),
        )
        .filter(~pl.col("is_attn"))
        .drop("is_attn")
        .collect()
    )


# --- depth decay ----------------------------------------------------------------------------------


def first_half(relative_depth: pl.Expr) -> pl.Expr:
    """The components of the first half without the embedding and block 0, whose large relative
    contribution (the embedding is small) can carry the first half alone."""
    return (relative_depth <= 0.5) & (pl.col("kind") != "embed") & (pl.col("layer") > 0)


def instance_halves(rows: pl.DataFrame, labels: pl.DataFrame) -> pl.DataFrame:
    """Per instance: its mean ``rel_contribution`` over the :func:`first_half`'s components
    (``rel_first``), over the second half's (relative depth > 1/2, ``rel_second``) and their
    difference (``rel_difference``)."""
    first = first_half(pl.col("relative_depth"))
    second = pl.col("relative_depth") > 0.5
    return (
        rows.select("instance", "component", "rel_contribution")
        .join(labels.select("component", "kind", "layer", "relative_depth"), on="component")
        .group_by("instance")
        .agg(
            pl.col("rel_contribution").filter(first).mean().alias("rel_first"),
            pl.col("rel_contribution").filter(second).mean().alias("rel_second"),
        )
        .with_columns((pl.col("rel_first") - pl.col("rel_second")).alias("rel_difference"))
        .sort("instance")
    )


def decay_interval(blocks: pl.DataFrame) -> pl.DataFrame:
    """One row: beta's bootstrap interval over the instances of per (instance, block) update
    sizes (:func:`~layerdiv.analyze.stats.resampled_power_law`) and the instances counted."""
    wide = blocks.pivot("block", index="instance", values="rel_contribution", sort_columns=True)
    depth = np.array([float(c) for c in wide.columns[1:]])
    (low, high), n = resampled_power_law(depth, wide.drop("instance").to_numpy())
    return pl.DataFrame(
        {"beta_low": [low], "beta_high": [high], "n_units": [n]},
        schema={"beta_low": pl.Float64, "beta_high": pl.Float64, "n_units": pl.Int64},
    )


def depth_decay(
    geometry: pl.DataFrame, blocks: pl.DataFrame | None, intervals: pl.DataFrame | None = None
) -> pl.DataFrame:
    """Per (model, task): the least-squares line log rel_contribution_l = log a - beta log l
    through the mean block update sizes (methods §7; the inverse-depth paper's Fig. 2d),
    beta with its standard error and (``intervals``, per partition, of :func:`decay_interval`)
    its bootstrap interval over instances, and the mean of every ``geometry`` column over the
    components in the first (relative depth <= 1/2) and the second half of the stack, and over
    the first half without the embedding and the first block (``<c>_first_half_after_block0``):
    the embedding is small, so the first block's relative contribution is large and can carry
    the first half's mean alone."""
    rows = []
    sizes = pl.DataFrame() if blocks is None else blocks.sort("block")
    for key, sub in sizes.group_by(*KEY) if sizes.height else []:
        fit = power_law_fit(
            sub["block"].to_numpy().astype(float), sub["rel_contribution"].to_numpy()
        )
        rows.append({**dict(zip(KEY, key, strict=True)), **fit})
    fits = pl.DataFrame(rows, schema={**dict.fromkeys(KEY, pl.String), **POWER_FIT_SCHEMA})
    first = pl.col("relative_depth") <= 0.5
    halves = geometry.group_by(*KEY).agg(
        *(pl.col(c).filter(first).mean().alias(f"{c}_first_half") for c in GEOMETRY),
        *(pl.col(c).filter(~first).mean().alias(f"{c}_second_half") for c in GEOMETRY),
        *(
            pl.col(c)
            .filter(first_half(pl.col("relative_depth")))
            .mean()
            .alias(f"{c}_first_half_after_block0")
            for c in GEOMETRY
        ),
    )
    out = halves.join(fits, on=[*KEY], how="left")
    if intervals is not None:
        out = out.join(intervals, on=[*KEY], how="left")
    return out.sort(*KEY)


# --- all tables -----------------------------------------------------------------------------------


def _partition_tables(info: PartitionInfo) -> tuple[dict[str, pl.DataFrame], list[str]]:
    """The tables one partition can give, and what it lacks (``cos_prev``, ``norms`` or
    ``norms_gram``, ``blocks``)."""
    extra, out = set(info.tables), dict[str, pl.DataFrame]()
    lacks: list[str] = []
    if not _has_cos_prev(info):
        return out, [*lacks, "cos_prev"]
    if not _exact_norms(info):
        lacks.append("norms_gram" if "gram" in extra else "norms")
    rows = component_rows(info)
    labels = component_map(info)
    geometry = labels.drop("block").join(instance_means(rows, GEOMETRY), on="component")
    out["geometry"] = tag(geometry, info)
    out["geometry_halves"] = tag(instance_halves(rows, labels), info)
    if not paired_blocks(info):
        return out, [*lacks, "blocks"]
    # a block's row is its MLP component's: label it with the block's number and depth
    n_blocks = int(labels["block"].max())  # type: ignore[arg-type]
    block_labels = labels.select(
        "component", "block", "layer", (pl.col("block") / n_blocks).alias("relative_depth")
    )
    per_block = block_rows(rows)
    numbered = per_block.join(block_labels.select("component", "block"), on="component")
    out["decay_interval"] = tag(decay_interval(numbered), info)
    blocks = block_labels.join(instance_means(per_block, BLOCK_GEOMETRY), on="component")
    out["geometry_blocks"] = tag(blocks.drop("component"), info)
    return out, lacks


def depth_tables(parts: list[PartitionInfo], notes: list[str]) -> dict[str, pl.DataFrame]:
    """Every table of this module for the partitions that hold the data it needs; a partition that
    lacks a column or table adds a line to ``notes`` saying how to get it. Tables no partition
    can give are left out."""

    def which(some: list[PartitionInfo]) -> str:
        return "every partition" if len(some) == len(parts) else listing(some)

    lacking: dict[str, list[PartitionInfo]] = {}
    frames: dict[str, list[pl.DataFrame]] = {}
    for info, (out, lacks) in zip(parts, map_partitions(_partition_tables, parts), strict=True):
        for name in lacks:
            lacking.setdefault(name, []).append(info)
        for name, frame in out.items():
            frames.setdefault(name, []).append(frame)
    tables = {name: pl.concat(found) for name, found in frames.items()}
    intervals = tables.pop("decay_interval", None)
    if "geometry" in tables:
        tables["depth_decay"] = depth_decay(
            tables["geometry"], tables.get("geometry_blocks"), intervals
        )
    if lacking.get("blocks"):
        notes.append(
            f"Block geometry left out for {which(lacking['blocks'])}: their blocks are not "
            "an attention component followed by the MLP component of the same layer."
        )
    if lacking.get("cos_prev"):
        notes.append(
            f"Depth geometry left out for {which(lacking['cos_prev'])}: their store (schema "
            "version 1) has no components.cos_prev; re-extract them with --overwrite."
        )
    if lacking.get("norms"):
        notes.append(
            f"rel_contribution and angle_deg are empty for {which(lacking['norms'])}: their "
            "final norm is a LayerNorm (or the manifest has no hidden_size), whose stored prefix "
            "scale is the norm of the centred stream; extract with --gram for exact angles."
        )
    if lacking.get("norms_gram"):
        notes.append(
            f"rel_contribution and angle_deg of geometry are empty for "
            f"{which(lacking['norms_gram'])}: their final norm is a LayerNorm, whose stored "
            "prefix scale is the norm of the centred stream; their exact angles are in "
            "gram_blocks (from their gram table)."
        )
    return tables


@partition_engine
def geometry(
    store: Store | str | Path, models: Iterable[str] = (), tasks: Iterable[str] = ()
) -> dict[str, pl.DataFrame]:
    """The depth-use tables (``geometry``, ``geometry_blocks``, ``depth_decay``) of the selected
    partitions (their Gram angles and skip effects: :func:`.gram.gram_tables`,
    :func:`.skips.skip_effects`). Raises :class:`DepthError` when none of them holds
    ``cos_prev``."""
    notes: list[str] = []
    tables = depth_tables(selected(store, models, tasks), notes)
    if "geometry" not in tables:
        raise DepthError(" ".join(notes))
    return tables


# --- report section -------------------------------------------------------------------------------

_KIND_STYLE: dict[str, tuple[plots.Dash, str]] = {"attn": ("solid", "o"), "mlp": ("dash", "s")}

_BLOCK_STYLE: dict[str, Any] = {"dash": "dot", "marker": "^"}
"""A whole block's series, unlike either kind's."""


def geometry_spec(tables: Mapping[str, pl.DataFrame], names: dict[str, str]) -> plots.Figure:
    """Relative contribution and cosine to the stream per component (attention and MLP apart),
    the angle between consecutive states per block, and block update size against block index on
    log-log axes with the fitted a * l^(-beta) (β, its s.e. and R² in the notes); models overlay
    on the relative-depth axis, each curve the mean over the model's tasks."""
    geo = by_model(
        tables["geometry"],
        tables["manifests"],
        ["kind", "name", "relative_depth"],
        ["rel_contribution", "cos_residual"],
    ).sort("model", "kind", "relative_depth")
    blocks = by_model(
        tables["geometry_blocks"],
        tables["manifests"],
        ["block", "relative_depth"],
        ["angle_deg", "rel_contribution"],
    )
    fits = by_model(tables["depth_decay"], tables["manifests"], [], ["a", "beta", "beta_se", "r2"])
    rel = plots.Panel(  # log: the first MLP's ratio (the embedding is small) is tens of times
        "Relative contribution per component",  # the others'
        xlabel="relative depth c / L",
        ylabel="||z_c|| / ||r_(c-1)||",
        yscale="log",
    )
    cos = plots.Panel(
        "Cosine of each component with the stream it joins",
        xlabel="relative depth c / L",
        ylabel="cos(z_c, r_(c-1))",
        lines=[plots.RefLine(0)],
    )
    angle = plots.Panel(
        "Angle between the states before and after each block",
        xlabel="relative depth l / blocks",
        ylabel="angle (degrees)",
    )
    size = plots.Panel(
        "Block update size against depth (dashed: a·l^(−β))",
        xlabel="block l",
        ylabel="||z_attn + z_mlp|| / ||r||",
        xscale="log",
        yscale="log",
    )
    for model, color in plots.model_colors(sorted(geo["model"].unique())).items():
        label = names.get(model, model)
        for kind, (dash, marker) in _KIND_STYLE.items():
            sub = geo.filter((pl.col("model") == model) & (pl.col("kind") == kind))
            for panel, column in ((rel, "rel_contribution"), (cos, "cos_residual")):
                panel.series.append(
                    plots.Series(
                        f"{label} {kind}",
                        sub["relative_depth"].to_list(),
                        sub[column].to_list(),
                        color=color,
                        dash=dash,
                        marker=marker,
                        hover=sub["name"].to_list(),
                        width=1.1,
                    )
                )
        sub = blocks.filter(pl.col("model") == model)
        hover = [f"block {b}" for b in sub["block"]]
        block = f"{label} block (attn + mlp)"  # its own style: not one of the kinds'
        angle.series.append(
            plots.Series(
                block,
                sub["relative_depth"].to_list(),
                sub["angle_deg"].to_list(),
                color=color,
                hover=hover,
                **_BLOCK_STYLE,
            )
        )
        size.series.append(
            plots.Series(
                block,
                sub["block"].to_list(),
                sub["rel_contribution"].to_list(),
                color=color,
                line=False,
                hover=hover,
                marker=_BLOCK_STYLE["marker"],
            )
        )
        x = sub["block"].to_numpy().astype(float)
        fit = fits.filter(pl.col("model") == model)
        plots.power_law_overlay(size, block, x.tolist(), fit, label, color, width=1.0)
    return plots.Figure(
        "How depth is used (methods §7), mean over tasks, at the last prompt token",
        [rel, cos, angle, size],
        panel_size=(6.0, 3.8),
        caption=f"β: mean over tasks; poor fit: R² < {plots.POOR_FIT_R2:g}",
    )


def decay_table(tables: Mapping[str, pl.DataFrame], names: dict[str, str]) -> str:
    """Per (model, task): beta ± s.e. and R² of the block update-size fit, then first / second
    half means of every geometry column."""
    rows = [
        [
            names.get(r["model"], r["model"]),
            r["task"],
            f"{fmt(r['beta'], digits=2)} ± {fmt(r['beta_se'], digits=2)}",
            plots.r2_text(r["r2"]) or DASH,
            *(
                f"{fmt(r[f'{c}_first_half'], digits=3)} / {fmt(r[f'{c}_second_half'], digits=3)} "
                f"({fmt(r[f'{c}_first_half_after_block0'], digits=3)})"
                for c in GEOMETRY
            ),
        ]
        for r in tables["depth_decay"].iter_rows(named=True)
    ]
    header = [
        "Model",
        "Task",
        "β (size ∝ l^−β)",
        "R²",
        "rel. contribution, 1st / 2nd half (ratio) (1st without block 0)",
        "cos(z, r), 1st / 2nd half (1st without block 0)",
        "angle, 1st / 2nd half (°) (1st without block 0)",
        "cos(z_c, z_c−1), 1st / 2nd half (1st without block 0)",
    ]
    return markdown_table(header, rows)


MIN_BLOCKS = 5
"""Blocks below which a power-law fit of the update sizes cannot tell (3 parameters' worth of
points and two degrees of freedom left)."""

DECAY = 0.5
"""The inverse-depth paper's finding (update size ∝ 1/l, beta = 1) holds where beta's interval
lies above this: halfway between no decay (0) and 1/l."""


def decay_verdict(finding: str, fit: Mapping[str, Any], unit: str) -> str:
    """The verdict on the inverse-depth paper's mean update ∝ 1/l from a fit row
    (:func:`~layerdiv.analyze.stats.power_law_fit` with ``beta_low``, ``beta_high``, its
    bootstrap interval over ``n_units`` ``unit``: documents or instances, never blocks): beta
    above :data:`DECAY`, its R² named; *too few to tell* below :data:`MIN_BLOCKS` blocks
    fitted or :data:`~layerdiv.analyze.stats.MIN_INTERVAL_N` units."""
    r2 = fit["r2"]
    if r2 is not None and np.isfinite(r2):
        poor = ", a poor fit" if r2 < plots.POOR_FIT_R2 else ""
        finding += f" (power law R² {r2:.2f}{poor}"
        finding += f"; {fit['n_fitted'] or 0} blocks fitted)"
    n = fit.get("n_units") or 0
    if (fit["n_fitted"] or 0) < MIN_BLOCKS:
        n = 0  # too few blocks to fit: too few to tell, whatever the units
    interval: Interval = (fit.get("beta_low"), fit.get("beta_high"))
    return verdict(finding, "β", fit["beta"], interval, n, DECAY, min_n=MIN_INTERVAL_N,
                   unit=unit)  # fmt: skip


def decay_verdicts(tables: Mapping[str, pl.DataFrame], names: dict[str, str]) -> str:
    """Per (model, task), one per set of tasks with the same instances
    (:func:`~layerdiv.analyze.overlap.one_verdict`): the verdict on the inverse-depth paper's
    mean update ∝ 1/l (beta above :data:`DECAY`, its interval over instances) and on the
    depth-efficiency paper's first finding (a component of the second half contributes less:
    per instance, its mean relative contribution over the first half without the embedding and
    block 0 minus the second half's, ``geometry_halves``; the mean over instances and its
    bootstrap interval over them)."""
    decay, note = one_verdict(tables["depth_decay"], tables["manifests"])
    lines = []
    for r in decay.iter_rows(named=True):
        who = f"{names.get(r['model'], r['model'])}, {r['task']}"
        lines.append("- " + decay_verdict(f"{who}: block update size falls roughly as 1/l", r,
                                          "instances"))  # fmt: skip
        sub = tables["geometry_halves"].filter(*[pl.col(k) == r[k] for k in KEY])
        diff, interval, n = unit_mean([sub["rel_difference"].to_numpy()])
        lines.append("- " + verdict(
            f"{who}: a component of the second half contributes less",
            "mean over instances of the relative contribution, 1st half without block 0 − 2nd "
            "half", diff, interval, n, 0.0, min_n=MIN_INTERVAL_N, unit="instances",
            digits=3))  # fmt: skip
    return "\n".join([*lines, *([note] if note else [])])


def report(ctx: ReportContext) -> str:
    """The "How depth is used" section: the depth-decay table, its verdicts and the geometry
    figure."""
    tables = ctx.tables
    if "geometry" not in tables:
        return "No partition holds the geometry columns (see the notes above)."
    names = plots.short_names(ctx.names)

    def figure(file: str, caption: str, spec: Any) -> str:
        return plots.figure_link(ctx, file, caption, lambda: spec(tables, names))

    parts = [
        "The geometry of the residual stream and the effect of skipping blocks, as in the two "
        f"companion papers (methods §7). {POSITION_NOTE} Per component c: relative "
        "contribution ||z_c|| / ||r_(c-1)|| (a ratio), cosine of z_c with the stream r_(c-1) it "
        "joins (negative: it erases), angle between r_(c-1) and r_c (degrees) and cosine with the "
        "previous component's output. A block is its attention and MLP outputs together; β is "
        "the slope of the least-squares line of log block update size against log block index "
        "(the inverse-depth paper finds β close to 1); poor fit: R² < "
        f"{plots.POOR_FIT_R2:g}. Halves split the components at relative depth 1/2; in "
        "brackets, the first half without the embedding and block 0, whose large relative "
        "contribution (the embedding is small) can carry the first half alone. The figures "
        "average over tasks. " + left_out(tables["geometry"], tables["manifests"]),
        decay_table(tables, ctx.names),
        decay_verdicts(tables, ctx.names),
        figure(
            "depth_geometry.png",
            "Geometry of the residual stream",
            geometry_spec,
        ),
    ]
    return "\n\n".join(p for p in parts if p)


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: :func:`depth_tables` of the selected partitions."""
    return depth_tables(ctx.parts, ctx.notes)


ANALYSIS = Analysis(
    name="depth",
    title="How depth is used",
    tables=tables,
    report=report,
    methods=(7,),
    order=20,
)
