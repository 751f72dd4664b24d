"""``--lens``: the logit lens of every block input (methods §9): at the last prompt
token of a choice task (``lens``), at every token of a text task (``token_lens``), read out by
the final norm and unembedding (``final``) or with the last block applied first
(``last-block``, text tasks). Its hooks (:func:`layerdiv.extract.lens.lens_hooks`) are bound to
the task kind's own capture: a choice task's last-token decomposition, a text task's per-token
capture (which keeps the states it reads)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import click
import numpy as np
import pyarrow as pa

from layerdiv.errors import LayerdivError
from layerdiv.measurements.registry import Measurement, ModelShape, Planning, Setting, register
from layerdiv.schemas import LENS as LENS_SCHEMA

READOUTS = {"final": ("choice", "text"), "last-block": ("text",)}
"""Each readout of the lens (``--lens NAME``, ``layerdiv.extract.lens.LENSES``) and the task kinds
it applies to."""


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


def lens_rows(units: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``lens`` rows of a choice task's instances ``units`` from each one's (L + 1, 3) kl,
    top5_overlap and ce of its gold option's first token; or the ``token_lens`` rows of a text
    task's documents from each one's (T, L + 1, 3) kl, top5_overlap and next-token ce."""
    if np.ndim(values[0]) == 3:
        from layerdiv.store.tables import token_lens_table  # the store imports this package

        v = np.concatenate([np.asarray(x) for x in values])
        lengths = [len(x) for x in values]
        return {"token_lens": token_lens_table(units, lengths, v[..., 0], v[..., 1], v[..., 2])}
    v = np.stack([np.asarray(x) for x in values])
    return {"lens": lens_table(units, v[..., 0], v[..., 1], v[..., 2])}


def lens_row_counts(
    rows: Mapping[str, int], blocks: int, settings: Mapping[str, Any]
) -> tuple[str, str] | None:
    """A text task's ``token_lens`` holds a row per token of the chunk and layer 0..L."""
    found, tokens = rows.get("token_lens"), rows.get("tokens")
    if found is None or tokens is None or found == tokens * (blocks + 1):
        return None
    return "token_lens", (
        f"{found} rows where the chunk needs {tokens * (blocks + 1)} (one per token of its "
        f"{tokens} and layer 0..{blocks})"
    )


def plan_lens(plan: Planning) -> None:
    """Refuse a readout the task's kind cannot take (:data:`READOUTS`)."""
    readout, kind = plan.settings["lens"], plan.task.kind
    if kind not in READOUTS[readout]:
        raise LayerdivError(
            f"task {plan.task.name} is a {kind} task: --lens {readout} applies to "
            f"{', '.join(READOUTS[readout])} tasks only (a choice task keeps the last prompt "
            "token alone); use --lens"
        )


def lens_cost(shape: ModelShape, kind: str, tokens: int, settings: Mapping[str, Any]) -> float:
    """FLOPs of the lens of a sequence: a text task's L + 1 full-vocabulary readouts of every
    token (``last-block``: and the last block once per block input), a choice task's L readouts
    of the last prompt token."""
    L = shape.layers
    if kind != "text":
        return L * shape.readout()
    extra = (L + 1) * shape.readout(tokens)
    return extra + (L * shape.block(tokens) if settings.get("lens") == "last-block" else 0.0)


LENS = register(
    Measurement(
        name="lens",
        flag="--lens",  # declared by its setting (it takes the readout)
        settings=(
            Setting(
                "lens",
                click.Option(
                    ["--lens", "lens"],
                    type=click.Choice(list(READOUTS)),
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
        attach="layerdiv.extract.lens:lens_hooks",
        rows=lens_rows,
        check_rows=lens_row_counts,
        cost=lens_cost,
        costed={"text": ({"lens": "last-block"},)},
        plan=plan_lens,
    )
)
