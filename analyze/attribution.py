"""What the attribution maps of a text task share (integrated gradients, methods §13; residual
erasure, methods §14): where each document's answer starts, the tokens on a map's axis, and the
per-document heatmap of a map.

Neither measurement's table names the answer's start s; both maps give it exactly, by
construction: the last block's output h_L at position t reaches the target only through the
logits z_t (the final norm and the unembedding act position by position), and the target reads
only the answer-predicting positions j = s-1..T-2. So the last block's attribution
IG(L-1, t) (any site: its gradient is exactly 0 there) and the erasure of the last state
effect(L, t) are 0 at every t < s-1 and nonzero at t = s-1: s = 1 + the first position where
they are nonzero (:func:`answer_starts`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.store import PartitionInfo

MAP_DOCUMENTS = 2
"""The maps drawn per partition: its first documents (by index), each site of each."""


def answer_starts(last: pl.DataFrame, value: str) -> pl.DataFrame:
    """Per document (``doc``) its answer's start ``answer_start`` s, from ``last``: the rows
    (``doc``, ``pos``, ``value``) of the last block's attribution or the last state's erasure
    (see the module docstring): 1 + the first position whose value is nonzero; none where every
    value is 0."""
    return (
        last.filter(pl.col(value) != 0)
        .group_by("doc")
        .agg(answer_start=(pl.col("pos").min() + 1).cast(pl.Int32))
        .sort("doc")
    )


def first_documents(info: PartitionInfo, table: str) -> list[int]:
    """The first :data:`MAP_DOCUMENTS` documents of ``info`` that hold rows of ``table``."""
    docs = info.scan(table).select("doc").unique().sort("doc").head(MAP_DOCUMENTS).collect()
    return docs["doc"].to_list()


def document_tokens(info: PartitionInfo, docs: Sequence[int]) -> pl.DataFrame:
    """The ``doc``, ``pos`` and ``token`` id of every token of ``docs`` (the store keeps ids,
    not their text)."""
    return (
        info.scan("tokens")
        .filter(pl.col("doc").is_in(list(docs)))
        .select("doc", "pos", "token")
        .sort("doc", "pos")
        .collect()
    )


def token_labels(tokens: pl.DataFrame) -> list[str]:
    """The axis label of each token of one document: ``<position>:<token id>``."""
    return [f"{p}:{t}" for p, t in zip(tokens["pos"], tokens["token"], strict=True)]


def map_panel(
    title: str,
    z: np.ndarray,
    labels: list[str],
    rows: list[int],
    ylabel: str,
    colorbar: str,
    start: int | None,
    signed: bool,
) -> plots.Panel:
    """The row x token heatmap ``z`` (rows, T) of one document: ``signed``, diverging colours
    centred at 0 (symmetric range), else sequential from 0; the colour range set by the
    positions 1..T-1 (position 0, the attention sink, would take all of it and is drawn clipped);
    a dotted line before the answer's first token ``start``."""
    rest = np.abs(z[:, 1:]) if z.shape[1] > 1 else np.abs(z)
    top = float(rest.max()) if rest.size and rest.max() > 0 else 1.0
    heat = plots.Heatmap(
        z.tolist(),
        labels,
        rows,
        colorbar,
        cmap="RdBu_r" if signed else "viridis",
        zmin=-top if signed else 0.0,
        zmax=top,
        zmid=0.0 if signed else None,
        origin="lower",
    )
    lines = (
        []
        if start is None
        else [
            plots.RefLine(start - 0.5, axis="x", label="answer starts", dash="dot", color="black")
        ]
    )
    return plots.Panel(title, heatmap=heat, xlabel="position:token id", ylabel=ylabel, lines=lines)
