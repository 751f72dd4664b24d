"""The hooks of ``extract --states`` (:mod:`layerdiv.measurements.states`, methods §11): the
block inputs h_0..h_(L-1) and the final norm's input h_L of one forward pass, kept in the stored
dtype with their token ids at each document's sampled positions (a text task) or at each
instance's last prompt token (a choice task)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from layerdiv.extract.adapters import get_module
from layerdiv.extract.capture import DecompositionError
from layerdiv.extract.hooks import Hooks, unique_blocks
from layerdiv.measurements import Attachment
from layerdiv.measurements.states import (
    LARGE_BYTES,
    state_positions,
    state_rows_count,
    states_size,
)
from layerdiv.store.location import human_bytes

TORCH_TYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""``--states-dtype`` values (``layerdiv.schemas.STATE_TYPES``) and the torch dtype of each."""


class StateCapture(Hooks):
    """Pre-hooks on the model, every decoder block and the final norm; after each pass, per
    row, its positions, their token ids and states (k, L + 1, d). Only the first pass after
    :meth:`batch` is kept (later passes, as the future effects run them, are not the model's
    own)."""

    def __init__(self, ctx: Attachment) -> None:
        super().__init__()
        model, adapter, settings = ctx.model, ctx.adapter, ctx.settings
        self.k, self.seed = settings["states"], int(settings["states_seed"])
        self.dtype = str(settings["states_dtype"])
        self.last = ctx.kind == "choice"
        """A choice task: the last prompt token alone."""
        self.n_blocks = len(get_module(model, adapter.blocks))
        self.add(model.register_forward_pre_hook(self._ids_hook, with_kwargs=True))
        norm = get_module(model, adapter.final_norm)
        self.add(norm.register_forward_pre_hook(self._final_hook))
        for block in unique_blocks(model, adapter):
            self.add(block.register_forward_pre_hook(self._input_hook, with_kwargs=True))
        self.reset()

    def reset(self) -> None:
        self._h: list[torch.Tensor] = []
        self._input_ids: torch.Tensor | None = None
        self._rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        self._ids: Sequence[int] | None = None
        self._lengths: Sequence[int] = ()

    def batch(self, ids: Sequence[int] | None, lengths: Sequence[int]) -> None:
        self._ids, self._lengths = ids, lengths

    def _ids_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self._ids is not None and self._input_ids is None:
            self._input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]

    def _input_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self._ids is not None and self._rows is None and len(self._h) < self.n_blocks:
            self._h.append(args[0] if args else kwargs["hidden_states"])

    def _final_hook(self, module: Any, args: tuple) -> None:
        if self._ids is None or self._rows is not None:
            return
        if self._input_ids is None:
            raise DecompositionError("the model was called without input_ids")
        stacked = torch.stack([*self._h, args[0]], dim=2)  # (B, width, L + 1, d)
        width = stacked.shape[1]
        ids = self._input_ids.cpu().numpy()
        self._rows = []
        unit = "instance" if self.last else "document"
        for row, (doc, n) in enumerate(zip(self._ids, self._lengths, strict=True)):
            pos = np.array([n - 1]) if self.last else state_positions(n, self.k, self.seed, doc)
            h = stacked[row, torch.as_tensor(width - n + pos, device=stacked.device)]
            stored = to_stored(h, self.dtype, f"{unit} {doc}")
            self._rows.append((pos, ids[row, width - n + pos], stored))
        self._h = []

    def result(self) -> Sequence[Any]:
        if self._ids is None:
            return [None] * len(self._lengths)
        if self._rows is None:
            raise DecompositionError("no forward pass reached the final norm")
        return self._rows


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


def size_warning(
    lengths: Sequence[int], ids: Sequence[int], kind: str, settings: Mapping[str, Any],
    n_blocks: int, width: int,
) -> str | None:  # fmt: skip
    """A line saying how large the states of units ``ids`` will be when that exceeds
    :data:`~layerdiv.measurements.states.LARGE_BYTES` (None otherwise)."""
    rows = state_rows_count(lengths, ids, kind, settings["states"])
    size = states_size(rows, n_blocks + 1, width, str(settings["states_dtype"]))
    if size <= LARGE_BYTES:
        return None
    return (
        f"Warning: this run will write about {human_bytes(size)} of states ({rows:,} positions "
        f"x {n_blocks + 1} layers x d {width} x {settings['states_dtype']}); fewer positions "
        "(--states K) or fewer documents (--limit) write less"
    )
