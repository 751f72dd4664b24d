"""Arrow tables of one chunk, built from arrays: the one place that turns numbers into the
table schemas of ``layerdiv.schemas`` (used by extraction and by synthetic stores); a
measurement that builds its own rows (``layerdiv.measurements``) has its table's builder in its
module."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from layerdiv.schemas import (
    COMPONENTS,
    DOCUMENTS,
    INSTANCES,
    PROMPT_CHARS,
    PROMPT_HEAD,
    TOKEN_BLOCKS,
    TOKENS,
    token_key,
)
from layerdiv.store.manifest import ComponentInfo


def components_table(
    instances: Sequence[int],
    infos: list[ComponentInfo],
    logits: np.ndarray,
    out_norm: np.ndarray,
    prefix_rms: np.ndarray,
    cos_residual: np.ndarray,
    cos_prev: np.ndarray,
) -> pa.Table:
    """Long rows (instance, component, option) of :data:`~layerdiv.schemas.COMPONENTS`.

    ``logits`` is (B, L, K) u_c[k] per instance; the per-component arrays are (B, L), NaN where
    the column is null (``out_norm``, ``cos_residual``, ``cos_prev``).
    """
    b, n_comp, n_opt = logits.shape
    comp_index = np.tile(np.repeat(np.arange(n_comp, dtype=np.int16), n_opt), b)
    names = pa.array([c.name for c in infos], pa.string())
    kinds = [c.kind for c in infos]
    kind_values = list(dict.fromkeys(kinds))  # in order of first appearance
    kind_index = np.array([kind_values.index(k) for k in kinds], dtype=np.int8)
    layers = np.array([c.layer for c in infos], dtype=np.int16)

    def per_component(values: np.ndarray, nullable: bool = True) -> pa.Array:
        flat = np.repeat(np.asarray(values, dtype=np.float32).reshape(-1), n_opt)
        return pa.array(flat, from_pandas=nullable)  # NaN -> null where nullable

    return pa.table(
        {
            "instance": pa.array(np.repeat(np.asarray(instances, dtype=np.int32), n_comp * n_opt)),
            "component": pa.array(comp_index),
            "name": pa.DictionaryArray.from_arrays(pa.array(comp_index), names),
            "kind": pa.DictionaryArray.from_arrays(
                pa.array(kind_index[comp_index]), pa.array(kind_values, pa.string())
            ),
            "layer": pa.array(layers[comp_index]),
            "option": pa.array(np.tile(np.arange(n_opt, dtype=np.int8), b * n_comp)),
            "logit": pa.array(np.asarray(logits, dtype=np.float32).reshape(-1)),
            "out_norm": per_component(out_norm),
            "prefix_rms": per_component(prefix_rms, nullable=False),
            "cos_residual": per_component(cos_residual),
            "cos_prev": per_component(cos_prev),
        },
        schema=COMPONENTS,
    )


def bounded_prompt(text: str) -> str:
    """``text`` as the ``instances`` table keeps it: whole up to
    :data:`~layerdiv.schemas.PROMPT_CHARS` characters, else its first
    :data:`~layerdiv.schemas.PROMPT_HEAD` and its last characters around a marker that says how
    many were left out (the result is at most ``PROMPT_CHARS`` plus the marker long)."""
    if len(text) <= PROMPT_CHARS:
        return text
    tail = PROMPT_CHARS - PROMPT_HEAD
    cut = len(text) - PROMPT_CHARS
    return f"{text[:PROMPT_HEAD]}\n[... {cut} characters not stored ...]\n{text[-tail:]}"


def instances_table(
    instances: Sequence[int],
    gold: Sequence[int] | np.ndarray,
    n_tokens: Sequence[int],
    truncated: Sequence[bool],
    final_rms: np.ndarray,
    model_logits: np.ndarray,
    sum_error: np.ndarray,
    prompts: Sequence[str],
    pieces: Sequence[list[str]] | None = None,
) -> pa.Table:
    """Rows of :data:`~layerdiv.schemas.INSTANCES`; ``model_logits`` is (B, K); ``prompts`` are
    stored as :func:`bounded_prompt` keeps them; ``pieces``: each prompt's tokens as the
    vocabulary spells them (None: null)."""
    return pa.table(
        {
            "instance": pa.array(instances, pa.int32()),
            "gold": pa.array(gold, pa.int8()),
            "n_tokens": pa.array(n_tokens, pa.int32()),
            "truncated": pa.array(truncated, pa.bool_()),
            "final_rms": pa.array(np.asarray(final_rms, dtype=np.float32)),
            "model_logits": pa.array(
                list(np.asarray(model_logits, dtype=np.float32)), pa.list_(pa.float32())
            ),
            "sum_error": pa.array(np.asarray(sum_error, dtype=np.float32)),
            "prompt": pa.array([bounded_prompt(p) for p in prompts], pa.string()),
            "pieces": pa.array(
                [None] * len(instances) if pieces is None else pieces, pa.list_(pa.string())
            ),
        },
        schema=INSTANCES,
    )


def documents_table(
    docs: Sequence[int],
    n_tokens: Sequence[int],
    truncated: Sequence[bool],
    group: Sequence[str | None] | None = None,
    answer_start: Sequence[int] | None = None,
) -> pa.Table:
    """Rows of :data:`~layerdiv.schemas.DOCUMENTS` (``group`` None: no group field;
    ``answer_start`` None: the task names no answer)."""
    none = [None] * len(docs)
    return pa.table(
        {
            "doc": pa.array(docs, pa.int32()),
            "n_tokens": pa.array(n_tokens, pa.int32()),
            "truncated": pa.array(truncated, pa.bool_()),
            "group": pa.array(group if group is not None else none, pa.string()),
            "answer_start": pa.array(
                answer_start if answer_start is not None else none, pa.int32()
            ),
        },
        schema=DOCUMENTS,
    )


def tokens_table(
    docs: Sequence[int],
    tokens: Sequence[Sequence[int]],
    loss: np.ndarray | None = None,
    pieces: Sequence[Sequence[str]] | None = None,
) -> pa.Table:
    """Rows (doc, pos) of :data:`~layerdiv.schemas.TOKENS`: ``tokens[i]`` the ids of ``docs[i]``;
    ``loss`` (sum of the lengths) the model's next-token cross-entropy per token, NaN (stored as
    null) at each document's last position; None: null everywhere; ``pieces[i]`` the tokens of
    ``docs[i]`` as the vocabulary spells them (None: null)."""
    doc, pos = token_key(docs, [len(t) for t in tokens])
    ids = np.concatenate([np.asarray(t, np.int32) for t in tokens]) if tokens else np.zeros(0)
    spelled = [p for doc_pieces in pieces for p in doc_pieces] if pieces else [None] * len(doc)
    return pa.table(
        {
            "doc": pa.array(doc),
            "pos": pa.array(pos),
            "token": pa.array(ids.astype(np.int32)),
            "loss": _floats(np.full(len(doc), np.nan) if loss is None else loss, nullable=True),
            "piece": pa.array(spelled, pa.string()),
        },
        schema=TOKENS,
    )


TOKEN_BLOCK_VALUES = ("hh", "aa", "mm", "ha", "hm", "am", "dd_next", "h_final", "h_embed")
"""The float columns of :data:`~layerdiv.schemas.TOKEN_BLOCKS`, in the order
:func:`token_blocks_table` takes them."""


def token_blocks_table(docs: Sequence[int], n_tokens: Sequence[int], dots: np.ndarray) -> pa.Table:
    """Rows (doc, pos, block) of :data:`~layerdiv.schemas.TOKEN_BLOCKS`; ``dots`` is
    (sum n_tokens, L, 9): per token (documents in order) and block the values of
    :data:`TOKEN_BLOCK_VALUES` (``dd_next`` NaN, stored as null, at the last block)."""
    n, blocks, _ = dots.shape
    doc, pos = token_key(docs, n_tokens)
    values = np.asarray(dots, np.float32).reshape(n * blocks, len(TOKEN_BLOCK_VALUES))
    return pa.table(
        {
            "doc": pa.array(np.repeat(doc, blocks)),
            "pos": pa.array(np.repeat(pos, blocks)),
            "block": pa.array(np.tile(np.arange(blocks, dtype=np.int16), n)),
            **{
                c: _floats(values[:, i], nullable=TOKEN_BLOCKS.field(c).nullable)
                for i, c in enumerate(TOKEN_BLOCK_VALUES)
            },
        },
        schema=TOKEN_BLOCKS,
    )


def _floats(values: np.ndarray, nullable: bool = False) -> pa.Array:
    """float32 column of ``values`` flattened; NaN becomes null where ``nullable``."""
    return pa.array(np.asarray(values, np.float32).reshape(-1), from_pandas=nullable)
