"""Running text (task kind ``text``): per token and decoder block, the dot products of the block's
input h, what its attention adds (a) and what its MLP adds (m), from hooks on one forward pass
(methods §9), reduced on the device in float32, and the model's own next-token loss. The
measurements bound to it (``layerdiv.measurements.DecompositionCapture``: the lens, the future
effects) read the states it keeps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from layerdiv.extract.adapters import Adapter, get_module
from layerdiv.extract.capture import DecompositionError
from layerdiv.extract.hooks import Hooks, unique_blocks
from layerdiv.extract.readout import Readout
from layerdiv.schemas import component_names
from layerdiv.store.manifest import ComponentInfo
from layerdiv.store.tables import TOKEN_BLOCK_VALUES

LOSS_ROWS = 256
"""Positions per slice of the loss's full-vocabulary logits (256 x 50k float32: 50 MB)."""


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
    budget: int
    """Padded tokens of a forward pass the runner's batches hold (the rows a readout of the
    bound measurements may stack)."""
    loss: torch.Tensor | None = None
    """(B, width) float32: the model's own next-token cross-entropy (NaN at the last position;
    set by a bound measurement that reads h_L out anyway, the lens, else by
    :meth:`TextCapture.loss`)."""
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


class TextCapture(Hooks):
    """Hooks on every decoder block (its input h, its attention's and MLP's additions a and m)
    and on the final norm (the last residual state h_L); :meth:`decompose` after each pass.
    ``readout``: the model's."""

    def __init__(self, model: Any, adapter: Adapter, readout: Readout) -> None:
        super().__init__()
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
        """Forget the last pass; ``input_ids`` (B, width) of the next one (the loss's)."""
        self.input_ids = input_ids
        """The last pass's token ids (B, width)."""
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

    def decompose(self, budget: int) -> TextBatch:
        """The per-token, per-block dot products of the last forward pass (``budget``: the
        padded tokens of a forward pass, for the bound measurements' readouts)."""
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
        return TextBatch(comps, dots.cpu(), budget)

    def loss(self) -> torch.Tensor:
        """(B, width) float32 on the CPU: the last pass's loss (:meth:`_loss`), read out with the
        hooks paused (a readout must not replace h_L: the final-norm hook)."""
        if self._final is None:
            raise DecompositionError("no forward pass was captured")
        with self.pausing():
            return self._loss(self._final).float().cpu()

    def _loss(self, final: torch.Tensor) -> torch.Tensor:
        """(B, width): -log p_L(token at p + 1), p_L the model's own output distribution read
        from h_L as its head reads it (methods §12's loss), in slices of
        :data:`LOSS_ROWS` positions; NaN at the last position."""
        if self.input_ids is None:
            raise DecompositionError("the loss needs the batch's input ids")
        x = final.to(self._dtype).flatten(0, 1)
        nxt = self.input_ids.roll(-1, dims=1).flatten().to(x.device)
        loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for a in range(0, x.shape[0], LOSS_ROWS):
            z = self.readout.logits(x[a : a + LOSS_ROWS])
            gold = z.gather(-1, nxt[a : a + LOSS_ROWS, None])[:, 0]
            loss[a : a + LOSS_ROWS] = torch.logsumexp(z, dim=-1) - gold
        loss = loss.view(final.shape[:2])
        loss[:, -1] = float("nan")  # no next token
        return loss


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
