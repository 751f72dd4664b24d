"""Writing results: all or nothing (a temporary name, then one rename), never a partial output."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from layerdiv.analyze.options import FORMATS
from layerdiv.errors import LayerdivError
from layerdiv.store.atomic import atomic_path, remove_stale_temps, restore
from layerdiv.store.location import is_url
from layerdiv.store.paths import INDEX_NAME as INDEX_NAME  # a new run replaces a folder of

# only the files its index lists, and refuses one that holds anything else

Frame = TypeVar("Frame", pl.DataFrame, pl.LazyFrame)


class OutputError(LayerdivError, RuntimeError):
    """The output path cannot be written (it holds what is not ours, or has an unknown type)."""


def _entries(folder: Path) -> set[str]:
    """Every file, folder and link under ``folder``, as paths relative to it (links are not
    followed)."""
    found: set[str] = set()
    for here, dirs, files in os.walk(folder):
        base = Path(here).relative_to(folder)
        found.update((base / name).as_posix() for name in [*dirs, *files])
    return found


def _check_replaceable(out: Path) -> None:
    """Refuse an ``out`` that exists and holds anything layerdiv did not write there (the files
    listed in its :data:`INDEX_NAME`, and their folders)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"{out} exists and is not a folder; choose another output folder")
    entries = _entries(out)
    if not entries:
        return
    try:
        listed = json.loads((out / INDEX_NAME).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise OutputError(
            f"{out} is not empty and is not a layerdiv result folder (no readable {INDEX_NAME} "
            "listing its files); choose another output folder or remove it"
        ) from None
    ours = {INDEX_NAME, *listed}
    ours |= {p.as_posix() for f in listed for p in Path(f).parents if p != Path(".")}
    foreign = sorted(entries - ours)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise OutputError(
            f"{out} holds {foreign[0]}{more}, which layerdiv did not write; it replaces only its "
            "own results: move them away or choose another output folder"
        )


def refuse_inside(out: str | Path, store: str | Path) -> None:
    """Refuse an output path inside the store (analysis never writes there) and a URL (results
    are written locally: ``query``, ``analyze`` and ``report`` alike)."""
    if is_url(out):
        raise OutputError(
            f"{out}: results are written to a local path only; write them locally, then "
            f"copy them to object storage (e.g. `aws s3 cp --recursive <folder> {out}`)"
        )
    root, target = Path(store).expanduser().resolve(), Path(out).expanduser().resolve()
    if target == root or root in target.parents:
        raise OutputError(
            f"{out} is inside the store {store}; layerdiv writes nothing there outside "
            "`extract`: choose another output path"
        )


@contextmanager
def result_dir(out: str | Path, index: Mapping[str, Any]) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``out`` to write results into; on success,
    :data:`INDEX_NAME` (``index`` plus the list of files written) is added and the folder
    replaces ``out`` (:func:`~layerdiv.store.atomic.atomic_path`); on failure it is deleted and
    ``out`` is left as it was.

    An existing ``out`` is replaced only when it holds nothing but a layerdiv result (the files
    its index lists); temporary folders of killed runs are removed first."""
    out = Path(out)
    restore(out)
    _check_replaceable(out)
    remove_stale_temps(out.parent, out.name)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        yield tmp
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        text = json.dumps({**index, "files": files}, indent=2, default=str) + "\n"
        (tmp / INDEX_NAME).write_text(text)
        _check_replaceable(out)  # again: something may have been put there meanwhile


def file_format(path: str | Path) -> str:
    """``parquet`` or ``csv`` from a file name's suffix."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise OutputError(f"{path}: unknown output type; name the file *.parquet or *.csv")
    return suffix


def flat(frame: Frame) -> Frame:
    """The frame with list columns joined into '|'-separated strings and untyped (all-null)
    columns as strings, so that every format can hold it."""
    schema = frame.collect_schema()
    return frame.with_columns(
        *(
            pl.col(name).cast(pl.List(pl.String)).list.join("|")
            for name, dtype in schema.items()
            if isinstance(dtype, pl.List)
        ),
        *(pl.col(name).cast(pl.String) for name, dtype in schema.items() if dtype == pl.Null),
    )


def write_frame(frame: pl.DataFrame | pl.LazyFrame, path: Path, fmt: str) -> None:
    """Write one table as Parquet or CSV; a lazy one is streamed (memory bounded by a batch)."""
    if isinstance(frame, pl.LazyFrame):
        if fmt == "parquet":
            flat(frame).sink_parquet(path)
        else:
            flat(frame).sink_csv(path)
    elif fmt == "parquet":
        flat(frame).write_parquet(path)
    else:
        flat(frame).write_csv(path)


def n_rows(frame: pl.DataFrame | pl.LazyFrame) -> int:
    """Rows of a table (of a lazy one without loading it)."""
    if isinstance(frame, pl.LazyFrame):
        return int(frame.select(pl.len()).collect().item())
    return frame.height


def write_reader(reader: pa.RecordBatchReader, path: Path, fmt: str) -> None:
    """Stream record batches into one Parquet or CSV file (memory bounded by one batch)."""
    if fmt == "parquet":
        with pq.ParquetWriter(path, reader.schema) as writer:
            for batch in reader:
                writer.write_batch(batch)
        return
    with path.open("wb") as fh:
        flat(pl.DataFrame(pl.from_arrow(reader.schema.empty_table()))).write_csv(fh)
        for batch in reader:
            flat(pl.DataFrame(pl.from_arrow(batch))).write_csv(fh, include_header=False)


def write_tables(
    tables: Mapping[str, pl.DataFrame | pl.LazyFrame],
    out: str | Path,
    fmt: str,
    settings: Mapping[str, Any],
) -> Path:
    """Write every table as ``<out>/<name>.<fmt>`` plus :data:`INDEX_NAME` (the settings, each
    table's row count and the files written), all at once (:func:`result_dir`)."""
    if fmt not in FORMATS:
        raise OutputError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    index = {
        "settings": dict(settings),
        "tables": {n: {"file": f"{n}.{fmt}", "rows": n_rows(f)} for n, f in tables.items()},
    }
    with result_dir(out, index) as tmp:
        for name, frame in tables.items():
            write_frame(frame, tmp / f"{name}.{fmt}", fmt)
    return Path(out)
