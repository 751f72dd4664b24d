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


LENS_SLICE = 2**21
"""Vocabulary entries (rows x V) per slice of the lens statistics: each slice's temporaries stay
a few MiB, reused from one slice to the next instead of paged in for every layer."""


def _slices(n_rows: int, vocab: int) -> list[slice]:
    step = max(1, LENS_SLICE // vocab)
    return [slice(a, a + step) for a in range(0, n_rows, step)]


def _normalize(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn logits ``z`` (rows, V) into log-probabilities in place; exp(z - max) and its row sums
    (the same operations for every lens layer and the reference, so that p_L against itself is
    exactly zero)."""
    top = z.amax(-1, keepdim=True)
    e = (z - top).exp_()
    s = e.sum(-1, keepdim=True)
    z.sub_(top + s.log())
    return e, s


class LensReference:
    """The model's output distribution p_L, which every layer of the logit lens is compared with:
    its log-probabilities (V last) and top five tokens."""

    def __init__(self, logits: torch.Tensor) -> None:
        logp = logits.float().clone()
        flat = logp.reshape(-1, logp.shape[-1])
        for rows in _slices(flat.shape[0], flat.shape[1]):
            _normalize(flat[rows])
        self.logp = logp
        self.top = logp.topk(5, dim=-1).indices


def lens_stats(logits: torch.Tensor, ref: LensReference, ids: torch.Tensor) -> torch.Tensor:
    """(..., 2 + K): KL(p_l || p_L), |top5(p_l) & top5(p_L)| / 5 and log p_l at ``ids`` (..., K)
    over the last axis (METHODS.md section 9, logit lens) of a lens layer's float32 ``logits``
    (overwritten) against ``ref`` (broadcast over the leading axes); row slices of
    :data:`LENS_SLICE` entries, KL as one batched dot product per row."""
    vocab = logits.shape[-1]
    z = logits.reshape(-1, vocab)
    ref_logp = ref.logp.expand_as(logits).reshape(-1, vocab)
    ref_top = ref.top.expand(*logits.shape[:-1], 5).reshape(-1, 5)
    ids = ids.expand(*logits.shape[:-1], ids.shape[-1]).reshape(z.shape[0], -1)
    out = torch.empty(z.shape[0], 2 + ids.shape[1], device=z.device)
    for rows in _slices(*z.shape):
        zr = z[rows]
        top = zr.topk(5, dim=-1).indices
        e, s = _normalize(zr)
        out[rows, 2:] = zr.gather(-1, ids[rows])
        zr.sub_(ref_logp[rows])  # log p_l - log p_L
        out[rows, 0] = torch.bmm(e[:, None], zr[:, :, None]).view(-1) / s.view(-1)
        out[rows, 1] = (top[:, :, None] == ref_top[rows, None, :]).any(-1).sum(-1) / 5.0
    return out.view(*logits.shape[:-1], -1)
