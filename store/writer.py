"""Writing a (model, task) partition: atomic parts, chunk claims, run records, verified resume
and refusal of mixed provenance.

Every write is atomic (:mod:`layerdiv.store.atomic`) and nothing read-modify-writes a shared
file: the manifest is created once (exclusively), each run writes its own record, each optional
table its own marker, each chunk its own parts. Processes writing into one partition at once
(shards, or two runs started by accident) coordinate through one lock file per chunk of the
partition's fixed chunk grid.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from layerdiv.errors import LayerdivError
from layerdiv.measurements import (
    all_optional_tables,
    measurement_of,
    registered,
    table_schemas,
    tables_of_kind,
)
from layerdiv.measurements.registry import SETTINGS_KEY, MeasurementError, as_json
from layerdiv.schemas import TABLES, WHOLE_TABLES, SchemaError, schema_matches
from layerdiv.schemas.kinds import KINDS
from layerdiv.store.atomic import (
    atomic_path,
    host,
    remove_stale_temps,
    temp_path,
    write_bytes,
)
from layerdiv.store.key import DEFAULT_REVISION, PartitionKey
from layerdiv.store.manifest import (
    RUNS_DIR,
    TABLES_DIR,
    Identity,
    Manifest,
    read_manifest,
    write_manifest,
)
from layerdiv.store.parts import StoreError, read_whole
from layerdiv.store.paths import Partition, list_partitions, partition, slug

CLAIMS_DIR = "claims"
"""Folder (beside ``manifest.json``) of the chunk claim lock files."""


ROW_GROUP_BYTES = 16 * 2**20
"""About the bytes of one Parquet row group of a table with wide rows (:func:`row_group_rows`)."""


def row_group_rows(schema: pa.Schema) -> int:
    """Rows per Parquet row group: 2^20, fewer for a table whose rows hold fixed-size lists
    (the residual states: about :data:`ROW_GROUP_BYTES` per group), so that the writer's
    buffers for one group (the values and their list levels) are reused by the next rather
    than allocated afresh for the whole part (the first write of a 130 MB part took twice the
    time of the next in one group, as much as the next in groups of 16 MiB)."""
    width = sum(
        f.type.list_size * f.type.value_type.bit_width // 8
        for f in schema
        if pa.types.is_fixed_size_list(f.type)
    )
    return max(1024, min(1 << 20, ROW_GROUP_BYTES // width)) if width else 1 << 20


def _float_list(kind: pa.DataType) -> bool:
    """A list or fixed-size list of floats (a stored vector: the residual states, the Gram rows)."""
    lists = pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind)
    return lists and pa.types.is_floating(kind.value_type)


def _not_finite(data: pa.Table) -> str | None:
    """The first float column of ``data`` (or list of floats, at any depth) holding a NaN or an
    infinite value (nulls are not values), or None."""
    for name, column in zip(data.column_names, data.columns, strict=True):
        values: pa.ChunkedArray | pa.Array = column
        while (
            pa.types.is_list(values.type)
            or pa.types.is_large_list(values.type)
            or (pa.types.is_fixed_size_list(values.type))
        ):
            values = pc.list_flatten(values)
        if pa.types.is_floating(values.type) and pc.any(pc.invert(pc.is_finite(values))).as_py():
            return name
    return None


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The columns worth dictionary-encoding in Parquet: all but the floating-point ones (and
    lists of them), whose values rarely repeat, so that a dictionary only adds its indices (the
    docs page "The store", "Scale of a store", has the bytes measured with and without)."""
    return [f.name for f in schema if not (pa.types.is_floating(f.type) or _float_list(f.type))]


def statistics_columns(schema: pa.Schema) -> list[str]:
    """The columns whose Parquet pages carry min/max statistics: all but lists of floats, whose
    elements' range prunes nothing (and costs a third of a float16 states part's write time)."""
    return [f.name for f in schema if not _float_list(f.type)]


def _has_data(part: Partition) -> bool:
    """Any file but temporaries (dot files) in the partition's folders."""
    return any(not p.name.startswith(".") for d in part.dirs() if d.is_dir() for p in d.iterdir())


class StoreConflict(LayerdivError, RuntimeError):
    """The partition holds another extraction, or data that cannot be trusted."""


class StoreUnwritable(LayerdivError, RuntimeError):
    """The store folder cannot be created or written."""


def flock(fd: int, mode: int, path: Path) -> None:
    """``fcntl.flock`` on the open lock file ``path``; a file system without advisory locks
    (``ENOLCK``, ``EOPNOTSUPP``, ``ENOSYS``: NFS without lockd, Lustre mounted without
    ``-o flock``) is a ``StoreUnwritable`` that names the path and what to do."""
    try:
        fcntl.flock(fd, mode)
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        raise StoreUnwritable(
            f"{path}: the store's file system does not support locks ({err.strerror}); give a "
            "--store on a local or lock-capable file system (NFS with lockd, Lustre mounted "
            "with -o flock), or extract locally and `layerdiv merge` the stores"
        ) from err


@contextmanager
def partition_lock(part: Partition) -> Iterator[None]:
    """Hold the lock that serializes the creation, replacement and redos of partition
    ``part`` (``Partition.open_lock``), waiting for another process that holds it."""
    lock = part.open_lock
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        flock(fd, fcntl.LOCK_EX, lock)
        yield
    finally:
        os.close(fd)


class Verdict(Enum):
    """What opening a partition for a run will do."""

    NEW = "new"
    RESUME = "resume"
    REPLACE = "replace"


class ChunkClaim:
    """An exclusive lock on one chunk of the grid, held while the chunk is computed and written;
    the operating system releases it if the process dies."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


@dataclass
class RunRecord:
    """This run's record file (``runs/<utc-time>-<host>-<pid>.json``), written when the run
    starts and replaced when it ends; only this process writes it."""

    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    def write(self, **fields: Any) -> None:
        self.data.update(fields)
        write_bytes(self.path, json.dumps(self.data, indent=2, sort_keys=True).encode())


def one_checkpoint_twice(
    key: PartitionKey, weights_hash: str | None, other: Partition[Any], stored: Manifest
) -> str | None:
    """The rule against one checkpoint under two names, for ``extract`` and ``merge`` alike:
    weights of fingerprint ``weights_hash`` (``Manifest.weights_hash``) stored as ``key`` equal
    those of ``other`` (manifest ``stored``), another revision of the same model. The problem in
    words, or None (another model or revision, or a fingerprint not recorded: before schema
    version 5)."""
    if (
        other.key.model != key.model
        or other.key.revision == key.revision
        or weights_hash is None
        or stored.weights_hash != weights_hash
    ):
        return None
    return (
        f"the weights of {stored.model} revision {key.revision} equal those stored as "
        f"revision {other.key.revision} (fingerprint {weights_hash[:12]}, "
        f"{other.manifest.parent}): one checkpoint under two names"
    )


def stamp(table: str, settings: Mapping[str, Any] | None) -> dict[bytes, bytes]:
    """The key-value metadata that records, in a part of the optional ``table``, the settings of
    the measurement writing it as ``settings`` (by measurement, a manifest's) holds them: none for
    a measurement without settings or one ``settings`` lacks."""
    m = measurement_of(table)
    values = None if settings is None or not m.settings else settings.get(m.name)
    if values is None:
        return {}
    return {SETTINGS_KEY: json.dumps(values, sort_keys=True).encode()}


def write_part_file(path: Path, table: str, data: pa.Table, stamp: Mapping[bytes, bytes]) -> None:
    """Atomically write ``data`` as a part file of ``table`` at ``path``, its key-value metadata
    the schema's and ``stamp`` (:func:`stamp`)."""
    schema = table_schemas()[table]
    with atomic_path(path) as tmp:
        pq.write_table(
            data.replace_schema_metadata({**(schema.metadata or {}), **stamp}),
            tmp,
            compression="zstd",
            row_group_size=row_group_rows(data.schema),
            use_dictionary=dictionary_columns(data.schema),
            write_statistics=statistics_columns(data.schema),
            write_page_checksum=True,  # readers verify them (store.location.open_parquet)
        )


def write_whole_file(path: Path, table: str, data: pa.Table, stamp: Mapping[bytes, bytes]) -> None:
    """Atomically write ``data`` as the one file of ``table``, a table stored once per
    partition, at ``path``, its key-value metadata the schema's and ``stamp``."""
    with atomic_path(path) as tmp:
        pq.write_table(
            data.replace_schema_metadata({**(TABLES[table].metadata or {}), **stamp}),
            tmp,
            compression="zstd",
            write_page_checksum=True,
        )


def refuse_other_settings(
    where: Path, stored: Mapping[str, Mapping[str, Any]], settings: Mapping[str, Any]
) -> None:
    """Refuse (``StoreConflict``) the ``settings`` of a measurement (by name) other than those
    the partition's manifest at ``where`` records (``stored``), naming both and what to do: the
    one rule for ``extract``'s plan (before anything is written) and its writer (under the
    partition's lock)."""
    for name, values in settings.items():
        if name in stored and as_json(values) != stored[name]:
            m = next(m for m in registered() if m.name == name)
            raise StoreConflict(
                f"{where}: the stored {name} was extracted with {m.describe(stored[name])}, "
                f"this run asks for {m.describe(values)}; drop these options to keep the stored "
                f"ones, give --redo {name} to extract it again with them (the other measurements "
                "kept), or use --overwrite"
            )


class PartitionWriter:
    """Writes one partition's chunks; a rerun skips every chunk that is complete and readable."""

    def __init__(self, root: str | Path, model: str, task: str, revision: str = DEFAULT_REVISION):
        self.part: Partition = partition(root, PartitionKey(slug(model), slug(revision), task))
        self._claims = self.part.dir("manifests") / CLAIMS_DIR
        self._opened: Manifest | None = None
        """The manifest as :meth:`open` left it (its generation and settings are this run's)."""

    def ensure_writable(self) -> None:
        """Refuse a store folder that cannot be created or written (before any model loads)."""
        root = self.part.root
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = temp_path(root / "write-test")
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise StoreUnwritable(
                f"cannot write the store {root} ({err.strerror or err}): give a writable --store"
            ) from err

    def check(self, identity: Identity, overwrite: bool, shards: int = 1) -> Verdict:
        """What opening the partition for ``identity`` will do, refusing (before anything is
        written) a different or untrusted stored extraction unless ``overwrite``.

        With ``overwrite`` and ``shards`` > 1, only a partition that holds another extraction is
        replaced; one that holds this extraction is resumed (another shard replaced it already),
        so that the replacement happens once per extraction, not once per shard.
        """
        older = self.part.older()
        if older is not None and _has_data(older):
            if overwrite:
                return Verdict.REPLACE
            raise StoreConflict(
                f"{older.manifest.parent} holds this partition in the layout of schema version 4 "
                "or older: pass --overwrite to re-extract it, or use another --store"
            )
        if not self.part.manifest.exists():
            if not _has_data(self.part):
                return Verdict.NEW
            if overwrite:
                return Verdict.REPLACE
            raise StoreConflict(
                f"{self.part.manifest.parent} has data but no manifest: it cannot be trusted. "
                "Delete it or re-extract with --overwrite."
            )
        try:
            diff = read_manifest(self.part.manifest).identity().differences(identity)
        except SchemaError:
            if overwrite:
                return Verdict.REPLACE
            raise
        if diff and not overwrite:
            raise StoreConflict(
                f"{self.part.manifest.parent} holds a different extraction ({'; '.join(diff)}). "
                "Pass --overwrite to replace it, or use another --store."
            )
        if diff or (overwrite and shards == 1):
            return Verdict.REPLACE
        return Verdict.RESUME

    def open(self, manifest: Manifest, overwrite: bool, shards: int = 1) -> Manifest:
        """Create (or replace, see :meth:`check`) the partition and return the stored manifest
        (its chunk grid is the partition's, whatever this run asked for). A replacement's
        generation is one more than the replaced one's. The settings of ``manifest``'s
        measurements are recorded for those the partition has none of; settings other than those
        recorded are refused (``StoreConflict``: two runs started at once with other settings)."""
        with partition_lock(self.part):  # one process at a time decides and replaces
            if self.check(manifest.identity(), overwrite, shards) is Verdict.REPLACE:
                manifest.generation = self._generation() + 1
                older = self.part.older()
                for d in [*self.part.dirs(), *(older.dirs() if older else [])]:
                    shutil.rmtree(d, ignore_errors=True)
            write_manifest(self.part.manifest, manifest, exclusive=True)
            required = {self.part.dir(t) for t in KINDS[manifest.kind].required}
            for d in self.part.dirs(manifest.kind):
                if d in required:  # an optional table's folder comes with its first part
                    d.mkdir(parents=True, exist_ok=True)
                remove_stale_temps(d)
            for sub in (RUNS_DIR, TABLES_DIR):
                remove_stale_temps(self.part.manifest.parent / sub)
            stored = read_manifest(self.part.manifest)
            self._refuse_other_settings(stored, manifest.settings)
            if any(name not in stored.settings for name in manifest.settings):
                stored.settings = {**manifest.settings, **stored.settings}
                write_manifest(self.part.manifest, stored)
        self._opened = read_manifest(self.part.manifest)
        return self._opened

    def _generation(self) -> int:
        """The stored manifest's generation (-1: none that can be read)."""
        try:
            return read_manifest(self.part.manifest).generation
        except (SchemaError, OSError):
            return -1

    def _refuse_other_settings(self, stored: Manifest, settings: Mapping[str, Any]) -> None:
        """Refuse ``settings`` (by measurement) other than those ``stored`` records."""
        refuse_other_settings(self.part.manifest, stored.settings, settings)

    def recheck(self) -> None:
        """Refuse to write on (``StoreConflict``) when the partition is no longer the one this
        run opened: replaced by another run's ``--overwrite`` (another generation), or its
        settings changed. Called under each chunk's claim, before its parts are written."""
        opened = self._opened
        if opened is None:
            return
        try:  # the manifest file alone (not its run records): once or twice per chunk
            now = read_manifest(self.part.manifest, listed=())
        except SchemaError:
            now = None
        if now is None or now.generation != opened.generation:
            raise StoreConflict(
                f"{self.part.manifest.parent} was replaced by another run (--overwrite) while "
                "this run wrote it: this run stopped; rerun it to extend the new extraction"
            )
        self._refuse_other_settings(now, opened.settings)

    def refuse_same_weights(self, weights_hash: str) -> None:
        """Refuse (``StoreConflict``) weights that the store holds under another revision of the
        same model (:func:`one_checkpoint_twice`)."""
        key = self.part.key
        read: set[str] = set()
        for other in list_partitions(self.part.root):
            if other.key.model != key.model or other.key.revision in read | {key.revision}:
                continue
            read.add(other.key.revision)
            try:
                stored = read_manifest(other.manifest)
            except (SchemaError, OSError):
                continue  # no trusted fingerprint there
            if problem := one_checkpoint_twice(key, weights_hash, other, stored):
                raise StoreConflict(f"{problem}; extract it once")

    def start_run(self, record: dict[str, Any]) -> RunRecord:
        """Write this run's record (it adds ``started_at``, ``host`` and ``pid``)."""
        now = datetime.now(timezone.utc)
        name = f"{now.strftime('%Y%m%dT%H%M%S.%fZ')}-{host()}-{os.getpid()}.json"
        run = RunRecord(self.part.manifest.parent / RUNS_DIR / name)
        run.write(
            started_at=now.isoformat(timespec="seconds"), host=host(), pid=os.getpid(), **record
        )
        return run

    def mark_table(self, table: str) -> None:
        """Record that the partition has the optional ``table`` (an exclusive marker file)."""
        optional = all_optional_tables()
        if table not in optional:
            raise ValueError(f"{table} is not an optional table ({', '.join(optional)})")
        write_bytes(self.part.manifest.parent / TABLES_DIR / table, b"", exclusive=True)

    def try_claim(self, chunk: int) -> ChunkClaim | None:
        """Claim chunk ``chunk`` of the grid, or None if another live process holds it."""
        try:
            return self._lock(chunk, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None

    def claim(self, chunk: int) -> ChunkClaim:
        """Claim chunk ``chunk`` of the grid, waiting while another process holds it."""
        return self._lock(chunk, fcntl.LOCK_EX)

    def _lock(self, chunk: int, mode: int) -> ChunkClaim:
        self._claims.mkdir(parents=True, exist_ok=True)
        path = self._claims / f"chunk-{chunk:07d}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flock(fd, mode, path)
        except BaseException:
            os.close(fd)
            raise
        return ChunkClaim(fd)

    def done_instances(self, manifest: Manifest | None = None) -> set[int]:
        """Instances (documents) stored in complete chunks; with the partition's ``manifest``,
        only in chunks whose parts are readable and hold the right row counts."""
        parts = self.part.done_parts()
        if manifest is not None:
            bad = set(self.unreadable(parts, manifest))
            parts = [p for p in parts if p not in bad]
        return {i for start, n in parts for i in range(start, start + n)}

    def unreadable(self, parts: list[tuple[int, int]], manifest: Manifest) -> list[tuple[int, int]]:
        """The complete chunks among ``parts`` with a part (of any table) whose Parquet footer
        cannot be read or whose row count is wrong (a truncated or damaged file)."""
        return [(s, n) for s, n in parts if not self._readable(s, n, manifest)]

    def _readable(self, start: int, count: int, manifest: Manifest) -> bool:
        kind = KINDS[manifest.kind]
        try:
            n_tokens = 0
            if kind.per_token:  # the marker (documents) says how many tokens the chunk has
                docs = pq.read_table(
                    self.part.part(kind.marker, start, count), columns=["n_tokens"]
                )
                n_tokens = int(docs["n_tokens"].to_numpy().sum())
            rows = {}
            for table in tables_of_kind(kind.name):
                path = self.part.part(table, start, count)
                if table in kind.required or path.exists():
                    meta = pq.read_metadata(path)
                    if manifest.settings_problem(table, meta.metadata):
                        return False  # a part of another extraction's settings: redone
                    rows[table] = meta.num_rows
        except (OSError, pa.ArrowInvalid):
            return False
        return manifest.wrong_rows(count, rows, n_tokens) is None

    def remove_chunk(self, start: int, count: int) -> None:
        """Delete a chunk's parts, the completion marker first."""
        markers = [k.marker for k in KINDS.values()]
        for table in (*markers, *(t for t in table_schemas() if t not in markers)):
            self.part.part(table, start, count).unlink(missing_ok=True)

    def write_chunk(self, start: int, count: int, tables: Mapping[str, pa.Table]) -> None:
        """Write one chunk: optional tables first, then the required ones, the kind's marker
        (``instances``, ``documents``) last. The tables are checked together first
        (:meth:`check_parts`): nothing of a chunk that fails is written."""
        kind = next((k for k in KINDS.values() if k.marker in tables), None)
        missing = [t for t in kind.required if t not in tables] if kind else ["instances"]
        if kind is None or missing:
            raise ValueError(f"chunk {start}: no {', '.join(missing)} table")
        self.check_parts(start, count, tables)
        order = sorted(
            tables, key=lambda t: kind.required.index(t) + 1 if t in kind.required else 0
        )
        for table in order:
            self.write_table_part(table, start, count, tables[table])

    def check_parts(self, start: int, count: int, tables: Mapping[str, pa.Table]) -> None:
        """Refuse parts of the chunk at ``start`` that readers would refuse: a table that does not
        match its schema (``SchemaError``), a row count that cannot be right
        (``Manifest.wrong_rows``, the readers' rule), or, in a table of a measurement declared
        outside layerdiv, a float that is not finite (NaN or infinite; null where its schema
        allows). A measurement's table is refused naming it (``MeasurementError``)."""
        schemas = table_schemas()
        for table, data in tables.items():
            schema = schemas.get(table)
            if schema is None:
                raise ValueError(f"unknown table {table!r}; tables: {', '.join(schemas)}")
            if not schema_matches(table, data.schema, schema):
                raise self._refusal(
                    start, table, f"{table} table does not match its schema\n{data.schema}"
                )
        manifest = self._manifest()
        per_token = manifest is not None and KINDS[manifest.kind].per_token
        n_tokens = self._n_tokens(start, count, tables) if per_token else 0
        if manifest is not None and n_tokens is not None:
            rows = {t: d.num_rows for t, d in tables.items()}
            wrong = manifest.wrong_rows(count, rows, n_tokens)
            if wrong is not None:
                raise self._refusal(start, wrong[0], f"{wrong[0]}: {wrong[1]}")
        for table, data in tables.items():
            column = None if table in TABLES else _not_finite(data)
            if column is not None:
                raise self._refusal(start, table, f"{table}.{column} holds NaN or infinite values")

    def _refusal(self, start: int, table: str, problem: str) -> LayerdivError:
        """The error refusing ``table``'s part of the chunk at ``start``, naming the measurement
        that writes it when it is declared outside layerdiv."""
        m = measurement_of(table) if table in all_optional_tables() else None
        if m is None or not m.modules():
            return SchemaError(f"chunk {start}: {problem}")
        return MeasurementError(
            f"measurement {m.name} ({m.flag}), chunk {start} of {self.part.manifest.parent}: "
            f"{problem.splitlines()[0]}; nothing of this chunk was written"
        )

    def _manifest(self) -> Manifest | None:
        """The manifest this writer opened, else the stored one (None: none yet)."""
        if self._opened is None and self.part.manifest.exists():
            self._opened = read_manifest(self.part.manifest)
        return self._opened

    def _n_tokens(self, start: int, count: int, tables: Mapping[str, pa.Table]) -> int | None:
        """The tokens of a text chunk's documents (its ``documents`` table, given or stored);
        None where neither is there yet (the chunk's other parts are written first)."""
        docs = tables.get("documents")
        if docs is None:
            path = self.part.part("documents", start, count)
            if not path.exists():
                return None
            docs = pq.read_table(path, columns=["n_tokens"])
        return int(pc.sum(docs["n_tokens"]).as_py() or 0)

    def _stamp(self, table: str) -> dict[bytes, bytes]:
        """The key-value metadata of a part of ``table``: the settings of the measurement that
        writes it, as the partition records them (none for a measurement without settings, or
        whose settings the partition does not record: a store written by other means than
        ``extract``)."""
        if table not in all_optional_tables() and table not in WHOLE_TABLES:
            return {}
        manifest = self._manifest()
        return stamp(table, None if manifest is None else manifest.settings)

    def stored_whole(self, table: str) -> pa.Table | None:
        """The partition's stored ``table``, a table stored once per partition
        (``layerdiv.schemas.WHOLE_TABLES``), read against the stored manifest (None: none
        stored), for a resume or another shard to use rather than compute it again."""
        if not self.part.manifest.exists():
            return None
        stored = read_manifest(self.part.manifest)
        return read_whole(self.part.whole(table), table, stored, self.part.key.where)

    def write_whole(self, table: str, data: pa.Table) -> None:
        """Atomically write the one file of ``table``, a table stored once per partition, stamped
        with the settings of the manifest :meth:`open` recorded (before the partition's first
        chunk); one stored with those settings (by a resume, another shard) is kept."""
        if not schema_matches(table, data.schema, TABLES[table]):
            raise SchemaError(f"{table} table does not match its schema\n{data.schema}")
        path = self.part.whole(table)
        manifest = self._manifest()
        try:
            if read_whole(path, table, manifest, self.part.key.where) is not None:
                return
        except StoreError:
            pass  # a damaged file, or one of a replaced extraction: written again
        write_whole_file(path, table, data, self._stamp(table))

    def chunks_missing(self, table: str) -> list[tuple[int, int]]:
        """Complete chunks that lack a part of the optional ``table`` (to backfill it)."""
        return self.part.lacking(table)

    def write_table_part(self, table: str, start: int, count: int, data: pa.Table) -> None:
        """Atomically write ``table``'s part of the chunk at ``start`` (alone, it backfills an
        optional table for an existing chunk), checked first (:meth:`check_parts`)."""
        self.check_parts(start, count, {table: data})
        write_part_file(self.part.part(table, start, count), table, data, self._stamp(table))
