"""Reading a store: checked manifests, DuckDB views and Polars frames over complete chunks only.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import contextlib
import functools
import html
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Generic, cast

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa

from layerdiv.errors import LayerdivError, one_line
from layerdiv.measurements import (
    kind_of_table,
    measurement_of,
    optional_tables,
    table_rules,
    table_schemas,
    tables_of,
)
from layerdiv.schemas import GRIDS, VECTOR_TABLES, Grid, SchemaError
from layerdiv.schemas.kinds import KINDS, Kind
from layerdiv.store.atomic import restore
from layerdiv.store.checks import check_partition, check_sums, grid_problem, stray_parts
from layerdiv.store.key import DEFAULT_REVISION, KEY, MODEL_KEY, PartitionKey
from layerdiv.store.location import (
    RemotePath,
    StorePath,
    file_sizes,
    open_parquet,
    read_batches,
    store_root,
)
from layerdiv.store.manifest import Manifest, read_manifest
from layerdiv.store.parts import (
    StoreError,
    dense,
    in_key_order,
    naming,
    not_finite,
    read_whole,
    refuse_not_finite,
    repeats,
    scan_parts,
    with_defaults,
)
from layerdiv.store.paths import (
    INDEX_NAME,
    MANIFEST_NAME,
    MANIFESTS,
    Partition,
    list_partitions,
    slug,
)
from layerdiv.store.redo import finish as finish_redo
from layerdiv.store.views import MANIFEST_FACTS, MODEL_COLUMNS, NOT_FINITE, connect

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

    def batches(
        self, table: str, columns: Sequence[str], rows: int, unique: Sequence[str] = ()
    ) -> Iterator[pa.RecordBatch]:
        """The ``columns`` of ``table`` (:meth:`files`), file by file in order, in record batches
        of at most ``rows`` rows (exactly ``rows`` but the last of each file); a part that cannot
        be read (a damaged page: its checksum does not match) or holds a NaN or an infinite value
        is a ``StoreError`` naming it, and so is one where two rows share the key columns
        ``unique``, or whose key rows break its table's grid (:meth:`check_keys`; both checked
        after its last batch: rows repeated, out of range or in place of others)."""
        wanted: list[str] = list(columns)
        grid: list[str] = self.grid_columns(table)
        key: list[str] = list(dict.fromkeys([*unique, *grid]))
        read = list(dict.fromkeys([*wanted, *key]))
        schema = table_schemas()[table]
        older = set(read) - set(tables_of(self.manifest.schema_version)[table].names)
        for path in self.files(table):
            keys = []
            with naming(path, self.where):
                for batch in with_defaults(
                    read_batches(path, [c for c in read if c not in older], rows), schema, read
                ):
                    refuse_not_finite(not_finite(batch), table, path, self.where)
                    if key:
                        keys.append(batch.select(key))
                    yield batch if read == wanted else batch.select(wanted)
            if unique and keys and repeats(pa.Table.from_batches(keys).select(list(unique))):
                raise StoreError(
                    f"{path}: rows repeat a ({', '.join(unique)}) key; re-extract {self.where} "
                    "with --overwrite"
                )
            if grid:
                found = pa.Table.from_batches(keys) if keys else _keys(schema, key).empty_table()
                self.check_keys(table, path, found)

    def grid_columns(self, table: str) -> list[str]:
        """The key columns of ``table`` that :meth:`check_keys` reads (its unit's and its
        rules' grid, ``layerdiv.schemas.Rules``); none for a table without a grid."""
        columns: list[str] = [c for c, _ in table_rules(table).grid]
        if not columns:
            return []
        names = table_schemas()[table].names
        return [self.kind.unit if self.kind.unit in names else "doc", *columns]

    def check_keys(self, table: str, path: StorePath, keys: pa.Table) -> None:
        """Refuse (``StoreError`` naming the part) the key rows ``keys`` (:meth:`grid_columns`)
        of ``table``'s part ``path`` that break its grid (:func:`~layerdiv.store.checks.
        grid_problem`: against the units of its chunk and their tokens, and the blocks)."""
        start, count = self._chunks(table)[str(path)]
        ids, n_tokens = self.units
        first, last = np.searchsorted(ids, [start, start + count])
        unit = keys.column_names[0]
        wrong = grid_problem(
            table, keys, unit, (ids[first:last], n_tokens[first:last]), self.manifest.n_blocks
        )
        if wrong:
            raise StoreError(
                f"{path}: {wrong} (rows repeated, out of range or of another {unit}); "
                f"re-extract {self.where} with --overwrite"
            )

    def _chunks(self, table: str) -> dict[str, tuple[int, int]]:
        """Each part of ``table`` (:meth:`files`, by path) with its chunk (start, count)."""
        return {str(self.partition.part(table, s, n)): (s, n) for s, n in self.done}

    @cached_property
    def units(self) -> tuple[np.ndarray, np.ndarray]:
        """The ids of the partition's stored units (instances, documents; sorted) and each one's
        ``n_tokens``, from its complete chunks' markers."""
        marker, unit = self.kind.marker, self.kind.unit
        found = []
        for path in self.files(marker):
            with naming(path, self.where), open_parquet(path) as file:
                found.append(file.read([unit, "n_tokens"], use_threads=False))
        if not found:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        both = pa.concat_tables(found)
        order = np.argsort(both[unit].to_numpy(), kind="stable")
        return (
            both[unit].to_numpy().astype(np.int64)[order],
            both["n_tokens"].to_numpy().astype(np.int64)[order],
        )

    def whole(self, table: str) -> pa.Table | None:
        """The partition's ``table`` stored once per partition (``layerdiv.schemas.WHOLE_TABLES``:
        ``--erase``'s reference means), checked (:func:`~layerdiv.store.parts.read_whole`); None
        where it has none."""
        return read_whole(self.partition.whole(table), table, self.manifest, self.where)

    def scan(self, table: str) -> pl.LazyFrame:
        """A Polars LazyFrame over ``table``'s parts (:meth:`files`), read through Arrow with
        every page's checksum verified: a part that cannot be read, holds a NaN or an infinite
        value, or whose key rows break its table's grid (:meth:`check_keys`) is a
        ``StoreError`` naming it, never numbers (:func:`scan_parts`)."""
        grid: list[str] = self.grid_columns(table)
        check = (grid, functools.partial(self.check_keys, table)) if grid else None
        return scan_parts(self.files(table), table, table_schemas()[table], self.where, check)

    @cached_property
    def lacking(self) -> dict[str, list[tuple[int, int]]]:
        """Each optional table the partition has (marked in its manifest folder, or with a part
        of a complete chunk), with the complete chunks that have no part of it: an optional
        table is complete when that list is empty, and only then read (:attr:`tables`)."""
        out = {}
        for table in optional_tables(self.manifest.kind):
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
        ] + self.stopped()

    def stopped(self) -> list[str]:
        """One line when parts lie outside the complete chunks (a run stopped, or still running,
        before their chunk's marker: ``checks.stray_parts``; refused on open once every run has
        finished), with the command that completes them."""
        stray = {(s, n) for _, s, n in stray_parts(self)}
        if not stray:
            return []
        return [
            f"{sum(n for _, n in stray)} {self.kind.units} of {self.where} have parts but no "
            f"{self.kind.marker} part (a run stopped before it, or is still running): left out; "
            f"complete them with `{self.extract_command()}`"
        ]

    @property
    def task_argument(self) -> str:
        """The task as the last run that recorded it gave it (a built-in name or a YAML path;
        the partition's task name where none did)."""
        given = [
            r["task"] for r in self.manifest.runs if isinstance(r.get("task"), str) and r["task"]
        ]
        return (given or [self.task])[-1]

    def extract_command(self, table: str | None = None) -> str:
        """The ``layerdiv extract`` command that adds the optional ``table`` to every stored
        instance or document (with the settings the partition records for it), or (None) that
        resumes the extraction (the task as the last run that recorded it gave it: a built-in
        name or a YAML path)."""
        m = self.manifest
        revision = "" if m.revision in (None, DEFAULT_REVISION) else f"--revision {m.revision} "
        measure = measurement_of(table) if table else None
        flag = f"{measure.command(m.settings.get(measure.name))} " if measure else ""
        return (
            f"layerdiv extract --model {m.model} {revision}--task {self.task_argument} "
            f"{flag}"
            f"--limit {max(m.n_requested, max((s + n for s, n in self.done), default=0))} "
            f"--store {self.partition.root}"
        )

    @property
    def kind(self) -> Kind:
        """The partition's task kind (``layerdiv.schemas.kinds``): its tables and marker."""
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
        partition's instances exactly once (:func:`~layerdiv.store.parts.dense`), components
        that do not sum to the stored model logits (:func:`~layerdiv.store.checks.check_sums`),
        and names the file of a part that cannot be read or holds a NaN or an infinite value."""
        m = self.manifest
        grid: Grid = GRIDS["components"]
        keys: list[str] = [*grid.units, *grid.cells]
        read = list(dict.fromkeys([*keys, "logit", *components]))
        rows = in_key_order(self.scan("components").select(read).collect(), keys)
        wanted: list[str] = ["instance", *(c for c in instances if c != "instance")]
        both = list(dict.fromkeys([*wanted, "model_logits"]))
        inst = self.scan("instances").select(both).sort("instance").collect()
        n_comp, k_opts = len(m.components), len(m.options)
        cells = pl.DataFrame({"component": np.repeat(np.arange(n_comp), k_opts),
                              "option": np.tile(np.arange(k_opts), n_comp)})  # fmt: skip
        dense(rows, "components", inst.select(grid.units), cells, self.where)
        model = inst["model_logits"].explode().to_numpy()
        if len(model) != inst.height * k_opts:
            raise StoreError(f"{self.where}: its instances hold model logits of other than "
                             f"{k_opts} options; re-extract it with --overwrite")  # fmt: skip
        logits = rows["logit"].to_numpy().reshape(inst.height, n_comp, k_opts)
        check_sums(inst["instance"].to_numpy(), logits.astype(np.float64),
                   model.reshape(-1, k_opts), m, self.where)  # fmt: skip
        return rows.select(*keys, *(c for c in components if c not in keys)), inst.select(wanted)

    def states(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The ``states`` table as arrays: (doc, pos) of every stored row (n, 2; a choice task's
        doc is the instance), their token ids (n,), the states (n, L + 1, d) in the stored
        dtype (float16 or float32; bfloat16 widened to float32) and where each row's token ends
        in the text (n,; ``char_end``, -1 where null or not stored). Refuses a partition without
        complete states, rows that do not hold every layer of every (doc, pos) once in order
        (methods §11; :func:`~layerdiv.store.parts.dense`), and a part holding a NaN or an
        infinite state, naming it."""
        if "states" not in self.tables:
            raise StoreError(
                f"{self.where} has no complete states table; extract it with "
                + (
                    f"`{self.extract_command('states')}`"
                    if "states" in self.manifest.settings
                    else f"`{self.extract_command()} --states 1024` (or all)"
                )
            )
        parts, values = [], []
        for f in self.files("states"):
            with naming(f, self.where), open_parquet(f) as file:
                part = file.read(use_threads=False)
            flat = part["state"].combine_chunks()
            got = flat.values.to_numpy(zero_copy_only=False)
            if pa.types.is_uint16(flat.type.value_type):  # bfloat16 bits: the float32's high half
                got = (got.astype(np.uint32) << 16).view(np.float32)
            if not np.isfinite(got).all():
                refuse_not_finite("state", "states", f, self.where)
            parts.append(part.drop_columns(["state"]))
            values.append(got)
        table = pa.concat_tables(parts)
        layers = self.manifest.n_blocks + 1
        grid: Grid = GRIDS["states"]
        key = cast(pl.DataFrame, pl.from_arrow(table.select([*grid.units, *grid.cells])))
        units = key.select(grid.units).gather_every(layers)
        dense(key, "states", units, pl.DataFrame({"layer": np.arange(layers)}), self.where)
        stacked = np.concatenate(values) if values else np.zeros(0, np.float32)
        width = len(stacked) // max(1, table.num_rows)
        chars = (
            table["char_end"].fill_null(-1).to_numpy()[::layers]
            if "char_end" in table.column_names
            else np.full(units.height, -1, np.int32)
        )
        return (
            units.to_numpy(),
            table["token"].to_numpy()[::layers],
            stacked.reshape(units.height, layers, width),
            chars,
        )


class QueryError(LayerdivError, ValueError):
    """SQL that DuckDB refuses (a table that is not there, a typo)."""


def _held(parts: Sequence[PartitionInfo[Any]]) -> list[str]:
    """The tables ``parts`` hold, in the schemas' order."""
    held = {t for p in parts for t in (*p.kind.required, *p.manifest.extra_tables)}
    return [t for t in table_schemas() if t in held]


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
            if isinstance(self.root, Path):
                with contextlib.suppress(OSError):  # a read-only folder is read as it is
                    finish_redo(part)
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
            started = [p for p in self.partitions if match(p.partition)]
            if started:
                raise StoreError(
                    f"{started[0].where} has a manifest but no complete chunk: its extraction "
                    "stopped (killed) before writing its first chunk, or is still running; "
                    f"resume it with `{started[0].extract_command()}` and the flags it was "
                    "started with"
                )
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

    def verify(self, models: Names = (), tasks: Names = ()) -> None:
        """Read every part of the selected partitions (the views of :meth:`duckdb`) with every
        page's checksum verified; a part that cannot be read, or holds a NaN or an infinite
        value, is a ``StoreError`` naming it (a failed query calls this to say which part failed:
        it reads the whole selection)."""
        for p in self.select(models, tasks):
            for table in (*p.kind.required, *p.tables):
                for path in p.files(table):
                    with naming(path, p.where), open_parquet(path) as file:
                        read = file.read(use_threads=False)
                    refuse_not_finite(not_finite(read), table, path, p.where)

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
        if table in VECTOR_TABLES:
            raise StoreError(
                f"{table} holds vectors of each model's width: read it per partition "
                f"({VECTOR_TABLES[table]})"
            )
        if table not in have:
            kind = kind_of_table(table)
            flag = (
                f" (extract with {optional_tables(kind)[table]} to add it)"
                if kind and table in optional_tables(kind)
                else ""
            )
            raise StoreError(
                f"no table {table!r} in the selected partitions{flag}; their tables are "
                f"{', '.join(have)}"
            )
        # Every version's parts under today's columns: a column an older part lacks is null.
        frame = pl.concat(
            [
                p.scan(table).with_columns(p.key_columns())
                for p in parts
                if table in p.kind.required or table in p.lacking
            ],
            how="vertical",
        )
        columns = frame.collect_schema()
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
                    "commit": m.commit,
                    "step": m.step,
                    "tokens_seen": m.tokens_seen,
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
        return pl.DataFrame(rows, schema_overrides=MANIFEST_FACTS)

    def sizes(self, models: Names = (), tasks: Names = ()) -> pl.DataFrame:
        """One row per partition: its key and ``bytes``, what its files take on disk (every
        table, complete or not, and its manifest)."""
        rows = []
        for p in self.select(models, tasks, require_data=False):
            files = p.partition.stored_files()
            rows.append({**dict(p.key.items()), "bytes": sum(file_sizes(files))})
        return pl.DataFrame(rows, schema={**dict.fromkeys(KEY, pl.String), "bytes": pl.Int64})

    def models(self, models: Names = (), tasks: Names = ()) -> pl.DataFrame:
        """One row per (model, revision) of the selected partitions: what the law of methods §12
        needs to know of a model (``layerdiv.store.views.MODEL_COLUMNS``). Partitions of schema
        version <= 4 did not record them all: their depth is their block calls, the rest null."""
        rows: dict[tuple[str, ...], dict[str, Any]] = {}
        for p in self.select(models, tasks, require_data=False):
            m = p.manifest
            key = dict((c, v) for c, v in p.key.items() if c in MODEL_KEY)
            if rows.get(tuple(key.values()), {}).get("weights_hash") is not None:
                continue  # one partition of a (model, revision) says it (the same weights)
            rows[tuple(key.values())] = {
                **key,
                "model_id": m.model,
                "revision_name": m.revision,
                "commit": m.commit,
                "step": m.step,
                "tokens_seen": m.tokens_seen,
                "width": m.hidden_size,
                "depth": m.n_layers if m.n_layers is not None else m.n_blocks,
                "vocab_size": m.vocab_size,
                "n_params": m.n_params,
                "n_params_non_embedding": m.n_params_non_embedding,
                "weights_hash": m.weights_hash,
            }
        return pl.DataFrame(list(rows.values()), schema=MODEL_COLUMNS).sort(*MODEL_KEY)

    def query(self, sql: str, models: Names = (), tasks: Names = ()) -> pl.DataFrame:
        """Run SQL against the views of :meth:`duckdb` (``layerdiv.query``); the result of the
        last statement, as a Polars frame. SQL that DuckDB refuses raises a ``QueryError`` naming
        the views."""
        con = self.duckdb(models, tasks)
        try:
            relation = con.sql(sql)
            return relation.pl() if relation is not None else pl.DataFrame()
        except duckdb.Error as err:
            raise self.query_error(err, models, tasks) from err

    def query_error(
        self,
        err: Exception,
        models: Names = (),
        tasks: Names = (),
        statement: tuple[int, int] = (1, 1),
    ) -> LayerdivError:
        """DuckDB's refusal or failure of SQL on the views of :meth:`duckdb`, in one line that
        says which ``statement`` (number, of how many) failed and how, and names the views this
        store has; a failure to read a part (a damaged page) or a NaN or an infinite value read
        is the ``StoreError`` naming the part (:meth:`verify`)."""
        tables = [t for t in self.tables(models, tasks) if t not in VECTOR_TABLES]
        views = ", ".join([*tables, "manifests", "models"])
        which = f"statement {statement[0]} of {statement[1]}: " if statement[1] > 1 else ""
        message = one_line(err)
        if isinstance(err, duckdb.PermissionException):
            return QueryError(
                f"{which}{message}: SQL here reads only the views of this store ({views}) and "
                "writes no file; save a result with --out FILE"
            )
        if "reading the stream registered as" in message or NOT_FINITE in message:
            try:
                self.verify(models, tasks)
            except StoreError as named:
                return named
        refused = (duckdb.ParserException, duckdb.CatalogException, duckdb.BinderException)
        kind = "refused" if isinstance(err, refused) else "failed while running"
        return QueryError(f"{which}the SQL {kind}: {message} (the views of this store are {views})")

    def duckdb(self, models: Names = (), tasks: Names = ()) -> duckdb.DuckDBPyConnection:
        """An in-memory DuckDB connection with the views ``manifests``, ``models`` and one of
        every table the selected partitions hold whole (:func:`~layerdiv.store.views.connect`):
        SQL run on it cannot read or write any file, and a NaN or an infinite value it reads is
        an error."""
        models, tasks = as_names(models), as_names(tasks)
        return connect(
            self.root,
            self.select(models, tasks),
            {"manifests": self.manifests(models, tasks), "models": self.models(models, tasks)},
        )


def _keys(schema: pa.Schema, columns: Sequence[str]) -> pa.Schema:
    """The fields ``columns`` of ``schema`` (a part's key rows, however few batches it has)."""
    return pa.schema([schema.field(c) for c in columns])


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


def _open_partition(part: Partition[StorePath]) -> PartitionInfo[StorePath]:
    """A partition's checked manifest and part files; ``StoreError`` says what is wrong."""
    listed = None if part.listing is None else part.listing.get(MANIFESTS, ())
    if MANIFEST_NAME not in listed if listed is not None else not part.manifest.exists():
        raise StoreError(
            f"{part.key.where} has data but no manifest ({part.manifest}): it cannot be trusted. "
            "Delete it or re-extract it with --overwrite."
        )
    try:
        info = PartitionInfo(part, read_manifest(part.manifest, listed))
    except SchemaError as err:
        raise StoreError(str(err)) from err
    check_partition(info)
    return info
