"""Residual states at sampled positions (``extract --states``, methods §11): which
positions of a document are stored, and the states h_0..h_L there, converted to the stored
dtype, from the block inputs and last residual state one forward pass captured."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from layerdiv.extract.capture import DecompositionError

TORCH_TYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""``--states-dtype`` values (``layerdiv.schemas.STATE_TYPES``) and the torch dtype of each."""


@dataclass(frozen=True)
class StateSettings:
    """How states are sampled and stored."""

    k: int = 0
    """Positions per document; 0 means ``all`` (every position but the first)."""
    seed: int = 0
    """Seed of the sampled positions."""
    dtype: str = "float16"
    """One of :data:`TORCH_TYPES`."""


def state_positions(n_tokens: int, settings: StateSettings, doc: int) -> np.ndarray:
    """The sorted positions of document ``doc`` (``n_tokens`` tokens) whose states are stored:
    K drawn without replacement from 1..T-1 by ``numpy.random.default_rng([seed, doc])``;
    every one of them when K is 0 (``all``) or K >= T - 1 (methods §11)."""
    every = np.arange(1, n_tokens)
    if settings.k == 0 or settings.k >= n_tokens - 1:
        return every
    rng = np.random.default_rng([settings.seed, doc])
    return np.sort(rng.choice(every, size=settings.k, replace=False))


def gather_states(
    states: list[torch.Tensor],
    n_tokens: list[int],
    ids: list[int],
    settings: StateSettings,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row of a left-padded batch (document ``ids[row]`` of ``n_tokens[row]`` tokens): its
    positions (:func:`state_positions`) and the states there, (k, L + 1, d) in the stored
    dtype (bfloat16 as its raw bits, uint16), from ``states`` = [h_0, ..., h_L], each
    (B, width, d). A value that float16 cannot hold is refused, naming bfloat16."""
    width = states[0].shape[1]
    stacked = torch.stack(states, dim=2)  # (B, width, L + 1, d)
    out = []
    for row, (doc, n) in enumerate(zip(ids, n_tokens, strict=True)):
        pos = state_positions(n, settings, doc)
        h = stacked[row, torch.as_tensor(width - n + pos, device=stacked.device)]
        out.append((pos, to_stored(h, settings.dtype, f"document {doc}")))
    return out


def to_stored(h: torch.Tensor, dtype: str, where: str) -> np.ndarray:
    """``h`` as stored with ``--states-dtype dtype``; refuses a non-finite state, and with
    float16 a value beyond its range (about 65504)."""
    if not torch.isfinite(h).all():
        raise DecompositionError(f"{where}: a residual state is NaN or Inf (try --dtype fp32)")
    stored = h.to(TORCH_TYPES[dtype])
    if dtype == "float16" and not torch.isfinite(stored).all():
        big = float(h.abs().max())
        raise DecompositionError(
            f"{where}: a residual state value ({big:.6g}) does not fit float16; use "
            "--states-dtype bfloat16 (or float32)"
        )
    if dtype == "bfloat16":
        return stored.view(torch.int16).cpu().numpy().view(np.uint16)
    return stored.cpu().numpy()
