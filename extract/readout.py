"""The model's own readout: its final norm and unembedding (and final logit soft-cap), found
once through the architecture adapter. The decomposition (``capture.py``, ``heads.py``) freezes
its scale; the logit lens (``text.py``) applies it whole to any residual state; the layer skips
(``skips.py``) read the unembedding's output."""

from __future__ import annotations

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
        gain, centred over d for LayerNorm (centring is linear, METHODS.md section 1): the logit
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

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The model's full-vocabulary logits (float32) read from residual states ``x`` (..., d)
        exactly as from its last one: final norm, unembedding, soft-cap."""
        out = self.head(self.norm(x)).float()
        if self.softcap:
            out = self.softcap * torch.tanh(out / self.softcap)
        return out


def lens_stats(logp: torch.Tensor, logp_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p_l || p_L) and |top5(p_l) & top5(p_L)| / 5 over the last axis (METHODS.md section 9,
    logit lens) from the log-probabilities of a lens layer and of the model's output."""
    kl = (logp.exp() * (logp - logp_final)).sum(-1)
    top, top_final = logp.topk(5, dim=-1).indices, logp_final.topk(5, dim=-1).indices
    overlap = (top[..., :, None] == top_final[..., None, :]).any(-1).sum(-1) / 5.0
    return kl, overlap.to(kl.dtype)
