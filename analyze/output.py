"""Writing results: all or nothing (a temporary name, then one rename), never a partial output."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import polars as pl

from layerdiv.errors import LayerdivError

FORMATS = ("parquet", "csv")
INDEX_NAME = "index.json"
"""Written into every result directory: what it holds and how it was made. A directory that has
one may be replaced by a new run; any other existing directory is left alone."""


class OutputError(LayerdivError, RuntimeError):
    """The output path cannot be written (it exists and is not ours, or has an unknown type)."""


@contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``out``; on success it replaces ``out`` in one
    rename (an older result directory is removed), on failure it is deleted and ``out`` is left
    as it was. Refuses to replace an existing path that is not a layerdiv result directory."""
    out = Path(out)
    ours = (out / INDEX_NAME).is_file()
    if out.exists() and not ours and (not out.is_dir() or any(out.iterdir())):
        raise OutputError(
            f"{out} exists and is not a layerdiv result directory (no {INDEX_NAME}); "
            "choose another --out or remove it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_file(out: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``out`` (same suffix); on success it is renamed to ``out``,
    on failure deleted."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=f".tmp{out.suffix}", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def file_format(path: str | Path) -> str:
    """``parquet`` or ``csv`` from a file name's suffix."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise OutputError(f"{path}: unknown output type; name the file *.parquet or *.csv")
    return suffix


def flat(frame: pl.DataFrame) -> pl.DataFrame:
    """The frame with list columns joined into '|'-separated strings and untyped (all-null)
    columns as strings, so that every format can hold it."""
    return frame.with_columns(
        *(
            pl.col(name).cast(pl.List(pl.String)).list.join("|")
            for name, dtype in frame.schema.items()
            if isinstance(dtype, pl.List)
        ),
        *(pl.col(name).cast(pl.String) for name, dtype in frame.schema.items() if dtype == pl.Null),
    )


def write_frame(frame: pl.DataFrame, path: Path, fmt: str) -> None:
    """Write one table as Parquet or CSV."""
    if fmt == "parquet":
        flat(frame).write_parquet(path)
    else:
        flat(frame).write_csv(path)


def write_tables(
    tables: Mapping[str, pl.DataFrame], out: str | Path, fmt: str, settings: Mapping[str, Any]
) -> Path:
    """Write every table as ``<out>/<name>.<fmt>`` plus :data:`INDEX_NAME` (the settings and each
    table's row count), all at once (:func:`atomic_dir`)."""
    if fmt not in FORMATS:
        raise OutputError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    with atomic_dir(out) as tmp:
        for name, frame in tables.items():
            write_frame(frame, tmp / f"{name}.{fmt}", fmt)
        index = {
            "settings": dict(settings),
            "tables": {
                name: {"file": f"{name}.{fmt}", "rows": f.height} for name, f in tables.items()
            },
        }
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, default=str) + "\n")
    return Path(out)
