"""Layer skips (``extract --skips``, methods §7): the model's own option logits with one
decoder block replaced by the identity on every call, for every block.

The blocks before the first call of the skipped block would compute exactly what the full pass
already computed, so they do not run again: during the full pass every block call's arguments are
kept, and the pass that skips block b starts at b's first call with its kept input
(:class:`~layerdiv.extract.removal.UpdateRemoval`, the intervention the text future effects share),
b's calls add nothing at any position, and the calls after it compute with the arguments of their
clean calls; the model's own final norm and unembedding read the last position.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from layerdiv.errors import LayerdivError
from layerdiv.extract.adapters import Adapter, get_module
from layerdiv.extract.hooks import unique_blocks
from layerdiv.extract.readout import Readout
from layerdiv.extract.removal import Call, UpdateRemoval, hidden_of


class SkipError(LayerdivError, ValueError):
    """The model's blocks cannot be bypassed one at a time."""


class BlockSkipper:
    """Option logits of one batch with each decoder block skipped in turn (:meth:`skip_logits`),
    reusing the block calls kept by :meth:`recording` during the batch's full pass."""

    def __init__(self, model: Any, adapter: Adapter, option_ids: list[int]):
        blocks = list(get_module(model, adapter.blocks))
        self.modules = unique_blocks(model, adapter)
        """Distinct block modules; index = the ``layer`` of the skips table and of components."""
        index = {id(m): i for i, m in enumerate(self.modules)}
        self.calls = [index[id(block)] for block in blocks]
        """Module index of every block call, in execution order."""
        self.removal = UpdateRemoval(model, adapter)
        readout = Readout(model, adapter)
        self.norm, self.head = readout.norm, readout.head
        self.option_ids = torch.tensor(option_ids, device=self.head.weight.device)
        self._calls: list[Call] = []  # every block call's arguments in the full pass

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Keep every block call's arguments (references, no copies) while the model runs its
        full pass inside this context."""
        self._calls = []

        def keep(module: Any, args: tuple, kwargs: dict) -> None:
            self._calls.append((args, kwargs))

        handles = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in self.modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def skip_logits(self) -> torch.Tensor:
        """(B, modules, K) float32 option logits (before any soft-cap, as ``model_logits``) with
        each block module skipped on every call, from the recorded batch's block calls."""
        if len(self._calls) != len(self.calls):
            raise SkipError("no full pass was recorded for this batch")
        seen = []
        zero = torch.zeros(())  # keep nothing: the skipped calls add nothing anywhere
        for skipped in range(len(self.modules)):
            first = self.calls.index(skipped)
            removed = [j for j, m in enumerate(self.calls) if m == skipped]
            x = hidden_of(*self._calls[first])
            x = self.removal.last(x, self._calls, first, removed, "block", zero)
            out = self.head(self.norm(x)[:, -1:])  # normed as the model does: every position
            out = out[0] if isinstance(out, tuple) else out
            seen.append(out[:, -1, self.option_ids].float())
        return torch.stack(seen, dim=1).cpu()
