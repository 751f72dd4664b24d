"""The hooks of ``extract --heads`` (:mod:`layerdiv.measurements.heads`): per-head option logits
(methods §8), exact and cheap.

The attention component of a block is o(sum_h W_O,h a_h + b_O). For each attention output
projection the K x d_in matrix M = (W_U[options] * g) W_O (centred over d for LayerNorm models,
times the frozen post-attention norm's gain for sandwich-norm models) is formed once, so that a
head costs one (K x head_dim) product per instance: u_(b,h) = M_h a_h / (scale of the final
residual) (/ the block's post-norm rms). A forward hook on the projection reads a_h at the last
position only; no per-head d-dimensional vector is ever formed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerdiv.errors import DecompositionError
from layerdiv.extract.adapters import (
    Adapter,
    UnsupportedModel,
    adapter_for,
    get_module,
    norm_eps,
)
from layerdiv.extract.capture import (
    SUM_TOLERANCE,
    BatchDecomposition,
    ComponentCapture,
)
from layerdiv.extract.hooks import Hooks, unique_blocks
from layerdiv.extract.readout import norm_gain, onloaded
from layerdiv.measurements import Attachment
from layerdiv.measurements.heads import HeadValues


def check_heads(config: Any) -> int:
    """The number of attention heads of a config whose attention splits exactly into heads
    (methods §8), or a one-line refusal: ``--heads``'s check of the model
    (:mod:`layerdiv.measurements.heads`), before the weights load."""
    adapter = adapter_for(config)
    model_type = getattr(config, "model_type", None)
    heads = getattr(config, "num_attention_heads", None)
    if adapter.attn_out is None:
        raise UnsupportedModel(
            f"--heads: the attention of {model_type!r} models cannot be split into heads exactly "
            "(no per-head output projection in layerdiv/extract/adapters.py); extract without "
            "--heads."
        )
    if not isinstance(heads, int) or heads < 1:
        raise UnsupportedModel(
            f"--heads: the {model_type!r} config gives no num_attention_heads ({heads!r}); "
            "extract without --heads."
        )
    return heads


@dataclass
class HeadDecomposition:
    """Per-head option logits of one batch (float32, on the CPU)."""

    components: list[int]
    """Index (execution order, as in :class:`BatchDecomposition`) of each attention component."""
    head_ids: list[int]
    """Head index of each column: 0..H-1, preceded by -1 (the output projection's bias) when
    the projection has one."""
    logits: torch.Tensor
    """(B, A, G, K) u_(b,h)[k]: head G of attention component A's share of option k's logit."""


@dataclass
class _Projection:
    layer: int
    m: torch.Tensor  # (K, H, head_dim): option rows of W_U * gains times W_O, per head
    bias: torch.Tensor | None  # (K,): the same rows times b_O
    post_eps: float | None  # epsilon of the frozen post-attention norm (sandwich models)


class HeadCapture(Hooks):
    """Hooks on every attention output projection of a model, bound to its
    :class:`ComponentCapture` (``layerdiv.measurements.DecompositionCapture``); after each
    forward pass, every instance's heads (:class:`HeadValues`), their sums checked against the
    attention components (methods §8)."""

    def __init__(self, ctx: Attachment) -> None:
        model, adapter = ctx.model, ctx.adapter
        if adapter.attn_out is None:
            raise UnsupportedModel(f"--heads: no attention output projection for {adapter.family}")
        super().__init__()
        self.model, self.adapter, self.attn_out = model, adapter, adapter.attn_out
        self.n_heads = check_heads(model.config)
        self.tol = SUM_TOLERANCE[model.dtype]
        self.capture: ComponentCapture | None = None
        self.heads: HeadDecomposition | None = None
        """The heads of the last forward pass."""
        self._layers: list[int] = []
        self.head_ids: list[int] | None = None
        self._records: list[tuple[_Projection, torch.Tensor, torch.Tensor | None]] = []
        self._ids: Sequence[int] | None = None

    def bind(self, capture: ComponentCapture) -> None:
        """Form M for every block from ``capture``'s option rows and hook the projections."""
        self.capture = capture
        rows = capture.readout.frozen_rows(capture.w_options)  # (K, d): W_U[k] * g
        for layer, block in enumerate(unique_blocks(self.model, self.adapter)):
            module = get_module(block, self.attn_out)
            proj = self._projection(layer, block, module, self.adapter, rows, self.n_heads)
            ids = ([-1] if proj.bias is not None else []) + list(range(self.n_heads))
            if self.head_ids is not None and ids != self.head_ids:
                raise UnsupportedModel("--heads: blocks differ in whether W_O has a bias")
            self.head_ids = ids
            self.add(module.register_forward_hook(self._hook(proj)))

    @staticmethod
    def _projection(
        layer: int, block: Any, module: Any, adapter: Adapter, rows: torch.Tensor, n_heads: int
    ) -> _Projection:
        """M = rows W_O of one block's output projection ``module`` (times its frozen
        post-attention norm's gain for sandwich models), split by head, and the same rows times
        b_O; formed where W_O lives (weights offloaded by accelerate, ``--device-map``, are
        loaded for it)."""
        with onloaded(module):
            weight = module.weight.detach().float()
            w_o = weight.T if adapter.attn_out_transposed else weight  # (d, d_in)
            block_rows, post_eps = rows.to(w_o.device), None
            if adapter.attn_post_norm:  # o = frozen post-attention norm (methods §8)
                post = get_module(block, adapter.attn)
                block_rows = block_rows * norm_gain(post, adapter.norm).to(w_o.device)
                post_eps = norm_eps(post)
            d_in = w_o.shape[1]
            if d_in % n_heads:
                raise UnsupportedModel(
                    f"--heads: block {layer}'s output projection has {d_in} inputs, not a multiple "
                    f"of {n_heads} heads; extract without --heads."
                )
            m = (block_rows @ w_o).view(-1, n_heads, d_in // n_heads)
            b_o = getattr(module, "bias", None)
            bias = None if b_o is None else block_rows @ b_o.detach().float()
        return _Projection(layer, m, bias, post_eps)

    def _hook(self, proj: _Projection) -> Any:
        def hook(module: Any, args: tuple, output: Any) -> None:
            if self.capture is None or self.capture.paused:  # a block skipped (--skips)
                return
            a = args[0][:, -1, :].float()  # (B, d_in): the heads' outputs, head-major
            m = proj.m.to(a.device)  # a no-op unless --device-map moved the block
            per_head = torch.einsum("bhj,khj->bhk", a.view(a.shape[0], self.n_heads, -1), m)
            rms = None
            if proj.post_eps is not None:
                out = (output[0] if isinstance(output, tuple) else output)[:, -1, :].float()
                rms = torch.sqrt(out.pow(2).mean(dim=-1) + proj.post_eps)
            self._records.append((proj, per_head, rms))

        return hook

    def reset(self) -> None:
        self._records, self.heads = [], None

    def batch(self, ids: Sequence[int] | None, lengths: Sequence[int]) -> None:
        self._ids = ids

    def decomposed(self, batch: BatchDecomposition) -> None:
        """The heads of the pass just run, with the final scale of ``batch`` frozen (and each
        sandwich block's own post-norm scale): u_(b,h) = M_h a_h / scale(x) [/ rms_b]; stops
        the run where they do not sum to their attention components (a batch whose components
        do not sum to the model's logits is left to the decomposition's own check)."""
        attn = [c for c, info in enumerate(batch.components) if info.kind == "attn"]
        if len(attn) != len(self._records):
            raise DecompositionError(
                f"--heads: {len(self._records)} attention output projections ran for "
                f"{len(attn)} attention components"
            )
        inv_scale = 1.0 / batch.final_rms  # (B,)
        blocks = []
        for c, (proj, per_head, rms) in zip(attn, self._records, strict=True):
            if batch.components[c].layer != proj.layer:
                raise DecompositionError(
                    f"--heads: the output projection of block {proj.layer} ran for component "
                    f"{batch.components[c].name}"
                )
            scale = inv_scale if rms is None else inv_scale / rms.cpu()
            terms = per_head.cpu()
            if proj.bias is not None:
                terms = torch.cat([proj.bias.cpu().expand(terms.shape[0], 1, -1), terms], dim=1)
            blocks.append(terms * scale[:, None, None])
        self.heads = HeadDecomposition(attn, list(self.head_ids or []), torch.stack(blocks, dim=1))
        self._layers = [batch.components[c].layer for c in attn]
        sound = (
            bool(torch.isfinite(batch.logits).all()) and float(batch.sum_error.max()) <= self.tol
        )
        if sound:  # else the decomposition's own check (check_batch) names the component
            ids = list(self._ids) if self._ids is not None else list(range(len(inv_scale)))
            check_head_sums(self.heads, batch, ids, self.tol)

    def result(self) -> Sequence[HeadValues]:
        if self.heads is None:
            raise DecompositionError("--heads: no forward pass was decomposed")
        heads, layers = self.heads, self._layers
        return [HeadValues(heads.components, layers, heads.head_ids, r) for r in heads.logits]


def check_head_sums(
    heads: HeadDecomposition, batch: BatchDecomposition, ids: list[int], tol: float
) -> float:
    """The invariant of methods §8: the heads and bias of every attention component
    sum to its logits, within ``tol`` relative to max(1, sum_h |u_(b,h)[k]|); returns the worst
    relative error, or stops the run naming the instance and the block."""
    total = heads.logits.sum(dim=2)  # (B, A, K)
    spread = heads.logits.abs().sum(dim=2).amax(dim=-1).clamp(min=1.0)  # (B, A)
    error = (total - batch.logits[:, heads.components]).abs().amax(dim=-1) / spread
    if not bool(torch.isfinite(error).all()) or float(error.max()) > tol:
        bad = torch.where(torch.isfinite(error), error, torch.inf)
        row, col = divmod(int(bad.argmax()), bad.shape[1])
        name = batch.components[heads.components[col]].name
        raise DecompositionError(
            f"instance {ids[row]}: the heads of {name} sum to its logits only within "
            f"{float(bad[row, col]):.2e} (relative), above the tolerance {tol:.0e}; the "
            "adapter's head split does not match this model (layerdiv/extract/adapters.py)"
        )
    return float(error.max()) if error.numel() else 0.0
