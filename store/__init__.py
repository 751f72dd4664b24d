"""The cache on disk: paths, manifests, atomic writing and checked reading.

The reader (``Store``) needs duckdb and polars; it is imported on first use, so extraction nodes
need neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from layerdiv.store.manifest import ComponentInfo, Manifest
from layerdiv.store.paths import slug
from layerdiv.store.writer import PartitionWriter, StoreConflict

if TYPE_CHECKING:
    from layerdiv.store.reader import PartitionInfo, Store, StoreError

_READER = ("PartitionInfo", "Store", "StoreError")


def __getattr__(name: str) -> Any:
    if name in _READER:
        from layerdiv.store import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'layerdiv.store' has no attribute {name!r}")


__all__ = [
    "ComponentInfo",
    "Manifest",
    "PartitionInfo",
    "PartitionWriter",
    "Store",
    "StoreConflict",
    "StoreError",
    "slug",
]
