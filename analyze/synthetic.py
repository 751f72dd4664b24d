"""Synthetic stores from numpy arrays: for tests, examples and the scale benchmark.

A synthetic partition is written through the store's own :class:`PartitionWriter`, so it is a valid
store in every respect (manifest, schemas, complete-chunk markers); only the numbers are made up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from layerdiv.measurements import measurement_of, optional_tables
from layerdiv.measurements.future import FUTURE, future_tables
from layerdiv.measurements.heads import HeadValues
from layerdiv.measurements.lens import LENS, token_lens_table
from layerdiv.schemas import component_names
from layerdiv.schemas.kinds import KINDS
from layerdiv.store import ComponentInfo, Manifest, PartitionWriter
from layerdiv.store.key import DEFAULT_REVISION
from layerdiv.store.tables import (
    TOKEN_BLOCK_VALUES,
    components_table,
    documents_table,
    instances_table,
    token_blocks_table,
    tokens_table,
)


def component_infos(kinds: Sequence[str]) -> list[ComponentInfo]:
    """Names and layers for components given by kind in execution order (``embed``, ``attn``,
    ``mlp``, ``bias``): every ``attn`` opens a new layer."""
    calls, layer = [], -1
    for kind in kinds:
        if kind == "attn":
            layer += 1
        calls.append((kind, layer if kind in ("attn", "mlp") else -1))
    names = component_names(calls)
    return [ComponentInfo(n, kind, at) for n, (kind, at) in zip(names, calls, strict=True)]


def decoder_kinds(n_blocks: int, bias: bool = False) -> list[str]:
    """Kinds of a pre-norm decoder: the embedding, then attention and MLP per block."""
    return ["embed"] + ["attn", "mlp"] * n_blocks + (["bias"] if bias else [])


def synthetic_manifest(
    model: str,
    task: str,
    components: list[ComponentInfo],
    n: int,
    chunk: int,
    options: int = 0,
    kind: str = "choice",
    n_params: int = 1_000_000,
    created_at: str = "2025-01-01T00:00:00Z",
    **fields: Any,
) -> Manifest:
    """The manifest of a made-up partition of ``n`` instances (documents) in chunks of
    ``chunk``, with ``options`` options (``option0``, ...); ``fields`` are the manifest's other
    fields (``context_length``, ``hidden_size``, ...)."""
    names = [f"option{j}" for j in range(options)]
    return Manifest(
        **fields,
        model=model,
        n_params=n_params,
        task=task,
        revision=None,
        weights_fingerprint="synthetic",
        dtype="float32",
        model_type="synthetic",
        adapter="synthetic",
        norm="rms",
        options=names,
        option_token_ids=list(range(options)),
        option_tokens=names,
        template_sha256="synthetic",
        data_sha256="synthetic",
        task_spec={"name": task, **({"kind": kind} if "kind" in KINDS[kind].task_fields else {})},
        components=components,
        n_requested=n,
        sum_tolerance=1e-4,
        chunk_size=chunk,
        created_at=created_at,
        kind=kind,
    )


def mark_optional(writer: PartitionWriter, kind: str, tables: Mapping[str, pa.Table]) -> None:
    """Mark the optional tables of ``kind`` (``layerdiv.measurements.optional_tables``) that a
    partition's first chunk, ``tables``, holds: every chunk written holds them."""
    for table in optional_tables(kind):
        if table in tables:
            writer.mark_table(table)


def write_partition(
    root: str | Path,
    model: str,
    task: str,
    logits: np.ndarray,
    gold: np.ndarray,
    kinds: Sequence[str],
    prefix_rms: np.ndarray | None = None,
    final_rms: np.ndarray | None = None,
    n_params: int = 1_000_000,
    chunk: int | None = None,
    created_at: str = "2025-01-01T00:00:00Z",
    shuffle: np.random.Generator | None = None,
    optional: Mapping[str, np.ndarray] | None = None,
    head_ids: Sequence[int] = (),
    columns: Mapping[str, np.ndarray] | None = None,
    hidden_size: int | None = None,
    norm_eps: float | None = None,
) -> None:
    """Write one (model, task) partition from arrays.

    ``logits`` is (N, L, K): u_c[k] of instance i; ``gold`` (N,) option indices; ``kinds`` the L
    component kinds in execution order; ``prefix_rms`` (N, L) rms of each prefix (default 1, and
    ``final_rms`` defaults to its last column). Instances are written in chunks of ``chunk``;
    with ``shuffle`` the rows of each chunk are permuted (the store promises no row order).
    ``optional`` fills optional choice tables, by name, each by its measurement's rows
    (:func:`optional_part`): ``heads`` (N, A, G, K)
    for the A attention components in execution order, with ``head_ids`` the G head indices
    (-1: the output projection's bias); ``skips`` (N, blocks, K) skip logits; ``gram``
    (N, C(C+1)/2) Gram rows; ``sinks`` (N, blocks, heads) sink(l, h); ``erasure`` (N, blocks + 1,
    100) effect(l, t) at each instance's 100 prompt tokens. ``columns`` gives (N, L)
    values of ``out_norm``, ``cos_residual`` or ``cos_prev`` (default 1, 0, 0; NaN is stored as
    null); ``hidden_size`` and ``norm_eps`` go to the manifest.
    """
    n, n_comp, k = logits.shape
    if len(kinds) != n_comp or gold.shape != (n,):
        raise ValueError("logits, gold and kinds disagree in shape")
    rms = np.ones((n, n_comp), np.float32) if prefix_rms is None else prefix_rms
    final = rms[:, -1] if final_rms is None else final_rms
    infos = component_infos(kinds)
    manifest = synthetic_manifest(
        model,
        task,
        infos,
        n,
        chunk or n,
        options=k,
        n_params=n_params,
        context_length=2048,
        created_at=created_at,
        hidden_size=hidden_size,
        norm_eps=norm_eps,
    )
    defaults = {"out_norm": 1.0, "cos_residual": 0.0, "cos_prev": 0.0}
    geometry = {c: np.full((n, n_comp), v) for c, v in defaults.items()} | dict(columns or {})
    writer = PartitionWriter(root, model, task)
    writer.open(manifest, overwrite=True)
    step = chunk or n
    for start in range(0, n, step):
        stop = min(n, start + step)
        ids = range(start, stop)
        b = stop - start
        tables = {
            "components": components_table(
                ids,
                infos,
                logits[start:stop],
                geometry["out_norm"][start:stop],
                rms[start:stop],
                geometry["cos_residual"][start:stop],
                geometry["cos_prev"][start:stop],
            ),
            "instances": instances_table(
                ids,
                gold[start:stop],
                [100] * b,
                [False] * b,
                final[start:stop],
                logits[start:stop].astype(np.float32).sum(axis=1),
                np.zeros(b),
                [f"Synthetic prompt of instance {i} of {task}." for i in ids],
            ),
        }
        for table, values in (optional or {}).items():
            tables[table] = optional_part(table, ids, values[start:stop], infos, head_ids)
        if shuffle is not None:
            tables = {k: t.take(shuffle.permutation(t.num_rows)) for k, t in tables.items()}
        if start == 0:
            mark_optional(writer, "choice", tables)
        writer.write_chunk(start, b, tables)


def optional_part(
    table: str,
    ids: range,
    values: np.ndarray,
    infos: list[ComponentInfo],
    head_ids: Sequence[int],
) -> pa.Table:
    """A chunk's part of the optional ``table`` from the chunk's instances and their rows of
    the table's array, by its measurement's own rows (``Measurement.rows``), each instance's row
    taken as the value its hooks give (``heads``: the attention components' ``HeadValues``, with
    the head ids ``head_ids``)."""
    measurement = measurement_of(table)
    if measurement.rows is None:
        raise ValueError(f"measurement {measurement.name} declares no rows")
    rows: list[Any] = list(values)
    if table == "heads":
        attn = [c for c, info in enumerate(infos) if info.kind == "attn"]
        layers = [infos[c].layer for c in attn]
        rows = [HeadValues(attn, layers, head_ids, v) for v in values]
    return measurement.rows(ids, rows)[table]


def random_partition(
    rng: np.random.Generator, n: int, n_blocks: int, k: int, skill: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Plausible made-up data: components push the gold option with a strength that grows with
    depth (scaled by ``skill``) plus noise; prefix rms grows with depth.

    Returns (logits (N, L, K), gold (N,), prefix_rms (N, L), kinds).
    """
    kinds = decoder_kinds(n_blocks)
    n_comp = len(kinds)
    gold = rng.integers(0, k, n)
    depth = np.arange(1, n_comp + 1) / n_comp
    signal = skill * depth * (1.5 - depth) * 0.6
    logits = rng.normal(0.0, 1.0, (n, n_comp, k)) + rng.normal(0.0, 0.5, (n, 1, k))
    logits[np.arange(n), :, gold] += signal[None, :] * rng.uniform(0.0, 2.0, (n, 1))
    prefix_rms = np.sqrt(np.arange(1, n_comp + 1))[None, :] * rng.uniform(0.8, 1.2, (n, 1))
    return logits, gold, prefix_rms, kinds


def random_heads(
    rng: np.random.Generator,
    logits: np.ndarray,
    gold: np.ndarray,
    kinds: Sequence[str],
    n_heads: int,
    bias: bool = False,
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Split every attention component into ``n_heads`` made-up heads: noise, a constant
    preference for some option per head, and a push towards the gold option whose strength
    varies by head (a few strong ones); with ``bias`` one more constant term (head -1). The
    attention components' logits become the sum of their heads.

    Returns (logits (N, L, K), heads (N, A, G, K), head ids (G,)).
    """
    n, _, k = logits.shape
    attn = [c for c, kind in enumerate(kinds) if kind == "attn"]
    heads = rng.normal(0.0, 0.5, (n, len(attn), n_heads, k))
    heads += rng.normal(0.0, 0.3, (1, len(attn), n_heads, k))
    strength = rng.exponential(0.3, (len(attn), n_heads))
    heads[np.arange(n), :, :, gold] += strength * rng.uniform(0.0, 2.0, (n, 1, 1))
    head_ids = list(range(n_heads))
    if bias:
        const = np.broadcast_to(rng.normal(0.0, 0.2, (1, len(attn), 1, k)), (n, len(attn), 1, k))
        heads = np.concatenate([const, heads], axis=2)
        head_ids = [-1, *head_ids]
    out = logits.copy()
    out[:, attn] = heads.sum(axis=2)
    return out, heads, head_ids


PAPER_TASK_OPTIONS = (4, 4, 2, 3, 4, 3, 3, 4)
"""Options per synthetic task, cycled: with 61-81 components and 2,000 instances, 16 models x 8
tasks give about 60 million component-option rows."""


def synthesize_store(
    root: str | Path,
    n_models: int = 16,
    n_tasks: int = 8,
    n_instances: int = 2000,
    blocks: tuple[int, int] = (30, 40),
    options: Sequence[int] = PAPER_TASK_OPTIONS,
    seed: int = 0,
    progress: bool = True,
) -> int:
    """Write a store of ``n_models`` x ``n_tasks`` random partitions (model m has between
    ``blocks`` decoder blocks, evenly spread; task t has ``options[t % len(options)]`` options);
    returns the number of component-option rows written."""
    rng = np.random.default_rng(seed)
    model_blocks = np.linspace(blocks[0], blocks[1], n_models).round().astype(int)
    rows = 0
    pairs = [(m, t) for m in range(n_models) for t in range(n_tasks)]
    for m, t in tqdm(pairs, desc="synthesizing", unit="partition", disable=not progress):
        k = options[t % len(options)]
        logits, gold, rms, kinds = random_partition(
            rng, n_instances, int(model_blocks[m]), k, skill=1.0 + m / n_models
        )
        write_partition(
            root,
            f"synth/model-{m:02d}",
            f"task{t}",
            logits,
            gold,
            kinds,
            rms,
            n_params=int(1e8 * (m + 1)),
            hidden_size=576,
            norm_eps=1e-5,
        )
        rows += logits.size
    return rows


def text_dots(h0: np.ndarray, attn: np.ndarray, mlp: np.ndarray) -> dict[str, np.ndarray]:
    """The ``token_blocks`` dot products (methods §9) of residual streams given as
    vectors: ``h0`` (tokens, d) the embedding outputs, ``attn`` and ``mlp`` (tokens, L, d) what each
    block's attention and MLP add. Returns (tokens, L) arrays ``hh``, ``aa``, ``mm``, ``ha``,
    ``hm``, ``am``, ``dd_next`` (NaN on the last block), ``h_final`` and ``h_embed``, in
    float64."""
    update = attn + mlp
    h = h0[:, None, :] + np.cumsum(update, axis=1) - update  # h_l, the input of block l
    h_last = h0 + update.sum(axis=1)

    def dot(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.einsum("tld,tld->tl", x, y)

    dd_next = np.full(update.shape[:2], np.nan)
    dd_next[:, :-1] = dot(update[:, :-1], update[:, 1:])
    return {
        "hh": dot(h, h),
        "aa": dot(attn, attn),
        "mm": dot(mlp, mlp),
        "ha": dot(h, attn),
        "hm": dot(h, mlp),
        "am": dot(attn, mlp),
        "dd_next": dd_next,
        "h_final": np.einsum("tld,td->tl", h, h_last),
        "h_embed": np.einsum("tld,td->tl", h, h0),
    }


def random_text_vectors(
    rng: np.random.Generator, pos: np.ndarray, blocks: int, d: int = 4
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Made-up residual streams of tokens at positions ``pos``: (h0 (tokens, d), attn and mlp
    (tokens, L, d), float32). Updates shrink as l^-0.8 with depth and point in random directions;
    the first token of each document stops updating after the middle block (as the inverse-depth
    paper finds for first tokens)."""
    n = len(pos)
    scale = (0.8 * np.arange(1, blocks + 1, dtype=np.float32) ** -0.8)[None, :, None]
    h0 = rng.standard_normal((n, d), dtype=np.float32)
    attn = rng.standard_normal((n, blocks, d), dtype=np.float32) * scale
    mlp = rng.standard_normal((n, blocks, d), dtype=np.float32) * scale
    first = pos == 0
    attn[first, blocks // 2 :] *= 1e-2
    mlp[first, blocks // 2 :] *= 1e-2
    return h0, attn, mlp


def text_chunk(
    rng: np.random.Generator,
    docs: range,
    n_tokens: int,
    blocks: int,
    groups: Sequence[str] = (),
    lens: bool = False,
    skips: bool = False,
    d: int = 4,
) -> dict[str, Any]:
    """The tables of one chunk of a made-up text partition: ``len(docs)`` documents of
    ``n_tokens`` tokens (``group`` cycling through ``groups``), their ``token_blocks`` from
    :func:`random_text_vectors` and, with ``lens`` / ``skips``, made-up ``token_lens`` (KL falling
    and top-5 overlap rising with depth) and future effects (4 split points, whole blocks); the
    model's loss per token is made up too (lower for more blocks)."""
    b = len(docs)
    lengths = [n_tokens] * b
    pos = np.tile(np.arange(n_tokens), b)
    dots = text_dots(*random_text_vectors(rng, pos, blocks, d))
    group = [groups[i % len(groups)] for i in docs] if groups else None
    ids = [rng.integers(0, 50_000, n_tokens).tolist() for _ in docs]
    own = np.random.default_rng(docs.start)  # the loss's own draws: rng's stream unchanged
    loss = 2 + own.exponential(1.0, len(pos)) + 8 / blocks  # deeper models: lower loss
    loss[pos == n_tokens - 1] = np.nan
    tables: dict[str, Any] = {
        "documents": documents_table(docs, lengths, [False] * b, group),
        "tokens": tokens_table(docs, ids, loss),
        "token_blocks": token_blocks_table(
            docs, lengths, np.stack([dots[c] for c in TOKEN_BLOCK_VALUES], axis=-1)
        ),
    }
    if lens:
        depth = np.arange(blocks + 1) / blocks
        kl = rng.exponential(1.0, (len(pos), blocks + 1)) * 4 * (1 - depth)
        top5 = np.clip(depth + rng.normal(0, 0.1, kl.shape), 0, 1).round(1)
        ce = 3 + kl + rng.exponential(0.5, kl.shape)
        ce[pos == n_tokens - 1] = np.nan
        # the ranks' own draws: rng's stream (the skips after it) as before they were stored
        ranks = np.random.default_rng(docs.start + 1)
        rank, top1 = made_up_ranks(ranks, np.concatenate(ids), pos, n_tokens, blocks)
        values = np.stack([kl, np.clip(top5, 0, 1), rank, top1, ce], axis=-1)
        tables["token_lens"] = token_lens_table(docs, lengths, values)
    if skips:
        splits = [8 * (k + 1) for k in range(4)]
        keys = [(doc, t, b) for doc in docs for t in splits for b in range(blocks)]
        doc_, split, skipped = (list(k) for k in zip(*keys, strict=True))
        later = np.arange(blocks)[None, :] >= np.array(skipped)[:, None]
        rel = rng.exponential(0.2, (len(keys), blocks)) * later
        out = rng.exponential(0.1, len(keys)) * (1 - np.array(skipped) / blocks)
        sub = ["block"] * len(keys)
        tables.update(future_tables(doc_, split, sub, skipped, rel, out))
    return tables


def made_up_ranks(
    rng: np.random.Generator, ids: np.ndarray, pos: np.ndarray, n_tokens: int, blocks: int
) -> tuple[np.ndarray, np.ndarray]:
    """Made-up ``final_rank`` and ``top1`` (tokens, L + 1) of tokens ``ids`` at positions ``pos``
    of documents of ``n_tokens`` tokens (methods §16): each token's prediction y is the next token
    about half the time, else another id; it is decided at a random block, deeper for later
    positions (rank 1 from there on, a rank above 1 before, where p_l's top-1 is another id)."""
    n = len(ids)
    nxt = np.roll(ids, -1)
    y = np.where(rng.random(n) < 0.5, nxt, rng.integers(0, 50_000, n))
    decided = np.minimum(rng.integers(0, blocks + 1, n) + pos * blocks // (2 * n_tokens), blocks)
    layer = np.arange(blocks + 1)[None, :]
    rank = np.where(layer >= decided[:, None], 1, 2 + rng.geometric(0.01, (n, blocks + 1)))
    other = (y[:, None] + 1 + rng.integers(0, 1000, (n, blocks + 1))) % 50_000
    return rank, np.where(rank == 1, y[:, None], other)


def text_manifest(
    model: str,
    task: str,
    n_docs: int,
    blocks: int,
    max_tokens: int,
    chunk: int,
    lens: bool = False,
    skips: bool = False,
    hidden_size: int = 4,
) -> Manifest:
    """The manifest of a made-up text partition (``lens``, ``skips``: extracted with ``--lens``,
    ``--skips``)."""
    return synthetic_manifest(
        model,
        task,
        component_infos(decoder_kinds(blocks)),
        n_docs,
        chunk,
        context_length=max_tokens,
        hidden_size=hidden_size,
        norm_eps=1e-5,
        kind="text",
        max_tokens=max_tokens,
        settings={
            **({LENS.name: LENS.defaults()} if lens else {}),
            **({FUTURE.name: FUTURE.defaults()} if skips else {}),
        },
    )


def write_text_partition(
    root: str | Path, manifest: Manifest, chunks: Iterable[tuple[int, int, Mapping[str, pa.Table]]]
) -> None:
    """Write a text partition through the store's writer: ``chunks`` yields (first document,
    documents, tables) in turn (memory: one chunk)."""
    writer = PartitionWriter(
        root, manifest.model, manifest.task, manifest.revision or DEFAULT_REVISION
    )
    writer.open(manifest, overwrite=True)
    for i, (start, count, tables) in enumerate(chunks):
        if i == 0:
            mark_optional(writer, manifest.kind, tables)
        writer.write_chunk(start, count, tables)


def synthesize_text_store(
    root: str | Path,
    n_models: int = 2,
    n_docs: int = 4800,
    n_tokens: int = 1024,
    blocks: int = 32,
    chunk: int = 64,
    lens: bool = False,
    skips: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> int:
    """Write ``n_models`` made-up text partitions (task ``fineweb``) of ``n_docs`` documents of
    ``n_tokens`` tokens and ``blocks`` blocks in chunks of ``chunk`` documents (:func:`text_chunk`,
    :func:`write_text_partition`); returns the number of ``token_blocks`` rows written."""
    for m in tqdm(range(n_models), desc="synthesizing", unit="model", disable=not progress):
        manifest = text_manifest(
            f"synth/text-model-{m:02d}", "fineweb", n_docs, blocks, n_tokens, chunk, lens, skips
        )
        rng = np.random.default_rng(seed + m)
        starts = range(0, n_docs, chunk)
        chunks = (
            (s, len(docs), text_chunk(rng, docs, n_tokens, blocks, lens=lens, skips=skips))
            for s in starts
            for docs in [range(s, min(n_docs, s + chunk))]
        )
        write_text_partition(root, manifest, chunks)
    return n_models * n_docs * n_tokens * blocks
