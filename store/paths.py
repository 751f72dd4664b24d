"""Every path of the store is built here, and nowhere else.

Layout (hive-partitioned by the key, ``layerdiv.store.key``: model slug, revision, task name)::

    <store>/manifests/<key>/manifest.json
    <store>/manifests/<key>/runs/<utc-time>-<host>-<pid>.json   (one per run)
    <store>/manifests/<key>/tables/<table>     (optional tables requested)
    <store>/manifests/<key>/claims/chunk-<j>.lock   (held while computing)
    <store>/manifests/<key>/<table>.parquet    (a table stored once per partition)
    <store>/manifests/<key>/.redo/             (a committed ``extract --redo``, layerdiv.store.redo)
    <store>/<table>/<key>/part-<start>-<count>.parquet

with ``<key>`` = ``model=<slug>/revision=<rev>/task=<task>`` (stores of schema version <= 4 have
no ``revision=`` level: their partitions read as revision ``main``,
:data:`~layerdiv.store.key.ABSENT`).

``<table>`` is one of the tables of the partition's task kind (``layerdiv.schemas.kinds``:
``components`` and ``instances`` for choice tasks, ``tokens``, ``token_blocks`` and ``documents``
for text tasks, and the optional tables). A part holds the instances (documents)
``start .. start+count-1``. A table stored once per partition rather than per chunk
(``layerdiv.schemas.WHOLE_TABLES``: ``--erase``'s reference means) is one file beside the
manifest (:meth:`Partition.whole`): a replacement (``--overwrite``) removes it with the manifest's
folder, and ``merge`` copies it as it copies the folder's run records (the same name in two stores
must hold the same bytes). The kind's marker part (``instances``, ``documents``) is renamed into
place after every other table's part, so it is the chunk's completion marker.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Generic

from layerdiv.errors import LayerdivError
from layerdiv.measurements import table_schemas, tables_of_kind
from layerdiv.schemas import SchemaError
from layerdiv.schemas.kinds import KINDS
from layerdiv.store.key import ABSENT, KEY, PartitionKey
from layerdiv.store.location import StorePath

MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.json"
"""Written by ``layerdiv analyze`` into every result folder (how it was made and the files written
there): a store that holds it at its root is a folder of results, not a store."""
MANIFESTS = "manifests"
"""Folder of the manifests (and run records, table markers and chunk claims)."""
_PART = re.compile(r"^part-(\d{7})-(\d{6})\.parquet$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class StoreNameError(LayerdivError, ValueError):
    """A model id or revision that makes no directory name."""


@functools.lru_cache(maxsize=4096)
def slug(name: str, what: str = "model") -> str:
    """Directory-safe name of a model id (or of a revision, ``what``): ``org/name`` becomes
    ``org--name``; one with no letter or digit left is refused, naming it as ``what``."""
    text = name.rstrip("/").replace("/", "--")
    out = _UNSAFE.sub("_", text).strip("._-")
    if not out:
        raise StoreNameError(
            f"cannot make a store name from {what} {name!r}: give a {what} with a letter or digit"
        )
    return out


def check_task_name(task: str) -> str:
    """Task names become directory names: letters, digits, '.', '_' and '-' only."""
    if not task or _UNSAFE.search(task) or task.startswith("."):
        raise ValueError(
            f"task name {task!r} is not usable as a directory name: "
            "use letters, digits, '.', '_' and '-' only"
        )
    return task


class OverlappingParts(SchemaError):
    """Two complete parts of a partition claim the same instances (the layout is broken)."""


@dataclass(frozen=True)
class Partition(Generic[StorePath]):
    """The files of one partition (:class:`~layerdiv.store.key.PartitionKey`) of a store, local
    (``Path``) or on object storage (``RemotePath``, read-only)."""

    root: StorePath
    key: PartitionKey
    absent: tuple[str, ...] = ()
    """Key columns its folders lack (a partition of an older layout, :data:`ABSENT`)."""
    listing: Mapping[str, tuple[str, ...]] | None = field(default=None, compare=False)
    """The file names in each table's folder when the store was listed (:func:`list_partitions`,
    one walk of every folder), or None: each folder is listed when asked."""

    @property
    def model_slug(self) -> str:
        return self.key.model

    @property
    def task(self) -> str:
        return self.key.task

    def dir(self, table: str) -> StorePath:
        """Folder of ``table`` (a table of ``layerdiv.measurements.table_schemas``, or
        ``manifests``)."""
        return self.root / table / self._relative

    @cached_property
    def _relative(self) -> str:
        return "/".join(self._dirs)

    @cached_property
    def _dirs(self) -> list[str]:
        return [d for d, c in zip(self.key.dirs(), KEY, strict=True) if c not in self.absent]

    def older(self) -> Partition[StorePath] | None:
        """The same key in the layout of older schema versions (no folder level for the columns
        of :data:`ABSENT` that have their default value), or None where there is none."""
        absent = tuple(c for c, v in ABSENT.items() if getattr(self.key, c) == v)
        return Partition(self.root, self.key, absent) if absent and not self.absent else None

    @property
    def manifest(self) -> StorePath:
        return self.dir(MANIFESTS) / MANIFEST_NAME

    def whole(self, table: str) -> StorePath:
        """The one file of ``table``, a table stored once per partition
        (``layerdiv.schemas.WHOLE_TABLES``), beside the manifest."""
        return self.dir(MANIFESTS) / f"{table}.parquet"

    @property
    def open_lock(self) -> StorePath:
        """Lock file serializing the creation and replacement of the partition (outside the
        partition's folders, so that replacing them keeps it)."""
        *outer, last = self._dirs
        folder = self.root / MANIFESTS
        for name in outer:
            folder = folder / name
        return folder / f".{last}.lock"

    def dirs(self, kind: str | None = None) -> list[StorePath]:
        """The manifest folder and every table's folder (of the task ``kind`` only, if given)."""
        names: tuple[str, ...] = tables_of_kind(kind) if kind else tuple(table_schemas())
        return [self.dir(t) for t in (MANIFESTS, *names)]

    def stored_files(self) -> list[StorePath]:
        """Every file in the partition's folders but temporaries (dot files)."""
        return [
            self.dir(t) / n
            for t in (MANIFESTS, *table_schemas())
            for n in (
                self.listing.get(t, ())
                if self.listing is not None
                else [p.name for p in _listdir(self.dir(t))]
            )
            if not n.startswith(".")
        ]

    @staticmethod
    def part_name(start: int, count: int) -> str:
        return f"part-{start:07d}-{count:06d}.parquet"

    def part(self, table: str, start: int, count: int) -> StorePath:
        """The part file of ``table`` holding instances ``start .. start+count-1``."""
        return self.dir(table) / self.part_name(start, count)

    def parts(self, table: str) -> list[tuple[int, int]]:
        """(start, count) of every part file of ``table``, by start."""
        names = (
            self.listing.get(table, ())
            if self.listing is not None
            else [p.name for p in _listdir(self.dir(table))]
        )
        return sorted((int(m.group(1)), int(m.group(2))) for n in names if (m := _PART.match(n)))

    def done_parts(self) -> list[tuple[int, int]]:
        """(start, count) of every complete chunk (those whose marker part exists: ``instances``
        for choice tasks, ``documents`` for text tasks); parts whose ranges overlap are refused,
        naming the files."""
        return [(s, n) for s, n, _ in self._done()]

    def _done(self) -> list[tuple[int, int, str]]:
        done = sorted((s, n, k.marker) for k in KINDS.values() for s, n in self.parts(k.marker))
        for (s0, n0, t0), (s1, n1, t1) in itertools.pairwise(done):
            if s1 < s0 + n0 or t0 != t1:
                what = "overlapping chunks" if t0 == t1 else "chunks of two task kinds"
                raise OverlappingParts(
                    f"{self.part(t0, s0, n0)} and {self.part(t1, s1, n1)} hold {what} (written "
                    "by conflicting runs): delete the partition or re-extract it with --overwrite"
                )
        return done

    def lacking(
        self, table: str, done: list[tuple[int, int]] | None = None
    ) -> list[tuple[int, int]]:
        """The complete chunks (``done``; by default :meth:`done_parts`) that have no part of the
        optional ``table`` (one listing of its folder)."""
        have = set(self.parts(table))
        return [p for p in (self.done_parts() if done is None else done) if p not in have]


def _listdir(path: StorePath) -> list[StorePath]:
    return list(path.iterdir()) if path.is_dir() else []


def partition(root: str | Path, key: PartitionKey) -> Partition[Path]:
    """The partition ``key`` under the local store ``root``."""
    check_task_name(key.task)
    return Partition(Path(root), key)


def list_partitions(root: StorePath) -> list[Partition[StorePath]]:
    """Every partition that has a manifest or any other file but temporaries (dot files: a
    leftover temporary alone is no partition), in either layout (a key found in both is read in
    today's)."""
    listings: dict[tuple[PartitionKey, tuple[str, ...]], dict[str, tuple[str, ...]]] = {}
    for table in (MANIFESTS, *table_schemas()):
        for key, absent, names in _keys(root / table, (), ()):
            listings.setdefault((key, absent), {})[table] = names
    found: dict[PartitionKey, tuple[str, ...]] = {}
    for key, absent in listings:
        if not found.get(key, ()) or not absent:
            found[key] = absent
    return [Partition(root, k, found[k], listings[k, found[k]]) for k in sorted(found)]


def _keys(
    folder: StorePath, values: tuple[str, ...], absent: tuple[str, ...]
) -> list[tuple[PartitionKey, tuple[str, ...], tuple[str, ...]]]:
    """The keys under ``folder`` whose first ``len(values)`` columns are ``values``, each with
    the columns its folders lack (:data:`ABSENT`) and the names of the files in its folder."""
    if len(values) == len(KEY):
        names = tuple(p.name for p in _listdir(folder))
        held = any(not n.startswith(".") for n in names)
        return [(PartitionKey(*values), absent, names)] if held else []
    column = KEY[len(values)]
    prefix = f"{column}="
    out = [
        k
        for sub in _listdir(folder)
        if sub.name.startswith(prefix)
        for k in _keys(sub, (*values, sub.name[len(prefix) :]), absent)
    ]
    if column in ABSENT:  # the layout of older versions: no folder level for this column
        out += _keys(folder, (*values, ABSENT[column]), (*absent, column))
    return out
