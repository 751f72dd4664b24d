"""Reading a store: checked manifests, DuckDB views and Polars frames over complete chunks only.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from layerdiv.errors import LayerdivError
from layerdiv.schemas import REQUIRED_TABLES, SchemaError, tables_of
from layerdiv.store.manifest import Manifest, read_manifest
from layerdiv.store.paths import Partition, list_partitions, slug


class StoreError(LayerdivError, RuntimeError):
    """The store is empty, unreadable, or holds nothing that matches the request."""


@dataclass(frozen=True)
class PartitionInfo:
    """A checked (model, task) partition and its complete part files."""

    partition: Partition
    manifest: Manifest

    @property
    def model(self) -> str:
        return self.partition.model_slug

    @property
    def task(self) -> str:
        return self.partition.task

    def files(self, table: str) -> list[Path]:
        """The part files of ``table`` (any table) of complete chunks."""
        return self.partition.files(table)

    @property
    def n_done(self) -> int:
        return sum(n for _, n in self.partition.done_parts())


class Store:
    """A layerdiv store on disk, checked on open: every partition needs a readable manifest of a
    schema version this code reads, and its part files must carry the declared schemas."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise StoreError(f"no store at {self.root}: run `layerdiv extract` first")
        found = list_partitions(self.root)
        if not found:
            raise StoreError(f"the store {self.root} is empty: run `layerdiv extract` first")
        self.partitions: list[PartitionInfo] = []
        for part in found:
            if not part.manifest.exists():
                raise StoreError(
                    f"partition model={part.model_slug} task={part.task} has data but no "
                    f"manifest ({part.manifest}): it cannot be trusted. Delete it or re-extract "
                    "it with --overwrite."
                )
            try:
                info = PartitionInfo(part, read_manifest(part.manifest))
            except SchemaError as err:
                raise StoreError(str(err)) from err
            _check_part_schemas(info)
            self.partitions.append(info)

    def select(
        self, models: Iterable[str] = (), tasks: Iterable[str] = (), require_data: bool = True
    ) -> list[PartitionInfo]:
        """Partitions matching the model (id or slug) and task filters (empty filter: all)."""
        want_models = {slug(m) for m in models}
        want_tasks = set(tasks)
        chosen = [
            p
            for p in self.partitions
            if (not want_models or p.model in want_models)
            and (not want_tasks or p.task in want_tasks)
            and (p.n_done > 0 or not require_data)
        ]
        if not chosen:
            have = ", ".join(f"{p.model}/{p.task}" for p in self.partitions) or "nothing"
            raise StoreError(
                f"no extracted data matches models={sorted(want_models) or 'any'} "
                f"tasks={sorted(want_tasks) or 'any'}; the store holds: {have}"
            )
        return chosen

    def files(self, table: str, parts: list[PartitionInfo]) -> list[str]:
        return [str(f) for p in parts for f in p.files(table)]

    def scan(
        self, table: str, models: Iterable[str] = (), tasks: Iterable[str] = ()
    ) -> pl.LazyFrame:
        """A Polars LazyFrame over ``components`` or ``instances``, with model/task columns."""
        files = self.files(table, self.select(models, tasks))
        return pl.scan_parquet(
            files, hive_partitioning=True, hive_schema={"model": pl.String, "task": pl.String}
        )

    def manifests(self, models: Iterable[str] = (), tasks: Iterable[str] = ()) -> pl.DataFrame:
        """One row per partition: provenance and progress (``n_done`` of ``n_requested``)."""
        rows = []
        for p in self.select(models, tasks, require_data=False):
            m = p.manifest
            kinds = [c.kind for c in m.components]
            rows.append(
                {
                    "model": p.model,
                    "task": p.task,
                    "model_id": m.model,
                    "revision": m.revision,
                    "dtype": m.dtype,
                    "n_params": m.n_params,
                    "n_components": len(kinds),
                    "n_embed": kinds.count("embed"),
                    "n_attn": kinds.count("attn"),
                    "n_mlp": kinds.count("mlp"),
                    "n_bias": kinds.count("bias"),
                    "n_options": len(m.options),
                    "options": m.options,
                    "n_requested": m.n_requested,
                    "n_done": p.n_done,
                    "approximate": m.approximate,
                    "created_at": m.created_at,
                }
            )
        return pl.DataFrame(rows)

    def duckdb(
        self, models: Iterable[str] = (), tasks: Iterable[str] = ()
    ) -> duckdb.DuckDBPyConnection:
        """An in-memory DuckDB connection with the views ``components``, ``instances`` and
        ``manifests`` over the selected partitions."""
        models, tasks = list(models), list(tasks)
        parts = self.select(models, tasks)
        con = duckdb.connect()
        for table in REQUIRED_TABLES:
            listing = ", ".join(_sql_str(f) for f in self.files(table, parts))
            con.execute(
                f"CREATE VIEW {table} AS SELECT * FROM read_parquet([{listing}], "
                "hive_partitioning = true, hive_types = {'model': VARCHAR, 'task': VARCHAR}, "
                "union_by_name = true)"
            )
        con.register("manifests_arrow", self.manifests(models, tasks).to_arrow())
        con.execute("CREATE VIEW manifests AS SELECT * FROM manifests_arrow")
        return con


def _sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _check_part_schemas(info: PartitionInfo) -> None:
    """Check the first part of each table against the schema of the partition's version (cheap:
    footers only)."""
    schemas = tables_of(info.manifest.schema_version)
    for table in REQUIRED_TABLES:
        schema, files = schemas[table], info.files(table)
        if not files:
            continue
        try:
            found: pa.Schema = pq.read_schema(files[0])
        except (OSError, pa.ArrowInvalid) as err:
            raise StoreError(f"{files[0]}: unreadable Parquet ({err}); re-extract it") from err
        if not found.equals(schema, check_metadata=False):
            raise StoreError(
                f"{files[0]}: columns do not match the {table} schema of this layerdiv "
                "version; re-extract with --overwrite"
            )
