"""The Gram-matrix angles of ``extract --gram`` (methods §7), from the cache alone.

Table ``gram_blocks`` (one row per model, task and block): the angle between consecutive states,
between consecutive block updates, and of each state to the final one (the inverse-depth paper's
Theta and angle_to_end), means over instances and their standard deviations, exact for every
norm.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import by_model, instance_means, tag
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    map_partitions,
)
from layerdiv.schemas import gram_index
from layerdiv.store import PartitionInfo, StoreError

GRAM_ANGLES = ("state_angle_deg", "update_angle_deg", "angle_to_end_deg")
"""Per-block angles from the Gram matrix (``extract --gram``)."""


def gram_matrices(info: PartitionInfo) -> tuple[np.ndarray, np.ndarray]:
    """(instances (N,), G (N, C, C)): the full Gram matrices z_a . z_b of one partition.
    Refuses (``StoreError``, naming the first instance) a negative squared norm z_c . z_c,
    which no forward pass gives (a NaN or infinite entry is refused as the part is read,
    ``PartitionInfo.scan``): never averaged."""
    frame = info.scan("gram").collect().sort("instance")
    flat = np.asarray(frame["gram"].to_list(), dtype=np.float64)
    n = len([c for c in info.manifest.components if c.kind != "bias"])
    upper = np.triu_indices(n)
    index = np.array([gram_index(int(a), int(b), n) for a, b in zip(*upper, strict=True)])
    squares = [gram_index(c, c, n) for c in range(n)]
    bad = (flat[:, squares] < 0).any(axis=1)
    if bad.any():
        raise StoreError(
            f"{info.where}: the gram row of instance {frame['instance'][int(np.argmax(bad))]} "
            "holds a negative squared norm (a damaged part); "
            "re-extract it with --overwrite"
        )
    gram = np.zeros((len(frame), n, n))
    gram[:, upper[0], upper[1]] = flat[:, index]
    gram[:, upper[1], upper[0]] = flat[:, index]
    return frame["instance"].to_numpy(), gram


def gram_block_rows(info: PartitionInfo) -> pl.DataFrame:
    """Per (instance, block l): with h_l the stream after block l (h_0 = the embedding) and
    Delta_l = h_l - h_(l-1) its update, the angles theta(h_(l-1), h_l) (``state_angle_deg``),
    theta(Delta_(l-1), Delta_l) (``update_angle_deg``, null for l = 1) and theta(h_l, h_n)
    (``angle_to_end_deg``), in degrees. Each is a bilinear form of G: x = A z gives x . y =
    A G B^T."""
    comps = [c for c in info.manifest.components if c.kind != "bias"]
    blocks = np.cumsum([c.kind == "attn" for c in comps])  # block of each component, 0 = embed
    n_blocks = int(blocks[-1])
    states = (blocks[None, :] <= np.arange(n_blocks + 1)[:, None]).astype(float)  # h_0 .. h_n
    updates = np.diff(states, axis=0)  # Delta_1 .. Delta_n
    instances, gram = gram_matrices(info)

    def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        dot = np.einsum("ic,ncd,id->ni", a, gram, b)
        na = np.sqrt(np.einsum("ic,ncd,id->ni", a, gram, a))
        nb = np.sqrt(np.einsum("ic,ncd,id->ni", b, gram, b))
        return dot / (na * nb)

    def deg(c: np.ndarray) -> np.ndarray:
        return np.degrees(np.arccos(np.clip(c, -1.0, 1.0)))

    state = deg(cos(states[:-1], states[1:]))
    update = np.full_like(state, np.nan)
    update[:, 1:] = deg(cos(updates[:-1], updates[1:]))
    to_end = deg(cos(states[1:], np.repeat(states[-1:], n_blocks, axis=0)))
    first = np.searchsorted(blocks, np.arange(1, n_blocks + 1))  # first component of each block
    layer = np.array([comps[c].layer for c in first], np.int16)
    n = len(instances)
    return pl.DataFrame(
        {
            "instance": np.repeat(instances, n_blocks),
            "block": np.tile(np.arange(1, n_blocks + 1, dtype=np.int32), n),
            "layer": np.tile(layer, n),
            "relative_depth": np.tile(np.arange(1, n_blocks + 1) / n_blocks, n),
            "state_angle_deg": state.reshape(-1),
            "update_angle_deg": update.reshape(-1),
            "angle_to_end_deg": to_end.reshape(-1),
        }
    ).fill_nan(None)


def gram_table(info: PartitionInfo) -> pl.DataFrame:
    """``gram_blocks`` of one partition: :func:`gram_block_rows` averaged over instances."""
    keys = ["block", "layer", "relative_depth"]
    return tag(instance_means(gram_block_rows(info), GRAM_ANGLES, keys), info)


def gram_tables(parts: list[PartitionInfo]) -> dict[str, pl.DataFrame]:
    """``gram_blocks`` of ``parts`` (each extracted with ``--gram``; none: no table)."""
    frames = list(map_partitions(gram_table, parts))
    return {"gram_blocks": pl.concat(frames)} if frames else {}


# --- report section -------------------------------------------------------------------------------


def gram_spec(tables: Mapping[str, pl.DataFrame], names: dict[str, str]) -> plots.Figure:
    """From the Gram matrices: the angle between consecutive block updates and of each state to
    the final one, per block; mean over the model's tasks."""
    gram = by_model(
        tables["gram_blocks"], tables["manifests"], ["block", "relative_depth"], GRAM_ANGLES
    )
    panels = [
        plots.Panel(
            title,
            xlabel="relative depth l / blocks",
            ylabel="degrees",
            lines=[plots.RefLine(90, label="90°")],
        )
        for title in (
            "Angle between consecutive block updates",
            "Angle of each state to the final state",
        )
    ]
    for model, color in plots.model_colors(sorted(gram["model"].unique())).items():
        sub = gram.filter(pl.col("model") == model)
        hover = [f"block {b}" for b in sub["block"]]
        for panel, column in zip(panels, ("update_angle_deg", "angle_to_end_deg"), strict=True):
            panel.series.append(
                plots.Series(
                    names.get(model, model),
                    sub["relative_depth"].to_list(),
                    sub[column].to_list(),
                    color=color,
                    hover=hover,
                )
            )
    return plots.Figure(
        "Gram-matrix angles (extract --gram), at the last prompt token",
        panels,
        panel_size=(6.0, 3.8),
    )


def report(ctx: ReportContext) -> str:
    """The Gram-matrix angles section: what they are and their figure."""
    names = plots.short_names(ctx.names)
    return "\n\n".join(
        [
            "Angles from the Gram matrices (`extract --gram`): between consecutive block updates "
            "(90° = uncorrelated, as the inverse-depth paper finds) and of each state to the final "
            "one.",
            plots.figure_link(
                ctx, "depth_gram.png", "Gram-matrix angles", lambda: gram_spec(ctx.tables, names)
            ),
        ]
    )


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: :func:`gram_tables` of the partitions extracted with
    ``--gram``."""
    return gram_tables(ctx.parts)


ANALYSIS = Analysis(
    name="gram",
    title="Gram-matrix angles",
    tables=tables,
    report=report,
    methods=(7,),
    needs=("gram",),
    order=30,
)
