"""The hooks of ``extract --states`` (:mod:`layerdiv.measurements.states`, methods §11): the
block inputs h_0..h_(L-1) and the final norm's input h_L of one forward pass, kept in the stored
dtype with their token ids at each document's sampled positions (a text task) or at each
instance's last prompt token (a choice task)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from layerdiv.errors import DecompositionError
from layerdiv.extract.adapters import get_module
from layerdiv.extract.hooks import Recorder
from layerdiv.measurements import Attachment
from layerdiv.measurements.states import (
    LARGE_BYTES,
    WORDS,
    TokenEnds,
    state_positions,
    state_rows_count,
    states_size,
)
from layerdiv.schemas.kinds import KINDS
from layerdiv.store.location import human_bytes

TORCH_TYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""``--states-dtype`` values (``layerdiv.schemas.STATE_TYPES``) and the torch dtype of each."""


class StateCapture(Recorder):
    """Records the model call's token ids, every block input h_0..h_(L-1) and the final norm's
    input h_L of one pass; after each pass, per row, its positions, their token ids and states
    (k, L + 1, d). Each state keeps only the sampled positions, converted to the stored dtype at
    once (nothing of the pass's own size outlives it). Only the first pass after :meth:`batch`
    is kept (later passes, as the future effects run them, are not the model's own)."""

    def __init__(self, ctx: Attachment) -> None:
        super().__init__(ctx.model, ctx.adapter, ("ids", "inputs", "final"))
        settings = ctx.settings
        self.k, self.seed = settings["states"], int(settings["states_seed"])
        self.stored = str(settings["states_dtype"])
        """The stored dtype (``--states-dtype``)."""
        self.last = KINDS[ctx.kind].scored
        """A choice task: the last prompt token alone."""
        self.ends: Sequence[TokenEnds] | None = ctx.planned
        """A text task's token ends per document (:func:`~layerdiv.measurements.states.plan_states`;
        None: no offsets, ``char_end`` null)."""
        self.n_blocks = len(get_module(ctx.model, ctx.adapter.blocks))
        self.reset()

    def reset(self) -> None:
        self.clear()
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._row_of = np.zeros(0, np.int64)  # the batch row of each kept position
        self._rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] | None = None
        self._ids: Sequence[int] | None = None
        self._lengths: Sequence[int] = ()
        self._pos: list[np.ndarray] = []  # the sampled positions of each row
        self._char_end: list[np.ndarray | None] = []  # where their tokens end in the text

    def batch(self, ids: Sequence[int] | None, lengths: Sequence[int]) -> None:
        self._ids, self._lengths = ids, lengths
        units = [] if ids is None else zip(ids, lengths, strict=True)  # a probe pass keeps nothing
        self._pos = [self._positions(doc, n) for doc, n in units]
        self._char_end = [
            None if self.ends is None else self.ends[doc].char_end[pos]
            for doc, pos in zip(ids or [], self._pos, strict=True)
        ]

    def _positions(self, doc: int, n: int) -> np.ndarray:
        """The stored positions of unit ``doc`` of ``n`` tokens (methods §11)."""
        if self.last:
            return np.array([n - 1])
        if self.k == WORDS:
            assert self.ends is not None  # the plan refuses words without offsets
            return np.flatnonzero(self.ends[doc].word_end[:n][1:]) + 1
        return state_positions(n, self.k, self.seed, doc)

    def recording(self) -> bool:
        """From :meth:`batch` (not a probe pass) to the first pass's final norm."""
        return self._ids is not None and self._rows is None

    def select(self, site: str, x: torch.Tensor) -> torch.Tensor:
        """The sampled positions of every row of ``x`` (B, width, d), in the stored dtype."""
        if self._index is None:  # rows are left-padded to the pass's width
            width = x.shape[1]
            self._row_of = np.repeat(np.arange(len(self._pos)), [len(p) for p in self._pos])
            cols = np.concatenate(
                [width - n + p for n, p in zip(self._lengths, self._pos, strict=True)]
            )
            self._index = (
                torch.as_tensor(self._row_of, device=x.device),
                torch.as_tensor(cols, device=x.device),
            )
        return to_stored(x[self._index], self.stored, self._unit)

    def keep(self, site: str, layer: int, x: torch.Tensor) -> None:
        if site == "inputs" and len(self.inputs) >= self.n_blocks:
            return  # more block inputs than the model's blocks: not one pass's own
        super().keep(site, layer, x)
        if site == "final":
            self._assemble()

    def _unit(self, position: int) -> str:
        """The instance or document of kept position ``position``, for messages."""
        assert self._ids is not None  # a pass after batch()
        return f"{'instance' if self.last else 'document'} {self._ids[self._row_of[position]]}"

    def _assemble(self) -> None:
        """Each row's positions, token ids and states, from the pass just kept."""
        if self.input_ids is None:
            raise DecompositionError("the model was called without input_ids")
        values = as_numpy(torch.stack(self.states(), dim=1))  # (positions, L + 1, d)
        ids, width = self.input_ids.cpu().numpy(), self.input_ids.shape[1]
        ends = np.cumsum([len(p) for p in self._pos])
        self._rows = [
            (pos, ids[row, width - n + pos], values[end - len(pos) : end], chars)
            for row, (pos, n, end, chars) in enumerate(
                zip(self._pos, self._lengths, ends, self._char_end, strict=True)
            )
        ]
        self.clear()

    def result(self) -> Sequence[Any]:
        if self._ids is None:
            return [None] * len(self._lengths)
        if self._rows is None:
            raise DecompositionError("no forward pass reached the final norm")
        return self._rows


def to_stored(h: torch.Tensor, dtype: str, unit: Callable[[int], str]) -> torch.Tensor:
    """``h`` (rows, d) as stored with ``--states-dtype dtype``; refuses a non-finite state, and
    with float16 a value beyond its range (about 65504), naming the first such row's ``unit``."""
    finite = torch.isfinite(h).all(dim=-1)
    if not bool(finite.all()):
        first = int((~finite).nonzero()[0])
        raise DecompositionError(
            f"{unit(first)}: a residual state is NaN or Inf (try --dtype fp32)"
        )
    stored = h.to(TORCH_TYPES[dtype])
    if dtype == "float16":
        fits = torch.isfinite(stored).all(dim=-1)
        if not bool(fits.all()):
            first = int((~fits).nonzero()[0])
            raise DecompositionError(
                f"{unit(first)}: a residual state value ({float(h[first].abs().max()):.6g}) does "
                "not fit float16; use --states-dtype bfloat16 (or float32)"
            )
    return stored


def as_numpy(stored: torch.Tensor) -> np.ndarray:
    """Stored states on the CPU as numpy (bfloat16 as its raw bits, uint16)."""
    if stored.dtype == torch.bfloat16:
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
