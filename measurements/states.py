"""``--states K|all`` on a text task: the residual states h_0..h_L at K sampled positions per
document (methods §11, ``states`` table), with the settings ``--states`` (K, or ``all``),
``--states-seed`` and ``--states-dtype`` (recorded in the manifest, compared on a rerun). The
hooks are :class:`layerdiv.extract.states.StateCapture`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
import numpy as np
import pyarrow as pa

from layerdiv.measurements.registry import Measurement, Setting, register
from layerdiv.schemas import STATE_TYPES, states_schema


def state_count(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """``--states K|all``: K (1 or more) as an int, or ``all``."""
    if value is None or value == "all":
        return value
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter(f"{value!r}: give a number of positions (1 or more) or all")
    return int(value)


def state_positions(n_tokens: int, k: int | str, seed: int, doc: int) -> np.ndarray:
    """The sorted positions of document ``doc`` (``n_tokens`` tokens) whose states are stored:
    K drawn without replacement from 1..T-1 by ``numpy.random.default_rng([seed, doc])``;
    every one of them when K is ``all`` or K >= T - 1 (methods §11)."""
    every = np.arange(1, n_tokens)
    if k == "all" or int(k) >= n_tokens - 1:
        return every
    rng = np.random.default_rng([seed, doc])
    return np.sort(rng.choice(every, size=int(k), replace=False))


_STORED = {"float16": "float16", "float32": "float32", "uint16": "bfloat16"}
"""numpy dtype of stored states -> ``--states-dtype`` (bfloat16 is kept as its raw bits)."""


def states_table(
    docs: Sequence[int], positions: Sequence[np.ndarray], states: Sequence[np.ndarray]
) -> pa.Table:
    """Rows (doc, pos, layer) of :data:`~layerdiv.schemas.STATES` (``states_schema(d, dtype)``):
    ``positions[i]`` the positions of ``docs[i]`` and ``states[i]`` its (k, L + 1, d) states in
    the stored dtype (float16, float32, or bfloat16 as raw uint16 bits)."""
    counts = [len(p) for p in positions]
    _, layers, width = states[0].shape
    dtype = _STORED[np.asarray(states[0]).dtype.name]
    values = np.concatenate([np.asarray(s).reshape(-1) for s in states])
    n = sum(counts)
    schema = states_schema(width, dtype)
    flat = pa.array(values, schema.field("state").type.value_type)
    return pa.table(
        {
            "doc": pa.array(np.repeat(np.asarray(docs, np.int32), np.multiply(counts, layers))),
            "pos": pa.array(np.repeat(np.concatenate(positions).astype(np.int32), layers)),
            "layer": pa.array(np.tile(np.arange(layers, dtype=np.int16), n)),
            "state": pa.FixedSizeListArray.from_arrays(flat, width),
        },
        schema=schema,
    )


def state_rows(docs: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``states`` rows of documents ``docs`` from each one's (positions, states)."""
    return {"states": states_table(docs, [p for p, _ in values], [h for _, h in values])}


STATES = register(
    Measurement(
        name="states",
        flag="--states",  # declared by its first setting (it takes K)
        tables={"text": ("states",)},
        settings=(
            Setting(
                "states",
                click.Option(
                    ["--states", "states"],
                    type=str,
                    default=None,
                    callback=state_count,
                    metavar="K|all",
                    help="Text tasks: also store the residual states h_0..h_L at K sampled "
                    "positions per document (K, or all: every position but the first); states "
                    "are large (L + 1 vectors of width d per position).",
                ),
                "all",
            ),
            Setting(
                "states_seed",
                click.Option(
                    ["--states-seed"],
                    type=click.IntRange(min=0),
                    default=None,
                    help="Text tasks with --states: seed of the sampled positions (default 0).",
                ),
                0,
            ),
            Setting(
                "states_dtype",
                click.Option(
                    ["--states-dtype"],
                    type=click.Choice(list(STATE_TYPES)),
                    default=None,
                    help="Text tasks with --states: how states are stored (default float16).",
                ),
                "float16",
            ),
        ),
        attach="layerdiv.extract.states:StateCapture",
        rows=state_rows,
    )
)
