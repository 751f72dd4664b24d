"""The logit lens (methods §9): residual states read out as full-vocabulary distributions by the
model's own readout, and their statistics against the model's output distribution.

A lens is a class that shares the model's one :class:`~layerdiv.extract.readout.Readout` (as
tuned-lens's ``LogitLens`` and ``TunedLens`` share one ``Unembed``): :class:`Lens` (``final``)
reads a block input out by the final norm and unembedding, :class:`LastBlockLens`
(``last-block``) applies the model's last block to it first. :data:`LENSES` names them
(``extract --lens NAME``); :func:`make_lens` builds the one a run names for a model.
:func:`lens_hooks` gives the hooks of ``--lens`` (:mod:`layerdiv.measurements.lens`): on a choice
task :class:`LastTokenLens`, bound to the last-token decomposition; on a text task
:class:`TokenLens`, bound to the per-token capture.

The statistics (:func:`lens_stats`) are taken per slice of rows small enough for its few passes
over the vocabulary to run from the processor's cache (:data:`LENS_SLICE` entries per torch
thread) rather than from memory, which a layer's logits (tokens x V float32) far exceed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, overload

import numpy as np
import pyarrow as pa
import torch

from layerdiv.errors import DecompositionError
from layerdiv.extract.adapters import Adapter, get_module
from layerdiv.extract.capture import BatchDecomposition, ComponentCapture
from layerdiv.extract.readout import Readout
from layerdiv.extract.text import TextBatch, TextCapture
from layerdiv.measurements import Attachment
from layerdiv.measurements.lens import LENS_VALUES, READOUTS
from layerdiv.schemas.kinds import KINDS

BlockCall = tuple[tuple, dict]
"""The positional and keyword arguments of one call of a decoder block (mask, positions)."""


class Lens:
    """``final``: a residual state h read out as the model reads out its last one, p =
    softmax(unembed(norm(h))) (methods §9, logit lens)."""

    name: ClassVar[str] = "final"
    kinds: ClassVar[tuple[str, ...]] = READOUTS["final"]
    """The task kinds it applies to (declared by the measurement)."""

    def __init__(self, readout: Readout) -> None:
        self.readout = readout

    @classmethod
    def for_model(cls, model: Any, adapter: Adapter, readout: Readout) -> Lens:
        """The lens of ``model`` reading out through its ``readout``."""
        return cls(readout)

    def transform(self, h: torch.Tensor, call: BlockCall | None) -> torch.Tensor:
        """What the readout reads of states ``h``: the states themselves."""
        return h

    def logits(
        self, h: torch.Tensor, call: BlockCall | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Full-vocabulary float32 logits of residual states ``h`` (..., d, the model's dtype;
        ``call``: the last block's call in the pass that gave them; ``out``: a buffer, as
        :meth:`Readout.logits`)."""
        return self.readout.logits(self.transform(h, call), out=out)


class LastBlockLens(Lens):
    """``last-block``: the model's last block applied to h (with the arguments of its own call in
    the same pass) before the readout (text tasks)."""

    name = "last-block"
    kinds = READOUTS["last-block"]

    def __init__(self, readout: Readout, block: Any) -> None:
        super().__init__(readout)
        self.block = block

    @classmethod
    def for_model(cls, model: Any, adapter: Adapter, readout: Readout) -> Lens:
        return cls(readout, get_module(model, adapter.blocks)[-1])

    def transform(self, h: torch.Tensor, call: BlockCall | None) -> torch.Tensor:
        """The last block applied to each of the states ``h`` (G, B, T, d) stacked over G."""
        if call is None:
            raise ValueError("the last-block lens needs the arguments of the last block's call")
        args, kwargs = call

        def run(x: torch.Tensor) -> torch.Tensor:
            if args:
                out = self.block(x, *args[1:], **kwargs)
            else:
                out = self.block(*args, **{**kwargs, "hidden_states": x})
            return out[0] if isinstance(out, tuple) else out

        return torch.stack([run(x) for x in h])


LENSES: dict[str, type[Lens]] = {lens.name: lens for lens in (Lens, LastBlockLens)}
"""Every lens by its name (``extract --lens NAME``)."""


def make_lens(name: str, model: Any, adapter: Adapter, readout: Readout) -> Lens:
    """The lens ``name`` of ``model``, reading out through its ``readout``."""
    return LENSES[name].for_model(model, adapter, readout)


LENS_SLICE = 2**20
"""Vocabulary entries (rows x V: 4 MiB of float32) per torch thread in one slice of the lens
statistics: a slice's passes after its first read it from the cache."""


def _slices(n_rows: int, vocab: int) -> list[slice]:
    step = max(1, LENS_SLICE * torch.get_num_threads() // vocab)
    return [slice(a, a + step) for a in range(0, n_rows, step)]


def _softmax(
    z: torch.Tensor, out: torch.Tensor, first: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """p = softmax(z) written into ``out`` and log sum_v exp(z_v) (rows, 1) of logits ``z``
    (rows, V) whose largest entries are at ``first`` (rows, 1): one fused softmax pass, the
    log-sum-exp read from the largest entry, log p(v*) = z(v*) - lse with p(v*) = max_v p_v >=
    1 / V (gathered, not searched; the same operations for every lens layer and the reference,
    so that p_L against itself gives exactly zero)."""
    p = torch.softmax(z, dim=-1, out=out)
    return p, z.gather(-1, first) - p.gather(-1, first).log()


TOP_BLOCK = 64
"""Entries per block of :func:`top5`'s first pass."""


def top5(z: torch.Tensor) -> torch.Tensor:
    """(rows, 5): the indices of the five largest entries of each row of ``z`` (rows, V), largest
    first, as ``torch.topk`` finds them in a third of its time: each row's maxima over blocks of
    :data:`TOP_BLOCK` entries, then the five largest among the entries of the five blocks with the
    largest maxima and of the last, partial block (a block holding one of the five largest entries
    has at most four blocks with a larger maximum)."""
    rows, vocab = z.shape
    full = vocab // TOP_BLOCK * TOP_BLOCK
    if full < 5 * TOP_BLOCK:
        return z.topk(5, dim=-1).indices
    best = z[:, :full].unflatten(1, (-1, TOP_BLOCK)).amax(-1).topk(5, dim=-1).indices
    offsets = torch.arange(TOP_BLOCK, device=z.device)
    candidates = (best[:, :, None] * TOP_BLOCK + offsets).flatten(1)
    if full < vocab:
        tail = torch.arange(full, vocab, device=z.device).expand(rows, -1)
        candidates = torch.cat([candidates, tail], dim=1)
    return candidates.gather(-1, z.gather(-1, candidates).topk(5, dim=-1).indices)


def _scratch(z: torch.Tensor) -> torch.Tensor:
    """One slice's buffer for the probabilities of logits ``z`` (rows, V), reused by every slice."""
    return z.new_empty(min(z.shape[0], _slices(z.shape[0], z.shape[1])[0].stop), z.shape[1])


class LensReference:
    """The model's output distribution p_L, which every layer of the logit lens is compared with:
    its logits (V last), their log-sum-exp, its top five tokens and its own top-1 token y (the
    first largest entry: the smallest id among ties, methods §16)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits.float().clone()
        flat = self.logits.reshape(-1, self.logits.shape[-1])
        top = top5(flat)
        self.first = flat.argmax(-1).view(*self.logits.shape[:-1], 1)
        buf = _scratch(flat)
        lse = [
            _softmax(flat[r], buf[: len(flat[r])], top[r, :1])[1]
            for r in _slices(flat.shape[0], flat.shape[1])
        ]
        self.lse = torch.cat(lse).view(*self.logits.shape[:-1], 1)
        self.top = top.view(*self.logits.shape[:-1], 5)


STATS = LENS_VALUES[: LENS_VALUES.index("ce")]
"""The columns :func:`lens_stats` gives before the log-probabilities of its ``ids``: the lens
values but the cross-entropy, which its callers take from those."""
CE = LENS_VALUES.index("ce")
"""The column of the cross-entropy in the lens values (after :data:`STATS`, the
log-probability :func:`lens_stats` gives of the next token)."""


def ranks_fused(
    z: torch.Tensor, first: torch.Tensor, top: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, top1), each (rows,), of logits ``z`` (rows, V) as one expression without a host
    synchronisation (methods §16): the rank of the tokens ``first`` (rows, 1), 1 + the entries
    greater than its own + the entries of a smaller index equal to it, and the first largest entry
    (the smallest index among ties) from the five largest ``top`` (rows, 5; :func:`top5`), the
    row's argmax where all five tie. Compiled on a GPU (:func:`ranks`) it is one fused reduction
    over the row."""
    own = z.gather(-1, first)
    index = torch.arange(z.shape[-1], device=z.device)
    rank = ((z > own) | ((z == own) & (index < first))).sum(-1) + 1
    values = z.gather(-1, top)
    tie = values == values[:, :1]
    smallest = torch.where(tie, top, z.shape[-1]).amin(-1)
    return rank, torch.where(tie[:, -1], z.argmax(-1), smallest)


@functools.cache
def _compiled_ranks() -> Any:
    """:func:`ranks_fused` compiled where Triton can build its GPU kernel, else as it is (eager:
    slower, same values)."""
    from torch.utils._triton import has_triton

    return torch.compile(ranks_fused, dynamic=True) if has_triton() else ranks_fused


def ranks(
    z: torch.Tensor, first: torch.Tensor, top: torch.Tensor, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ranks_fused`'s (rank, top1). On a GPU it is compiled where Triton is installed
    (:func:`_compiled_ranks`): one fused reduction (in eager mode its five passes and the argmax
    cost more than half the lens statistics on an H100). On the processor, where a
    synchronisation costs nothing, the same by counts: the entries greater than y's and equal to
    it, each comparison written as 0/1 floats into ``scratch`` (rows, V) and summed (exact up to
    2^24, several times faster than a sum of booleans), the index comparison only for the rare
    rows where another entry ties, and the row's argmax only where all five largest tie."""
    if z.is_cuda:
        return _compiled_ranks()(z, first, top)
    own = z.gather(-1, first)
    rank = torch.gt(z, own, out=scratch).sum(-1) + 1
    tied = (torch.eq(z, own, out=scratch).sum(-1) > 1).nonzero()[:, 0]
    if len(tied):
        index = torch.arange(z.shape[-1], device=z.device)
        rank[tied] += ((z[tied] == own[tied]) & (index < first[tied])).sum(-1)
    values = z.gather(-1, top)
    tie = values == values[:, :1]
    first_top = torch.where(tie, top, z.shape[-1]).amin(-1)
    full = tie[:, -1].nonzero()[:, 0]
    if len(full):
        first_top[full] = z[full].argmax(-1)
    return rank, first_top


def lens_stats(logits: torch.Tensor, ref: LensReference, ids: torch.Tensor) -> torch.Tensor:
    """(..., 4 + K): the :data:`STATS` KL(p_l || p_L), |top5(p_l) & top5(p_L)| / 5, the rank of
    p_L's top-1 token y under p_l and p_l's own top-1 token (methods §9, §16; token ids exact in
    float32 up to 2^24), then log p_l at ``ids`` (..., K), over the last axis of a lens layer's
    float32 ``logits`` (overwritten) against ``ref`` (broadcast over the leading axes), slice by
    slice (:data:`LENS_SLICE`): the top five, the rank's two counts, a softmax, one difference,
    one product and one sum per slice, each pass after the first over data in the cache."""
    vocab = logits.shape[-1]
    lead = logits.shape[:-1]
    z = logits.reshape(-1, vocab)
    ref_z = ref.logits.expand_as(logits).reshape(-1, vocab)
    ref_lse = ref.lse.expand(*lead, 1).reshape(-1, 1)
    ref_top = ref.top.expand(*lead, 5).reshape(-1, 5)
    ref_first = ref.first.expand(*lead, 1).reshape(-1, 1)
    ids = ids.expand(*lead, ids.shape[-1]).reshape(z.shape[0], -1)
    n = len(STATS)
    out = torch.empty(z.shape[0], n + ids.shape[1], device=z.device)
    buf = _scratch(z)
    for sl in _slices(z.shape[0], vocab):
        zr = z[sl]
        top = top5(zr)
        out[sl, 2], out[sl, 3] = ranks(zr, ref_first[sl], top, buf[: len(zr)])  # before softmax
        p, lse = _softmax(zr, buf[: len(zr)], top[:, :1])
        out[sl, n:] = zr.gather(-1, ids[sl]) - lse  # log p_l(ids)
        # KL(p_l || p_L) = sum_v p_l (log p_l - log p_L) = sum_v p_l (z_l - z_L) - (lse_l - lse_L)
        # (sum_v p_l = 1), so that a shift of the logits cancels before any sum; the products
        # in place in p's buffer, summed per row
        p.mul_(zr.sub_(ref_z[sl]))
        out[sl, 0] = p.sum(-1) - (lse - ref_lse[sl]).view(-1)
        out[sl, 1] = (top[:, :, None] == ref_top[sl, None, :]).any(-1).sum(-1) / 5.0
    return out.view(*lead, -1)


class LastTokenLens:
    """The logit lens at the last prompt token of a choice task (methods §9), bound to its
    :class:`ComponentCapture` (``layerdiv.measurements.DecompositionCapture``, and a
    ``RowsCapture``: which instance each row is gives its gold option); no hooks of its own.
    Block l's input h_l is the prefix of the component outputs just before its ``attn``
    component; layer L is the full residual x, read out as the model reads it (the ``final``
    lens, the one a choice task takes). After each pass, per instance and layer l = 0..L: the
    :data:`STATS` and the cross-entropy of the gold option's first token
    (``layerdiv.schemas.LENS``)."""

    def __init__(self, ctx: Attachment) -> None:
        self.lens = make_lens(ctx.settings["lens"], ctx.model, ctx.adapter, ctx.readout)
        self.gold = ctx.gold
        self.capture: ComponentCapture | None = None
        self._ids: Sequence[int] | None = None
        self._n = 0
        self._rows: torch.Tensor | None = None

    def bind(self, capture: ComponentCapture) -> None:
        self.capture = capture

    def reset(self) -> None:
        self._rows = None

    def batch(self, ids: Sequence[int] | None, lengths: Sequence[int]) -> None:
        self._ids, self._n = ids, len(lengths)

    def decomposed(self, batch: BatchDecomposition) -> None:
        if self._ids is None:  # a probe pass: nothing of it is stored
            return
        capture = self.capture
        assert capture is not None  # bound before any pass
        z = capture.outputs()  # (B, C, d)
        prefix = torch.cumsum(z, dim=1)  # r_c = z_0 + ... + z_c
        blocks = [c for c, info in enumerate(batch.components) if info.kind == "attn"]
        states = [prefix[:, c - 1] for c in blocks] + [capture.final_input().to(z.device)]
        with capture.pausing():  # its final-norm and head hooks keep the model's own pass
            logits = self.lens.logits(torch.stack(states, 1).to(capture.readout.head.weight.dtype))
        ids = capture.option_ids.to(logits.device)
        stats = lens_stats(logits, LensReference(logits[:, -1:]), ids).cpu()  # (B, L + 1, 4 + K)
        gold = torch.tensor([self.gold[i] for i in self._ids])
        ce = -stats[torch.arange(len(gold)), :, len(STATS) + gold]  # -log p_l(gold's token)
        self._rows = torch.cat([stats[..., : len(STATS)], ce[..., None]], dim=-1)

    def result(self) -> Sequence[np.ndarray | None]:
        if self._ids is None:
            return [None] * self._n
        if self._rows is None:
            raise DecompositionError("--lens: no forward pass was decomposed")
        return list(self._rows.numpy())

    def remove(self) -> None:
        """No hooks of its own to remove."""


class TokenLens:
    """The logit lens at every token of a text task (methods §9), bound to its
    :class:`~layerdiv.extract.text.TextCapture` (``layerdiv.measurements.DecompositionCapture``,
    and a ``RowsCapture``: each row's token count): no hooks of its own, it reads the block
    inputs, the last block's call, h_L and the token ids the capture keeps (a second copy would
    double the pass's memory). After each pass, per position and layer l = 0..L: kl,
    top5_overlap and the next token's cross-entropy (``layerdiv.schemas.TOKEN_LENS``); its layer
    L is the model's own loss, which the pass's ``TextBatch`` takes from it."""

    def __init__(self, ctx: Attachment) -> None:
        self.lens = make_lens(ctx.settings["lens"], ctx.model, ctx.adapter, ctx.readout)
        self.readout = ctx.readout
        self.text: TextCapture | None = None
        self._lengths: Sequence[int] = ()
        self._values: torch.Tensor | None = None

    def bind(self, capture: TextCapture) -> None:
        self.text = capture

    def reset(self) -> None:
        self._values = None

    def batch(self, ids: Sequence[int] | None, lengths: Sequence[int]) -> None:
        self._lengths = lengths

    def decomposed(self, batch: TextBatch) -> None:
        text = self.text
        assert text is not None  # bound before any pass
        *h, final = text.states()
        with text.pausing():  # the readouts must not replace h_L (the final-norm hook)
            self._values = self._lens(text, h, final, batch.budget).cpu()
        batch.loss = self._values[:, :, -1, CE]  # layer L: the model's own loss

    def _lens(
        self, text: TextCapture, h: Sequence[torch.Tensor], final: torch.Tensor, budget: int | None
    ) -> torch.Tensor:
        """(B, width, L + 1, 5): the :data:`LENS_VALUES` of p_l, the lens's distribution of
        every block input h_l, and (layer L) of the model's own output p_L (methods §9, §16). The
        layers' states are read out in groups, as many layers' rows stacked into one matmul as
        ``budget`` rows allow (at least one layer), into one reused buffer."""
        if text.input_ids is None:
            raise DecompositionError("the lens needs the batch's input ids")
        dtype = text.dtype
        rows = final[..., 0].numel()
        group = max(1, (budget or rows) // rows)  # layers per readout matmul
        logits = self.readout.logits(final.to(dtype))
        ref = LensReference(logits)
        nxt = text.input_ids.roll(-1, dims=1)[..., None].to(logits.device)  # the next token
        # layer L (the model's own output) first: its logits' memory is then the readout buffer
        # of every group of one layer
        out = [self._layer(logits, ref, nxt)]
        buf = logits[None] if group == 1 else logits.new_empty(group, *logits.shape)
        for start in range(0, len(h), group):
            xs = torch.stack([x.to(dtype) for x in h[start : start + group]])
            stacked = self.lens.logits(xs, text.calls[-1], out=buf[: len(xs)])
            out += [self._layer(z, ref, nxt) for z in stacked]
        return torch.stack([*out[1:], out[0]], dim=2)

    @staticmethod
    def _layer(logits: torch.Tensor, ref: LensReference, nxt: torch.Tensor) -> torch.Tensor:
        """(B, width, 5): one layer's :data:`LENS_VALUES` from its ``logits`` (overwritten)."""
        stats = lens_stats(logits, ref, nxt)
        stats[..., CE].neg_()  # ce = -log p_l(next token)
        stats[:, -1, CE] = float("nan")  # none after the last position
        return stats

    def result(self) -> Sequence[np.ndarray]:
        """Per row, (T, L + 1, 5): the values at its document's own T positions."""
        if self._values is None:
            raise DecompositionError("--lens: no forward pass was decomposed")
        width = self._values.shape[1]
        return [self._values[row, width - n :].numpy() for row, n in enumerate(self._lengths)]

    def remove(self) -> None:
        """No hooks of its own to remove."""


def lens_hooks(ctx: Attachment) -> LastTokenLens | TokenLens:
    """The hooks of ``--lens`` (:mod:`layerdiv.measurements.lens`): :class:`LastTokenLens` on a
    choice task, :class:`TokenLens` on a text task."""
    return LastTokenLens(ctx) if KINDS[ctx.kind].scored else TokenLens(ctx)


class Translated(Sequence[torch.Tensor]):
    """Block inputs h_0..h_(L-1) as a learned lens reads them: T_l(h_l) = A_l h_l + b_l (methods
    §17), in float32, each translated when the readout takes it (no second copy of every
    layer's states)."""

    def __init__(self, h: Sequence[torch.Tensor], A: torch.Tensor, b: torch.Tensor) -> None:
        self.h, self.A, self.b = h, A, b

    def __len__(self) -> int:
        return len(self.h)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        A, b = self.A[index], self.b[index]
        x = self.h[index].to(A.device, torch.float32)
        return torch.matmul(x, A.T) + b  # h A^T + b: A_l h + b_l of each row h


class LearnedTokenLens(TokenLens):
    """A learned lens at every token of a text task (methods §17): :class:`TokenLens`'s
    statistics of p_l^T = softmax(W_U norm(A_l h_l + b_l)), the translators those the plan read
    (``Attachment.planned``, a ``layerdiv.store.translators.Translators``), checked against the
    model's weights and shape when attached, before anything is written. A
    ``PartitionCapture``: the translators' kind, fingerprint and training task are the settings
    it derives, recorded in the manifest and compared by every resume, shard and merge."""

    def __init__(self, ctx: Attachment) -> None:
        t = ctx.planned
        blocks = len(get_module(ctx.model, ctx.adapter.blocks))
        t.check_model(ctx.weights_fingerprint, blocks, int(ctx.model.config.hidden_size))
        super().__init__(replace(ctx, settings={"lens": Lens.name}))  # read out as the final lens
        self.translators = t
        device = ctx.readout.head.weight.device
        self.A = torch.from_numpy(np.asarray(t.A, np.float32)).to(device)
        self.b = torch.from_numpy(np.asarray(t.b, np.float32)).to(device)

    def prepare(
        self,
        seqs: Sequence[Sequence[int]],
        probe: Callable[[list[list[int]]], Any],
        stored: Mapping[str, pa.Table],
    ) -> tuple[dict[str, Any], dict[str, pa.Table]]:
        """The settings derived from the translators (no pass, no table)."""
        t = self.translators
        return {"kind": t.kind, "fingerprint": t.fingerprint, "task": t.task}, {}

    def _lens(
        self, text: TextCapture, h: Sequence[torch.Tensor], final: torch.Tensor, budget: int | None
    ) -> torch.Tensor:
        """:meth:`TokenLens._lens` of the translated block inputs (:class:`Translated`)."""
        return super()._lens(text, Translated(h, self.A, self.b), final, budget)


def learned_lens_hooks(ctx: Attachment) -> LearnedTokenLens:
    """The hooks of ``--lens-ls`` and ``--lens-tuned`` (text tasks)."""
    return LearnedTokenLens(ctx)
