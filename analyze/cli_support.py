"""What the analysis commands of ``layerdiv`` share: bad input as one line, tables as text."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import click
import duckdb
import polars as pl

from layerdiv.analyze.output import OutputError
from layerdiv.schemas import SchemaError
from layerdiv.store import StoreError


def one_line(err: BaseException) -> str:
    """An error message on one line: DuckDB's source excerpt (``LINE 1: ...`` and the caret
    under it) is dropped, the remaining lines are joined."""
    lines = [ln.strip() for ln in str(err).splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith("LINE ") and set(ln) != {"^"}]
    return re.sub(r"\s+", " ", " ".join(kept)) or type(err).__name__


@contextmanager
def clean_errors() -> Iterator[None]:
    """Turn the errors that bad input causes into a one-line ``click`` error (exit status 1,
    no traceback): store and schema problems, unwritable outputs, SQL errors, unreadable files."""
    try:
        yield
    except (StoreError, SchemaError, OutputError) as err:
        raise click.ClickException(one_line(err)) from None
    except duckdb.Error as err:
        raise click.ClickException(
            f"{one_line(err)} (the views are components, instances and manifests)"
        ) from None
    except (pl.exceptions.PolarsError, OSError) as err:
        raise click.ClickException(f"cannot read or write: {one_line(err)}") from None


def show(frame: pl.DataFrame, max_rows: int = 40) -> str:
    """A frame as a text table, every column shown, at most ``max_rows`` rows."""
    with pl.Config(
        tbl_rows=max_rows,
        tbl_cols=-1,
        tbl_width_chars=1000,
        fmt_str_lengths=60,
        tbl_hide_column_data_types=True,
        tbl_hide_dataframe_shape=frame.height <= max_rows,
    ):
        return str(frame)
