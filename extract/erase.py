"""The hooks of ``extract --erase`` on a text task (:mod:`layerdiv.measurements.erase`, methods
§14): residual erasure from the clean pass's kept states.

For state l and position t, the edited copy differs from the clean pass only at positions
>= t (attention is causal), so the blocks after l run only at the queries t..T-1, reading the keys
and values of the positions before t from the clean pass: one clean pass of the blocks keeps them
(:class:`KeyValues`), and each edited pass gives block call j a cache of its own
(:class:`Prefix`) that puts them before the keys and values the call computes. The blocks before l
are not run again (the clean pass's input of block l, kept by the per-token capture, is the
start), and every block call runs with the arguments of its own clean call (mask, positions,
rotary angles) cut to the queries (``layerdiv.extract.future._expand``). The copies of one state
run together, grouped by t: a group of copies starting at t0 runs the queries t0..T-1, its copies
with t > t0 recomputing the few positions t0..t-1 unchanged. The readout runs only at each copy's
answer-predicting positions max(s - 1, t)..T-2 (the last state h_L reaches z_t alone: at t
alone); positions t > T - 2 precede none of them, and their effect is stored as an exact 0, not
computed (so is the last state's before s - 1)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from layerdiv.errors import LayerdivError
from layerdiv.extract.capture import DecompositionError
from layerdiv.extract.future import PassesAfter, _expand
from layerdiv.extract.removal import Call, UpdateRemoval
from layerdiv.measurements import Attachment
from layerdiv.measurements.erase import (
    FINGERPRINT,
    fingerprint,
    reference_means,
    reference_table,
)

CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")
"""The names under which a decoder block takes its attention's key/value cache (transformers'
families differ)."""

GROUP_SHARE = 8
"""A group of copies starting at t0 spans at most (T - t0) / GROUP_SHARE positions t (its
recomputed unchanged positions: at most about 1/16 of its work)."""

READ_ROWS = 256
"""Positions per slice of an edited pass's full-vocabulary readout."""


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


class Erasure:
    """Runs the edited passes of one batch after its clean pass (see the module docstring)."""

    def __init__(self, model: Any, adapter: Any, readout: Any, answers: Sequence[Any]) -> None:
        self.removal = UpdateRemoval(model, adapter)
        self.blocks = self.removal.blocks
        self.readout = readout
        self.answers = answers
        """Per document (its number), its answer's start s and length A (methods §10)."""
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
        """Per document of a left-padded batch, its (L + 1, T) effects: ``states`` the clean
        pass's h_0..h_L (L + 1 tensors (B, W, d), float32), ``calls`` each block call's
        arguments, ``means`` the (L + 1, d) reference means; at most ``budget`` query tokens
        per edited pass."""
        kept = [KeyValues() for _ in self.blocks]
        recording = [_with(c, **{self.cache: k}) for c, k in zip(calls, kept, strict=True)]
        self.removal.last(states[0].to(dtype), recording, 0)
        return [
            self._document(b, n, self.answers[doc], states, calls, kept, dtype, means, budget)
            for b, (n, doc) in enumerate(zip(n_tokens, docs, strict=True))
        ]

    def _document(
        self,
        row: int,
        n: int,
        answer: tuple[int, int],
        states: list[torch.Tensor],
        calls: list[Call],
        kept: list[KeyValues],
        dtype: torch.dtype,
        means: torch.Tensor,
        budget: int,
    ) -> np.ndarray:
        """The (L + 1, n) effects of the document in batch row ``row``."""
        width = states[0].shape[1]
        start = width - n  # the document's first position in the padded row
        first = max(answer[0] - 1, 0)  # the first answer-predicting position s - 1
        effect = torch.zeros(len(states), n)
        if first > n - 2:  # no answer-predicting position in the document (cut short)
            return effect.numpy()
        clean = torch.softmax(self.readout.logits(states[-1][row, start + first : width - 1]
                                                  .to(dtype)), dim=-1)  # fmt: skip
        for layer in range(len(states)):
            t0 = 0
            while t0 <= n - 2:
                span = max(1, (n - t0) // GROUP_SHARE)
                rows = max(1, min(span, budget // (n - t0), n - 1 - t0))
                t = torch.arange(t0, t0 + rows)
                effect[layer, t0 : t0 + rows] = self._group(
                    layer, row, start, t, first, states, calls, kept, dtype, means, clean
                )
                t0 += rows
        return effect.numpy()

    def _group(
        self,
        layer: int,
        row: int,
        start: int,
        t: torch.Tensor,
        first: int,
        states: list[torch.Tensor],
        calls: list[Call],
        kept: list[KeyValues],
        dtype: torch.dtype,
        means: torch.Tensor,
        clean: torch.Tensor,
    ) -> torch.Tensor:
        """The effects of the copies erasing state ``layer`` at positions ``t`` (ascending) of the
        document in batch row ``row``: the queries t[0]..T-1 run from block ``layer`` on."""
        batch, width = states[0].shape[:2]
        q = start + int(t[0])  # the group's first query, in the padded row
        copies = len(t)
        device = states[0].device
        x = states[layer][row, q:].to(dtype).repeat(copies, 1, 1)
        x[torch.arange(copies), t - t[0]] = means[layer].to(device, dtype)
        rows = torch.full((copies,), row, dtype=torch.long, device=device)
        memo: dict[int, torch.Tensor] = {}
        edited: list[Call] = list(calls)
        for j in range(layer, len(self.blocks)):
            k, v = kept[j].keys, kept[j].values
            assert k is not None and v is not None  # kept by the clean pass of the blocks
            args, kwargs = calls[j]  # its hidden states left out: the run gives them
            bare = ((None, *args[1:]), kwargs) if args else _with(calls[j], hidden_states=None)
            edited[j] = _with(
                _expand(bare, rows, batch, memo, (width, q)),
                **{self.cache: Prefix(k[row : row + 1, ..., :q, :], v[row : row + 1, ..., :q, :])},
            )
            if self.sdpa and edited[j][1].get("attention_mask", 0) is None:
                edited[j] = _with(edited[j], attention_mask=self._causal(copies, q, width, device))
        final = self.removal.last(x, edited, layer) if layer < len(self.blocks) else x
        # effect(l, t) = max_{j = max(s-1, t)..T-2} ||softmax(z'_j) - softmax(z_j)||_2
        pos = torch.arange(q, width, device=device)
        edit = (start + t).to(device)[:, None]
        measured = (pos[None, :] >= (start + torch.maximum(t, torch.tensor(first)))[:, None]
                    .to(device)) & (pos[None, :] < width - 1)  # fmt: skip
        if layer == len(self.blocks):  # h_L reaches z_t alone: the others are exactly unchanged
            measured &= pos[None, :] == edit
        copy, col = measured.nonzero(as_tuple=True)
        out = torch.zeros(copies, device=device)
        for a in range(0, len(copy), READ_ROWS):
            c, p = copy[a : a + READ_ROWS], col[a : a + READ_ROWS]
            probs = torch.softmax(self.readout.logits(final[c, p]), dim=-1)
            change = (probs - clean[q + p - start - first]).norm(dim=-1)
            out = out.scatter_reduce(0, c, change, reduce="amax")
        return out.cpu()

    @staticmethod
    def _causal(copies: int, q: int, width: int, device: torch.device) -> torch.Tensor:
        """The boolean mask (copies, 1, W - q, W) of queries q..W-1 over keys 0..W-1 (True:
        attends), where the clean call had none (its attention was causal without padding)."""
        keys = torch.arange(width, device=device)
        queries = torch.arange(q, width, device=device)
        return (keys[None, :] <= queries[:, None]).expand(copies, 1, width - q, width)


class EraseCapture(PassesAfter):
    """The hooks of ``--erase`` on a text task (also a ``PartitionCapture``): the reference
    means once per partition (:meth:`prepare`), then after each pass of stored documents their
    effects (:class:`Erasure`)."""

    flag = "--erase"

    def __init__(self, ctx: Attachment) -> None:
        super().__init__()
        self.count = int(ctx.settings["erase_reference"])
        self.erasure = Erasure(ctx.model, ctx.adapter, ctx.readout, ctx.planned)
        self.means: torch.Tensor | None = None

    def prepare(
        self,
        seqs: Sequence[Sequence[int]],
        probe: Callable[[list[list[int]]], Any],
        stored: Mapping[str, pa.Table],
    ) -> tuple[dict[str, Any], dict[str, pa.Table]]:
        """The reference means mu_l: the stored ones, else the mean of h_l over every position
        (BOS included) of the first R documents, one probe pass each (methods §14)."""
        if "erasure_reference" in stored:
            means = reference_means(stored["erasure_reference"])
        else:
            total: torch.Tensor | None = None
            for seq in seqs[: self.count]:
                probe([list(seq)])
                h = torch.stack([s[0] for s in self.text.states()]).double()  # (L + 1, T, d)
                total = h.sum(dim=1) if total is None else total + h.sum(dim=1)
            assert total is not None  # plan_erase refuses fewer than one document
            tokens = sum(len(s) for s in seqs[: self.count])
            means = (total / tokens).float().cpu().numpy()
        self.means = torch.from_numpy(means)
        return {FINGERPRINT: fingerprint(means)}, {"erasure_reference": reference_table(means)}

    def measure(self, batch: Any, lengths: list[int], docs: list[int]) -> list[np.ndarray]:
        if self.means is None:
            raise DecompositionError("--erase: the reference means were not prepared")
        text = self.text
        return self.erasure.run(
            text.states(), text.block_args, text.dtype, self.means, lengths, docs, batch.budget
        )
