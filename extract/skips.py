"""Layer skips (``extract --skips``, methods §7): the model's own option logits with one
decoder block replaced by the identity on every call, for every block.

The blocks before the first call of the skipped block would compute exactly what the full pass
already computed, so they do not run again: during the full pass every block call's input hidden
states are kept; in the pass that skips block b, the calls before b's first call return at once (the
last of them returns b's kept input), b's calls return their input, and only the calls after b
compute. The model's own code (masks, rotary embeddings, final norm) runs unchanged; the blocks'
forwards are patched for one pass and always restored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from layerdiv.errors import LayerdivError
from layerdiv.extract.adapters import Adapter, get_module
from layerdiv.extract.hooks import unique_blocks
from layerdiv.extract.readout import Readout


class SkipError(LayerdivError, ValueError):
    """The model's blocks cannot be bypassed one at a time."""


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class BlockSkipper:
    """Option logits of one batch with each decoder block skipped in turn (:meth:`skip_logits`),
    reusing the states kept by :meth:`recording` during the batch's full pass."""

    def __init__(self, model: Any, adapter: Adapter, option_ids: list[int]):
        self.model = model
        blocks = list(get_module(model, adapter.blocks))
        self.modules = unique_blocks(model, adapter)
        """Distinct block modules; index = the ``layer`` of the skips table and of components."""
        index = {id(m): i for i, m in enumerate(self.modules)}
        self.calls = [index[id(block)] for block in blocks]
        """Module index of every block call, in execution order."""
        self.head = Readout(model, adapter).head
        self.option_ids = torch.tensor(option_ids, device=self.head.weight.device)
        self._inputs: list[torch.Tensor] = []  # input hidden states of every call of the full pass
        self._tails: list[tuple | None] = []  # what a call returns besides the hidden states
        self._position = 0

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Keep every block call's input hidden states (references, no copies) and the structure
        of its output while the model runs its full pass inside this context."""
        self._inputs, self._tails = [], []

        def keep_input(module: Any, args: tuple, kwargs: dict) -> None:
            self._inputs.append(_hidden(args, kwargs))

        def keep_tail(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            self._tails.append(tuple(output[1:]) if isinstance(output, tuple) else None)

        handles = [
            h
            for m in self.modules
            for h in (
                m.register_forward_pre_hook(keep_input, with_kwargs=True),
                m.register_forward_hook(keep_tail, with_kwargs=True),
            )
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def skip_logits(self, run: Callable[[], None]) -> torch.Tensor:
        """(B, modules, K) float32 option logits (before any soft-cap, as ``model_logits``) with
        each block module skipped on every call; ``run`` repeats the recorded batch's forward."""
        if len(self._inputs) != len(self.calls):
            raise SkipError("no full pass was recorded for this batch")
        seen: list[torch.Tensor] = []

        def keep_logits(module: Any, args: tuple, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            seen.append(out[:, -1, self.option_ids].float())

        handle = self.head.register_forward_hook(keep_logits)
        try:
            for skipped in range(len(self.modules)):
                with self._patched(skipped):
                    run()
        finally:
            handle.remove()
        return torch.stack(seen, dim=1).cpu()

    @contextmanager
    def _patched(self, skipped: int) -> Iterator[None]:
        """Replace every block module's forward for one pass (see the module docstring)."""
        first = self.calls.index(skipped)
        saved = [m.__dict__.get("forward") for m in self.modules]
        self._position = 0

        def patch(module: Any, original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                position = self._position
                self._position += 1
                if position >= first and self.calls[position] != skipped:
                    return original(*args, **kwargs)
                # before the skipped block: the kept state; the skipped block: the identity
                hidden = self._inputs[first] if position == first - 1 else _hidden(args, kwargs)
                tail = self._tails[position]
                return hidden if tail is None else (hidden, *tail)

            return forward

        try:
            for module in self.modules:
                module.forward = patch(module, module.forward)
            yield
        finally:
            for module, forward in zip(self.modules, saved, strict=True):
                if forward is None:
                    del module.forward
                else:
                    module.forward = forward
