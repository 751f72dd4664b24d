"""``--states K|all|words``: the residual states h_0..h_L (methods §11, ``states`` table) at K
sampled positions per document of a text task (or every position, or every word end), at the
last prompt token of each instance of a choice task (K and the seed unused there), with the
settings ``--states``, ``--states-seed`` and ``--states-dtype`` (recorded in the manifest,
compared on a rerun). On a text task each row also records where its token ends in the text
(``char_end``, from the tokenizer's offsets): two models with different tokenizers share word
ends, and ``--maps`` pairs their rows there. The hooks are
:class:`layerdiv.measurements.states.hooks.StateCapture`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import click
import numpy as np
import pyarrow as pa

from layerdiv.measurements.registry import (
    Measurement,
    MeasurementError,
    Planning,
    Setting,
    negligible,
)
from layerdiv.schemas import NONNEGATIVE, STATE_TYPES, Rules, states_schema
from layerdiv.schemas.kinds import KINDS

WORDS = "words"
"""``--states words``: every position whose token ends a word (:func:`word_ends`)."""


def state_count(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """``--states K|all|words``: K (1 or more) as an int, ``all`` or ``words``."""
    if value is None or value in ("all", WORDS):
        return value
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter(
            f"{value!r}: give a number of positions (1 or more), all, or words"
        )
    return int(value)


class TokenEnds(NamedTuple):
    """Where each token of one document ends in its text (the tokenizer's offsets)."""

    char_end: np.ndarray
    """(T,) int32: the character offset where token p ends (special tokens: 0)."""
    word_end: np.ndarray
    """(T,) bool: token p ends a word (:func:`word_ends`)."""


def word_ends(text: str, spans: Sequence[tuple[int, int]]) -> TokenEnds:
    """Per token of ``text`` (its character ``spans``, the tokenizer's offsets): where it ends,
    and whether it ends a word: it ends on a non-space character followed by a space or the
    text's end, and the next token ends elsewhere (tokens that share a character, such as byte
    pieces of one letter, end the word at the last of them). Defined on the text alone, so
    every tokenizer marks the same characters where its tokens end there."""
    end = np.array([e for _, e in spans], np.int32)
    nxt = np.append(end[1:], -1)
    chars = np.array([not c.isspace() for c in text] + [False], bool)  # chars[len] = text end
    at = np.clip(end, 0, len(text))
    word = (end > 0) & chars[np.maximum(at - 1, 0)] & ~chars[at] & (nxt != end)
    return TokenEnds(end, word)


def plan_states(plan: Planning) -> list[TokenEnds] | None:
    """The states' check of a text task's plan: each document's token ends (:class:`TokenEnds`)
    from the tokenizer's offsets (None on a choice task, or where the tokenizer gives no
    offsets: ``char_end`` is then null); refuses ``--states words`` without offsets."""
    if KINDS[plan.task.kind].scored:
        return None
    texts = [item.prompt for item in plan.items]
    try:
        enc = plan.tokenizer(texts, add_special_tokens=True, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):
        enc = None
    if enc is None or "offset_mapping" not in enc:
        if plan.settings["states"] == WORDS:
            raise MeasurementError(
                "--states words needs the tokenizer's character offsets, and this tokenizer "
                "gives none (a slow tokenizer); use a fast tokenizer or --states K|all"
            )
        plan.notes.append("the tokenizer gives no character offsets: states' char_end is null")
        return None
    return [word_ends(t, spans) for t, spans in zip(texts, enc["offset_mapping"], strict=True)]


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
    """Stored positions of units ``ids`` (``lengths`` indexed by unit), at most: a text
    document's K sampled positions (all of 1..T-1 when K is ``all`` or ``words``, or
    K >= T - 1), a choice instance's last prompt token (methods §11)."""
    if KINDS[kind].scored:
        return len(ids)
    every = k in ("all", WORDS)
    return sum(lengths[i] - 1 if every else min(int(k), lengths[i] - 1) for i in ids)


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
    char_ends: Sequence[np.ndarray | None] | None = None,
) -> pa.Table:
    """Rows (doc, pos, layer) of :data:`~layerdiv.schemas.STATES` (``states_schema(d, dtype)``):
    ``positions[i]`` the positions of ``docs[i]``, ``tokens[i]`` their token ids, ``states[i]``
    its (k, L + 1, d) states in the stored dtype (float16, float32, or bfloat16 as raw uint16
    bits) and ``char_ends[i]`` where their tokens end in the text (None: null)."""
    counts = [len(p) for p in positions]
    _, layers, width = states[0].shape
    dtype = _STORED[np.asarray(states[0]).dtype.name]
    values = np.concatenate([np.asarray(s).reshape(-1) for s in states])
    n = sum(counts)
    schema = states_schema(width, dtype)
    flat = pa.array(values, schema.field("state").type.value_type)
    ends = [
        np.full(len(p), -1, np.int32) if e is None else np.asarray(e, np.int32)
        for p, e in zip(positions, char_ends or [None] * len(positions), strict=True)
    ]
    char_end = np.repeat(np.concatenate(ends), layers) if ends else np.zeros(0, np.int32)
    return pa.table(
        {
            "doc": pa.array(np.repeat(np.asarray(docs, np.int32), np.multiply(counts, layers))),
            "pos": pa.array(np.repeat(np.concatenate(positions).astype(np.int32), layers)),
            "token": pa.array(np.repeat(np.concatenate(tokens).astype(np.int32), layers)),
            "layer": pa.array(np.tile(np.arange(layers, dtype=np.int16), n)),
            "char_end": pa.array(char_end, pa.int32(), mask=char_end < 0),
            "state": pa.FixedSizeListArray.from_arrays(flat, width),
        },
        schema=schema,
    )


def state_rows(docs: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``states`` rows of documents or instances ``docs`` from each one's (positions, token
    ids, states, char ends or None)."""
    pos, tokens, states, ends = (list(c) for c in zip(*values, strict=True))
    return {"states": states_table(docs, pos, tokens, states, ends)}


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
                metavar="K|all|words",
                help="Also store the residual states h_0..h_L: text tasks at K sampled "
                "positions per document (K; all: every position but the first; words: every "
                "word end, what models with different tokenizers share for --maps), choice "
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
    flops=negligible,
    plan_check=plan_states,
    size_warning=f"{__name__}.hooks:size_warning",
    rules={
        "states": Rules(
            bounds={
                "pos": (0, "T-1"),
                "layer": (0, "L"),
                "token": (0, "V-1"),
                "char_end": NONNEGATIVE,
            }
        )
    },
    since={"states": 5},
    order=60,
)
