"""Running text (task kind ``text``): per token and decoder block, the dot products of the block's
input h, what its attention adds (a) and what its MLP adds (m), from hooks on one forward pass
(methods §9), reduced on the device in float32; with ``--lens``, the logit lens of every
block input against the model's own output distribution."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from layerdiv.extract.adapters import Adapter, get_module
from layerdiv.extract.capture import DecompositionError
from layerdiv.extract.future import FutureRows
from layerdiv.extract.hooks import Hooks, unique_blocks
from layerdiv.extract.lens import Lens, LensReference, lens_stats
from layerdiv.extract.readout import Readout
from layerdiv.measurements.lens import LENS_VALUES
from layerdiv.schemas import component_names
from layerdiv.store.manifest import ComponentInfo
from layerdiv.store.tables import TOKEN_BLOCK_VALUES

LOSS_ROWS = 256
"""Positions per slice of the loss's full-vocabulary logits (256 x 50k float32: 50 MB)."""

CE = LENS_VALUES.index("ce")
"""The column of the cross-entropy in the lens values (after :data:`~layerdiv.extract.lens.STATS`,
the log-probability :func:`~layerdiv.extract.lens.lens_stats` gives of the next token)."""

_PAIRS = ((0, 1, 2, 0, 0, 1), (0, 1, 2, 1, 2, 2))
"""(h, a, m) row and column indices of ``hh``, ``aa``, ``mm``, ``ha``, ``hm``, ``am``."""


@dataclass
class TextBatch:
    """What one forward pass over a left-padded batch of documents gives."""

    components: list[ComponentInfo]
    """embed, attn.<i>, mlp.<i> (and bias) in execution order, as a choice partition lists them."""
    dots: torch.Tensor
    """(B, width, L, 9) float32 on the CPU: per row, position and block the values of
    ``layerdiv.store.tables.TOKEN_BLOCK_VALUES`` (``dd_next`` NaN at the last block); a
    document of T tokens is the last T positions of its row."""
    lens: torch.Tensor | None = None
    """With ``--lens``: (B, width, L + 1, 5) float32, per layer l = 0..L the logit lens's
    ``layerdiv.measurements.lens.LENS_VALUES`` (ce NaN at the row's last position)."""
    future: list[FutureRows] | None = None
    """With ``--skips``: per row, its document's future effects."""
    loss: torch.Tensor | None = None
    """(B, width) float32: the model's own next-token cross-entropy (NaN at the last position)."""
    measured: dict[str, Sequence[Any]] = field(default_factory=dict)
    """Each registered measurement's values (``layerdiv.measurements.Capture.result``), one per
    row, by name."""

    def document(self, row: int, n_tokens: int) -> np.ndarray:
        """(n_tokens, L, 8): the values at the document's own positions (padding dropped)."""
        return self.dots[row, self.dots.shape[1] - n_tokens :].numpy()

    def document_loss(self, row: int, n_tokens: int) -> np.ndarray:
        """(n_tokens,): the loss at the document's own positions."""
        assert self.loss is not None
        return self.loss[row, self.loss.shape[1] - n_tokens :].numpy()

    def document_lens(self, row: int, n_tokens: int) -> np.ndarray:
        """(n_tokens, L + 1, 5): the lens values at the document's own positions."""
        assert self.lens is not None
        return self.lens[row, self.lens.shape[1] - n_tokens :].numpy()


class TextCapture(Hooks):
    """Hooks on every decoder block (its input h, its attention's and MLP's additions a and m)
    and on the final norm (the last residual state h_L); :meth:`decompose` after each pass.
    ``readout``: the model's; ``lens``: the logit lens to take (methods §9), or None."""

    def __init__(
        self, model: Any, adapter: Adapter, readout: Readout, lens: Lens | None = None
    ) -> None:
        super().__init__()
        self.lens = lens
        self.readout = readout
        self.bias = self.readout.constant_bias
        self.add(self.readout.norm.register_forward_pre_hook(self._final_hook))
        for i, block in enumerate(unique_blocks(model, adapter)):
            self.add(block.register_forward_pre_hook(self._input_hook, with_kwargs=True))
            for kind in ("attn", "mlp"):
                module = get_module(block, getattr(adapter, kind))
                self.add(module.register_forward_hook(self._addition_hook(kind, i)))
        self.reset()

    def reset(self, input_ids: torch.Tensor | None = None) -> None:
        """Forget the last pass; ``input_ids`` (B, width) of the next one (the lens's ce)."""
        self._ids = input_ids
        self.block_args: list[tuple[tuple, dict]] = []  # every block call's arguments
        self._dtype = torch.float32
        self._h: list[torch.Tensor] = []  # block inputs, float32
        self._dots: list[torch.Tensor] = []  # (B, T, 6) per block
        self._d: list[torch.Tensor] = []  # a + m of the previous block only
        self._dd: list[torch.Tensor] = []  # d_l . d_(l+1)
        self._parts: dict[str, torch.Tensor] = {}
        self._calls: list[tuple[str, int]] = []
        self._final: torch.Tensor | None = None

    # hooks -------------------------------------------------------------------------------------
    def _input_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.paused:
            return
        h = args[0] if args else kwargs["hidden_states"]
        if not self._calls:
            self._calls.append(("embed", -1))
        self._dtype = h.dtype
        self.block_args.append((args, kwargs))
        self._h.append(h.to(torch.float32))

    def _addition_hook(self, kind: str, layer: int) -> Any:
        def hook(module: Any, args: tuple, output: Any) -> None:
            if self.paused:
                return
            out = output[0] if isinstance(output, tuple) else output
            self._parts[kind] = out.to(torch.float32)
            self._calls.append((kind, layer))
            if len(self._parts) == 2:  # both additions of the block: reduce it now
                self._block_done()

        return hook

    def _block_done(self) -> None:
        h, a, m = self._h[-1], self._parts.pop("attn"), self._parts.pop("mlp")
        x = torch.stack([h, a, m], dim=-2)  # (B, T, 3, d): one batched matmul, every pair
        self._dots.append((x @ x.transpose(-1, -2))[..., _PAIRS[0], _PAIRS[1]])
        d = a + m
        if self._d:
            self._dd.append(torch.linalg.vecdot(self._d[0], d))
        self._d = [d]

    def _final_hook(self, module: Any, args: tuple) -> None:
        if not self.paused:
            self._final = args[0].to(torch.float32)

    # results -----------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The model's residual-stream dtype in the last pass."""
        return self._dtype

    def states(self) -> list[torch.Tensor]:
        """The last pass's block inputs h_0..h_(L-1) and last residual state h_L (float32)."""
        if self._final is None:
            raise DecompositionError("no forward pass was captured")
        return [*self._h, self._final]

    def decompose(self, budget: int | None = None) -> TextBatch:
        """The per-token, per-block dot products of the last forward pass; with the lens, its
        readouts stacked over as many layers as ``budget`` rows hold (the padded tokens of a
        forward pass; None: one layer at a time)."""
        if self._final is None or not self._dots:
            raise DecompositionError("no forward pass was captured")
        final = self._final
        blocks = len(self._dots)
        nan = torch.full_like(self._dots[0][..., 0], float("nan"))
        dd = torch.stack([*self._dd, nan], dim=-1)  # (B, T, L)
        h_final = torch.stack([(h * final).sum(-1) for h in self._h[:blocks]], dim=-1)
        h_embed = torch.stack([(h * self._h[0]).sum(-1) for h in self._h[:blocks]], dim=-1)
        dots = torch.cat(
            [torch.stack(self._dots, dim=2), dd[..., None], h_final[..., None], h_embed[..., None]],
            dim=-1,
        )
        assert dots.shape[-1] == len(TOKEN_BLOCK_VALUES)
        calls = self._calls + ([("bias", -1)] if self.bias else [])
        names = component_names(calls)
        comps = [ComponentInfo(n, k, layer) for n, (k, layer) in zip(names, calls, strict=True)]
        with self.pausing():  # the lens's readouts must not replace h_L (the final-norm hook)
            lens = None if self.lens is None else self._lens(self.lens, final, budget)
            loss = self._loss(final) if lens is None else lens[:, :, -1, CE]  # the lens's layer L
        return TextBatch(
            comps, dots.cpu(), None if lens is None else lens.cpu(), loss=loss.float().cpu()
        )

    def _loss(self, final: torch.Tensor) -> torch.Tensor:
        """(B, width): -log p_L(token at p + 1), p_L the model's own output distribution read
        from h_L as its head reads it (methods §12's loss), in slices of
        :data:`LOSS_ROWS` positions; NaN at the last position."""
        if self._ids is None:
            raise DecompositionError("the loss needs the batch's input ids")
        x = final.to(self._dtype).flatten(0, 1)
        nxt = self._ids.roll(-1, dims=1).flatten().to(x.device)
        loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for a in range(0, x.shape[0], LOSS_ROWS):
            z = self.readout.logits(x[a : a + LOSS_ROWS])
            gold = z.gather(-1, nxt[a : a + LOSS_ROWS, None])[:, 0]
            loss[a : a + LOSS_ROWS] = torch.logsumexp(z, dim=-1) - gold
        loss = loss.view(final.shape[:2])
        loss[:, -1] = float("nan")  # no next token
        return loss

    def _lens(self, lens: Lens, final: torch.Tensor, budget: int | None) -> torch.Tensor:
        """(B, width, L + 1, 5): the ``LENS_VALUES`` of p_l, ``lens``'s distribution of every
        block input h_l, and (layer L) of the model's own output p_L (methods §9, §16). The
        layers' states are read out in groups, as many layers' rows stacked into one matmul as
        ``budget`` rows allow (at least one layer), into one reused buffer."""
        if self._ids is None:
            raise DecompositionError("the lens needs the batch's input ids")
        rows = final[..., 0].numel()
        group = max(1, (budget or rows) // rows)  # layers per readout matmul
        logits = self.readout.logits(final.to(self._dtype))
        ref = LensReference(logits)
        nxt = self._ids.roll(-1, dims=1)[..., None].to(logits.device)  # the next token
        # layer L (the model's own output) first: its logits' memory is then the readout buffer
        # of every group of one layer
        out = [self._lens_layer(logits, ref, nxt)]
        buf = logits[None] if group == 1 else logits.new_empty(group, *logits.shape)
        for start in range(0, len(self._h), group):
            xs = torch.stack([h.to(self._dtype) for h in self._h[start : start + group]])
            stacked = lens.logits(xs, self.block_args[-1], out=buf[: len(xs)])
            out += [self._lens_layer(z, ref, nxt) for z in stacked]
        return torch.stack([*out[1:], out[0]], dim=2)

    @staticmethod
    def _lens_layer(logits: torch.Tensor, ref: LensReference, nxt: torch.Tensor) -> torch.Tensor:
        """(B, width, 5): one layer's ``LENS_VALUES`` from its ``logits`` (overwritten)."""
        stats = lens_stats(logits, ref, nxt)
        stats[..., CE].neg_()  # ce = -log p_l(next token)
        stats[:, -1, CE] = float("nan")  # none after the last position
        return stats


def check_text_batch(batch: TextBatch, ids: list[int], n_tokens: list[int], task: str) -> None:
    """Stop on a NaN or Inf at a document's own positions, naming the document and block."""
    for row, (doc, n) in enumerate(zip(ids, n_tokens, strict=True)):
        own = batch.dots[row, batch.dots.shape[1] - n :]
        values = torch.cat([own[..., :6], own[..., 7:]], dim=-1)  # dd_next is NaN at the end
        if not torch.isfinite(values).all():
            block = int((~torch.isfinite(values)).any(dim=(0, 2)).nonzero()[0])
            raise DecompositionError(
                f"task {task}, document {doc}: block {block} has a NaN or Inf dot product (try "
                "--dtype fp32)"
            )
