"""Tokenizing prompts, the chunk grid (the unit of resumption, sharding and claiming) and
length-sorted batches within a chunk."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MAX_BATCH_ROWS = 256
"""Upper bound on instances per batch with ``--batch-size auto``."""

MAX_PADDING = 0.2
"""With ``--batch-size auto``, no prompt in a batch is padded by more than this fraction of the
batch's width (length-bucketed batches: padding is wasted compute)."""


def tokenize(
    tokenizer: Any, prompts: list[str], context_length: int
) -> tuple[list[list[int]], list[bool]]:
    """Token ids of every prompt; prompts longer than ``context_length`` keep their last tokens
    (and a leading BOS) and are flagged as truncated."""
    ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id
    out, truncated = [], []
    for seq in ids:
        if len(seq) <= context_length:
            out.append(list(seq))
            truncated.append(False)
            continue
        keep = (
            [seq[0], *seq[len(seq) - context_length + 1 :]]
            if seq[0] == bos
            else list(seq[-context_length:])
        )
        out.append(keep)
        truncated.append(True)
    return out, truncated


def tokenize_documents(
    tokenizer: Any, texts: list[str], max_tokens: int
) -> tuple[list[list[int]], list[bool]]:
    """Token ids of every document as the tokenizer encodes it by default (special tokens
    included), cut to its first ``max_tokens``; a cut document is flagged as truncated."""
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    return [list(seq[:max_tokens]) for seq in ids], [len(seq) > max_tokens for seq in ids]


def chunk_runs(
    todo: list[int], chunk_size: int, shard: tuple[int, int] = (0, 1)
) -> dict[int, list[list[int]]]:
    """The instances of ``todo`` (ascending) by chunk j = i // ``chunk_size`` of the grid, as
    contiguous runs (one stored part each), for the chunks of shard (i, N): j modulo N = i."""
    out: dict[int, list[list[int]]] = {}
    for i in todo:
        j = i // chunk_size
        if j % shard[1] != shard[0]:
            continue
        runs = out.setdefault(j, [])
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return out


def batches(
    lengths: list[int], ids: list[int], batch_size: int | None, budget: int
) -> list[list[int]]:
    """Group ``ids`` longest first; a fixed ``batch_size``, or as many as fit ``budget`` padded
    tokens (at most :data:`MAX_BATCH_ROWS`, none padded beyond :data:`MAX_PADDING`)."""
    order = sorted(ids, key=lambda i: (-lengths[i], i))
    if batch_size:
        return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]
    out: list[list[int]] = []
    for i in order:
        # Longest first: a batch's padded width is the length of its first member.
        if (
            out
            and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget
            and len(out[-1]) < MAX_BATCH_ROWS
            and lengths[i] >= (1 - MAX_PADDING) * lengths[out[-1][0]]
        ):
            out[-1].append(i)
        else:
            out.append([i])
    return out


CPU_TOKEN_BUDGET = 1024
"""Padded tokens per batch for ``--batch-size auto`` on the CPU."""


def token_budget(
    device: torch.device, config: Any, dtype: torch.dtype, vocab_rows: bool = False
) -> int:
    """Padded tokens per batch for ``--batch-size auto`` (the runner's; the hooks that run
    passes of their own size them by it too): a fixed budget on the CPU; on a GPU,
    half the free memory over an estimate of one token's transient activations in one block
    (residual, normed copy, q/k/v/o and three MLP-width tensors), and with ``vocab_rows`` (a
    measurement that reads every token out, ``Measurement.vocab_rows``) three float32 rows over
    the vocabulary. Halved on out-of-memory."""
    if device.type != "cuda":
        return CPU_TOKEN_BUDGET
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    d = config.hidden_size
    width = 4 * d + 3 * (getattr(config, "intermediate_size", None) or 4 * d)
    per_token = width * torch.finfo(dtype).bits // 8
    if vocab_rows:
        per_token += 3 * 4 * getattr(config, "vocab_size", 0)
    return max(256, int(free // 2 // per_token))
