"""``--skips`` on a choice task: the option logits with each block skipped (methods §7,
``skips`` table). The hooks are :class:`layerdiv.measurements.skips.hooks.SkipCapture`. On a text
task the same flag writes the future effects (:mod:`layerdiv.measurements.future`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from layerdiv.measurements.registry import Measurement, ModelShape
from layerdiv.schemas import SKIPS as SKIPS_SCHEMA
from layerdiv.schemas import Rules


def skips_table(instances: Sequence[int], skip_logits: np.ndarray) -> pa.Table:
    """Rows (instance, layer, option) of :data:`~layerdiv.schemas.SKIPS`; ``skip_logits`` is
    (B, blocks, K): the option logits with each block skipped."""
    b, n_layers, n_opt = skip_logits.shape
    return pa.table(
        {
            "instance": pa.array(np.repeat(np.asarray(instances, np.int32), n_layers * n_opt)),
            "layer": pa.array(np.tile(np.repeat(np.arange(n_layers, dtype=np.int16), n_opt), b)),
            "option": pa.array(np.tile(np.arange(n_opt, dtype=np.int8), b * n_layers)),
            "logit": pa.array(np.asarray(skip_logits, np.float32).reshape(-1)),
        },
        schema=SKIPS_SCHEMA,
    )


def skip_rows(instances: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``skips`` rows of ``instances`` from each one's (blocks, K) option logits."""
    return {"skips": skips_table(instances, np.stack([np.asarray(v) for v in values]))}


def skip_cost(shape: ModelShape, kind: str, tokens: int, settings: Mapping[str, Any]) -> float:
    """FLOPs of the skips of a choice task's prompt: blocks after b, once per skipped block b,
    and a readout of the last prompt token per skipped block."""
    L = shape.layers
    return L * (L - 1) / 2 * shape.block(tokens) + L * shape.readout()


SKIPS = Measurement(
    name="skips",
    flag="--skips",
    help="Also store the option logits with each block skipped (about half a forward pass "
    "per block; extends a partition stored without them). On a text task: the future effects "
    "of removing each block at the positions before a split point.",
    tables={"choice": ("skips",)},
    attach=f"{__name__}.hooks:SkipCapture",
    rows=skip_rows,
    flops=skip_cost,
    rules={"skips": Rules(bounds={"layer": (0, "L-1")})},
    since={"skips": 2},
    order=10,
)
