"""The cache on disk: paths, manifests, atomic writing and checked reading."""

from layerdiv.store.manifest import ComponentInfo, Manifest
from layerdiv.store.paths import slug
from layerdiv.store.reader import PartitionInfo, Store, StoreError
from layerdiv.store.writer import PartitionWriter, StoreConflict

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
