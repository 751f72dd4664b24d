"""Running text (task kind ``text``): per token and decoder block, the dot products of the block's
input h, what its attention adds (a) and what its MLP adds (m), from hooks on one forward pass
(methods §9), reduced on the device in float32, and the model's own next-token loss. The
measurements bound to it (``layerdiv.measurements.DecompositionCapture``: the lens, the future
effects) read the states it records (:class:`~layerdiv.extract.hooks.Recorder`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from layerdiv.errors import DecompositionError
from layerdiv.extract.adapters import Adapter
from layerdiv.extract.hooks import Recorder
from layerdiv.extract.readout import Readout
from layerdiv.schemas import component_names
from layerdiv.store.manifest import ComponentInfo
from layerdiv.store.tables import TOKEN_BLOCK_VALUES

LOSS_ROWS = 256
"""Positions per slice of the loss's full-vocabulary logits (256 x 50k float32: 50 MB)."""


PRODUCTS = TOKEN_BLOCK_VALUES[:6]
"""The dot products of the block input h, its attention's addition a and its MLP's m that
:data:`~layerdiv.store.tables.TOKEN_BLOCK_VALUES` starts with (``hh``, ``aa``, ..., ``am``)."""

_ROWS, _COLS = (tuple("ham".index(name[i]) for name in PRODUCTS) for i in (0, 1))
"""The row and the column index into (h, a, m) of each of :data:`PRODUCTS`."""

CHECKED = [i for i, name in enumerate(TOKEN_BLOCK_VALUES) if name != "dd_next"]
"""The indices of the values that must be finite (``dd_next`` is NaN at the last block)."""


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
        """(n_tokens, L, 9): the values of ``TOKEN_BLOCK_VALUES`` at the document's own
        positions (padding dropped)."""
        return self.dots[row, self.dots.shape[1] - n_tokens :].numpy()

    def document_loss(self, row: int, n_tokens: int) -> np.ndarray:
        """(n_tokens,): the loss at the document's own positions."""
        assert self.loss is not None
        return self.loss[row, self.loss.shape[1] - n_tokens :].numpy()


class TextCapture(Recorder):
    """Records every decoder block's input h and calls, its attention's and MLP's additions a
    and m (reduced as soon as both arrived), and the final norm's input h_L (the last residual
    state), float32; :meth:`decompose` after each pass. ``readout``: the model's."""

    def __init__(self, model: Any, adapter: Adapter, readout: Readout) -> None:
        super().__init__(model, adapter, ("calls", "inputs", "embed", "attn", "mlp", "final"))
        self.readout = readout
        self.bias = self.readout.constant_bias
        self.reset()

    def reset(self, input_ids: torch.Tensor | None = None) -> None:
        """Forget the last pass; ``input_ids`` (B, width) of the next one (the loss's)."""
        self.clear()
        self.input_ids = input_ids
        """The last pass's token ids (B, width)."""
        self._dots: list[torch.Tensor] = []  # (B, T, 6) per block
        self._d: list[torch.Tensor] = []  # a + m of the previous block only
        self._dd: list[torch.Tensor] = []  # d_l . d_(l+1)
        self._parts: dict[str, torch.Tensor] = {}

    def keep(self, site: str, layer: int, x: torch.Tensor) -> None:
        if site not in ("attn", "mlp"):
            super().keep(site, layer, x)
            return
        self._parts[site] = x
        if len(self._parts) == 2:  # both additions of the block: reduce it now
            self._block_done()

    def _block_done(self) -> None:
        h, a, m = self.inputs[-1], self._parts.pop("attn"), self._parts.pop("mlp")
        x = torch.stack([h, a, m], dim=-2)  # (B, T, 3, d): one batched matmul, every pair
        self._dots.append((x @ x.transpose(-1, -2))[..., _ROWS, _COLS])
        d = a + m
        if self._d:
            self._dd.append(torch.linalg.vecdot(self._d[0], d))
        self._d = [d]

    # results -----------------------------------------------------------------------------------
    def decompose(self, budget: int) -> TextBatch:
        """The per-token, per-block dot products of the last forward pass (``budget``: the
        padded tokens of a forward pass, for the bound measurements' readouts)."""
        if self.final is None or not self._dots:
            raise DecompositionError("no forward pass was captured")
        final, h_in = self.final, self.inputs
        blocks = len(self._dots)
        nan = torch.full_like(self._dots[0][..., 0], float("nan"))
        dd = torch.stack([*self._dd, nan], dim=-1)  # (B, T, L)
        h_final = torch.stack([(h * final).sum(-1) for h in h_in[:blocks]], dim=-1)
        h_embed = torch.stack([(h * h_in[0]).sum(-1) for h in h_in[:blocks]], dim=-1)
        dots = torch.cat(
            [torch.stack(self._dots, dim=2), dd[..., None], h_final[..., None], h_embed[..., None]],
            dim=-1,
        )
        assert dots.shape[-1] == len(TOKEN_BLOCK_VALUES)
        calls = self.components + ([("bias", -1)] if self.bias else [])
        names = component_names(calls)
        comps = [ComponentInfo(n, k, layer) for n, (k, layer) in zip(names, calls, strict=True)]
        return TextBatch(comps, dots.cpu(), budget)

    def loss(self) -> torch.Tensor:
        """(B, width) float32 on the CPU: the last pass's loss (:meth:`_loss`), read out with the
        hooks paused (a readout must not replace h_L: the final-norm hook)."""
        if self.final is None:
            raise DecompositionError("no forward pass was captured")
        with self.pausing():
            return self._loss(self.final).float().cpu()

    def _loss(self, final: torch.Tensor) -> torch.Tensor:
        """(B, width): -log p_L(token at p + 1), p_L the model's own output distribution read
        from h_L as its head reads it (methods §12's loss), in slices of
        :data:`LOSS_ROWS` positions; NaN at the last position."""
        if self.input_ids is None:
            raise DecompositionError("the loss needs the batch's input ids")
        x = final.to(self.dtype).flatten(0, 1)
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
        values = own[..., CHECKED]
        if not torch.isfinite(values).all():
            block = int((~torch.isfinite(values)).any(dim=(0, 2)).nonzero()[0])
            raise DecompositionError(
                f"task {task}, document {doc}: block {block} has a NaN or Inf dot product (try "
                "--dtype fp32)"
            )
