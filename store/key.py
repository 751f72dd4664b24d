"""The key of a partition: the one declaration of the store's hive partition columns.

Every path (``<table>/model=<slug>/revision=<rev>/task=<task>/``), reader column, analysis tag
and join derives its key columns from :class:`PartitionKey`; adding a key column is adding a field
here (and, for stores written before it, its value in :data:`ABSENT`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields


@dataclass(frozen=True, order=True)
class PartitionKey:
    """What names one partition, field by field in directory order (all strings)."""

    model: str
    """Directory-safe model slug (``layerdiv.store.paths.slug``)."""
    revision: str
    """Directory-safe slug of the model's revision as ``extract --revision`` gave it (a hub
    branch, tag or commit; a label for a local folder): ``main`` by default."""
    task: str
    """Task name."""

    def values(self) -> tuple[str, ...]:
        """The key's values, in :data:`KEY` order."""
        return tuple(getattr(self, c) for c in KEY)

    def items(self) -> Iterator[tuple[str, str]]:
        """(column, value) pairs, in :data:`KEY` order."""
        return zip(KEY, self.values(), strict=True)

    def dirs(self) -> list[str]:
        """The hive folder names (``model=<slug>``, ``revision=<rev>``, ``task=<task>``)."""
        return [f"{c}={v}" for c, v in self.items()]

    @property
    def label(self) -> str:
        """``<slug>/<revision>/<task>``, for lists in messages."""
        return "/".join(self.values())

    @property
    def within_model(self) -> str:
        """The key without the model (``<revision>/<task>``), for lists grouped by model."""
        return "/".join(self.values()[1:])

    @property
    def where(self) -> str:
        """``partition model=<slug> revision=<rev> task=<task>``, for messages."""
        return "partition " + " ".join(self.dirs())


KEY: tuple[str, ...] = tuple(f.name for f in fields(PartitionKey))
"""The key columns, in directory order: every reader adds them (as strings) to every table, and
every per-partition result table starts with them."""

MODEL_KEY: tuple[str, ...] = tuple(c for c in KEY if c != "task")
"""The key of one set of weights (a model's revision): the ``models`` view's rows."""

SERIES: tuple[str, ...] = tuple(c for c in KEY if c != "revision")
"""The key of one model's task across its revisions (a curve against the training step)."""

DEFAULT_REVISION = "main"
"""The revision of a model extracted without ``--revision``."""

ABSENT: dict[str, str] = {"revision": DEFAULT_REVISION}
"""Key columns that stores of older schema versions lack (their folders skip the level), with
the value their partitions read as (schema version <= 4: revision ``main``)."""
