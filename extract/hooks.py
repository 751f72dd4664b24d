"""What every capture shares: the decoder blocks each once, the handles of its hooks, and a pause
switch (a paused capture keeps nothing of the passes run meanwhile: a block skipped, the last
block run again for the lens); and the one recorder of the residual stream (:class:`Recorder`)
that every capture keeping block calls or residual states is built on."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from layerdiv.errors import DecompositionError
from layerdiv.extract.adapters import Adapter, get_module, hidden_of

Call = tuple[tuple, dict]
"""One block call's positional and keyword arguments, as its forward pre-hook saw them."""

SITES = ("ids", "calls", "inputs", "embed", "attn", "mlp", "block", "final")
"""What a :class:`Recorder` may keep of each pass (see there)."""


def unique_blocks(model: Any, adapter: Adapter) -> list[Any]:
    """The decoder blocks in call order, each once: a block listed twice (shared layers) is
    hooked once, and its hooks fire on every call."""
    return list({id(block): block for block in get_module(model, adapter.blocks)}.values())


class Hooks:
    """The handles of a capture's hooks on a model and its pause switch."""

    def __init__(self) -> None:
        self.paused = False
        """While True the hooks keep nothing."""
        self._handles: list[Any] = []

    def add(self, *handles: Any) -> None:
        """Keep the handles of hooks just registered (removed by :meth:`remove`)."""
        self._handles.extend(handles)

    @contextmanager
    def pausing(self) -> Iterator[None]:
        """Pause the hooks for the passes run inside the block."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def remove(self) -> None:
        """Detach every hook from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class Recorder(Hooks):
    """Records a model's residual stream as its passes run it: the ``sites`` named, each tensor
    through :meth:`select` (what of it to keep) into :meth:`keep` (where), while
    :meth:`recording` holds (when: by default while not paused, or, bound to a capture
    (:attr:`capture`), while that one is not). :meth:`clear` forgets everything kept. Sites:

    - ``ids``: the ``input_ids`` of the model's first call since :meth:`clear` (:attr:`input_ids`);
    - ``calls``: every decoder block call's arguments, references, no copies (:attr:`calls`);
    - ``inputs``: every block call's input h, h_0..h_(L-1) in a pass (:attr:`inputs`);
    - ``embed``: the first block input of a pass alone, h_0 (``activations["embed"]``);
    - ``attn``, ``mlp``: what each block call's attention and MLP add; ``block``: each block
      call's output (``activations[site]``);
    - ``final``: the final norm's input h_L (:attr:`final`).

    :attr:`components` lists the (kind, layer) of each ``embed``, ``attn`` and ``mlp`` kept, in
    execution order ("embed", -1 first), as a partition's components are named."""

    def __init__(self, model: Any, adapter: Adapter, sites: Collection[str]) -> None:
        super().__init__()
        self.recorded = frozenset(sites)
        unknown = self.recorded - set(SITES)
        assert not unknown, f"no recorder site {sorted(unknown)}"
        self.capture: Hooks | None = None
        """The capture whose pause switch this recorder follows (None: its own)."""
        if "ids" in self.recorded:
            self.add(model.register_forward_pre_hook(self._ids_hook, with_kwargs=True))
        if "final" in self.recorded:
            norm = get_module(model, adapter.final_norm)
            self.add(norm.register_forward_pre_hook(self._final_hook))
        for layer, block in enumerate(unique_blocks(model, adapter)):
            if self.recorded & {"calls", "inputs", "embed"}:
                hook = self._input_hook(layer)
                self.add(block.register_forward_pre_hook(hook, with_kwargs=True))
            if "block" in self.recorded:
                self.add(block.register_forward_hook(self._output_hook("block", layer)))
            for kind in ("attn", "mlp"):
                if kind in self.recorded:
                    module = get_module(block, getattr(adapter, kind))
                    self.add(module.register_forward_hook(self._output_hook(kind, layer)))
        self.clear()

    def clear(self) -> None:
        """Forget everything kept."""
        self.input_ids: torch.Tensor | None = None
        self.calls: list[Call] = []
        self.inputs: list[torch.Tensor] = []
        self.activations: dict[str, list[torch.Tensor]] = {
            s: [] for s in ("embed", "attn", "mlp", "block")
        }
        self.components: list[tuple[str, int]] = []
        self.final: torch.Tensor | None = None
        self.dtype = torch.float32
        """The model's residual-stream dtype in the last pass kept."""

    # what and when: overridden by the captures built on the recorder --------------------------
    def recording(self) -> bool:
        """Whether the hooks keep what they see now."""
        return not (self if self.capture is None else self.capture).paused

    def select(self, site: str, x: torch.Tensor) -> torch.Tensor:
        """What of tensor ``x`` (batch, positions, d) of ``site`` is kept: all of it, float32."""
        return x.to(torch.float32)

    def keep(self, site: str, layer: int, x: torch.Tensor) -> None:
        """Keep ``x`` (as :meth:`select` gave it) of ``site`` of block ``layer`` (-1: none)."""
        if site == "final":
            self.final = x
        elif site == "inputs":
            self.inputs.append(x)
        else:
            self.activations[site].append(x)

    @contextmanager
    def pausing(self) -> Iterator[None]:
        """Pause the hooks (bound: the capture followed, and every hook bound to it)."""
        with Hooks.pausing(self) if self.capture is None else self.capture.pausing():
            yield

    # results -----------------------------------------------------------------------------------
    def states(self) -> list[torch.Tensor]:
        """The last pass's block inputs h_0..h_(L-1) and last residual state h_L."""
        if self.final is None:
            raise DecompositionError("no forward pass was captured")
        return [*self.inputs, self.final]

    # hooks -------------------------------------------------------------------------------------
    def _ids_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.input_ids is None and self.recording():
            self.input_ids = kwargs.get("input_ids", args[0] if args else None)

    def _input_hook(self, layer: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            if not self.recording():
                return
            h = hidden_of(args, kwargs)
            self.dtype = h.dtype
            if "calls" in self.recorded:
                self.calls.append((args, kwargs))
            embed = "embed" in self.recorded and not self.components
            if "inputs" in self.recorded or embed:
                x = self.select("inputs", h)
                if embed:  # the first block may run again (shared layers): embed once
                    self.components.append(("embed", -1))
                    self.keep("embed", -1, x)
                if "inputs" in self.recorded:
                    self.keep("inputs", layer, x)

        return hook

    def _output_hook(self, site: str, layer: int) -> Any:
        def hook(module: Any, args: tuple, output: Any) -> None:
            if self.recording():
                out = output[0] if isinstance(output, tuple) else output
                if site != "block":
                    self.components.append((site, layer))
                self.keep(site, layer, self.select(site, out))

        return hook

    def _final_hook(self, module: Any, args: tuple) -> None:
        if self.recording():
            self.keep("final", -1, self.select("final", args[0]))
