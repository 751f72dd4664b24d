"""Every path of the store is built here, and nowhere else.

Layout (hive-partitioned by model slug and task name)::

    <store>/manifests/model=<slug>/task=<task>/manifest.json
    <store>/manifests/model=<slug>/task=<task>/runs/<utc-time>-<host>-<pid>.json   (one per run)
    <store>/manifests/model=<slug>/task=<task>/tables/<table>     (optional tables requested)
    <store>/manifests/model=<slug>/task=<task>/claims/chunk-<j>.lock   (held while computing)
    <store>/<table>/model=<slug>/task=<task>/part-<start>-<count>.parquet

``<table>`` is one of the tables of the partition's task kind (``layerdiv.schemas.KINDS``:
``components`` and ``instances`` for choice tasks, ``tokens``, ``token_blocks`` and ``documents``
for text tasks, and the optional tables). A part holds the instances (documents)
``start .. start+count-1``. The kind's marker part (``instances``, ``documents``) is renamed into
place after every other table's part, so it is the chunk's completion marker.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Generic

from layerdiv.schemas import KINDS, TABLES, SchemaError
from layerdiv.store.key import KEY, PartitionKey
from layerdiv.store.location import StorePath

MANIFEST_NAME = "manifest.json"
MANIFESTS = "manifests"
"""Folder of the manifests (and run records, table markers and chunk claims)."""
_PART = re.compile(r"^part-(\d{7})-(\d{6})\.parquet$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def slug(model: str) -> str:
    """Directory-safe name of a model id: ``org/name`` becomes ``org--name``."""
    text = model.rstrip("/").replace("/", "--")
    out = _UNSAFE.sub("_", text).strip("._-")
    if not out:
        raise ValueError(f"cannot make a store name from model {model!r}")
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

    @property
    def model_slug(self) -> str:
        return self.key.model

    @property
    def task(self) -> str:
        return self.key.task

    def dir(self, table: str) -> StorePath:
        """Folder of ``table`` (any table of ``layerdiv.schemas.TABLES``, or ``manifests``)."""
        out = self.root / table
        for name in self.key.dirs():
            out = out / name
        return out

    @property
    def manifest(self) -> StorePath:
        return self.dir(MANIFESTS) / MANIFEST_NAME

    @property
    def open_lock(self) -> StorePath:
        """Lock file serializing the creation and replacement of the partition (outside the
        partition's folders, so that replacing them keeps it)."""
        *outer, last = self.key.dirs()
        folder = self.root / MANIFESTS
        for name in outer:
            folder = folder / name
        return folder / f".{last}.lock"

    def dirs(self, kind: str | None = None) -> list[StorePath]:
        """The manifest folder and every table's folder (of the task ``kind`` only, if given)."""
        return [self.dir(t) for t in (MANIFESTS, *(KINDS[kind].tables if kind else TABLES))]

    @staticmethod
    def part_name(start: int, count: int) -> str:
        return f"part-{start:07d}-{count:06d}.parquet"

    def part(self, table: str, start: int, count: int) -> StorePath:
        """The part file of ``table`` holding instances ``start .. start+count-1``."""
        return self.dir(table) / self.part_name(start, count)

    def parts(self, table: str) -> list[tuple[int, int]]:
        """(start, count) of every part file of ``table``, by start."""
        return sorted(
            (int(m.group(1)), int(m.group(2)))
            for p in _listdir(self.dir(table))
            if (m := _PART.match(p.name))
        )

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
    leftover temporary alone is no partition)."""
    found: set[PartitionKey] = set()
    for table in (MANIFESTS, *TABLES):
        found.update(_keys(root / table, ()))
    return [Partition(root, k) for k in sorted(found)]


def _keys(folder: StorePath, values: tuple[str, ...]) -> list[PartitionKey]:
    """The keys under ``folder`` whose first ``len(values)`` columns are ``values``."""
    if len(values) == len(KEY):
        return (
            [PartitionKey(*values)]
            if any(not p.name.startswith(".") for p in _listdir(folder))
            else []
        )
    prefix = f"{KEY[len(values)]}="
    return [
        k
        for sub in _listdir(folder)
        if sub.name.startswith(prefix)
        for k in _keys(sub, (*values, sub.name[len(prefix) :]))
    ]
