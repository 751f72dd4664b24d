"""Reading a store: checked manifests, DuckDB views and Polars frames over complete chunks only.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Generic, cast

import duckdb
import polars as pl
import pyarrow as pa

from layerdiv.errors import LayerdivError
from layerdiv.schemas import (
    KIND_OF_TABLE,
    KINDS,
    TABLES,
    Kind,
    SchemaError,
    tables_of,
)
from layerdiv.store.atomic import restore
from layerdiv.store.key import KEY, PartitionKey
from layerdiv.store.location import (
    RemotePath,
    StorePath,
    arrow_source,
    read_batches,
    read_schema,
    read_table,
    store_root,
)
from layerdiv.store.manifest import Manifest, read_manifest
from layerdiv.store.paths import Partition, list_partitions, slug


class StoreError(LayerdivError, RuntimeError):
    """The store is empty, unreadable, or holds nothing that matches the request."""


Names = str | Iterable[str]
"""One name, or any number of them (an empty list: no filter)."""


def as_names(names: Names) -> list[str]:
    """``names`` as a list: a single string is one name, not its letters."""
    return [names] if isinstance(names, str) else list(names)


@dataclass(frozen=True)
class PartitionInfo(Generic[StorePath]):
    """A checked partition (local or remote) and its complete part files."""

    partition: Partition[StorePath]
    manifest: Manifest

    def __repr__(self) -> str:
        m = self.manifest
        extra = f", tables +{'+'.join(m.extra_tables)}" if m.extra_tables else ""
        return (
            f"PartitionInfo({', '.join(c + '=' + repr(v) for c, v in self.key.items())}: "
            f"{self.n_done} of "
            f"{m.n_requested} instances, {len(m.components)} components, {len(m.options)} "
            f"options{extra})"
        )

    @property
    def key(self) -> PartitionKey:
        return self.partition.key

    def key_columns(self) -> list[pl.Expr]:
        """The key as literal columns (strings), to tag rows read from this partition."""
        return [pl.lit(v, pl.String).alias(c) for c, v in self.key.items()]

    @property
    def model(self) -> str:
        return self.partition.model_slug

    @property
    def task(self) -> str:
        return self.partition.task

    @cached_property
    def done(self) -> list[tuple[int, int]]:
        """(start, count) of the complete chunks, listed once: every table is read over this
        one set of chunks, however long the reading takes (an extraction may be adding some)."""
        return self.partition.done_parts()

    def files(self, table: str) -> list[StorePath]:
        """The part files of ``table`` of the complete chunks (:attr:`done`); for an optional
        table, of those chunks that have it (:meth:`incomplete` says where some lack it)."""
        part = self.partition
        if table not in self.kind.required and table not in self.lacking:
            return []
        lacking = set(self.lacking.get(table, ()))
        return [part.part(table, s, n) for s, n in self.done if (s, n) not in lacking]

    def uris(self, table: str) -> list[str]:
        """:meth:`files` as Polars reads them: local paths, or URLs of a remote store."""
        return [str(f) for f in self.files(table)]

    def batches(self, table: str, columns: Sequence[str], rows: int) -> Iterator[pa.RecordBatch]:
        """The ``columns`` of ``table`` (:meth:`files`), file by file in order, in record batches
        of at most ``rows`` rows (exactly ``rows`` but the last of each file)."""
        for path in self.files(table):
            yield from read_batches(path, columns, rows)

    @cached_property
    def lacking(self) -> dict[str, list[tuple[int, int]]]:
        """Each optional table the partition has (marked in its manifest folder, or with a part
        of a complete chunk), with the complete chunks that have no part of it: an optional
        table is complete when that list is empty, and only then read (:attr:`tables`)."""
        out = {}
        for table in self.kind.optional:
            missing = self.partition.lacking(table, self.done)
            if table in self.manifest.extra_tables or len(missing) < len(self.done):
                out[table] = missing
        return out

    @property
    def tables(self) -> list[str]:
        """The optional tables every complete chunk of the partition has."""
        return [t for t, missing in self.lacking.items() if not missing]

    def incomplete(self) -> list[str]:
        """One line per optional table that some complete chunk lacks (a kill -9 during
        ``extract --gram``, or shards run with different flags): it is left out of every reader,
        and the line names the command that completes it."""
        return [
            f"{table} left out for {self.where}: {sum(n for _, n in missing)} of its "
            f"{self.n_done} stored {self.kind.units} lack it (the runs that added it stopped, are "
            f"still running, or covered only some {self.kind.units}); complete it with "
            f"`{self.extract_command(table)}`"
            for table, missing in self.lacking.items()
            if missing
        ]

    def extract_command(self, table: str) -> str:
        """The ``layerdiv extract`` command that adds the optional ``table`` to every stored
        instance or document (the
        task as the last run that recorded it gave it: a built-in name or a YAML path)."""
        m = self.manifest
        given = [r["task"] for r in m.runs if isinstance(r.get("task"), str) and r["task"]]
        return (
            f"layerdiv extract --model {m.model} --task {(given or [self.task])[-1]} "
            f"{self.kind.optional[table]} "
            f"--limit {max(m.n_requested, max((s + n for s, n in self.done), default=0))} "
            f"--store {self.partition.root}"
        )

    @property
    def kind(self) -> Kind:
        """The partition's task kind (``layerdiv.schemas.KINDS``): its tables and marker."""
        return KINDS[self.manifest.kind]

    @property
    def n_done(self) -> int:
        return sum(n for _, n in self.done)

    @property
    def where(self) -> str:
        """``partition model=<slug> task=<task>``, for messages."""
        return self.key.where

    def read(
        self, components: Sequence[str], instances: Sequence[str]
    ) -> tuple[pl.DataFrame, pl.DataFrame]:
        """The ``components`` columns of every (instance, component, option) row, sorted by that
        key, and the ``instances`` columns of every instance, sorted by instance.

        Refuses (``StoreError``) rows that do not hold every (instance, component, option) of the
        partition's instances exactly once, and names the file of a part that cannot be read."""
        manifest = self.manifest
        k_opts, n_comp = len(manifest.options), len(manifest.components)
        cells = n_comp * k_opts
        key = (
            pl.col("instance").cast(pl.Int64) * cells
            + pl.col("component").cast(pl.Int64) * k_opts
            + pl.col("option").cast(pl.Int64)
        )
        keys = ["instance", "component", "option"]
        rows = self._collect(
            "components",
            pl.scan_parquet(self.uris("components"))
            .select(*keys, *(c for c in components if c not in keys))
            .with_columns(key.alias("_key")),
        )
        if not rows[
            "_key"
        ].is_sorted():  # extraction writes in order; the store does not promise it
            rows = rows.sort("_key")
        wanted = ["instance", *(c for c in instances if c != "instance")]
        inst = self._collect(
            "instances", pl.scan_parquet(self.uris("instances")).select(wanted).sort("instance")
        )
        # Row r must be cell r % cells of the (r // cells)-th instance: every cell once, no others.
        row = pl.int_range(pl.len(), dtype=pl.Int64)
        expected = (
            pl.lit(inst["instance"].cast(pl.Int64)).gather(row // cells) * cells + row % cells
        )
        covered = (
            rows.height == inst.height * cells
            and rows.select(
                (pl.col("_key") == expected).all()
                & pl.col("option").is_between(0, k_opts - 1).all()
                & pl.col("component").is_between(0, n_comp - 1).all()
            ).item()
            and inst["instance"].is_unique().all()
        )
        if not covered:
            raise StoreError(
                f"{self.where}: its {rows.height} components rows do not hold {inst.height} "
                f"instances x {n_comp} components x {k_opts} options exactly once; re-extract it "
                "with --overwrite"
            )
        return rows.select(*keys, *(c for c in components if c not in keys)), inst

    def _collect(self, table: str, frame: pl.LazyFrame) -> pl.DataFrame:
        """Collect a scan of ``table``'s parts; a part that cannot be read is named."""
        try:
            return frame.collect()
        except (pl.exceptions.PolarsError, OSError) as err:
            for f in self.files(table):
                try:
                    read_table(f)
                except (OSError, pa.ArrowException) as bad:
                    raise StoreError(
                        f"{f}: unreadable part ({_first_line(bad)}); re-extract {self.where} "
                        "with --overwrite"
                    ) from err
            raise


class QueryError(LayerdivError, ValueError):
    """SQL that DuckDB refuses (a table that is not there, a typo)."""


def _held(parts: Sequence[PartitionInfo[Any]]) -> list[str]:
    """The tables ``parts`` hold, in the schemas' order."""
    held = {t for p in parts for t in (*p.kind.required, *p.manifest.extra_tables)}
    return [t for t in TABLES if t in held]


class TableNames(list[str]):
    """Table names (a list) that, called with model and task filters, gives those of a
    selection instead (:attr:`Store.tables`)."""

    def __init__(self, names: Iterable[str], select: Callable[[Names, Names], list[str]]):
        super().__init__(names)
        self._select = select

    def __call__(self, models: Names = (), tasks: Names = ()) -> list[str]:
        return self._select(models, tasks)


class Store:
    """A layerdiv store, in a local folder or (read-only) at a URL of object storage such as
    ``s3://bucket/prefix`` (``layerdiv.store.location``), checked on open: every partition needs
    a readable manifest of a schema version this code reads, and every part file must carry the
    declared schema (checked from the Parquet footers). A partition that fails is set aside in
    :attr:`unreadable`, so that the others stay usable; selecting it by name is an error."""

    def __init__(self, root: str | Path):
        self.root: Path | RemotePath = store_root(root)
        if isinstance(self.root, Path):
            _restore(self.root)
        if isinstance(self.root, RemotePath) and not self.root.is_dir():
            raise StoreError(f"no store at {self.root}: no object has that prefix; check the URL")
        if not self.root.is_dir():
            raise StoreError(f"no store at {self.root}: run `layerdiv extract` first")
        found: list[Partition[Any]] = list_partitions(cast(Any, self.root))  # either kind
        if not found:
            from layerdiv.analyze.output import INDEX_NAME

            if (self.root / INDEX_NAME).is_file():
                raise StoreError(
                    f"{self.root} is a folder of analysis results (`layerdiv analyze` wrote it), "
                    f"not a store: open the store its {INDEX_NAME} names under settings.store"
                )
            if any(True for _ in self.root.iterdir()):
                raise StoreError(
                    f"{self.root} holds no layerdiv partition (no manifests or table folders "
                    "with data): give the folder of a store (where `layerdiv extract --store` "
                    "wrote)"
                )
            raise StoreError(f"the store {self.root} is empty: run `layerdiv extract` first")
        self.partitions: list[PartitionInfo[Any]] = []
        self.unreadable: list[tuple[Partition[Any], StoreError]] = []
        """Partitions that cannot be read, each with the error that says why."""
        for part in found:
            try:
                self.partitions.append(_open_partition(part))
            except StoreError as err:
                self.unreadable.append((part, err))

    def __repr__(self) -> str:
        models = {p.model for p in self.partitions}
        tasks = {p.task for p in self.partitions}
        bad = f", {len(self.unreadable)} unreadable" if self.unreadable else ""
        return (
            f"Store({str(self.root)!r}): {_count(len(models), 'model')} x "
            f"{_count(len(tasks), 'task')}, {_count(len(self.partitions), 'partition')}{bad}"
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            "<tr>"
            + "".join(
                f"<td>{html.escape(str(v))}</td>"
                for v in (
                    *p.key.values(),
                    f"{p.n_done} of {p.manifest.n_requested}",
                    len(p.manifest.components),
                    len(p.manifest.options),
                    ", ".join(p.manifest.extra_tables),
                )
            )
            + "</tr>"
            for p in self.partitions
        )
        bad = "".join(f"<li>{html.escape(str(err))}</li>" for _, err in self.unreadable)
        head = "".join(
            f"<th>{h}</th>" for h in (*KEY, "instances", "components", "options", "optional tables")
        )
        return (
            f"<p><b>Store</b> <code>{html.escape(str(self.root))}</code></p>"
            f"<table><tr>{head}</tr>{rows}</table>"
            + (f"<p>Unreadable partitions:</p><ul>{bad}</ul>" if bad else "")
        )

    @property
    def tables(self) -> TableNames:
        """The tables the store's partitions with data hold (a list: ``store.tables``); called
        with filters, those of a selection (``store.tables(models, tasks)``): the required ones,
        and each optional one that some of them hold (the views of :meth:`duckdb`)."""
        return TableNames(_held([p for p in self.partitions if p.n_done > 0]), self._tables)

    def _tables(self, models: Names = (), tasks: Names = ()) -> list[str]:
        return _held(self.select(models, tasks))

    def select(
        self, models: Names = (), tasks: Names = (), require_data: bool = True
    ) -> list[PartitionInfo[Any]]:
        """Readable partitions matching the model (id or slug) and task filters (empty filter:
        all). Refuses a filter that names an unreadable partition, and a selection that is
        empty."""
        models, tasks = as_names(models), as_names(tasks)
        match = _matcher(models, tasks)
        broken = [err for part, err in self.unreadable if match(part)]
        if broken and (models or tasks):
            raise broken[0]
        chosen = [
            p for p in self.partitions if match(p.partition) and (p.n_done > 0 or not require_data)
        ]
        if not chosen:
            if broken:
                raise broken[0]
            have = ", ".join(p.key.label for p in self.partitions) or "nothing"
            raise StoreError(
                f"no extracted data matches models={sorted(slug(m) for m in models) or 'any'} "
                f"tasks={sorted(tasks) or 'any'}; the store holds: {have}"
            )
        return chosen

    def problems(self, models: Names = (), tasks: Names = ()) -> list[str]:
        """One line per unreadable partition matching the filters, saying it was left out."""
        match = _matcher(as_names(models), as_names(tasks))
        return [f"left out {part.key.where}: {err}" for part, err in self.unreadable if match(part)]

    def incomplete(self, models: Names = (), tasks: Names = ()) -> list[str]:
        """One line per optional table of a selected partition that some of its stored instances
        lack (:meth:`PartitionInfo.incomplete`): left out of every view and analysis."""
        parts = self.select(models, tasks, require_data=False)
        return [line for p in parts for line in p.incomplete()]

    def files(self, table: str, parts: list[PartitionInfo[Any]]) -> list[str]:
        """The part files of ``table`` of ``parts`` as Polars reads them (paths or URLs)."""
        return [f for p in parts for f in p.uris(table)]

    def scan(
        self,
        table: str,
        models: Names = (),
        tasks: Names = (),
        *,
        model: Names = (),
        task: Names = (),
    ) -> pl.LazyFrame:
        """A Polars LazyFrame over one table of the selected partitions (``components``,
        ``instances``, or an optional table that some of them hold), with the key columns;
        text columns are ``String``, as in every result table. ``model=`` and ``task=`` are the
        same filters as ``models=`` and ``tasks=``. Refuses (``StoreError``) a table that no
        selected partition holds, naming those there are."""
        if (model and models) or (task and tasks):
            raise StoreError("give models= or model=, tasks= or task=, not both")
        models, tasks = models or model, tasks or task
        parts = self.select(models, tasks)
        have = self.tables(models, tasks)
        if table not in have:
            kind = KIND_OF_TABLE.get(table)
            flag = (
                f" (extract with {kind.optional[table]} to add it)"
                if kind and table in kind.optional
                else ""
            )
            raise StoreError(
                f"no table {table!r} in the selected partitions{flag}; their tables are "
                f"{', '.join(have)}"
            )
        # Every version's parts under today's columns: a column an older part lacks is null.
        columns = pl.DataFrame(pl.from_arrow(TABLES[table].empty_table())).schema
        frame = pl.scan_parquet(
            self.files(table, parts),
            schema=columns,
            hive_partitioning=True,
            hive_schema=dict.fromkeys(KEY, pl.String),
            missing_columns="insert",
        )
        text = [c for c, t in columns.items() if isinstance(t, pl.Categorical | pl.Enum)]
        return frame.with_columns(pl.col(text).cast(pl.String)) if text else frame

    def manifests(self, models: Names = (), tasks: Names = ()) -> pl.DataFrame:
        """One row per partition: provenance and progress (``n_done`` of ``n_requested``)."""
        rows = []
        for p in self.select(models, tasks, require_data=False):
            m = p.manifest
            kinds = [c.kind for c in m.components]
            rows.append(
                {
                    **dict(p.key.items()),
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
                    "kind": m.kind,
                    "tables": ", ".join(
                        t if not lack else f"{t} (incomplete)" for t, lack in p.lacking.items()
                    ),
                    "options": m.options,
                    "n_requested": m.n_requested,
                    "n_done": p.n_done,
                    "approximate": m.approximate,
                    "schema_version": m.schema_version,
                    "created_at": m.created_at,
                    "weights": m.weights,
                }
            )
        return pl.DataFrame(rows, schema_overrides={"weights": pl.String})

    def query(self, sql: str, models: Names = (), tasks: Names = ()) -> pl.DataFrame:
        """Run SQL against the views of :meth:`duckdb` (``layerdiv.query``); the result of the
        last statement, as a Polars frame. SQL that DuckDB refuses raises a ``QueryError`` naming
        the views."""
        con = self.duckdb(models, tasks)
        try:
            relation = con.sql(sql)
            return relation.pl() if relation is not None else pl.DataFrame()
        except duckdb.Error as err:
            views = ", ".join([*self.tables(models, tasks), "manifests"])
            first = str(err).strip().splitlines()[0]
            raise QueryError(f"{first} (the views of this store are {views})") from err

    def duckdb(self, models: Names = (), tasks: Names = ()) -> duckdb.DuckDBPyConnection:
        """An in-memory DuckDB connection with the view ``manifests`` and a view of every table
        (``layerdiv.schemas.TABLES``) the selected partitions hold: the required tables of their
        task kinds (``components`` and ``instances``; ``documents``, ``tokens`` and
        ``token_blocks``) and each optional one over the partitions that hold it for every stored
        instance or document (:meth:`incomplete` names the others), and no file-system access:
        SQL run on it
        cannot read or write any file (the views scan the checked parts through Arrow), so the
        store cannot be changed through it."""
        import pyarrow.dataset as ds  # only here: it takes a third of a second to import

        models, tasks = as_names(models), as_names(tasks)
        parts = self.select(models, tasks)
        con = duckdb.connect(config={"enable_external_access": False})
        for table in TABLES:
            whole = [p for p in parts if table in p.kind.required or table in p.tables]
            files = [f for p in whole for f in p.files(table)]
            if not files:
                continue
            # Every version's columns under today's schema: a column an older part lacks is null.
            schema = TABLES[table]
            for name in KEY:
                schema = schema.append(pa.field(name, pa.string()))
            paths, filesystem, base = arrow_source(files, self.root / table)
            dataset = ds.dataset(
                paths,
                filesystem=filesystem,
                schema=schema,
                format="parquet",
                partitioning=ds.partitioning(
                    pa.schema([pa.field(n, pa.string()) for n in KEY]),
                    flavor="hive",
                ),
                partition_base_dir=base,
            )
            con.register(table, dataset)
        con.register("manifests", self.manifests(models, tasks).to_arrow())
        con.execute("SET lock_configuration = true")
        return con


def _restore(root: Path) -> None:
    """Put back a store folder that a killed replacement (``merge``) left aside
    (:func:`~layerdiv.store.atomic.restore`); a read-only folder is read as it is."""
    with contextlib.suppress(OSError):
        restore(root)


def _matcher(models: list[str], tasks: list[str]) -> Callable[[Partition[Any]], bool]:
    want_models, want_tasks = {slug(m) for m in models}, set(tasks)
    return lambda p: (
        (not want_models or p.model_slug in want_models)
        and (not want_tasks or p.task in want_tasks)
    )


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _open_partition(part: Partition[StorePath]) -> PartitionInfo[StorePath]:
    """A partition's checked manifest and part files; ``StoreError`` says what is wrong."""
    if not part.manifest.exists():
        raise StoreError(
            f"{part.key.where} has data but no manifest ({part.manifest}): it cannot be trusted. "
            "Delete it or re-extract it with --overwrite."
        )
    try:
        info = PartitionInfo(part, read_manifest(part.manifest))
    except SchemaError as err:
        raise StoreError(str(err)) from err
    _check_part_schemas(info)
    return info


def _check_part_schemas(info: PartitionInfo[Any]) -> None:
    """Check every part of each table against the schema of the partition's version (cheap:
    Parquet footers only)."""
    schemas = tables_of(info.manifest.schema_version)
    for table in (*info.kind.required, *info.lacking):
        for f in info.files(table):
            try:
                found: pa.Schema = read_schema(f)
            except (OSError, pa.ArrowException) as err:
                raise StoreError(
                    f"{f}: unreadable Parquet ({_first_line(err)}); re-extract {info.where} "
                    "with --overwrite"
                ) from err
            if not found.equals(schemas[table], check_metadata=False):
                raise StoreError(
                    f"{f}: columns do not match the {table} schema of version "
                    f"{info.manifest.schema_version}; re-extract {info.where} with --overwrite"
                )
