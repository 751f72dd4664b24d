"""What every capture shares: the decoder blocks each once, the handles of its hooks, and a pause
switch (a paused capture keeps nothing of the passes run meanwhile: a block skipped, the last
block run again for the lens)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from layerdiv.extract.adapters import Adapter, get_module


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
