"""One intervention shared by the choice skips (methods §7) and the text future effects (methods
§9, §10): remove block l's update (or only its attention's or MLP's addition) at positions P and
run the model on.

The blocks before l are not run again: the run starts from block l's input kept from the clean
pass, and every block call runs with the arguments of its own clean call (mask, positions,
rotary embeddings), so the model's own block code computes every update. The removal multiplies
the additions of the removed calls by ``keep`` (0 at the positions P, 1 elsewhere; a scalar 0
removes them everywhere: the block is the identity). In the local variant (methods §10) no block
is patched: every block after l reads the clean residual stream minus block l's clean update at
P (``override``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from layerdiv.extract.adapters import Adapter, get_module
from layerdiv.extract.hooks import Call

SUBLAYER_PARTS = {"block": ("attn", "mlp"), "attn": ("attn",), "mlp": ("mlp",)}
"""The sublayers whose additions a removal of each kind multiplies by ``keep``."""


class UpdateRemoval:
    """The decoder block calls of one model (a shared block once per call) and their attention
    and MLP modules; :meth:`run_on` runs the intervention."""

    def __init__(self, model: Any, adapter: Adapter) -> None:
        self.blocks = list(get_module(model, adapter.blocks))
        """Block calls in execution order."""
        self.parts = {
            kind: [get_module(b, getattr(adapter, kind)) for b in self.blocks]
            for kind in ("attn", "mlp")
        }
        self._keep: torch.Tensor | None = None

    @contextmanager
    def _removing(self, call: int, sublayer: str) -> Iterator[None]:
        """Multiply the additions of block call ``call`` named by ``sublayer`` by ``_keep``."""

        def hook(module: Any, args: tuple, output: Any) -> Any:
            assert self._keep is not None
            if isinstance(output, tuple):
                return (output[0] * self._keep.to(output[0].dtype), *output[1:])
            return output * self._keep.to(output.dtype)

        handles = [
            self.parts[k][call].register_forward_hook(hook) for k in SUBLAYER_PARTS[sublayer]
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def run_on(
        self,
        x: torch.Tensor,
        calls: Sequence[Call],
        first: int,
        removed: Sequence[int] = (),
        sublayer: str = "block",
        keep: torch.Tensor | None = None,
        override: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """From block call ``first`` with input ``x``, run every later block call with the
        arguments of its clean call (``calls``); the additions named by ``sublayer`` of the calls
        ``removed`` are multiplied by ``keep``. Yields (j, block j's input, its output); the next
        call reads that output, or ``override(j, output)`` where given (local effects)."""
        self._keep = keep
        try:
            for j in range(first, len(self.blocks)):
                args, kwargs = calls[j]
                if args:
                    args = (x, *args[1:])
                else:
                    kwargs = {**kwargs, "hidden_states": x}
                if j in removed:
                    with self._removing(j, sublayer):
                        y = self.blocks[j](*args, **kwargs)
                else:
                    y = self.blocks[j](*args, **kwargs)
                y = y[0] if isinstance(y, tuple) else y
                yield j, x, y
                x = y if override is None else override(j, y)
        finally:
            self._keep = None

    def last(self, x: torch.Tensor, calls: Sequence[Call], first: int, *args: Any) -> torch.Tensor:
        """The last block call's output of :meth:`run_on` (same arguments)."""
        for _, _, y in self.run_on(x, calls, first, *args):
            x = y
        return x


def expand_calls(
    value: Any,
    rows: torch.Tensor,
    batch: int,
    memo: dict[int, torch.Tensor],
    cut: tuple[int, int] | None = None,
) -> Any:
    """``value`` (block calls' arguments, :data:`~layerdiv.extract.hooks.Call`) with every
    batch-first tensor (first dimension ``batch``) repeated by ``rows``, the batch rows each
    row of the new pass repeats;
    a tensor passed to several calls (the mask, the positions) is repeated once (``memo``). With
    ``cut`` (W, q), each such tensor keeps only positions q..W-1 of its first dimension of the
    batch's width W after the batch one (the queries of a pass that reads the keys and values
    of the positions before q from a cache: the mask's query rows, the positions, the rotary
    angles)."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == batch:
            if id(value) not in memo:
                out = value.index_select(0, rows.to(value.device))
                if cut is not None:
                    width, start = cut
                    dim = next(i for i in range(1, out.dim()) if out.shape[i] == width)
                    out = out.narrow(dim, start, width - start)
                memo[id(value)] = out
            return memo[id(value)]
        return value
    if isinstance(value, tuple | list):
        return type(value)(expand_calls(v, rows, batch, memo, cut) for v in value)
    if isinstance(value, dict):
        return {k: expand_calls(v, rows, batch, memo, cut) for k, v in value.items()}
    return value
