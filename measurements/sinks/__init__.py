"""``--sinks``: attention sinks (methods §16, ``sinks`` table): per document of a text task (per
instance of a choice task, over its prompt), block l and query head h, the mean over query
positions p = 1..T-1 of the attention weight on key position 0. The hooks are
:class:`layerdiv.measurements.sinks.hooks.SinkCapture`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from layerdiv.measurements.registry import Measurement, ModelShape
from layerdiv.schemas import PROBABILITY, Rules
from layerdiv.schemas import SINKS as SINKS_SCHEMA


def sinks_table(docs: Sequence[int], values: np.ndarray) -> pa.Table:
    """Rows (doc, block, head) of :data:`~layerdiv.schemas.SINKS` from ``values`` (N, L, H):
    sink(l, h) of each of ``docs``."""
    n, blocks, heads = values.shape
    return pa.table(
        {
            "doc": pa.array(np.repeat(np.asarray(docs, np.int32), blocks * heads)),
            "block": pa.array(np.tile(np.repeat(np.arange(blocks, dtype=np.int16), heads), n)),
            "head": pa.array(np.tile(np.arange(heads, dtype=np.int16), n * blocks)),
            "bos_attention": pa.array(values.astype(np.float32).reshape(-1)),
        },
        schema=SINKS_SCHEMA,
    )


def sink_rows(docs: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``sinks`` rows of documents or instances ``docs`` from each one's (L, H) values; a
    unit of one token (no query position after the first: NaN) has none."""
    stacked = np.stack([np.asarray(v) for v in values])
    kept = np.isfinite(stacked).all(axis=(1, 2))
    return {"sinks": sinks_table(np.asarray(docs)[kept], stacked[kept])}


def whole_blocks(
    rows: Mapping[str, int], blocks: int, settings: Mapping[str, Any]
) -> tuple[str, str] | None:
    """The ``sinks`` rows of a chunk are whole blocks of heads: a multiple of L."""
    found = rows.get("sinks")
    if found is not None and found % blocks:
        return "sinks", f"{found} rows are not whole blocks of the model's {blocks}"
    return None


QUERY_SLICE = 64
"""The most queries the hooks score at once: a causal attention's slice reads the keys up to its
last query only, so smaller slices skip more of the masked half of the scores."""


def scores(tokens: int, slice_size: int = QUERY_SLICE) -> int:
    """The (query, key) scores the hooks compute over a sequence of ``tokens`` tokens: each
    slice of ``slice_size`` queries against the keys up to its last query."""
    return sum(
        (min(tokens, start + slice_size) - start) * min(tokens, start + slice_size)
        for start in range(0, tokens, slice_size)
    )


def sink_cost(shape: ModelShape, kind: str, tokens: int, settings: Mapping[str, Any]) -> float:
    """The scores q . k of every block again (:func:`scores` of them, the masked ones of a
    slice included), 2 x heads x head width FLOPs each (half of :attr:`attention`, which also
    counts the weighted sum of the values)."""
    return shape.layers * shape.attention / 2 * scores(tokens)


SINKS = Measurement(
    name="sinks",
    flag="--sinks",
    help="Also store each head's mean attention weight on the first token (sinks table), "
    "per document of a text task, per prompt of a choice task.",
    tables={"text": ("sinks",), "choice": ("sinks",)},
    attach=f"{__name__}.hooks:SinkCapture",
    rows=sink_rows,
    check_rows=whole_blocks,
    flops=sink_cost,
    model_check=f"{__name__}.hooks:check_sinks",
    rules={
        "sinks": Rules(
            grid=(("block", "blocks"), ("head", "shared")),
            bounds={"bos_attention": PROBABILITY},
            least=2,
        )
    },
    since={"sinks": 7},
    order=90,
)
