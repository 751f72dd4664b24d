"""``--gram``: each instance's Gram matrix of the component outputs (exact angles, methods §7),
choice tasks (``gram`` table). The hooks are
:class:`layerdiv.measurements.gram.hooks.GramCapture`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from layerdiv.measurements.registry import Measurement, negligible
from layerdiv.schemas import GRAM as GRAM_SCHEMA


def gram_table(instances: Sequence[int], gram: np.ndarray) -> pa.Table:
    """Rows of :data:`~layerdiv.schemas.GRAM`; ``gram`` is (B, C(C+1)/2), each row the upper
    triangle of one instance's Gram matrix (``layerdiv.schemas.gram_index``)."""
    return pa.table(
        {
            "instance": pa.array(instances, pa.int32()),
            "gram": pa.array(list(np.asarray(gram, np.float32)), pa.list_(pa.float32())),
        },
        schema=GRAM_SCHEMA,
    )


def gram_rows(instances: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``gram`` rows of ``instances`` from each one's upper triangle (C(C+1)/2 values)."""
    return {"gram": gram_table(instances, np.stack([np.asarray(v) for v in values]))}


GRAM = Measurement(
    name="gram",
    flag="--gram",
    help="Also store each instance's Gram matrix of the component outputs (exact angles).",
    tables={"choice": ("gram",)},
    attach=f"{__name__}.hooks:GramCapture",
    rows=gram_rows,
    flops=negligible,
    since={"gram": 2},
    order=30,
)
