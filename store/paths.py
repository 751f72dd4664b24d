"""Every path of the store is built here, and nowhere else.

Layout (hive-partitioned by model slug and task name)::

    <store>/manifests/model=<slug>/task=<task>/manifest.json
    <store>/components/model=<slug>/task=<task>/part-<start>-<count>.parquet
    <store>/instances/model=<slug>/task=<task>/part-<start>-<count>.parquet

A part holds the instances ``start .. start+count-1`` of one chunk. The instances part is renamed
into place after the components part, so it is the chunk's completion marker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MANIFEST_NAME = "manifest.json"
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


@dataclass(frozen=True)
class Partition:
    """The files of one (model, task) partition of a store."""

    root: Path
    model_slug: str
    task: str

    def table_dir(self, table: str) -> Path:
        """Folder of this partition in ``table`` (a table name of ``layerdiv.schemas``, or
        ``manifests``)."""
        return self.root / table / f"model={self.model_slug}" / f"task={self.task}"

    @property
    def manifest(self) -> Path:
        return self.table_dir("manifests") / MANIFEST_NAME

    @property
    def components_dir(self) -> Path:
        return self.table_dir("components")

    @property
    def instances_dir(self) -> Path:
        return self.table_dir("instances")

    def dirs(self) -> tuple[Path, Path, Path]:
        return self.table_dir("manifests"), self.components_dir, self.instances_dir

    def part_name(self, start: int, count: int) -> str:
        return f"part-{start:07d}-{count:06d}.parquet"

    def done_parts(self) -> list[tuple[int, int]]:
        """(start, count) of every complete chunk: those whose instances part exists."""
        return sorted(
            (int(m.group(1)), int(m.group(2)))
            for p in _listdir(self.instances_dir)
            if (m := _PART.match(p.name))
        )

    def component_files(self) -> list[Path]:
        """Components parts of complete chunks only (an orphan from a crash is left out)."""
        return [self.components_dir / self.part_name(s, n) for s, n in self.done_parts()]

    def instance_files(self) -> list[Path]:
        return [self.instances_dir / self.part_name(s, n) for s, n in self.done_parts()]


def _listdir(path: Path) -> list[Path]:
    return list(path.iterdir()) if path.is_dir() else []


def partition(root: str | Path, model_slug: str, task: str) -> Partition:
    """The partition of ``model_slug`` x ``task`` under store ``root``."""
    return Partition(Path(root), model_slug, check_task_name(task))


def list_partitions(root: str | Path) -> list[Partition]:
    """Every (model, task) partition that has a manifest or any part file."""
    root = Path(root)
    found: set[tuple[str, str]] = set()
    for table in ("manifests", "components", "instances"):
        for mdir in _listdir(root / table):
            if not mdir.name.startswith("model="):
                continue
            for tdir in _listdir(mdir):
                if tdir.name.startswith("task="):
                    found.add((mdir.name[len("model=") :], tdir.name[len("task=") :]))
    return [Partition(root, m, t) for m, t in sorted(found)]
