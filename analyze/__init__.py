"""Analysis stage: decompositions, curves, correlations and reports from the cache alone.

Nothing here imports torch or transformers; figures need matplotlib (the ``plot`` extra). The
public functions are loaded on first use, so that ``layerdiv query`` and ``layerdiv ls`` start
quickly.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layerdiv.analyze.api import (
        Results,
        analyze,
        junction_curves,
        ls,
        open_store,
        query,
        run_analysis,
        scores,
        task_summary,
    )
    from layerdiv.analyze.decomposition import instance_curves
    from layerdiv.analyze.options import ESTIMATORS, SCALES

_EXPORTS = {
    "Results": "api",
    "analyze": "api",
    "junction_curves": "api",
    "ls": "api",
    "open_store": "api",
    "query": "api",
    "run_analysis": "api",
    "scores": "api",
    "task_summary": "api",
    "ESTIMATORS": "options",
    "SCALES": "options",
    "instance_curves": "decomposition",
}


if not TYPE_CHECKING:  # type checkers see the imports above, and flag any other name

    def __getattr__(name: str) -> Any:
        if name in _EXPORTS:
            return getattr(import_module(f"layerdiv.analyze.{_EXPORTS[name]}"), name)
        raise AttributeError(f"module 'layerdiv.analyze' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "ESTIMATORS",
    "SCALES",
    "Results",
    "analyze",
    "instance_curves",
    "junction_curves",
    "ls",
    "open_store",
    "query",
    "run_analysis",
    "scores",
    "task_summary",
]
