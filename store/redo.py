"""Redoing one measurement of a partition (``extract --redo NAME``): its tables, its tables
stored once per partition and its settings replaced, every other table, setting and run record
kept.

The new parts are written to a staging folder beside the manifest (a temporary of
:func:`~layerdiv.store.atomic.temp_path`, which readers never see and writers delete once its
process is dead). The redo commits by renaming that folder to :data:`JOURNAL` in one step: before
that instant a crash leaves the old partition as it was; from it on, :func:`finish` (run by
``Store`` and by every ``extract`` of the partition before they read it) completes the swap: each
table's folder is exchanged for its staged one, the stored-once files replaced, the tables marked
complete, the new settings written to the manifest, and the journal deleted. Every step can be
run again after a crash at any point.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa

from layerdiv.schemas import TABLES, SchemaError, schema_matches
from layerdiv.store.atomic import fsync, fsync_tree, temp_path, write_bytes
from layerdiv.store.manifest import TABLES_DIR, read_manifest, write_manifest
from layerdiv.store.paths import Partition
from layerdiv.store.writer import (
    PartitionWriter,
    StoreConflict,
    partition_lock,
    stamp,
    write_part_file,
    write_whole_file,
)

JOURNAL = ".redo"
"""The committed redo of a partition, beside its manifest: the staged tables (a folder each), the
stored-once files (``whole/``) and :data:`RECORD`."""
RECORD = "redo.json"
"""In the journal: the measurement, its new settings, and the tables and stored-once files to
swap in."""


class MeasurementRedo:
    """New tables and settings of measurement ``name`` for the partition of ``writer``, staged
    until :meth:`commit` swaps them in (:func:`finish`); a redo left uncommitted changes nothing."""

    def __init__(
        self, writer: PartitionWriter, name: str, tables: list[str], settings: dict[str, Any]
    ) -> None:
        self.writer, self.name, self.tables = writer, name, tables
        self.settings = settings
        self.generation = read_manifest(writer.part.manifest).generation
        self.staging = temp_path(writer.part.manifest.parent / JOURNAL)
        self.whole: list[str] = []

    def write_part(self, table: str, start: int, count: int, data: pa.Table) -> None:
        """Stage ``table``'s part of the chunk at ``start``, checked as a chunk's parts are
        (``PartitionWriter.check_parts``), stamped with the new settings."""
        self.writer.check_parts(start, count, {table: data})
        path = self.staging / table / Partition.part_name(start, count)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_part_file(path, table, data, stamp(table, {self.name: self.settings}))

    def write_whole(self, table: str, data: pa.Table) -> None:
        """Stage the one file of ``table``, a table stored once per partition."""
        if not schema_matches(table, data.schema, TABLES[table]):
            raise SchemaError(f"{table} table does not match its schema\n{data.schema}")
        (self.staging / "whole").mkdir(parents=True, exist_ok=True)
        path = self.staging / "whole" / f"{table}.parquet"
        write_whole_file(path, table, data, stamp(table, {self.name: self.settings}))
        self.whole.append(table)

    def commit(self) -> None:
        """Swap the staged tables and settings in: the journal is renamed into place under the
        partition's lock (refused, ``StoreConflict``, when another run replaced the partition
        meanwhile), then :func:`finish` completes it."""
        part = self.writer.part
        record = {"measurement": self.name, "settings": self.settings, "tables": self.tables,
                  "whole": self.whole}  # fmt: skip
        (self.staging / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True))
        for table in self.tables:  # a table none of whose chunks has rows: an empty folder
            (self.staging / table).mkdir(exist_ok=True)
        with partition_lock(part):
            if read_manifest(part.manifest).generation != self.generation:
                raise StoreConflict(
                    f"{part.manifest.parent} was replaced by another run (--overwrite) while "
                    f"this run redid {self.name}: nothing was changed; rerun the redo"
                )
            fsync_tree(self.staging)
            os.rename(self.staging, part.manifest.parent / JOURNAL)
            fsync(part.manifest.parent)
        finish(part)

    def discard(self) -> None:
        """Delete the staged files (a redo that failed before :meth:`commit`)."""
        shutil.rmtree(self.staging, ignore_errors=True)


def finish(part: Partition[Path]) -> None:
    """Complete the committed redo of ``part`` (:data:`JOURNAL`), if any, under the partition's
    lock; each step is skipped where a run killed during it got past it."""
    journal = part.manifest.parent / JOURNAL
    if not (journal / RECORD).is_file():
        return
    with partition_lock(part):
        if (journal / RECORD).is_file():  # not completed by another process meanwhile
            _swap(part, journal)


def _swap(part: Partition[Path], journal: Path) -> None:
    """The steps of :func:`finish`."""
    record = json.loads((journal / RECORD).read_text())
    for table in record["tables"]:
        staged, old, target = journal / table, journal / f"{table}.old", part.dir(table)
        if staged.is_dir():
            if target.is_dir() and not old.exists():
                os.rename(target, old)
            elif target.is_dir():  # written by another run after the old one went aside
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(staged, target)
        shutil.rmtree(old, ignore_errors=True)
    for table in record["whole"]:
        staged = journal / "whole" / f"{table}.parquet"
        if staged.is_file():
            os.replace(staged, part.whole(table))
    for table in record["tables"]:
        write_bytes(part.manifest.parent / TABLES_DIR / table, b"", exclusive=True)
    manifest = read_manifest(part.manifest)
    if manifest.settings.get(record["measurement"]) != record["settings"]:
        manifest.settings = {**manifest.settings, record["measurement"]: record["settings"]}
        write_manifest(part.manifest, manifest)
    shutil.rmtree(journal)
