"""``--heads``: every attention head's option logits (methods §8), choice tasks (``heads``
table). The hooks are :class:`layerdiv.measurements.heads.hooks.HeadCapture`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from layerdiv.measurements.registry import Measurement, negligible
from layerdiv.schemas import HEADS as HEADS_SCHEMA
from layerdiv.schemas import Rules


@dataclass(frozen=True)
class HeadValues:
    """One instance's heads, as :class:`layerdiv.measurements.heads.hooks.HeadCapture` gives
    them."""

    components: Sequence[int]
    """Index (execution order) of each attention component."""
    layers: Sequence[int]
    """The block of each attention component."""
    head_ids: Sequence[int]
    """Head index of each column: 0..H-1, preceded by -1 (the output projection's bias) when the
    projection has one."""
    logits: Any
    """(A, G, K) u_(b,h)[k]: head G of attention component A's share of option k's logit."""


def heads_table(
    instances: Sequence[int],
    components: Sequence[int],
    layers: Sequence[int],
    head_ids: Sequence[int],
    logits: np.ndarray,
) -> pa.Table:
    """Long rows (instance, component, head, option) of :data:`~layerdiv.schemas.HEADS`.

    ``logits`` is (B, A, G, K) u_(b,h)[k] per instance for the A attention ``components`` (their
    ``layers``) and the G heads ``head_ids`` (-1: the output projection's bias)."""
    b, n_attn, n_heads, n_opt = logits.shape
    per_head = n_heads * n_opt
    return pa.table(
        {
            "instance": pa.array(
                np.repeat(np.asarray(instances, dtype=np.int32), n_attn * per_head)
            ),
            "component": pa.array(
                np.tile(np.repeat(np.asarray(components, np.int16), per_head), b)
            ),
            "layer": pa.array(np.tile(np.repeat(np.asarray(layers, np.int16), per_head), b)),
            "head": pa.array(np.tile(np.repeat(np.asarray(head_ids, np.int16), n_opt), b * n_attn)),
            "option": pa.array(np.tile(np.arange(n_opt, dtype=np.int8), b * n_attn * n_heads)),
            "logit": pa.array(np.asarray(logits, dtype=np.float32).reshape(-1)),
        },
        schema=HEADS_SCHEMA,
    )


def head_rows(instances: Sequence[int], values: Sequence[HeadValues]) -> dict[str, pa.Table]:
    """The ``heads`` rows of ``instances`` from each one's :class:`HeadValues`."""
    first = values[0]
    logits = np.stack([np.asarray(v.logits) for v in values])
    return {"heads": heads_table(instances, first.components, first.layers, first.head_ids, logits)}


HEADS = Measurement(
    name="heads",
    flag="--heads",
    help="Also store every attention head's option logits (heads table); extends partitions "
    "stored without them.",
    tables={"choice": ("heads",)},
    attach=f"{__name__}.hooks:HeadCapture",
    rows=head_rows,
    flops=negligible,
    model_check=f"{__name__}.hooks:check_heads",
    rules={"heads": Rules(bounds={"layer": (0, "L-1")})},
    since={"heads": 2},
    order=20,
)
