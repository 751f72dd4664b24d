"""Writing a (model, task) partition: atomic parts, resumable runs, refusal of mixed provenance."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from layerdiv.errors import LayerdivError
from layerdiv.schemas import TABLES, SchemaError
from layerdiv.store.manifest import Manifest, read_manifest, write_manifest
from layerdiv.store.paths import Partition, partition, slug


class StoreConflict(LayerdivError, RuntimeError):
    """The partition already holds data of another model revision, template or dtype."""


class PartitionWriter:
    """Writes one partition's chunks; a rerun skips every chunk that is already complete."""

    def __init__(self, root: str | Path, model: str, task: str):
        self.part: Partition = partition(root, slug(model), task)

    def check(self, identity: dict[str, object], overwrite: bool) -> None:
        """Refuse (before anything is written) a run whose identity differs from the stored one."""
        if not overwrite and self.part.manifest.exists():
            self._refuse_different(read_manifest(self.part.manifest), identity)

    def _refuse_different(self, stored: Manifest, identity: dict[str, object]) -> None:
        existing = stored.identity()
        diff = [k for k, v in identity.items() if existing.get(k) != v]
        if diff:
            details = "; ".join(
                f"{k}: stored {existing.get(k)!r}, now {identity[k]!r}" for k in diff
            )
            raise StoreConflict(
                f"{self.part.manifest.parent} holds a different extraction ({details}). "
                "Pass --overwrite to replace it, or use another --store."
            )

    def open(self, manifest: Manifest, overwrite: bool) -> None:
        """Create (or, with ``overwrite``, recreate) the partition and record its manifest; an
        existing partition must hold the same extraction (:meth:`check`)."""
        if overwrite:
            for d in self.part.dirs():
                shutil.rmtree(d, ignore_errors=True)
        if not write_manifest(self.part.manifest, manifest, exclusive=True):
            # The partition exists (a rerun, or another shard got here first).
            stored = read_manifest(self.part.manifest)
            self._refuse_different(stored, manifest.identity())
            if manifest.n_requested > stored.n_requested:
                stored.n_requested = manifest.n_requested
                write_manifest(self.part.manifest, stored)
        for d in (self.part.components_dir, self.part.instances_dir):
            d.mkdir(parents=True, exist_ok=True)
            for stale in d.glob(".*.tmp"):
                stale.unlink(missing_ok=True)

    def record_run(self, run: dict[str, object]) -> None:
        """Append a finished run's statistics to the manifest (atomic replace)."""
        manifest = read_manifest(self.part.manifest)
        manifest.runs.append(run)
        write_manifest(self.part.manifest, manifest)

    def done_instances(self) -> set[int]:
        """Instances already stored in complete chunks."""
        return {i for start, n in self.part.done_parts() for i in range(start, start + n)}

    def write_chunk(
        self,
        start: int,
        count: int,
        components: pa.Table,
        instances: pa.Table,
        extra: Mapping[str, pa.Table] | None = None,
    ) -> None:
        """Write one chunk: the components part and the ``extra`` optional tables' parts first,
        then the instances part (the marker)."""
        tables = {"components": components, **(extra or {}), "instances": instances}
        for table_name, table in tables.items():
            if not table.schema.equals(TABLES[table_name], check_metadata=False):
                raise SchemaError(f"chunk {start}: table does not match schema\n{table.schema}")
        name = self.part.part_name(start, count)
        for table_name, table in tables.items():
            folder = self.part.table_dir(table_name)
            folder.mkdir(parents=True, exist_ok=True)
            _write_parquet_atomic(
                table.replace_schema_metadata(TABLES[table_name].metadata), folder / name
            )


def _write_parquet_atomic(table: pa.Table, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd", row_group_size=1 << 20)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
