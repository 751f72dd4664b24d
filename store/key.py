"""The key of a partition: the one declaration of the store's hive partition columns.

Every path (``<table>/model=<slug>/task=<task>/``), reader column, analysis tag and join derives
its key columns from :class:`PartitionKey`; adding a key column is adding a field here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import astuple, dataclass, fields


@dataclass(frozen=True, order=True)
class PartitionKey:
    """What names one partition, field by field in directory order (all strings)."""

    model: str
    """Directory-safe model slug (``layerdiv.store.paths.slug``)."""
    task: str
    """Task name."""

    def values(self) -> tuple[str, ...]:
        """The key's values, in :data:`KEY` order."""
        return astuple(self)

    def items(self) -> Iterator[tuple[str, str]]:
        """(column, value) pairs, in :data:`KEY` order."""
        return zip(KEY, self.values(), strict=True)

    def dirs(self) -> list[str]:
        """The hive folder names (``model=<slug>``, ``task=<task>``), in order."""
        return [f"{c}={v}" for c, v in self.items()]

    @property
    def label(self) -> str:
        """``<slug>/<task>``, for lists in messages."""
        return "/".join(self.values())

    @property
    def within_model(self) -> str:
        """The key without the model (``<task>``), for lists grouped by model."""
        return "/".join(self.values()[1:])

    @property
    def where(self) -> str:
        """``partition model=<slug> task=<task>``, for messages."""
        return "partition " + " ".join(self.dirs())


KEY: tuple[str, ...] = tuple(f.name for f in fields(PartitionKey))
"""The key columns, in directory order: every reader adds them (as strings) to every table, and
every per-partition result table starts with them."""
