"""Result tables too large to hold in memory (one row per instance): an analysis appends them one
partition at a time as Parquet files in a temporary folder, and they are read back lazily, so that
the memory of ``layerdiv analyze`` does not grow with the number of instances in the store."""

from __future__ import annotations

import tempfile
from pathlib import Path

import polars as pl

from layerdiv.errors import LayerdivError
from layerdiv.measurements import table_name_problem


class Spill:
    """Tables written part by part under ``$TMPDIR/layerdiv-spill-*``; the folder is removed when
    this object is garbage-collected (the :class:`~layerdiv.analyze.api.Results` holding it)."""

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="layerdiv-spill-")
        self._files: dict[str, list[Path]] = {}

    @property
    def folder(self) -> Path:
        """The temporary folder (one subfolder of ``part-*.parquet`` files per table)."""
        return Path(self._folder.name)

    def append(self, name: str, frame: pl.DataFrame) -> None:
        """Add ``frame``'s rows to table ``name`` (every part must have the same schema; the name
        an identifier, never a path)."""
        if problem := table_name_problem(name):
            raise LayerdivError(f"a spilled result's {problem}")
        files = self._files.setdefault(name, [])
        folder = self.folder / name
        folder.mkdir(exist_ok=True)
        path = folder / f"part-{len(files):06d}.parquet"
        frame.write_parquet(path)
        files.append(path)

    def names(self) -> list[str]:
        """The tables, in the order of their first part."""
        return list(self._files)

    def tables(self) -> dict[str, pl.LazyFrame]:
        """Every table, its parts in the order they were appended (valid while this object
        lives)."""
        return {name: pl.scan_parquet(files) for name, files in self._files.items()}
