"""Writing results: all or nothing (a temporary name, then one rename), never a partial output."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from layerdiv.analyze.options import FORMATS
from layerdiv.errors import LayerdivError

INDEX_NAME = "index.json"
"""Written into every result folder: how it was made and the files layerdiv wrote there. A new run
replaces a folder that holds only those files; it refuses one that holds anything else."""


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
        raise OutputError(f"{out} exists and is not a folder; choose another --out")
    entries = _entries(out)
    if not entries:
        return
    try:
        listed = json.loads((out / INDEX_NAME).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise OutputError(
            f"{out} is not empty and is not a layerdiv result folder (no readable {INDEX_NAME} "
            "listing its files); choose another --out or remove it"
        ) from None
    ours = {INDEX_NAME, *listed}
    ours |= {p.as_posix() for f in listed for p in Path(f).parents if p != Path(".")}
    foreign = sorted(entries - ours)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise OutputError(
            f"{out} holds {foreign[0]}{more}, which layerdiv did not write; it replaces only its "
            "own results: move them away or choose another --out"
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(out: Path) -> None:
    """Remove the temporary folders ``.<out>.<pid>.*.tmp`` (and ``.old``) that a killed run of
    this host left beside ``out``: those whose process is gone."""
    stale = re.compile(rf"^\.{re.escape(out.name)}\.(\d+)\.[^.]+\.(tmp|old)$")
    for entry in out.parent.iterdir():
        match = stale.match(entry.name)
        if match and entry.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def refuse_inside(out: str | Path, store: str | Path) -> None:
    """Refuse an output path inside the store: analysis never writes there."""
    root, target = Path(store).resolve(), Path(out).resolve()
    if target == root or root in target.parents:
        raise OutputError(
            f"{out} is inside the store {store}; layerdiv writes nothing there outside "
            "`extract`: choose another --out"
        )


@contextmanager
def result_dir(out: str | Path, index: Mapping[str, Any]) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``out`` to write results into; on success,
    :data:`INDEX_NAME` (``index`` plus the list of files written) is added and the folder
    replaces ``out`` in one rename; on failure it is deleted and ``out`` is left as it was.

    An existing ``out`` is replaced only when it holds nothing but a layerdiv result (the files
    its index lists); temporary folders of killed runs are removed first."""
    out = Path(out)
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(out)
    prefix = f".{out.name}.{os.getpid()}."
    tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=out.parent))
    try:
        yield tmp
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        text = json.dumps({**index, "files": files}, indent=2, default=str) + "\n"
        (tmp / INDEX_NAME).write_text(text)
        _check_replaceable(out)  # again: something may have been put there meanwhile
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=prefix, suffix=".old", dir=out.parent))
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
    tables: Mapping[str, pl.DataFrame], out: str | Path, fmt: str, settings: Mapping[str, Any]
) -> Path:
    """Write every table as ``<out>/<name>.<fmt>`` plus :data:`INDEX_NAME` (the settings, each
    table's row count and the files written), all at once (:func:`result_dir`)."""
    if fmt not in FORMATS:
        raise OutputError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    index = {
        "settings": dict(settings),
        "tables": {name: {"file": f"{name}.{fmt}", "rows": f.height} for name, f in tables.items()},
    }
    with result_dir(out, index) as tmp:
        for name, frame in tables.items():
            write_frame(frame, tmp / f"{name}.{fmt}", fmt)
    return Path(out)
