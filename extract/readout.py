"""The model's own readout: its final norm and unembedding (and final logit soft-cap), found
once per model through the architecture adapter (``ModelRunner`` builds one and passes it to
every capture). The decomposition (``capture.py``, ``heads.py``) freezes its scale; the logit
lens (``lens.py``) and the future effects (``future.py``) apply it whole to any residual state;
the layer skips, the erasure and the integrated gradients of a choice task read the option
logits and probabilities (:meth:`Readout.option_logits`, :meth:`Readout.option_probs`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from layerdiv.errors import LayerdivError
from layerdiv.extract.adapters import Adapter, NormKind, final_softcap, get_module, norm_eps


class ReadoutError(LayerdivError, RuntimeError):
    """The model has no unembedding to read the residual stream out with."""


def onloaded(module: Any) -> Any:
    """Context in which ``module``'s weights are real tensors, also when accelerate keeps them
    offloaded on the CPU or disk between forward passes (``--device-map``)."""
    from accelerate.utils import align_module_device

    return align_module_device(module)


def norm_gain(norm: Any, kind: NormKind) -> torch.Tensor:
    """The gain g that a norm module multiplies its normalised input by, as a float32 copy: its
    weight, plus one for ``rms_plus_one`` (Gemma) norms."""
    with onloaded(norm):
        gain = norm.weight.detach().float().clone()
    return 1.0 + gain if kind == "rms_plus_one" else gain


class Readout:
    """Final norm + unembedding of one model (as tuned-lens's ``Unembed``)."""

    def __init__(self, model: Any, adapter: Adapter) -> None:
        self.adapter = adapter
        self.norm = get_module(model, adapter.final_norm)
        self.eps = norm_eps(self.norm)
        self.gain = norm_gain(self.norm, adapter.norm)
        """The final norm's gain g (float32)."""
        head = model.get_output_embeddings()
        if head is None:
            raise ReadoutError("the model has no output embedding (lm_head)")
        self.head = head
        self.softcap = final_softcap(model.config)

    def frozen_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Unembedding rows ``rows`` (K, d) (float32, e.g. W_U[options]) times the final norm's
        gain, centred over d for LayerNorm (centring is linear, methods §1): the logit
        share of a residual vector z with the final scale s frozen is ``frozen_rows · z / s``."""
        out = rows * self.gain.to(rows.device)
        if self.adapter.norm == "layer":
            out = out - out.mean(dim=-1, keepdim=True)
        return out

    @property
    def constant_bias(self) -> bool:
        """Whether the logits hold a constant ``bias`` component: a LayerNorm bias, or a bias of
        the unembedding."""
        norm_bias = self.adapter.norm == "layer" and getattr(self.norm, "bias", None) is not None
        return norm_bias or getattr(self.head, "bias", None) is not None

    def logits(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The model's full-vocabulary logits (float32) read from residual states ``x`` (..., d)
        exactly as from its last one: final norm, unembedding, soft-cap. With ``out`` (float32,
        (..., V)) they are written into it where the unembedding is a bias-free matrix of that
        dtype on x's device: a vocabulary-sized buffer reused from call to call instead of fresh
        memory paged in for each."""
        normed = self.norm(x)
        weight = getattr(self.head, "weight", None)
        if (
            out is not None
            and isinstance(weight, torch.Tensor)
            and getattr(self.head, "bias", None) is None
            and weight.dtype == normed.dtype == out.dtype
            and weight.device == normed.device == out.device
        ):
            z = torch.matmul(normed, weight.t(), out=out)
        else:
            z = self.head(normed).float()
        if self.softcap and z.requires_grad:  # autograd keeps tanh's output: not in place
            z = torch.tanh(z / self.softcap) * self.softcap
        elif self.softcap:
            z = z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z

    def token_probs(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(N,) float32 probabilities of ``tokens`` (N,) under the softmax of the full-vocabulary
        logits (:meth:`logits`) read from residual states ``x`` (N, d). Differentiable: where the
        unembedding is a bias-free matrix and ``x`` needs a gradient, the gradient w.r.t. the
        normed states is computed with the value (:class:`_TokenProb`), so that no
        vocabulary-sized tensor is kept for the backward pass."""
        normed = self.norm(x)
        weight = getattr(self.head, "weight", None)
        if (
            normed.requires_grad
            and isinstance(weight, torch.Tensor)
            and getattr(self.head, "bias", None) is None
        ):
            prob: torch.Tensor = _TokenProb.apply(normed, weight, tokens, self.softcap)
            return prob
        z = self.logits(x)
        return (z.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(z, dim=-1)).exp()

    def option_index(self, option_ids: Sequence[int]) -> torch.Tensor:
        """The option tokens ``option_ids`` as an index on the unembedding's device (the ``ids``
        of :meth:`option_logits`)."""
        return torch.tensor(list(option_ids), device=self.head.weight.device)

    def option_logits(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """(..., K) float32 option logits read from residual states ``x`` (..., d): final norm and
        unembedding at the option tokens ``ids``, before any final soft-cap (methods §1: the
        logits the decomposition splits, stored as ``model_logits``)."""
        return at_options(self.head(self.norm(x)), ids)

    def option_probs(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """(..., K) the option probabilities read from residual states ``x`` (..., d): the softmax
        over :meth:`option_logits`, the restricted vocabulary of methods §1, before any final
        soft-cap (the one rule of every measurement that reads them: §7, §13, §14)."""
        return torch.softmax(self.option_logits(x, ids), dim=-1)


class _TokenProb(torch.autograd.Function):
    """p = softmax(z)[x] per row, z = c tanh(n W^T / c) (c: the final soft-cap; none: z = n W^T),
    and its gradient dp/dn = p ((1 - t_x^2) W_x - sum_v s_v (1 - t_v^2) W_v) (s = softmax(z),
    t = tanh(n W^T / c); no cap: t = 0) made in the forward pass from one vocabulary-sized
    buffer, in place (the unembedding's two products, as autograd's, without its graph)."""

    @staticmethod
    def forward(
        ctx: Any,
        normed: torch.Tensor,
        weight: torch.Tensor,
        tokens: torch.Tensor,
        cap: float | None,
    ) -> torch.Tensor:
        z = torch.nn.functional.linear(normed, weight).float()
        t = None
        if cap:
            t = z.div(cap).tanh_()
            z = torch.mul(t, cap, out=z)
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        prob = (z.gather(-1, tokens[:, None]) - lse).exp_()
        slope = t.square_().neg_().add_(1) if t is not None else None  # 1 - t^2: dz/d(n W^T)
        s = z.sub_(lse).exp_()
        if slope is not None:
            s.mul_(slope)
        own = weight.index_select(0, tokens).float()
        if slope is not None:
            own = own * slope.gather(-1, tokens[:, None])
        mean = (s.to(weight.dtype) @ weight).float()
        ctx.save_for_backward(prob * (own - mean))
        ctx.dtype = normed.dtype
        return prob[:, 0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (slope,) = ctx.saved_tensors
        return (grad[:, None] * slope).to(ctx.dtype), None, None, None


def at_options(output: Any, ids: torch.Tensor) -> torch.Tensor:
    """(..., K) float32 the option logits in an unembedding's ``output`` (..., V) (a tensor or a
    tuple whose first item is one): its entries at the option tokens ``ids``, not soft-capped."""
    out = output[0] if isinstance(output, tuple) else output
    return out[..., ids.to(out.device)].float()
