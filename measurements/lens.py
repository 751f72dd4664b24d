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


def lens_table(
    instances: Sequence[int], kl: np.ndarray, top5: np.ndarray, ce: np.ndarray
) -> pa.Table:
    """Rows (instance, layer) of :data:`~layerdiv.schemas.LENS`; each array is (B, L + 1)."""
    b, layers = np.shape(kl)
    return pa.table(
        {
            "instance": pa.array(np.repeat(np.asarray(instances, np.int32), layers)),
            "layer": pa.array(np.tile(np.arange(layers, dtype=np.int16), b)),
            "kl": pa.array(np.asarray(kl, np.float32).reshape(-1)),
            "top5_overlap": pa.array(np.asarray(top5, np.float32).reshape(-1)),
            "ce": pa.array(np.asarray(ce, np.float32).reshape(-1)),
        },
        schema=LENS_SCHEMA,
    )


def lens_rows(instances: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``lens`` rows of ``instances`` (a choice task) from each one's (L + 1, 3) kl,
    top5_overlap and ce of its gold option's first token."""
    v = np.stack([np.asarray(x) for x in values])
    return {"lens": lens_table(instances, v[..., 0], v[..., 1], v[..., 2])}


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
