"""The hooks of ``extract --erase`` (:mod:`layerdiv.measurements.erase`, methods §14): residual
erasure from the clean pass's kept states, on a text task (the states its per-token capture
keeps) and on a choice task (a :class:`~layerdiv.extract.hooks.Recorder` of the clean pass's
block calls and states at every position, bound to its last-token decomposition).

For state l and position t, the edited copy differs from the clean pass only at positions
>= t (attention is causal), so the blocks after l run only at the queries t..T-1, reading the keys
and values of the positions before t from the clean pass: one clean pass of the blocks keeps them
(:class:`KeyValues`), and each edited pass gives block call j a cache of its own
(:class:`Prefix`) that puts them before the keys and values the call computes. The blocks before l
are not run again (the clean pass's input of block l, kept by the per-token capture, is the
start), and every block call runs with the arguments of its own clean call (mask, positions,
rotary angles) cut to the queries (``layerdiv.extract.removal.expand_calls``). The copies run
in groups by t: a group of copies starting at t0 runs the queries t0..T-1, its copies with t > t0
recomputing the few positions t0..t-1 unchanged; the groups of consecutive states at the same t
are stacked into one pass (the copies of h_l join it at block l), so that a short prompt's
passes are few large operations. What is read out is the task kind's
:class:`Target`: the readout runs only at each copy's read positions max(first, t)..last (a text
task, :class:`NextTokens`: the answer-predicting positions s - 1..T-2, the whole next-token
distribution; a choice task, :class:`OptionProbs`: the last prompt token T - 1 alone, the
softmax over the option logits), and the last state h_L reaches z_t alone: at t alone. Positions
t > last precede none of them, and their effect is stored as an exact 0, not computed; so is the
last state's at every t < first, whose copies are not run (a choice task: h_L at every position
but T - 1)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import torch

from layerdiv.errors import DecompositionError, LayerdivError
from layerdiv.extract.batching import token_budget
from layerdiv.extract.hooks import Call, Recorder
from layerdiv.extract.removal import UpdateRemoval, expand_calls
from layerdiv.measurements import Attachment
from layerdiv.measurements.erase import (
    FINGERPRINT,
    EraseError,
    ErasePlan,
    fingerprint,
    reference_means,
    reference_start,
    reference_table,
)
from layerdiv.measurements.future.hooks import PassesAfter
from layerdiv.schemas.kinds import KINDS

CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")
"""The names under which a decoder block takes its attention's key/value cache (transformers'
families differ)."""

GROUP_SHARE = 8
"""A group of copies starting at t0 spans at most (T - t0) / GROUP_SHARE positions t (its
recomputed unchanged positions: at most about 1/16 of its work), or :data:`GROUP_MIN`."""

GROUP_MIN = 16
"""The fewest positions a group spans (while the budget and the document allow): on prompts of
tens of tokens, groups of one or two copies spend most of their time in the blocks' per-call
cost rather than in the few positions a larger group recomputes."""

STACK_TOKENS = 8192
"""The query tokens an edited pass may hold where the token budget allows fewer (the CPU's
1,024): the copies of consecutive states are stacked into one pass of the blocks up to
max(budget, this), so that a pass of a short prompt's copies is a few large operations rather
than many small ones (each operation's fixed cost, and on a loaded machine each thread's wait
for the others, is paid per operation)."""

READ_ROWS = 256
"""Positions per slice of an edited pass's readout (over the whole vocabulary)."""


class EraseModelError(LayerdivError, ValueError):
    """A model whose blocks take no key/value cache, which the edited passes need."""


def cache_argument(block: Any) -> str:
    """The keyword under which ``block`` takes its attention's key/value cache."""
    params = inspect.signature(block.forward).parameters
    found = next((name for name in CACHE_ARGUMENTS if name in params), None)
    if found is None:
        raise EraseModelError(
            f"--erase: the model's blocks ({type(block).__name__}) take no key/value cache "
            f"argument ({', '.join(CACHE_ARGUMENTS)}); extract this model without --erase"
        )
    return found


class KeyValues:
    """A key/value cache that keeps what one block call computes (the clean pass's)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = keys, values
        return keys, values


class Prefix:
    """A key/value cache holding the clean keys and values of the positions before an edited
    pass's queries (batch 1, broadcast to the pass's rows): the call reads them, then its own."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = keys.shape[0]
        return (
            torch.cat([self.keys.expand(rows, *self.keys.shape[1:]), keys], dim=-2),
            torch.cat([self.values.expand(rows, *self.values.shape[1:]), values], dim=-2),
        )


def _with(call: Call, **kwargs: Any) -> Call:
    """Block call ``call`` with keyword arguments ``kwargs`` set."""
    args, given = call
    return args, {**given, **kwargs}


class Target(Protocol):
    """What the edited passes read out, per task kind."""

    def span(self, unit: int, n: int) -> tuple[int, int]:
        """The first and last read position of unit ``unit`` of ``n`` tokens (first > last:
        none)."""
        ...

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """The probability vectors (..., V or K) read from residual states ``x`` (..., d)."""
        ...


class NextTokens:
    """A text task's target: the whole next-token distribution (the model's readout, soft-cap
    included) at the answer-predicting positions s - 1..T-2 (``answers``: per document, its
    answer's start s and length A, methods §10)."""

    def __init__(self, readout: Any, answers: Sequence[tuple[int, int]]) -> None:
        self.readout, self.answers = readout, answers

    def span(self, unit: int, n: int) -> tuple[int, int]:
        return max(self.answers[unit][0] - 1, 0), n - 2

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.readout.logits(x), dim=-1)


class OptionProbs:
    """A choice task's target: the option probabilities (``Readout.option_probs``: the softmax
    over the option logits, before any soft-cap) at the last prompt token."""

    def __init__(self, readout: Any, option_ids: Sequence[int]) -> None:
        self.readout = readout
        self.ids = readout.option_index(option_ids)

    def span(self, unit: int, n: int) -> tuple[int, int]:
        return n - 1, n - 1

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout.option_probs(x, self.ids)


class Erasure:
    """Runs the edited passes of one batch after its clean pass (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        adapter: Any,
        target: Target,
        progress: Callable[[float], None] = lambda share: None,
    ) -> None:
        self.progress = progress
        """Told the share of the batch's edited passes done (``Attachment.progress``)."""
        self.removal = UpdateRemoval(model, adapter)
        self.blocks = self.removal.blocks
        self.target = target
        self.cache = cache_argument(self.blocks[0])
        self.sdpa = getattr(model.config, "_attn_implementation", None) == "sdpa"

    def run(
        self,
        states: list[torch.Tensor],
        calls: list[Call],
        dtype: torch.dtype,
        means: torch.Tensor,
        n_tokens: list[int],
        docs: list[int],
        budget: int,
    ) -> list[np.ndarray]:
        """Per document (instance) of a left-padded batch, its (L + 1, T) effects: ``states``
        the clean pass's h_0..h_L (L + 1 tensors (B, W, d), float32), ``calls`` each block
        call's arguments, ``means`` the (L + 1, d) reference means; at most ``budget`` query
        tokens per edited pass."""
        kept = [KeyValues() for _ in self.blocks]
        recording = [_with(c, **{self.cache: k}) for c, k in zip(calls, kept, strict=True)]
        self.removal.last(states[0].to(dtype), recording, 0)
        return [
            self._document(
                b, n, self.target.span(doc, n), states, calls, kept, dtype, means, budget,
                partial(self._done, b, len(docs)),
            )
            for b, (n, doc) in enumerate(zip(n_tokens, docs, strict=True))
        ]  # fmt: skip

    def _done(self, row: int, rows: int, share: float) -> None:
        """Batch row ``row`` of ``rows`` has done ``share`` of its edited passes."""
        self.progress((row + share) / rows)

    def _document(
        self,
        row: int,
        n: int,
        span: tuple[int, int],
        states: list[torch.Tensor],
        calls: list[Call],
        kept: list[KeyValues],
        dtype: torch.dtype,
        means: torch.Tensor,
        budget: int,
        done: Callable[[float], None],
    ) -> np.ndarray:
        """The (L + 1, n) effects of the unit in batch row ``row`` read out at the positions
        ``span`` = (first, last) of its own; ``done`` is told the share of its states done."""
        width = states[0].shape[1]
        start = width - n  # the unit's first position in the padded row
        first, last = span
        if first > last:  # no read position (max_tokens cut the answer off): stored as missing
            return torch.full((len(states), n), torch.nan).numpy()
        effect = torch.zeros(len(states), n)
        clean = self.target.probs(states[-1][row, start + first : start + last + 1].to(dtype))
        blocks = len(self.blocks)
        for layers, t0 in ((range(blocks), 0), (range(blocks, blocks + 1), first)):
            # h_0..h_(L-1) from t = 0, stacked; h_L from first (before it: exactly 0)
            while t0 <= last:
                share = max(GROUP_MIN, (n - t0) // GROUP_SHARE)
                rows = max(1, min(share, budget // (n - t0), last + 1 - t0))
                t = torch.arange(t0, t0 + rows)
                stack = max(1, max(budget, STACK_TOKENS) // (rows * (n - t0)))
                for l0 in range(layers[0], layers[-1] + 1, stack):
                    stacked = range(l0, min(l0 + stack, layers[-1] + 1))
                    effect[l0 : stacked[-1] + 1, t0 : t0 + rows] = self._group(
                        stacked, row, start, t, span, states, calls, kept, dtype, means, clean
                    )
                t0 += rows
            done((layers[-1] + 1) / len(states))
        return effect.numpy()

    def _group(
        self,
        layers: range,
        row: int,
        start: int,
        t: torch.Tensor,
        span: tuple[int, int],
        states: list[torch.Tensor],
        calls: list[Call],
        kept: list[KeyValues],
        dtype: torch.dtype,
        means: torch.Tensor,
        clean: torch.Tensor,
    ) -> torch.Tensor:
        """The effects (len(layers), len(t)) of the copies erasing each state of ``layers``
        (consecutive) at positions ``t`` (ascending) of the document in batch row ``row``: the
        queries t[0]..T-1 run from block ``layers[0]`` on, the copies of state l joining the
        batch at block l (one pass of the blocks for the stacked states)."""
        batch, width = states[0].shape[:2]
        q = start + int(t[0])  # the group's first query, in the padded row
        copies = len(t)
        device = states[0].device

        def erased(layer: int) -> torch.Tensor:
            """The copies of h_layer, each with its own position t replaced by mu_layer."""
            x = states[layer][row, q:].to(dtype).repeat(copies, 1, 1)
            x[torch.arange(copies), t - t[0]] = means[layer].to(device, dtype)
            return x

        memo: dict[int, dict[int, torch.Tensor]] = {}
        edited: list[Call] = list(calls)
        for j in range(layers[0], len(self.blocks)):
            size = copies * (min(j, layers[-1]) - layers[0] + 1)  # the states joined by block j
            rows = torch.full((size,), row, dtype=torch.long, device=device)
            k, v = kept[j].keys, kept[j].values
            assert k is not None and v is not None  # kept by the clean pass of the blocks
            args, kwargs = calls[j]  # its hidden states left out: the run gives them
            bare = ((None, *args[1:]), kwargs) if args else _with(calls[j], hidden_states=None)
            edited[j] = _with(
                expand_calls(bare, rows, batch, memo.setdefault(size, {}), (width, q)),
                **{self.cache: Prefix(k[row : row + 1, ..., :q, :], v[row : row + 1, ..., :q, :])},
            )
            if self.sdpa and edited[j][1].get("attention_mask", 0) is None:
                edited[j] = _with(edited[j], attention_mask=self._causal(size, q, width, device))

        def join(j: int, y: torch.Tensor) -> torch.Tensor:
            """Block j's output, the copies of h_(j+1) appended where they are stacked."""
            return torch.cat([y, erased(j + 1)]) if j + 1 in layers else y

        x = erased(layers[0])
        if layers[0] < len(self.blocks):
            x = self.removal.last(x, edited, layers[0], (), "block", None, join)
        # effect(l, t) = max_{j = max(first, t)..last} ||p'_j - p_j||_2 (a text task: the
        # next-token distributions at j = s-1..T-2; a choice task: the option probabilities at
        # j = T-1 alone)
        first, last = span
        pos = torch.arange(q, width, device=device)
        edit = (start + t).to(device)[:, None]
        measured = (pos[None, :] >= (start + torch.maximum(t, torch.tensor(first)))[:, None]
                    .to(device)) & (pos[None, :] <= start + last)  # fmt: skip
        if layers[0] == len(self.blocks):  # h_L reaches z_t alone: the others exactly unchanged
            measured &= pos[None, :] == edit
        copy, col = measured.repeat(len(layers), 1).nonzero(as_tuple=True)
        out = torch.zeros(len(x), device=device)
        for a in range(0, len(copy), READ_ROWS):
            c, p = copy[a : a + READ_ROWS], col[a : a + READ_ROWS]
            probs = self.target.probs(x[c, p])
            change = (probs - clean[q + p - start - first]).norm(dim=-1)
            out = out.scatter_reduce(0, c, change, reduce="amax")
        return out.view(len(layers), copies).cpu()

    @staticmethod
    def _causal(copies: int, q: int, width: int, device: torch.device) -> torch.Tensor:
        """The boolean mask (copies, 1, W - q, W) of queries q..W-1 over keys 0..W-1 (True:
        attends), where the clean call had none (its attention was causal without padding)."""
        keys = torch.arange(width, device=device)
        queries = torch.arange(q, width, device=device)
        return (keys[None, :] <= queries[:, None]).expand(copies, 1, width - q, width)


class EraseCapture(PassesAfter):
    """The hooks of ``--erase`` (also a ``PartitionCapture``): the reference means once per
    partition (:meth:`prepare`), then after each pass of stored documents (instances) their
    effects (:class:`Erasure`), from the states the text task's per-token capture keeps or, on a
    choice task, those a recorder bound to its last-token decomposition keeps (float32, every
    position: neither the edited passes, nor those of another capture bound to it, the skips',
    nor a gradient pass are kept)."""

    flag = "--erase"

    def __init__(self, ctx: Attachment) -> None:
        super().__init__()
        self.count = int(ctx.settings["erase_reference"])
        self.start = reference_start(ctx.settings)
        planned: ErasePlan = ctx.planned
        self.reference = planned.reference
        """``--erase-reference-task``: that task's first R units' token ids (None: this
        task's)."""
        choice = KINDS[ctx.kind].scored
        target = (
            OptionProbs(ctx.readout, ctx.option_ids)
            if choice
            else NextTokens(ctx.readout, planned.spans or [])
        )
        self.erasure = Erasure(ctx.model, ctx.adapter, target, ctx.progress)
        self.config = ctx.model.config
        states = ("calls", "inputs", "final")
        self.kept = Recorder(ctx.model, ctx.adapter, states) if choice else None
        """A choice task: the clean pass's states (a text task's capture keeps them)."""
        self.means: torch.Tensor | None = None

    def bind(self, capture: Any) -> None:
        if self.kept is not None:
            self.kept.capture = capture
        super().bind(capture if self.kept is None else self.kept)

    def reset(self) -> None:
        super().reset()
        if self.kept is not None:
            self.kept.clear()

    def remove(self) -> None:
        if self.kept is not None:
            self.kept.remove()

    def prepare(
        self,
        seqs: Sequence[Sequence[int]],
        probe: Callable[[list[list[int]]], Any],
        stored: Mapping[str, pa.Table],
    ) -> tuple[dict[str, Any], dict[str, pa.Table]]:
        """The reference means mu_l: the stored ones, else the mean of h_l over the positions
        1..T-1 (``all``: 0..T-1) of the first R documents or prompts of the task (or of the
        reference task), one probe pass each (methods §14)."""
        if "erasure_reference" in stored:
            means = reference_means(stored["erasure_reference"])
        else:
            first = self.start
            # mu_l = sum over sequences and positions t >= first of h_l[t] / their count
            units = [s for s in (self.reference or seqs)[: self.count] if len(s) > first]
            if not units:
                raise EraseError(
                    f"--erase: the reference's first {self.count} units hold no position after "
                    "the first; give more (--erase-reference) or --erase-reference-positions all"
                )
            total: torch.Tensor | None = None
            for seq in units:
                probe([list(seq)])
                h = torch.stack([s[0, first:] for s in self.text.states()]).double()
                total = h.sum(dim=1) if total is None else total + h.sum(dim=1)  # (L + 1, d)
            assert total is not None  # one unit at least
            tokens = sum(len(s) - first for s in units)
            means = (total / tokens).float().cpu().numpy()
        self.means = torch.from_numpy(means)
        return {FINGERPRINT: fingerprint(means)}, {"erasure_reference": reference_table(means)}

    def measure(self, batch: Any, lengths: list[int], docs: list[int]) -> list[np.ndarray]:
        if self.means is None:
            raise DecompositionError("--erase: the reference means were not prepared")
        text = self.text
        states = text.states()
        # a text pass's budget is the runner's; a choice pass's holds no readout row per token
        budget = (
            batch.budget
            if self.kept is None
            else token_budget(states[0].device, self.config, text.dtype)
        )
        return self.erasure.run(states, text.calls, text.dtype, self.means, lengths, docs, budget)
