"""``--lens``: the logit lens of every block input (methods §9): at the last prompt
token of a choice task (``lens``), at every token of a text task (``token_lens``), read out by
the final norm and unembedding (``final``) or with the last block applied first
(``last-block``, text tasks). Its hooks (:func:`layerdiv.measurements.lens.hooks.lens_hooks`) are
bound to the task kind's own capture: a choice task's last-token decomposition, a text task's
per-token capture (which keeps the states it reads)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import click
import numpy as np
import pyarrow as pa

from layerdiv.errors import LayerdivError
from layerdiv.measurements.registry import (
    Measurement,
    ModelShape,
    Planning,
    Setting,
    per_token_and_layer,
)
from layerdiv.schemas import LENS as LENS_SCHEMA
from layerdiv.schemas import TOKEN_LENS, token_key
from layerdiv.schemas.kinds import KINDS

READOUTS = {"final": ("choice", "text"), "last-block": ("text",)}
"""Each readout of the lens (``--lens NAME``, ``layerdiv.measurements.lens.hooks.LENSES``) and the
task kinds it applies to."""

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


def token_lens_table(docs: Sequence[int], n_tokens: Sequence[int], values: np.ndarray) -> pa.Table:
    """Rows (doc, pos, layer) of :data:`~layerdiv.schemas.TOKEN_LENS` from ``values``
    (sum n_tokens, L + 1, len(:data:`LENS_VALUES`)), ``ce`` NaN (stored as null) at each
    document's last position."""
    n, layers = np.shape(values)[:2]
    doc, pos = token_key(docs, n_tokens)
    return pa.table(
        {
            "doc": pa.array(np.repeat(doc, layers)),
            "pos": pa.array(np.repeat(pos, layers)),
            "layer": pa.array(np.tile(np.arange(layers, dtype=np.int16), n)),
            **lens_columns(values, nullable_ce=True),
        },
        schema=TOKEN_LENS,
    )


def readout_of(manifest: Any) -> str | None:
    """The logit lens's readout a partition's manifest records (``final`` or ``last-block``;
    None: no lens recorded)."""
    return manifest.settings.get(LENS.name, {}).get("lens")


def lens_rows(units: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``lens`` rows of a choice task's instances ``units`` from each one's (L + 1, 5)
    values (:data:`LENS_VALUES`; ce of its gold option's first token); or the ``token_lens``
    rows of a text task's documents from each one's (T, L + 1, 5) values (ce of the next
    token)."""
    if np.ndim(values[0]) == 3:
        lengths = [len(x) for x in values]
        v = np.concatenate([np.asarray(x) for x in values])
        return {"token_lens": token_lens_table(units, lengths, v)}
    return {"lens": lens_table(units, np.stack([np.asarray(x) for x in values]))}


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
    if KINDS[kind].scored:
        return L * shape.readout()
    extra = (L + 1) * shape.readout(tokens)
    return extra + (L * shape.block(tokens) if settings.get("lens") == "last-block" else 0.0)


LENS = Measurement(
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
    attach=f"{__name__}.hooks:lens_hooks",
    rows=lens_rows,
    check_rows=per_token_and_layer("token_lens"),
    cost=lens_cost,
    costed={"text": ({"lens": "last-block"},)},
    plan=plan_lens,
    since={"lens": 4, "token_lens": 4},
    order=40,
)
