"""Reading the Parquet parts of one table: every page's checksum verified, columns of older
versions filled with their defaults, and every value checked finite, so that a part that cannot be
read, or holds a number no extraction writes, is a ``StoreError`` naming it, never numbers.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from layerdiv.errors import LayerdivError
from layerdiv.schemas import DEFAULT, TABLES
from layerdiv.store.location import StorePath, open_parquet


class StoreError(LayerdivError, RuntimeError):
    """The store is empty, unreadable, or holds nothing that matches the request."""


def not_finite(columns: dict[str, Any] | pa.RecordBatch | pa.Table) -> str | None:
    """The first floating-point column of ``columns`` (Arrow arrays or a batch) holding a NaN or
    an infinite value (null is a value's absence, not a NaN), or None (also for a column of no
    rows: a text partition's part may hold none); lists of floats are checked element by
    element."""
    items = (
        columns.items()
        if isinstance(columns, dict)
        else zip(columns.schema.names, columns.columns, strict=True)
    )
    for name, values in items:
        kind = values.type
        if pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind):
            flat = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
            values, kind = pc.list_flatten(flat), kind.value_type
        if not pa.types.is_floating(kind) or kind == pa.float16():
            continue  # float16 states are checked as numpy arrays (Arrow has no kernels for them)
        if not pc.all(pc.fill_null(pc.is_finite(values), True), min_count=0).as_py():
            return name
    return None


def refuse_not_finite(column: str | None, table: str, path: StorePath, where: str) -> None:
    """Refuse (``StoreError`` naming the part) a ``column`` of ``table`` that :func:`not_finite`
    found holding a NaN or an infinite value."""
    if column is not None:
        raise StoreError(
            f"{path}: {table}.{column} holds a NaN or an infinite value, which no extraction "
            f"writes (a damaged part); re-extract {where} with --overwrite"
        )


def scan_parts(
    files: Sequence[StorePath], table: str, schema: pa.Schema, where: str
) -> pl.LazyFrame:
    """A Polars LazyFrame over Parquet part files of one ``table`` (``schema``: today's columns; a
    column an older part lacks is null, or its declared default: ``schemas.DEFAULT``), read file
    by file through Arrow with every page's checksum verified (Polars' own reader does not verify
    them) and every value read checked finite: a part that cannot be read, or holds a NaN or an
    infinite value, is a ``StoreError`` naming it and ``where`` (its partition)."""
    from polars.io.plugins import register_io_source

    columns = pl.DataFrame(pl.from_arrow(schema.empty_table())).schema
    defaults = {
        f.name: f.metadata[DEFAULT].decode() for f in schema if DEFAULT in (f.metadata or {})
    }

    def source(
        with_columns: list[str] | None, predicate: pl.Expr | None, n_rows: int | None, _: Any
    ) -> Iterator[pl.DataFrame]:
        wanted: list[str] = with_columns or list(columns)
        needed = list(
            dict.fromkeys(
                [*wanted, *(predicate.meta.root_names() if predicate is not None else [])]
            )
        )
        for path in files:
            if n_rows is not None and n_rows <= 0:
                return
            with naming(path, where), open_parquet(path) as file:
                present = [c for c in needed if c in file.schema_arrow.names]
                read = file.read(present, use_threads=False)
            refuse_not_finite(not_finite(read), table, path, where)
            frame = cast(pl.DataFrame, pl.from_arrow(read))
            frame = frame.with_columns(
                pl.lit(defaults.get(c), pl.String if c in defaults else columns[c])
                .cast(columns[c])
                .alias(c)
                for c in needed
                if c not in present
            )
            if predicate is not None:
                frame = frame.filter(predicate)
            if n_rows is not None:
                frame, n_rows = frame.head(n_rows), n_rows - min(n_rows, frame.height)
            yield frame.select(wanted)

    return register_io_source(io_source=source, schema=columns)


def with_defaults(
    batches: Iterator[pa.RecordBatch], schema: pa.Schema, columns: list[str]
) -> Iterator[pa.RecordBatch]:
    """``batches`` with ``columns`` in order, those they lack (a part of an older schema version)
    filled with the field's declared default (``schemas.DEFAULT``), else null."""
    for batch in batches:
        if batch.schema.names == columns:
            yield batch
            continue
        arrays = []
        for name in columns:
            if name in batch.schema.names:
                arrays.append(batch.column(name))
                continue
            f = schema.field(name)
            value = (f.metadata or {}).get(DEFAULT)
            fill = pa.array([None if value is None else value.decode()] * batch.num_rows)
            arrays.append(fill.cast(f.type))
        yield pa.RecordBatch.from_arrays(arrays, names=columns)


def repeats(keys: pa.Table) -> bool:
    """Whether two rows of ``keys`` (integer or dictionary columns) are equal: each row packed
    into one integer by the ranges its columns take, then (rows are written in key order) one
    comparison of neighbours, a sort only where they are not in increasing order."""
    packed = np.zeros(keys.num_rows, np.int64)
    bits = 0
    for column in keys.columns:
        values = column.combine_chunks()
        if pa.types.is_dictionary(values.type):
            values = values.indices
        ints = np.asarray(values.to_numpy(zero_copy_only=False), np.int64)
        if not len(ints):
            return False
        ints = ints - ints.min()
        width = int(ints.max()).bit_length()
        bits += width
        if bits > 62:  # too wide to pack: compare the rows themselves
            return bool(pl.DataFrame(pl.from_arrow(keys)).is_duplicated().any())
        packed = (packed << width) | ints
    return bool((np.diff(packed) <= 0).any()) and len(np.unique(packed)) < len(packed)


@contextlib.contextmanager
def naming(path: StorePath, where: str) -> Iterator[None]:
    """Turn a failure to read the Parquet part ``path`` into a ``StoreError`` naming it."""
    try:
        yield
    except (OSError, pa.ArrowException) as err:
        raise StoreError(
            f"{path}: unreadable part ({first_line(err)}); re-extract {where} with --overwrite"
        ) from err


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _packed(frame: pl.DataFrame, columns: Sequence[str]) -> pl.Expr:
    """One Int64 per row of ``frame`` that orders its integer ``columns`` as a sort by them
    would: each column less its least value, in the span of the values it takes."""
    key: pl.Expr = pl.lit(0, pl.Int64)
    for c in columns:
        low, high = frame.select(pl.col(c).min().alias("low"), pl.col(c).max().alias("high")).row(0)
        span = 1 if low is None else int(high) - int(low) + 1
        key = key * span + (pl.col(c).cast(pl.Int64) - (low or 0))
    return key


def in_key_order(rows: pl.DataFrame, columns: Sequence[str]) -> pl.DataFrame:
    """``rows`` sorted by the integer ``columns``, unless they are already (extraction writes in
    key order; the store does not promise it): one pass over packed keys."""
    key = _packed(rows, columns)
    return rows if rows.select(key.is_sorted()).item() else rows.sort(key)


def dense(
    rows: pl.DataFrame,
    table: str,
    units: pl.DataFrame,
    cells: pl.DataFrame,
    where: str,
    flag: str = "",
) -> None:
    """The one coverage check of a dense table (``schemas.GRIDS``): refuse (``StoreError``) key
    ``rows`` (sorted) that do not hold every one of ``units`` (the unit columns' values, in
    strictly increasing order) with every one of ``cells`` (the cell columns' values, in order),
    each once: row r must be cell r % cells of unit r // cells. ``flag``: the extract flag
    that re-extracts the table."""
    n, c = units.height, cells.height
    row = pl.int_range(pl.len(), dtype=pl.Int64)
    same = [
        pl.col(k).cast(pl.Int64) == pl.lit(frame[k].cast(pl.Int64)).gather(at)
        for frame, at in ((units, row // max(c, 1)), (cells, row % max(c, 1)))
        for k in frame.columns
    ]
    increasing = units.select(_packed(units, units.columns).diff().min()).item()
    covered = (
        rows.height == n * c
        and (c > 0 or n == 0)
        and (n < 2 or increasing > 0)
        and (rows.height == 0 or rows.select(pl.all_horizontal(same).all()).item())
    )
    if not covered:
        raise StoreError(
            f"{where}: its {rows.height} {table} rows do not hold each of its {n} "
            f"({', '.join(units.columns)}) x {c} ({', '.join(cells.columns)}) once, in order; "
            f"re-extract it with {flag}--overwrite"
        )


def read_whole(path: StorePath, table: str, manifest: Any, where: str) -> pa.Table | None:
    """The one file of ``table``, a table stored once per partition (``schemas.WHOLE_TABLES``)
    at ``path`` (``Partition.whole``), read with every page's checksum verified; None where the
    partition has none. Refuses (``StoreError`` naming it) a file that cannot be read, of another
    schema, recording settings other than the partition's ``manifest``'s
    (``Manifest.settings_problem``), or holding a NaN or an infinite value."""
    if not path.exists():
        return None
    with naming(path, where), open_parquet(path) as file:
        data = file.read(use_threads=False)
        metadata = file.metadata.metadata
    if not data.schema.equals(TABLES[table], check_metadata=False):
        raise StoreError(
            f"{path}: columns do not match the {table} schema; re-extract {where} with --overwrite"
        )
    mixed = manifest.settings_problem(table, metadata)
    if mixed:
        raise StoreError(
            f"{path} {mixed}: a file of another extraction; re-extract {where} with --overwrite"
        )
    refuse_not_finite(not_finite(data), table, path, where)
    return data
