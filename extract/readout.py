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
        if self.softcap:
            z = z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z


LENS_SLICE = 2**21
"""Vocabulary entries (rows x V) per slice of the lens statistics where the caller names no row
count (:func:`lens_stats`'s ``rows``): each slice's temporaries stay a few MiB."""


def _slices(n_rows: int, vocab: int, rows: int | None = None) -> list[slice]:
    step = max(1, rows if rows is not None else LENS_SLICE // vocab)
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


def _scratch(z: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """One slice's buffer for the probabilities of logits ``z`` (rows, V), reused by every slice."""
    return z.new_empty(min(z.shape[0], _slices(z.shape[0], z.shape[1], rows)[0].stop), z.shape[1])


class LensReference:
    """The model's output distribution p_L, which every layer of the logit lens is compared with:
    its logits (V last), their log-sum-exp and its top five tokens."""

    def __init__(self, logits: torch.Tensor, rows: int | None = None) -> None:
        self.logits = logits.float().clone()
        flat = self.logits.reshape(-1, self.logits.shape[-1])
        top = top5(flat)
        buf = _scratch(flat, rows)
        lse = [
            _softmax(flat[r], buf[: len(flat[r])], top[r, :1])[1]
            for r in _slices(flat.shape[0], flat.shape[1], rows)
        ]
        self.lse = torch.cat(lse).view(*self.logits.shape[:-1], 1)
        self.top = top.view(*self.logits.shape[:-1], 5)


def lens_stats(
    logits: torch.Tensor, ref: LensReference, ids: torch.Tensor, rows: int | None = None
) -> torch.Tensor:
    """(..., 2 + K): KL(p_l || p_L), |top5(p_l) & top5(p_L)| / 5 and log p_l at ``ids`` (..., K)
    over the last axis (methods §9, logit lens) of a lens layer's float32 ``logits``
    (overwritten) against ``ref`` (broadcast over the leading axes), per slice of ``rows`` rows
    (default: :data:`LENS_SLICE` entries): a softmax, one difference and one batched dot product
    per row. Each slice's few operations are each one parallel pass over it: the fewer and larger
    the slices, the less their threads wait for each other (on a busy machine, most of the
    statistics' time)."""
    vocab = logits.shape[-1]
    lead = logits.shape[:-1]
    z = logits.reshape(-1, vocab)
    ref_z = ref.logits.expand_as(logits).reshape(-1, vocab)
    ref_lse = ref.lse.expand(*lead, 1).reshape(-1, 1)
    ref_top = ref.top.expand(*lead, 5).reshape(-1, 5)
    ids = ids.expand(*lead, ids.shape[-1]).reshape(z.shape[0], -1)
    out = torch.empty(z.shape[0], 2 + ids.shape[1], device=z.device)
    buf = _scratch(z, rows)
    for sl in _slices(z.shape[0], z.shape[1], rows):
        zr = z[sl]
        top = top5(zr)
        p, lse = _softmax(zr, buf[: len(zr)], top[:, :1])
        out[sl, 2:] = zr.gather(-1, ids[sl]) - lse  # log p_l(ids)
        # KL(p_l || p_L) = sum_v p_l (log p_l - log p_L) = sum_v p_l (z_l - z_L) - (lse_l - lse_L)
        # (sum_v p_l = 1), so that a shift of the logits cancels before any sum; the sum over v
        # as one batched (1, V) x (V, 1) product per row
        diff = zr.sub_(ref_z[sl])
        kl = torch.bmm(p[:, None, :], diff[:, :, None]).view(-1) - (lse - ref_lse[sl]).view(-1)
        out[sl, 0] = kl
        out[sl, 1] = (top[:, :, None] == ref_top[sl, None, :]).any(-1).sum(-1) / 5.0
    return out.view(*lead, -1)
