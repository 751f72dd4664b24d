"""layerdiv: how the layers of a language model add up to its prediction.

Two stages: ``layerdiv extract`` runs a model once per task and caches every residual component's
option logits in a store (needs torch); the analysis reads that store alone (no torch), from the
command line or from Python:

- :class:`Store`: a store, opened and checked; ``Store(path).scan("components")`` is a Polars
  LazyFrame of a table.
- :func:`query`: SQL (DuckDB) over the store's views, as a Polars frame.
- :func:`ls`: what the store holds, one row per (model, task).
- :func:`run_analysis`: every registered analysis, as :class:`Results` (one Polars frame per
  result table).
- :class:`LayerdivError`: what bad input raises (one line saying what to do);
  :class:`LayerdivWarning`: what an analysis could not compute, and why.

>>> import layerdiv
>>> store = layerdiv.Store(path)
>>> store
Store('...'): 2 models x 2 tasks, 4 partitions
>>> layerdiv.query(store, "SELECT count(*) AS n FROM instances").item()
24
>>> results = layerdiv.run_analysis(store, tasks="boolq")
>>> results.scores.shape
(4, 13)

The subpackages: ``layerdiv.analyze`` (the analyses and their helpers), ``layerdiv.store`` (the
store's files and reading), ``layerdiv.schemas`` (its versioned columns), ``layerdiv.extract``
(extraction; imports torch).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from layerdiv.errors import LayerdivError, LayerdivWarning
from layerdiv.version import __version__

if TYPE_CHECKING:
    from layerdiv.analyze.api import Results, ls, query, run_analysis
    from layerdiv.store.reader import PartitionInfo, Store


_EXPORTS = {
    "Store": ("layerdiv.store.reader", "Store"),
    "PartitionInfo": ("layerdiv.store.reader", "PartitionInfo"),
    "query": ("layerdiv.analyze.api", "query"),
    "ls": ("layerdiv.analyze.api", "ls"),
    "run_analysis": ("layerdiv.analyze.api", "run_analysis"),
    "Results": ("layerdiv.analyze.api", "Results"),
}
_SUBPACKAGES = ("analyze", "store", "schemas", "tasks", "extract")


if not TYPE_CHECKING:  # type checkers see the imports above, and flag any other name

    def __getattr__(name: str) -> Any:
        # Loaded on first use: ``import layerdiv`` (and so the command line) stays quick.
        if name in _EXPORTS:
            module, attr = _EXPORTS[name]
            value = getattr(import_module(module), attr)
            globals()[name] = value
            return value
        if name in _SUBPACKAGES:
            return import_module(f"layerdiv.{name}")
        raise AttributeError(f"module 'layerdiv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*__all__, *_SUBPACKAGES})


__all__ = [
    "LayerdivError",
    "LayerdivWarning",
    "PartitionInfo",
    "Results",
    "Store",
    "__version__",
    "ls",
    "query",
    "run_analysis",
]
