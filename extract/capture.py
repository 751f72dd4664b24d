"""Forward hooks that keep the last prompt position of every residual component, and the exact
logit decomposition of methods §1 computed from them.

Prompts are left-padded, so the last position of every row is its last prompt token; hooks copy
only that position (B x d per component), never the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from layerdiv.errors import DecompositionError
from layerdiv.extract.adapters import Adapter
from layerdiv.extract.hooks import Recorder
from layerdiv.extract.readout import Readout, at_options, onloaded
from layerdiv.schemas import component_names
from layerdiv.store.manifest import ComponentInfo

SUM_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
"""Largest accepted relative decomposition error per dtype (methods §1 invariant)."""


@dataclass
class BatchDecomposition:
    """Per-instance, per-component results of one batch (all float32, on the CPU)."""

    components: list[ComponentInfo]
    """Components in execution order (the same for every batch of a model)."""
    logits: torch.Tensor
    """(B, L, K) u_c[k]: component c's contribution to option k's logit (methods §1, paper
    Eqs. 2-3)."""
    out_norm: torch.Tensor
    """(B, L) L2 norm of z_c (NaN for the bias component)."""
    prefix_rms: torch.Tensor
    """(B, L) scale statistic of the prefix r_c (rms, or std for LayerNorm)."""
    cos_residual: torch.Tensor
    """(B, L) cosine of z_c with the prefix r_(c-1) (NaN for c = 0 and for bias)."""
    cos_prev: torch.Tensor
    """(B, L) cosine of z_c with the previous output z_(c-1) (NaN for c = 0 and for bias)."""
    final_rms: torch.Tensor
    """(B,) scale statistic of the full residual x."""
    model_logits: torch.Tensor
    """(B, K) the model's own option logits (lm_head output, before any soft-cap)."""
    sum_error: torch.Tensor
    """(B,) max_k |sum_c u_c[k] - model_logits[k]| / max(1, max_k sum_c |u_c[k]|)."""
    measured: dict[str, Sequence[Any]] = field(default_factory=dict)
    """Each registered measurement's values (``layerdiv.measurements.Capture.result``), one per
    row, by name."""


class ComponentCapture(Recorder):
    """Records, at the last prompt position, every residual component (the embedding h_0, each
    attention's and MLP's addition) and the final norm's input x, and the model's own option
    logits (``readout``: the model's); :meth:`decompose` after each forward pass gives the
    batch's results. While :attr:`paused` (the passes of a capture bound to it) the hooks keep
    nothing."""

    def __init__(
        self,
        model: Any,
        adapter: Adapter,
        readout: Readout,
        option_ids: list[int],
    ):
        super().__init__(model, adapter, ("embed", "attn", "mlp", "final"))
        self.adapter = adapter
        self.readout = readout
        self.norm, head = self.readout.norm, self.readout.head
        with onloaded(head):  # weights offloaded by accelerate (--device-map) are loaded here
            ids = readout.option_index(option_ids)
            self.option_ids = ids
            self.w_options = head.weight.detach()[ids].to(torch.float32)  # (K, d) rows of W_U
            head_bias = getattr(head, "bias", None)
            self.head_bias = None if head_bias is None else head_bias.detach()[ids].float()
        with onloaded(self.norm):
            bias = getattr(self.norm, "bias", None)
            self.norm_bias = None if bias is None else bias.detach().float().clone()
        self.eps = self.readout.eps
        self._buffer: torch.Tensor | None = None  # (slots, rows, d) float32, reused every pass
        self._head: torch.Tensor | None = None
        self.add(head.register_forward_hook(self._head_hook))

    # what is kept ------------------------------------------------------------------------------
    def select(self, site: str, x: torch.Tensor) -> torch.Tensor:
        """The last position (B, d) (of the final norm's input: a float32 copy)."""
        last = x[:, -1, :]
        return last.to(torch.float32, copy=True) if site == "final" else last

    def keep(self, site: str, layer: int, x: torch.Tensor) -> None:
        """Copy a component's last position into the next slot of one preallocated buffer (many
        small long-lived copies between large activations fragment the heap)."""
        if site == "final":
            self.final = x
            return
        rows, slot, buf = x.shape[0], len(self.components) - 1, self._buffer
        if buf is None or rows > buf.shape[1] or slot >= buf.shape[0]:
            slots = max(64, 2 * slot) if buf is None or slot >= buf.shape[0] else buf.shape[0]
            width = rows if buf is None else max(rows, buf.shape[1])
            grown = x.new_empty((slots, width, x.shape[-1]), dtype=torch.float32)
            if buf is not None and slot:  # more calls than slots within one pass: keep them
                grown[:slot, :rows] = buf[:slot, :rows]
            self._buffer = buf = grown
        buf[slot, :rows].copy_(x)

    def _head_hook(self, module: Any, args: tuple, output: Any) -> None:
        if self.recording():
            self._head = at_options(output, self.option_ids)[:, -1]

    def reset(self) -> None:
        self.clear()
        self._head = None

    # decomposition -----------------------------------------------------------------------------
    def component_infos(self) -> list[ComponentInfo]:
        """The components of the last forward pass, in execution order."""
        calls = self.components + ([("bias", -1)] if self._has_bias() else [])
        names = component_names(calls)
        return [
            ComponentInfo(n, kind, layer) for n, (kind, layer) in zip(names, calls, strict=True)
        ]

    def _has_bias(self) -> bool:
        return self.readout.constant_bias

    def outputs(self) -> torch.Tensor:
        """(B, L, d) the component outputs z_c of the last forward pass at the last prompt token,
        in execution order (without the bias component), on the device of the first."""
        if self.final is None or self._head is None or self._buffer is None:
            raise DecompositionError("no forward pass was captured")
        return self._buffer[: len(self.components), : self.final.shape[0]].transpose(0, 1)

    def final_input(self) -> torch.Tensor:
        """(B, d) float32: the full residual x (the final norm's input) of the last forward pass
        at the last prompt token."""
        if self.final is None:
            raise DecompositionError("no forward pass was captured")
        return self.final

    def decompose(self) -> BatchDecomposition:
        """Split the last forward pass's option logits into its components (methods §1)."""
        z = self.outputs()  # (B, L, d)
        assert self.final is not None and self._head is not None  # checked by outputs()
        # Everything kept is gathered on the device of the first component (a model spread over
        # several devices by --device-map runs its blocks on different ones).
        dev = z.device
        x, head, w_options = self.final.to(dev), self._head.to(dev), self.w_options.to(dev)
        prefix = torch.cumsum(z, dim=1)  # r_c = z_0 + ... + z_c
        scale_x, prefix_rms, z_scaled = self._scales(z, x, prefix)
        s = self.readout.gain.to(dev) / scale_x[:, None]  # (B, d)
        logits = torch.einsum("bld,bd,kd->blk", z_scaled, s, w_options)
        out_norm = z.norm(dim=-1)
        cos = torch.full_like(out_norm, float("nan"))
        cos[:, 1:] = torch.nn.functional.cosine_similarity(z[:, 1:], prefix[:, :-1], dim=-1)
        cos_prev = torch.full_like(out_norm, float("nan"))  # methods §7
        cos_prev[:, 1:] = torch.nn.functional.cosine_similarity(z[:, 1:], z[:, :-1], dim=-1)
        if self._has_bias():
            logits = torch.cat([logits, self._bias_logits(w_options, z.shape[0])], dim=1)
            nan = torch.full((z.shape[0], 1), float("nan"), device=z.device)
            out_norm = torch.cat([out_norm, nan], dim=1)
            cos = torch.cat([cos, nan], dim=1)
            cos_prev = torch.cat([cos_prev, nan], dim=1)
            prefix_rms = torch.cat([prefix_rms, scale_x[:, None]], dim=1)
        total = logits.sum(dim=1)
        spread = logits.abs().sum(dim=1).amax(dim=-1).clamp(min=1.0)
        sum_error = (total - head).abs().amax(dim=-1) / spread
        return BatchDecomposition(
            components=self.component_infos(),
            logits=logits.cpu(),
            out_norm=out_norm.cpu(),
            prefix_rms=prefix_rms.cpu(),
            cos_residual=cos.cpu(),
            cos_prev=cos_prev.cpu(),
            final_rms=scale_x.cpu(),
            model_logits=head.cpu(),
            sum_error=sum_error.cpu(),
        )

    def _scales(
        self, z: torch.Tensor, x: torch.Tensor, prefix: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scale of x, scale of every prefix, the outputs as the frozen norm sees them)."""
        if self.adapter.norm == "layer":
            # LayerNorm: centering is linear, so u_c = W_U (g * (z_c - mean z_c) / std(x)).
            scale_x = torch.sqrt(x.var(dim=-1, unbiased=False) + self.eps)
            prefix_rms = torch.sqrt(prefix.var(dim=-1, unbiased=False) + self.eps)
            return scale_x, prefix_rms, z - z.mean(dim=-1, keepdim=True)
        # RMSNorm: u_c = W_U (s * z_c) with s = g / rms(x) frozen (methods §1, paper Eqs. 2-3).
        scale_x = torch.sqrt(x.pow(2).mean(dim=-1) + self.eps)
        prefix_rms = torch.sqrt(prefix.pow(2).mean(dim=-1) + self.eps)
        return scale_x, prefix_rms, z

    def _bias_logits(self, w_options: torch.Tensor, rows: int) -> torch.Tensor:
        """(B, 1, K) the constant component: the norm bias b through W_U, plus any lm_head
        bias."""
        dev = w_options.device
        const = torch.zeros(len(self.option_ids), device=dev)
        if self.adapter.norm == "layer" and self.norm_bias is not None:
            const = const + w_options @ self.norm_bias.to(dev)
        if self.head_bias is not None:
            const = const + self.head_bias.to(dev)
        return const.expand(rows, 1, -1)


def check_batch(dec: BatchDecomposition, ids: list[int], task: str, tol: float) -> None:
    """Stop on NaN/Inf or a decomposition error above ``tol``, naming instance and component."""
    # A NaN in one component output spreads to every logit through the norm scale: name the
    # first component whose output is not finite, else the first with a non-finite logit.
    real = torch.tensor([c.kind != "bias" for c in dec.components])
    bad_z = ~torch.isfinite(dec.out_norm) & real
    bad_u = ~torch.isfinite(dec.logits).all(dim=-1)
    if (bad_z | bad_u).any():
        row = int((bad_z | bad_u).any(dim=1).nonzero()[0])
        comp = int((bad_z[row] if bad_z[row].any() else bad_u[row]).nonzero()[0])
        raise DecompositionError(
            f"task {task}, instance {ids[row]}: component {dec.components[comp].name} has a "
            "NaN or Inf logit (try --dtype fp32)"
        )
    worst = int(dec.sum_error.argmax())
    if not float(dec.sum_error[worst]) <= tol:
        raise DecompositionError(
            f"task {task}, instance {ids[worst]}: components sum to the model's option logits "
            f"only within {float(dec.sum_error[worst]):.2e} (relative), above the tolerance "
            f"{tol:.0e}; the architecture adapter does not decompose this model exactly"
        )
