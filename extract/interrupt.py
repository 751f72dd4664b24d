"""SIGTERM (sent by SLURM and Kubernetes before they kill) and Ctrl-C during extraction."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived; ``exit_code`` is 128 + the signal number (143, 130). Like
    :class:`KeyboardInterrupt`, no ``except Exception`` (ours or a library's) swallows it."""

    def __init__(self, signum: int) -> None:
        self.exit_code = 128 + signum
        super().__init__(
            f"interrupted by {signal.Signals(signum).name}: the chunks stored so far are kept "
            "and none is half-written; run the same command again to resume"
        )


@contextmanager
def interruptible() -> Iterator[None]:
    """Raise :class:`Interrupted` in the main thread on SIGTERM or SIGINT: the batch in flight
    is dropped, a chunk being written by the writer thread is finished (atomically)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
