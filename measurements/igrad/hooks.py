"""Integrated gradients per block and position (``extract --igrad`` on a text task with an
answer or on a choice task, :mod:`layerdiv.measurements.igrad`, methods §13).

The runner runs each batch once more for these hooks with gradients on (the measurement declares
``needs_grad``); they keep every block call's arguments and input and the sites' activations x
(the block's output, its attention's or MLP's output). Then, per site and block l, every point of
the path x(alpha) = b + alpha (x - b) (b: x's mean over the document's positions, the same vector
at every position) for the points alpha_k of ``--igrad-rule`` (``riemann``: alpha_k = k/m,
k = 0..m-1; ``gauss``: alpha = 0, then the m Gauss-Legendre nodes on [0, 1];
:func:`~layerdiv.measurements.igrad.path_points`) runs as one batch (in slices that fit memory)
from the site onward: blocks before l are not run again (the clean
pass's input of block l and each block's own call arguments are reused, as the future effects do,
``layerdiv.extract.removal.UpdateRemoval``); for ``attn`` and ``mlp`` block l runs with that
sublayer's output replaced by x(alpha), so the rest of the block reads it as the model's own code
does (h + a(alpha), and in a family with parallel attention and MLP, the MLP reads h). The
model's final norm and unembedding (the shared ``Readout``) read out the answer-predicting
positions only; f = the sum of the answer tokens' probabilities (a choice task: the gold
option's probability among the options at the last prompt token), and ``torch.autograd.grad`` gives
df/dx(alpha) in float32 (the path is a float32 leaf; the blocks run in the model's dtype),
summed with the rule's weights w_k; f(b) is f at the first point, alpha = 0.
The path's end alpha = 1 is the clean pass at every site and block: f(x) is read out once per
batch from the clean pass's last block output, not run again per site and block.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from layerdiv.errors import DecompositionError
from layerdiv.extract.batching import token_budget
from layerdiv.extract.hooks import Recorder
from layerdiv.extract.removal import UpdateRemoval, expand_calls
from layerdiv.measurements import Attachment
from layerdiv.measurements.igrad import IgradRows, check_sites, path_points, sites_of
from layerdiv.schemas.kinds import KINDS


class IgradCapture(Recorder):
    """The hooks of ``--igrad`` (``layerdiv.measurements.GradientCapture`` and
    ``RowsCapture``): they record the batch's pass with gradients on (token ids, every block
    call's arguments and input, the sites' activations, detached), and :meth:`backward`
    computes every document's integrated gradients from them."""

    def __init__(self, ctx: Attachment) -> None:
        sites = sites_of(ctx.settings)
        super().__init__(
            ctx.model, ctx.adapter, ("ids", "calls", "inputs", "block", *set(sites) - {"block"})
        )
        self.model, self.readout = ctx.model, ctx.readout
        self.sites = sites
        alphas, weights = path_points(ctx.settings)
        self.alphas, self.weights = torch.tensor(alphas), torch.tensor(weights)
        """The path's points alpha_k (the first 0) and their weights w_k (float64)."""
        self.progress = ctx.progress
        self.answers: Sequence[tuple[int, int]] = ctx.planned
        """Text tasks: per document, the answer's start s and length A (methods §10)."""
        self.gold = ctx.gold
        """Choice tasks: each instance's gold option."""
        self.options = ctx.readout.option_index(ctx.option_ids) if KINDS[ctx.kind].scored else None
        """Choice tasks: the option tokens, whose logits the target's softmax is over."""
        self.removal = UpdateRemoval(ctx.model, ctx.adapter)
        check_sites(self.sites, ctx.adapter, self.removal.blocks)
        self._ids: Sequence[int] | None = None
        self._lengths: list[int] = []
        self._cap = sys.maxsize
        """Most path points per slice: halved where a slice ran out of accelerator memory."""
        self.reset()

    # what is kept, and when --------------------------------------------------------------------
    def recording(self) -> bool:
        """In the batch's pass with gradients on (not a probe pass, nor the paths' passes)."""
        return torch.is_grad_enabled() and not self.paused and self._ids is not None

    def select(self, site: str, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    # capture -----------------------------------------------------------------------------------
    def reset(self) -> None:
        self.clear()
        self._rows: list[IgradRows] | None = None

    def batch(self, ids: Sequence[int] | None, lengths: Sequence[int]) -> None:
        self._ids, self._lengths = ids, list(lengths)

    def backward(self, output: Any) -> None:
        if self._ids is None:  # a probe pass: nothing of it is stored
            return
        if self.input_ids is None or not self.calls:
            raise DecompositionError("--igrad: no forward pass was captured")
        with self.pausing():
            self._rows = self._integrate(list(self._ids))
        self.clear()

    def result(self) -> Sequence[IgradRows | None]:
        if self._ids is None:
            return [None] * len(self._lengths)
        if self._rows is None:
            raise DecompositionError("--igrad: no gradient pass ran")
        return self._rows

    # integrated gradients ------------------------------------------------------------------------
    def _integrate(self, docs: list[int]) -> list[IgradRows]:
        """Every document's :class:`IgradRows` from the states the hooks kept."""
        assert self.input_ids is not None
        ids = self.input_ids
        batch, width = ids.shape
        blocks = len(self.removal.blocks)
        n_tokens = self._lengths
        # per row: the answer-predicting positions j - 1 (j = max(s, 1)..T-1, in the padded row)
        # and the answer's tokens x_j; a choice task: the last prompt token and the gold option
        targets = []
        for b, (doc, n) in enumerate(zip(docs, n_tokens, strict=True)):
            if self.options is not None:
                last = torch.tensor([width - 1], device=ids.device)
                targets.append((last, torch.tensor([self.gold[doc]], device=ids.device)))
                continue
            # an answer past the cut (start >= n) has no position: no target
            offset, start = width - n, min(max(self.answers[doc][0], 1), n)
            j = torch.arange(offset + start, width, device=ids.device)
            targets.append((j - 1, ids[b, j]))
        # a row without an answer token (max_tokens cut it off) stays NaN: stored as missing
        attribution = torch.full((len(self.sites), blocks, batch, width), torch.nan)
        ends = torch.full((2, len(self.sites), blocks, batch), torch.nan)
        answered = [b for b in range(batch) if len(targets[b][0])]
        if answered:
            dtype = self.inputs[0].dtype
            rows = torch.tensor(answered, device=ids.device)
            with torch.no_grad():  # f(x): alpha = 1 is the clean pass (methods §13)
                clean = self._readout(self.activations["block"][-1].index_select(0, rows), rows,
                                      targets)  # fmt: skip
            for i, site in enumerate(self.sites):
                for layer in range(blocks):
                    ig, f = self._site(site, layer, answered, targets, dtype, clean)
                    attribution[i, layer, answered] = ig.cpu()
                    ends[:, i, layer][:, answered] = f.cpu()
                    self.progress((i * blocks + layer + 1) / (len(self.sites) * blocks))
        return [
            IgradRows(
                self.sites,
                attribution[:, :, b, width - n :].numpy(),
                ends[1, :, :, b].numpy(),
                ends[0, :, :, b].numpy(),
            )
            for b, n in enumerate(n_tokens)
        ]

    def _slice_rows(self, width: int, runs: int) -> int:
        """Path points per slice, at most what an earlier slice ran out of memory at
        (:attr:`_cap`): on an accelerator, its token budget (from its free memory) over the
        tokens whose activations the backward pass keeps (``runs`` blocks from the site, and the
        input); on the CPU, whose budget is a forward pass's batch rather than a memory estimate,
        that batch per block (larger products run faster there; the graph then holds that many
        tokens' activations in every block run)."""
        x = self.inputs[0]
        budget = token_budget(x.device, self.model.config, x.dtype)
        per_block = budget if x.device.type == "cpu" else budget // (runs + 1)
        return max(1, min(per_block // width, self._cap))

    def _site(
        self,
        site: str,
        layer: int,
        answered: list[int],
        targets: list[tuple[torch.Tensor, torch.Tensor]],
        dtype: torch.dtype,
        clean: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """IG (r, width) and (f(b), f(x)) (2, r) of the batch rows ``answered`` for ``site`` of
        block ``layer``; f(x) is ``clean`` (r,), the clean pass's."""
        x = self.activations[site][layer].float()
        batch, width, _ = x.shape
        own = torch.zeros(batch, width, 1, device=x.device)
        for row, n in enumerate(self._lengths):
            own[row, width - n :] = 1
        # baseline b: the mean of x over the document's own positions; padding keeps x
        base = (x * own).sum(1, keepdim=True) / own.sum(1, keepdim=True)
        diff = (x - base) * own
        start = x - diff
        grads = torch.zeros(batch, width, x.shape[-1], device=x.device)
        f = torch.zeros(batch, device=x.device)
        points = len(self.alphas)
        alphas = self.alphas.to(x.device, torch.float32)
        weights = self.weights.to(x.device, torch.float32)
        # point i = (row answered[i // P], k = i % P) of the rule's P points alpha_k; each
        # slice's points made when it runs
        rows_of = torch.tensor(answered, device=x.device)
        total = len(answered) * points
        runs = len(self.removal.blocks) - layer - (site == "block")
        lo, rows = 0, self._slice_rows(width, runs)
        while lo < total:
            point = torch.arange(lo, min(lo + rows, total), device=x.device)
            b, k = rows_of[point // points], point % points
            alpha = alphas[k][:, None, None]
            z = (start.index_select(0, b) + alpha * diff.index_select(0, b)).requires_grad_()
            try:
                value = self._target(site, layer, z, b, targets, batch, dtype)
                (grad,) = torch.autograd.grad(value.sum(), z)
            except torch.OutOfMemoryError:
                if rows == 1:
                    raise
                torch.cuda.empty_cache()
                rows = self._cap = rows // 2  # kept for the later slices and batches
                continue
            lo += len(point)
            grads.index_add_(0, b, grad * weights[k][:, None, None])
            f.index_put_((b[k == 0],), value.detach()[k == 0])
        # IG(l, t) = sum_d (x - b)[t, d] sum_k w_k df/dx[t, d] at x(alpha_k); alpha_0 = 0: f(b)
        ig = (diff * grads).sum(-1)
        return ig.index_select(0, rows_of), torch.stack([f.index_select(0, rows_of), clean])

    def _target(
        self,
        site: str,
        layer: int,
        z: torch.Tensor,
        b: torch.Tensor,
        targets: list[tuple[torch.Tensor, torch.Tensor]],
        batch: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """f per path point (r,): the sum over the answer's tokens j of softmax(z_(j-1))[x_j]
        (a choice task: the gold option's probability under the softmax over the option logits
        at the last prompt token),
        the model run on from ``site`` of block ``layer`` with its activation ``z`` (r, W, d)
        (rows of batch rows ``b``)."""
        calls = expand_calls(self.calls, b, batch, {})
        if site == "block":
            final = self.removal.last(z.to(dtype), calls, layer + 1)
        else:

            def replace(module: Any, args: tuple, output: Any) -> Any:
                handle.remove()  # block ``layer``'s call only (a shared block runs again)
                if isinstance(output, tuple):
                    return (z.to(output[0].dtype), *output[1:])
                return z.to(output.dtype)

            handle = self.removal.parts[site][layer].register_forward_hook(replace)
            try:
                final = self.removal.last(self.inputs[layer].index_select(0, b), calls, layer)
            finally:
                handle.remove()
        return self._readout(final, b, targets)

    def _readout(
        self, final: torch.Tensor, b: torch.Tensor, targets: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """f (r,) of :meth:`_target` read from the last block's outputs ``final`` (r, W, d) of
        batch rows ``b``."""
        row, pos, token = [], [], []
        for i, r in enumerate(b.tolist()):
            p, x = targets[r]
            row.append(torch.full_like(p, i))
            pos.append(p)
            token.append(x)
        at, where, tok = torch.cat(row), torch.cat(pos), torch.cat(token)
        if self.options is not None:  # a choice task: the option probabilities (before soft-cap)
            prob = self.readout.option_probs(final[at, where], self.options)
            prob = prob.gather(-1, tok[:, None])[:, 0]
        else:
            prob = self.readout.token_probs(final[at, where], tok)
        return torch.zeros(len(b), device=prob.device).index_add(0, at, prob)
