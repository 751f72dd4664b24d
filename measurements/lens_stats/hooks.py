"""The hooks of ``extract --lens-stats`` (methods §17): bound to a text task's per-token capture
(:class:`~layerdiv.extract.text.TextCapture`, which keeps the block inputs h_0..h_(L-1) and h_L),
they add each pass's float64 sums over its documents' own tokens to the sums of the run it
belongs to, on the model's device, block by block (one (tokens, d) float64 copy of a state at a
time).

A batch's sums join its run only once the batch is known to be kept: when the next batch of the
run starts with other documents, or when its rows are built. A batch that fails after its pass
(out of memory in a later readout) runs again in halves, whose documents overlap it: its sums are
dropped then, so no document is counted twice."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from layerdiv.extract.capture import DecompositionError
from layerdiv.extract.text import TextBatch, TextCapture
from layerdiv.measurements import Attachment
from layerdiv.measurements.lens_stats import LensSums


class RunSums:
    """The float64 sums of one run's documents (on the model's device) and the documents they
    hold."""

    def __init__(self) -> None:
        self.docs: set[int] = set()
        self.n = 0
        self.sums: list[torch.Tensor] | None = None  # h (L, d), final (d,), hh, hf (L, d, d)

    def add(self, docs: Sequence[int], n: int, sums: list[torch.Tensor]) -> None:
        if self.docs & set(docs):
            raise DecompositionError("--lens-stats: a document's sums would be counted twice")
        self.docs |= set(docs)
        self.n += n
        self.sums = (
            sums if self.sums is None else [a + b for a, b in zip(self.sums, sums, strict=True)]
        )

    def totals(self) -> LensSums:
        """The sums as numpy float64 arrays."""
        assert self.sums is not None
        h, final, hh, hf = (s.cpu().numpy().astype(np.float64) for s in self.sums)
        return LensSums(self.n, h, final, hh, hf)


class Contribution:
    """One kept batch's sums, to be added to its run's once (:meth:`fold`): every row of the
    batch holds it as its value."""

    def __init__(self, run: RunSums, docs: Sequence[int], n: int, sums: list[torch.Tensor]):
        self.run, self.docs, self.n = run, list(docs), n
        self._sums: list[torch.Tensor] | None = sums

    def fold(self) -> RunSums:
        """Add the batch's sums to its run's (the first call only); the run's sums."""
        if self._sums is not None:
            self.run.add(self.docs, self.n, self._sums)
            self._sums = None
        return self.run


class LensStatsCapture:
    """``layerdiv.measurements.DecompositionCapture``, ``RowsCapture`` and ``RunCapture``: no
    hooks of its own; after each pass, per block l, sum h_l, sum h_L, sum h_l h_l^T and
    sum h_l h_L^T over the documents' own positions (rows are left-padded), in float64."""

    def __init__(self, ctx: Attachment) -> None:
        self.text: TextCapture | None = None
        self._run = RunSums()
        self._pending: Contribution | None = None
        self.reset()

    def bind(self, capture: TextCapture) -> None:
        self.text = capture

    def begin(self, ids: Sequence[int]) -> None:
        self._settle(ids)
        self._run = RunSums()

    def reset(self) -> None:
        self._ids: Sequence[int] | None = None
        self._lengths: Sequence[int] = ()
        self._value: Contribution | None = None

    def batch(self, ids: Sequence[int] | None, lengths: Sequence[int]) -> None:
        if ids is not None:
            self._settle(ids)
        self._ids, self._lengths = ids, lengths

    def _settle(self, ids: Sequence[int]) -> None:
        """Before a batch of ``ids``: the last batch's sums join its run unless ``ids`` overlap
        its documents (it failed and runs again)."""
        if self._pending is not None and not set(ids) & set(self._pending.docs):
            self._pending.fold()
        self._pending = None

    def decomposed(self, batch: TextBatch) -> None:
        text = self.text
        assert text is not None  # bound before any pass
        if self._ids is None:  # a probe pass: nothing kept
            return
        *h, final = text.states()
        width = final.shape[1]
        own = torch.arange(width, device=final.device)[None, :] >= (
            width - torch.as_tensor(self._lengths, device=final.device)[:, None]
        )
        y = final[own].double()  # (n, d)
        rows = []
        for x in h:
            xl = x[own].double()
            rows.append((xl.sum(0), xl.T @ torch.cat([xl, y], dim=1)))
        d = y.shape[1]
        sums = [
            torch.stack([r[0] for r in rows]),
            y.sum(0),
            torch.stack([r[1][:, :d] for r in rows]),
            torch.stack([r[1][:, d:] for r in rows]),
        ]
        self._value = self._pending = Contribution(self._run, self._ids, int(y.shape[0]), sums)

    def result(self) -> Sequence[Any]:
        return [self._value] * len(self._lengths)

    def remove(self) -> None:
        self.text = None
