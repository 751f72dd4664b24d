"""Future effects (``extract --skips`` on a text task, :mod:`layerdiv.measurements.future`,
methods §9, as the depth-efficiency paper's code does it): per document and split point t, block
l's addition (or only its attention's, or only its MLP's) is removed at positions 1..t-1, the
blocks after it run on, and every later block's update and the output distribution are compared
with the clean pass's at positions p >= t.

Blocks before l are not run again: the clean pass's inputs of block l are reused (kept by
``TextCapture``), and each block runs with the arguments of its own clean call (mask, positions),
repeated for every (document, split point, sublayer) row
(:class:`~layerdiv.extract.removal.UpdateRemoval`, the intervention the choice skips share).
So rel_change(l, j) is 0 for j < l by construction, and for j = l too with the random and
answer-anchored split points (block l's update at p >= t only reads positions whose inputs did not
change), as is the output change of the last block with those split points (no block runs after
it): these are stored as exact zeros, not computed.

Split points (``--skip-split random``, the default): for a document of T tokens, the candidates
are 8, 16, ... < T - 4; up to 4 of them are drawn without replacement by
``numpy.random.default_rng([seed, doc])``, so a document's split points do not depend on its batch,
chunk or shard. A document of 12 tokens or fewer has none (and no rows). ``--skip-split all``
removes the addition at every position but the first and measures every position (split 0); a
document of one token has no position to remove, so none (and no rows) either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from layerdiv.errors import DecompositionError
from layerdiv.extract.adapters import Adapter
from layerdiv.extract.readout import Readout
from layerdiv.extract.removal import UpdateRemoval, expand_calls
from layerdiv.measurements import Attachment
from layerdiv.measurements.future import (
    ANSWER_MARGIN,
    SPLIT_MARGIN,
    SPLIT_STEP,
    SPLITS,
    SplitError,
    parse_split,
)


@dataclass(frozen=True)
class SkipSettings:
    """How ``--skips`` runs on a text task (recorded in the partition's manifest)."""

    split: str = "random"
    """``random`` (seeded split points), ``all`` (every position but the first), ``answer`` (the
    answer's first token) or ``answer:N:S`` (N seeded offsets 0, S, 2S, ... into the answer)."""
    seed: int = 0
    """Seed of the random split points (with the document number)."""
    sublayers: tuple[str, ...] = ("block",)
    """What is removed: ``block`` (attention and MLP), ``attn``, ``mlp`` (each a row set)."""
    modes: tuple[str, ...] = ("total",)
    """How the model runs on: ``total``, ``local`` (direct-only, methods §10; each a row set)."""

    @property
    def anchored(self) -> tuple[int, int] | None:
        """(N, S) of ``answer:N:S``, (1, 0) for ``answer``, None for the other rules."""
        return parse_split(self.split)


def split_points(
    n_tokens: int, doc: int, settings: SkipSettings, answer: tuple[int, int] | None = None
) -> list[int]:
    """The split points t of document ``doc`` of ``n_tokens`` tokens ([0] with ``all``, none for
    a document of one token: nothing would be removed); with an answer-anchored rule, ``answer``
    is (s, A), the answer's start and length (methods §10), and only points 1 < t < n_tokens (a
    position removed, one measured: the cut to ``max_tokens`` may leave fewer) are kept."""
    if settings.split == "all":
        return [0] if n_tokens > 1 else []
    rng = np.random.default_rng([settings.seed, doc])
    anchored = settings.anchored
    if anchored is None:
        candidates = np.arange(SPLIT_STEP, n_tokens - SPLIT_MARGIN, SPLIT_STEP)
        chosen = rng.choice(candidates, size=min(SPLITS, len(candidates)), replace=False)
        return sorted(int(t) for t in chosen)
    assert answer is not None, "an answer-anchored split needs the answer's start"
    start, length = answer
    if settings.split == "answer":
        return [start] if 1 < start < n_tokens else []
    n, step = anchored
    # methods §10: s + {0, S, 2S, ...} with offsets < A - 4, drawn without replacement
    candidates = start + np.arange(0, length - ANSWER_MARGIN, step)
    candidates = candidates[(candidates > 1) & (candidates < n_tokens)]
    chosen = rng.choice(candidates, size=min(n, len(candidates)), replace=False)
    return sorted(int(t) for t in chosen)


@dataclass
class FutureRows:
    """One document's future effects: R rows of (split, sublayer, mode, skipped)."""

    split: np.ndarray
    """(R,) split point t (0 with ``all``)."""
    sublayer: list[str]
    """(R,) what was removed."""
    skipped: np.ndarray
    """(R,) the block l whose addition was removed."""
    rel_change: np.ndarray
    """(R, L) max over measured positions of ||d'_j - d_j|| / max(||d_j||, 1e-6), every j."""
    out_change: np.ndarray
    """(R,) max over measured positions of ||softmax(z') - softmax(z)||_2 (0 for a ``local``
    row: none is defined)."""
    mode: list[str]
    """(R,) how the row ran on: ``total`` or ``local`` (methods §10)."""


@dataclass
class _Group:
    """Rows of a batch's skipped passes that run together (one part, one sublayer): what every
    skipped block's pass of them shares."""

    rows: torch.Tensor
    """(r,) each row's document's row in the batch."""
    keep: torch.Tensor
    """(r, W, 1): 0 at the positions whose addition is removed, [1, t) of the document."""
    measured: torch.Tensor
    """(r, W): the positions p >= t of the document."""
    calls: list[tuple[tuple, dict]]
    """Every block call's arguments, repeated for the rows."""
    scale: list[torch.Tensor]
    """Per block j, max(||d_j||, 1e-6) of the clean pass (r, W)."""
    before: bool
    """Every row's removed positions precede its measured ones (t > 0: the random and
    answer-anchored split rules; ``all`` measures the removed positions, t = 0): the skipped
    block's own update and the output of a skipped last block are then unchanged at p >= t."""


class FutureEffects:
    """Runs the skipped passes of one batch after its clean pass (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        adapter: Adapter,
        readout: Readout,
        settings: SkipSettings,
        answers: Sequence[tuple[int, int]] | None = None,
        progress: Callable[[float], None] = lambda share: None,
    ):
        self.progress = progress
        """Told the share of the batch's rows (document, split point, sublayer, mode) done
        (``Attachment.progress``)."""
        self.settings = settings
        self.answers = answers
        """Per document (its number), the answer's start s and length A (answer-anchored split
        points, methods §10)."""
        self.removal = UpdateRemoval(model, adapter)
        self.blocks = self.removal.blocks
        """Block calls in execution order (a shared block appears once per call)."""
        self.readout = readout
        self._scratch: torch.Tensor | None = None  # the skipped passes' readout buffer

    def run(
        self,
        states: list[torch.Tensor],
        calls: list[tuple[tuple, dict]],
        dtype: torch.dtype,
        n_tokens: list[int],
        docs: list[int],
        max_rows: int,
    ) -> list[FutureRows]:
        """The future effects of every document of a left-padded batch: ``states`` the clean
        pass's block inputs and its last residual state (L + 1 tensors (B, W, d), float32),
        ``calls`` each block call's arguments, ``n_tokens``/``docs`` per row; at most
        ``max_rows`` rows run at once."""
        batch, width = states[0].shape[:2]
        updates = [states[j + 1] - states[j] for j in range(len(self.blocks))]
        scale = [d.norm(dim=-1).clamp(min=1e-6) for d in updates]
        clean = torch.softmax(self.readout.logits(states[-1].to(dtype)), dim=-1)
        rows = [
            (b, t, sub, mode)
            for b, (n, doc) in enumerate(zip(n_tokens, docs, strict=True))
            for t in split_points(n, doc, self.settings, self._answer(doc))
            for sub in self.settings.sublayers
            for mode in self.settings.modes
        ]
        n_blocks = len(self.blocks)
        rel = torch.zeros(len(rows), n_blocks, n_blocks)
        out = torch.zeros(len(rows), n_blocks)
        done = 0
        for lo in range(0, len(rows), max_rows):
            part = range(lo, min(lo + max_rows, len(rows)))
            for sub, mode in dict.fromkeys((rows[i][2], rows[i][3]) for i in part):
                mine = [i for i in part if (rows[i][2], rows[i][3]) == (sub, mode)]
                b = torch.tensor([rows[i][0] for i in mine], device=clean.device)
                start = width - torch.tensor([n_tokens[rows[i][0]] for i in mine], device=b.device)
                t = torch.tensor([rows[i][1] for i in mine], device=b.device)
                end = torch.where(t > 0, start + t, width)  # removed: [1, t)
                col = torch.arange(width, device=b.device)
                group = _Group(
                    rows=b,
                    keep=(~((col > start[:, None]) & (col < end[:, None])))[..., None],
                    measured=col >= (start + t)[:, None],
                    calls=expand_calls(calls, b, batch, {}),
                    scale=[s.index_select(0, b) for s in scale],
                    before=bool((t > 0).all()),
                )
                for skipped in range(n_blocks):
                    if group.before and skipped == n_blocks - 1:
                        # Nothing runs after the last block and its update at p >= t reads
                        # unchanged inputs: rel_change and out_change are 0 by construction,
                        # stored as exact zeros (the rows of rel and out are zeros already).
                        continue
                    if mode == "local":
                        rel[mine, skipped] = self._local(skipped, states, updates, dtype, group)
                        continue
                    r, o = self._skip(skipped, sub, states, updates, clean, dtype, group)
                    rel[mine, skipped] = r
                    out[mine, skipped] = o
                done += len(mine)
                self.progress(done / len(rows))
        self._scratch = None
        return self._rows(rows, rel, out, len(docs))

    def _skip(
        self,
        skipped: int,
        sublayer: str,
        states: list[torch.Tensor],
        updates: list[torch.Tensor],
        clean: torch.Tensor,
        dtype: torch.dtype,
        group: _Group,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rel_change (r, L) and out_change (r,) of the rows of ``group`` with ``sublayer`` of
        block call ``skipped`` removed."""
        rows, mask = group.rows, group.measured
        rel = torch.zeros(len(rows), len(self.blocks))
        x = states[skipped].index_select(0, rows).to(dtype)
        run = self.removal.run_on(x, group.calls, skipped, [skipped], sublayer, group.keep)
        for j, x, y in run:
            if j == skipped and group.before:
                continue  # block l's update at p >= t reads unchanged inputs: 0 by construction
            # rel_change(l, j) = max_{p >= t} ||d'_j - d_j|| / max(||d_j||, 1e-6)
            d = updates[j].index_select(0, rows)
            change = (y.float() - x.float() - d).norm(dim=-1) / group.scale[j]
            rel[:, j] = change.masked_fill(~mask, 0).amax(dim=-1).cpu()
        x = y
        # out_change(l) = max_{p >= t} ||softmax(z'_p) - softmax(z_p)||_2, read out at the
        # measured positions only
        # (a row's measured positions are the last ones of the batch: its distributions are
        # compared in place with a view of the clean pass's)
        row, pos = mask.nonzero(as_tuple=True)
        p_skip = self.readout.logits(x[row, pos], out=self._buffer(len(row), clean))
        torch.softmax(p_skip, dim=-1, out=p_skip)
        out = torch.zeros(len(rows), device=p_skip.device)
        width = clean.shape[1]
        parts = p_skip.split(mask.sum(-1).tolist())
        for i, (b, part) in enumerate(zip(rows.tolist(), parts, strict=True)):
            if len(part):
                out[i] = part.sub_(clean[b, width - len(part) :]).norm(dim=-1).amax()
        return rel, out.cpu()

    def _local(
        self,
        skipped: int,
        states: list[torch.Tensor],
        updates: list[torch.Tensor],
        dtype: torch.dtype,
        group: _Group,
    ) -> torch.Tensor:
        """rel_change_local (r, L) of the rows of ``group`` (methods §10): every block i > l
        reads the clean stream minus block l's clean update d_l at the removed positions (block l
        itself reads the clean stream: its change is 0 and it does not run)."""
        rows, mask = group.rows, group.measured
        rel = torch.zeros(len(rows), len(self.blocks))
        removed = updates[skipped].index_select(0, rows) * ~group.keep  # d_l at [1, t)

        def stream(j: int, _: torch.Tensor | None = None) -> torch.Tensor:
            """The input of block j + 1: block j's clean output minus d_l at [1, t)."""
            return (states[j + 1].index_select(0, rows) - removed).to(dtype)

        for j, x, y in self.removal.run_on(
            stream(skipped), group.calls, skipped + 1, override=stream
        ):
            # rel_change_local(l, j) = max_{p >= t} ||d'_j - d_j|| / max(||d_j||, 1e-6)
            d = updates[j].index_select(0, rows)
            change = (y.float() - x.float() - d).norm(dim=-1) / group.scale[j]
            rel[:, j] = change.masked_fill(~mask, 0).amax(dim=-1).cpu()
        return rel

    def _answer(self, doc: int) -> tuple[int, int] | None:
        """The answer's (start, length) of document ``doc`` where the split rule needs it."""
        if self.settings.anchored is None:
            return None
        if self.answers is None:
            raise SplitError(f"--skip-split {self.settings.split} needs the documents' answers")
        return self.answers[doc]

    def _buffer(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A (rows, V) float32 buffer on the device of ``like`` (..., V) for a skipped pass's
        readout, reused from one skipped block to the next while large enough."""
        need = rows * like.shape[-1]
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, device=like.device)
        return self._scratch[:need].view(rows, like.shape[-1])

    def _rows(
        self,
        rows: list[tuple[int, int, str, str]],
        rel: torch.Tensor,
        out: torch.Tensor,
        n_docs: int,
    ) -> list[FutureRows]:
        """Per document of the batch, its rows, one per (split, sublayer, mode, skipped)."""
        n_blocks = len(self.blocks)
        result = []
        for b in range(n_docs):
            mine = [i for i, row in enumerate(rows) if row[0] == b]
            result.append(
                FutureRows(
                    split=np.repeat([rows[i][1] for i in mine], n_blocks).astype(np.int64),
                    sublayer=[rows[i][2] for i in mine for _ in range(n_blocks)],
                    skipped=np.tile(np.arange(n_blocks), len(mine)),
                    mode=[rows[i][3] for i in mine for _ in range(n_blocks)],
                    rel_change=rel[mine].reshape(-1, n_blocks).numpy(),
                    out_change=out[mine].reshape(-1).numpy(),
                )
            )
        return result


class PassesAfter:
    """Hooks that run passes of their own after each pass of stored documents (instances), from
    the clean pass's block calls and states kept by :attr:`text`, with it paused
    (``DecompositionCapture`` and ``RowsCapture``): :meth:`measure` gives each unit's value."""

    flag = ""
    """The extract flag, for messages."""

    def __init__(self) -> None:
        self.text: Any = None
        """The :class:`~layerdiv.extract.hooks.Recorder` of the clean pass bound to: a text
        task's per-token capture (``layerdiv.extract.text.TextCapture``), or (``--erase`` on a
        choice task) one bound to the last-token decomposition."""
        self._ids: Sequence[int] | None = None
        self._lengths: list[int] = []
        self._rows: list[Any] | None = None

    def bind(self, capture: Any) -> None:
        self.text = capture

    def reset(self) -> None:
        self._rows = None

    def batch(self, ids: Sequence[int] | None, lengths: Sequence[int]) -> None:
        self._ids, self._lengths = ids, list(lengths)

    def decomposed(self, batch: Any) -> None:
        if self._ids is None:  # a probe pass: nothing of it is stored
            return
        with self.text.pausing():
            self._rows = self.measure(batch, self._lengths, list(self._ids))

    def measure(self, batch: Any, lengths: list[int], docs: list[int]) -> list[Any]:
        """Per row of the pass just run (``batch``: its ``TextBatch``, or a choice task's
        ``BatchDecomposition``), the unit's value."""
        raise NotImplementedError

    def result(self) -> Sequence[Any]:
        if self._ids is None:
            return [None] * len(self._lengths)
        if self._rows is None:
            raise DecompositionError(f"{self.flag}: no forward pass was decomposed")
        return self._rows

    def remove(self) -> None:
        """No hooks of its own to remove."""


class FutureCapture(PassesAfter):
    """The hooks of ``--skips`` on a text task: after each pass of stored documents, their
    future effects (:class:`FutureEffects`)."""

    flag = "--skips"

    def __init__(self, ctx: Attachment) -> None:
        super().__init__()
        s = ctx.settings
        settings = SkipSettings(
            s["skip_split"],
            s["skip_seed"],
            tuple(s["skip_sublayers"]),
            tuple(s.get("skip_modes") or ["total"]),  # absent: recorded before local effects
        )
        self.effects = FutureEffects(
            ctx.model, ctx.adapter, ctx.readout, settings, ctx.planned, ctx.progress
        )

    def measure(self, batch: Any, lengths: list[int], docs: list[int]) -> list[FutureRows]:
        text = self.text
        return self.effects.run(
            text.states(),
            text.calls,
            text.dtype,
            lengths,
            docs,
            max(1, batch.budget // batch.dots.shape[1]),
        )
