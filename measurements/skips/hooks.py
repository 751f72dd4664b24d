"""The hooks of ``extract --skips`` on a choice task (:mod:`layerdiv.measurements.skips`, methods
§7): the model's own option logits with one decoder block replaced by the identity on every call,
for every block.

The blocks before the first call of the skipped block would compute exactly what the full pass
already computed, so they do not run again: during the full pass every block call's arguments are
kept, and the pass that skips block b starts at b's first call with its kept input
(:class:`~layerdiv.extract.removal.UpdateRemoval`, the intervention the text future effects share),
b's calls add nothing at any position, and the calls after it compute with the arguments of their
clean calls; the model's own final norm and unembedding read the last position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerdiv.errors import LayerdivError
from layerdiv.extract.adapters import get_module, hidden_of
from layerdiv.extract.capture import BatchDecomposition, ComponentCapture
from layerdiv.extract.hooks import Recorder, unique_blocks
from layerdiv.extract.removal import UpdateRemoval
from layerdiv.measurements import Attachment


class SkipError(LayerdivError, ValueError):
    """The model's blocks cannot be bypassed one at a time."""


class SkipCapture(Recorder):
    """Records each block call's arguments (references, no copies) during a batch's full pass,
    bound to its :class:`ComponentCapture` (``layerdiv.measurements.DecompositionCapture``):
    after the pass, the option logits with each block skipped in turn, run with the
    decomposition capture (and every hook bound to it) paused, so that the skip passes are
    nobody's values but these, and this capture keeps no call of its own passes."""

    def __init__(self, ctx: Attachment) -> None:
        super().__init__(ctx.model, ctx.adapter, ("calls",))
        blocks = list(get_module(ctx.model, ctx.adapter.blocks))
        self.modules = unique_blocks(ctx.model, ctx.adapter)
        """Distinct block modules; index = the ``layer`` of the skips table and of components."""
        index = {id(m): i for i, m in enumerate(self.modules)}
        self.module_of = [index[id(block)] for block in blocks]
        """Module index of every block call, in execution order."""
        self.removal = UpdateRemoval(ctx.model, ctx.adapter)
        self.readout = ctx.readout
        self.option_ids = ctx.readout.option_index(ctx.option_ids)
        self.progress = ctx.progress
        self._logits: torch.Tensor | None = None

    def bind(self, capture: ComponentCapture) -> None:
        self.capture = capture

    def recording(self) -> bool:
        """In the full pass only (the decomposition capture bound and not paused)."""
        return self.capture is not None and not self.capture.paused

    def reset(self) -> None:
        self.clear()
        self._logits = None

    def decomposed(self, batch: BatchDecomposition) -> None:
        assert self.capture is not None  # bound before any pass
        with self.capture.pausing():  # also pauses the hooks bound to it
            self._logits = self.skip_logits()
        self.clear()  # the full pass's states are not kept beyond it

    def result(self) -> Sequence[torch.Tensor]:
        if self._logits is None:
            raise SkipError("--skips: no forward pass was decomposed")
        return list(self._logits)

    def skip_logits(self) -> torch.Tensor:
        """(B, modules, K) float32 option logits (before any soft-cap, as ``model_logits``) with
        each block module skipped on every call, from the full pass's recorded block calls."""
        if len(self.calls) != len(self.module_of):
            raise SkipError("no full pass was recorded for this batch")
        seen = []
        zero = torch.zeros(())  # keep nothing: the skipped calls add nothing anywhere
        for skipped in range(len(self.modules)):
            first = self.module_of.index(skipped)
            removed = [j for j, m in enumerate(self.module_of) if m == skipped]
            x = hidden_of(*self.calls[first])
            x = self.removal.last(x, self.calls, first, removed, "block", zero)
            seen.append(self.readout.option_logits(x[:, -1], self.option_ids))
            self.progress((skipped + 1) / len(self.modules))
        return torch.stack(seen, dim=1).cpu()
