"""``--lens``: the logit lens of every block input (methods §9): at the last prompt
token of a choice task (``lens``), at every token of a text task (``token_lens``), read out by
the final norm and unembedding (``final``) or with the last block applied first
(``last-block``, text tasks). The hooks of a choice task are
:func:`layerdiv.extract.lens.last_token_lens`; a text task's lens is computed by its per-token
capture (``layerdiv.extract.text.TextCapture``, which keeps the states it reads)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
import numpy as np
import pyarrow as pa

from layerdiv.measurements.registry import Measurement, Setting, register
from layerdiv.schemas import LENS as LENS_SCHEMA

LENS_VALUES = ("kl", "top5_overlap", "final_rank", "top1", "ce")
"""The values of a lens row (:data:`~layerdiv.schemas.TOKEN_LENS`, :data:`~layerdiv.schemas.LENS`),
in the order extraction computes them and :func:`lens_columns` takes them."""


def lens_columns(values: np.ndarray, nullable_ce: bool = False) -> dict[str, pa.Array]:
    """The :data:`LENS_VALUES` columns of lens rows from ``values`` (..., len(LENS_VALUES)),
    flattened: the floats as float32, the rank and token id as int32 (exact in the float32 they
    are computed in up to 2^24); with ``nullable_ce`` a NaN ce is stored as null."""
    v = np.asarray(values).reshape(-1, len(LENS_VALUES))
    kl, top5, rank, top1, ce = v.T
    return {
        "kl": pa.array(kl.astype(np.float32)),
        "top5_overlap": pa.array(top5.astype(np.float32)),
        "ce": pa.array(ce.astype(np.float32), from_pandas=nullable_ce),
        "final_rank": pa.array(rank.astype(np.int32)),
        "top1": pa.array(top1.astype(np.int32)),
    }


def lens_table(instances: Sequence[int], values: np.ndarray) -> pa.Table:
    """Rows (instance, layer) of :data:`~layerdiv.schemas.LENS` from ``values`` (B, L + 1,
    len(:data:`LENS_VALUES`))."""
    b, layers = np.shape(values)[:2]
    return pa.table(
        {
            "instance": pa.array(np.repeat(np.asarray(instances, np.int32), layers)),
            "layer": pa.array(np.tile(np.arange(layers, dtype=np.int16), b)),
            **lens_columns(values),
        },
        schema=LENS_SCHEMA,
    )


def lens_rows(instances: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``lens`` rows of ``instances`` (a choice task) from each one's (L + 1, 5) values
    (:data:`LENS_VALUES`; ce of its gold option's first token)."""
    return {"lens": lens_table(instances, np.stack([np.asarray(x) for x in values]))}


LENS = register(
    Measurement(
        name="lens",
        flag="--lens",  # declared by its setting (it takes the readout)
        settings=(
            Setting(
                "lens",
                click.Option(
                    ["--lens", "lens"],
                    type=click.Choice(["final", "last-block"]),
                    is_flag=False,
                    flag_value="final",
                    default=None,
                    help="Also store the logit lens of every block input (text tasks: at every "
                    "token; KL to the model's output, top-5 overlap, next-token cross-entropy); "
                    "--lens last-block applies the last block first (text tasks).",
                ),
                "final",
            ),
        ),
        legacy=True,
        tables={"choice": ("lens",), "text": ("token_lens",)},
        readout=("text",),
        attach="layerdiv.extract.lens:last_token_lens",
        rows=lens_rows,
    )
)
