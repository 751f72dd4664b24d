"""``--states K|all``: the residual states h_0..h_L (methods §11, ``states`` table) at K sampled
positions per document of a text task, at the last prompt token of each instance of a choice task
(K and the seed unused there), with the settings ``--states`` (K, or ``all``), ``--states-seed``
and ``--states-dtype`` (recorded in the manifest, compared on a rerun). The hooks are
:class:`layerdiv.measurements.states.hooks.StateCapture`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
import numpy as np
import pyarrow as pa

from layerdiv.measurements.registry import Measurement, Setting, negligible
from layerdiv.schemas import STATE_TYPES, states_schema
from layerdiv.schemas.kinds import KINDS


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


LARGE_BYTES = 10 * 2**30
"""A run whose states will take more than this says so before it starts."""

STATE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
"""Bytes of one stored state value per ``--states-dtype``."""


def state_rows_count(lengths: Sequence[int], ids: Sequence[int], kind: str, k: int | str) -> int:
    """Stored positions of units ``ids`` (``lengths`` indexed by unit): a text document's
    K sampled positions (all of 1..T-1 when K is ``all`` or K >= T - 1), a choice instance's
    last prompt token (methods §11)."""
    if KINDS[kind].scored:
        return len(ids)
    return sum(lengths[i] - 1 if k == "all" else min(int(k), lengths[i] - 1) for i in ids)


def states_size(rows: int, layers: int, width: int, dtype: str) -> int:
    """rows x (L + 1) x d x dtype bytes: what the ``states`` vectors of ``rows`` positions take
    (their key columns and Parquet's pages add a little)."""
    return rows * layers * width * STATE_BYTES[dtype]


_STORED = {"float16": "float16", "float32": "float32", "uint16": "bfloat16"}
"""numpy dtype of stored states -> ``--states-dtype`` (bfloat16 is kept as its raw bits)."""


def states_table(
    docs: Sequence[int],
    positions: Sequence[np.ndarray],
    tokens: Sequence[np.ndarray],
    states: Sequence[np.ndarray],
) -> pa.Table:
    """Rows (doc, pos, layer) of :data:`~layerdiv.schemas.STATES` (``states_schema(d, dtype)``):
    ``positions[i]`` the positions of ``docs[i]``, ``tokens[i]`` their token ids and
    ``states[i]`` its (k, L + 1, d) states in the stored dtype (float16, float32, or bfloat16 as
    raw uint16 bits)."""
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
            "token": pa.array(np.repeat(np.concatenate(tokens).astype(np.int32), layers)),
            "layer": pa.array(np.tile(np.arange(layers, dtype=np.int16), n)),
            "state": pa.FixedSizeListArray.from_arrays(flat, width),
        },
        schema=schema,
    )


def state_rows(docs: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``states`` rows of documents or instances ``docs`` from each one's (positions, token
    ids, states)."""
    pos, tokens, states = (list(c) for c in zip(*values, strict=True))
    return {"states": states_table(docs, pos, tokens, states)}


STATES = Measurement(
    name="states",
    flag="--states",  # declared by its first setting (it takes K)
    tables={"text": ("states",), "choice": ("states",)},
    settings=(
        Setting(
            "states",
            click.Option(
                ["--states", "states"],
                type=str,
                default=None,
                callback=state_count,
                metavar="K|all",
                help="Also store the residual states h_0..h_L: text tasks at K sampled "
                "positions per document (K, or all: every position but the first), choice "
                "tasks at the last prompt token (K unused); states are large (L + 1 vectors "
                "of width d per position).",
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
                help="With --states: how states are stored (default float16).",
            ),
            "float16",
        ),
    ),
    attach=f"{__name__}.hooks:StateCapture",
    rows=state_rows,
    cost=negligible,
    size_warning=f"{__name__}.hooks:size_warning",
    since={"states": 5},
    order=60,
)
