"""Markdown building blocks every analysis's report section uses: numbers and tables."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import polars as pl

from layerdiv.store.key import DEFAULT_REVISION


def model_label() -> pl.Expr:
    """The model column of a models x tasks table: the slug, ``<slug>@<revision>`` for a revision
    other than the default (a model stored at several checkpoints has a row for each); a column
    labelled so already is left as it is."""
    other = pl.col("revision").is_not_null() & (pl.col("revision") != DEFAULT_REVISION)
    other &= ~pl.col("model").str.ends_with("@" + pl.col("revision"))
    label = pl.when(other).then(pl.col("model") + "@" + pl.col("revision"))
    return label.otherwise(pl.col("model")).alias("model")


AVG = "Avg."
DASH = "–"

Cells = dict[tuple[str | None, str | None], str]
"""Formatted cells by (model, task); None stands for the average over models or over tasks."""


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    """``value * scale`` with ``digits`` decimals; a dash for a missing or NaN value."""
    if value is None or math.isnan(value):
        return DASH
    return f"{value * scale:.{digits}f}"


class TableShapeError(ValueError):
    """A table row whose cell count differs from its header's (a bug in the section that built
    it, never bad input)."""


def cell(text: str) -> str:
    """``text`` as one table cell: a pipe escaped (``\\|``, else it would split the cell) and a
    line break as a space (a row is one line)."""
    one_line = str(text).replace("\r\n", " ").replace("\n", " ")
    return one_line.replace("\\|", "|").replace("|", "\\|")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table (first column left-aligned, the rest right-aligned),
    every cell escaped with :func:`cell`; a row with another cell count than the header is
    refused."""
    short = [r for r in rows if len(r) != len(header)]
    if short:
        raise TableShapeError(
            f"a table row has {len(short[0])} cells for {len(header)} columns: {list(short[0])}"
        )
    rule = "|" + "|".join([":--", *["--:"] * (len(header) - 1)]) + "|"
    lines = ["| " + " | ".join(map(cell, header)) + " |", rule]
    return "\n".join(lines + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])


def key_rows(
    frame: pl.DataFrame, names: Mapping[str, str], cells: Callable[[dict[str, Any]], Sequence[str]]
) -> list[list[str]]:
    """A Markdown row per row of ``frame`` (in its order): the model's display name from
    ``names`` (``<name>@<revision>`` for a revision other than the default, as
    :func:`model_label`), the task, then ``cells`` of the row."""
    rows = []
    for r in frame.iter_rows(named=True):
        model = names.get(r["model"], r["model"])
        if r.get("revision") not in (None, DEFAULT_REVISION):
            model = f"{model}@{r['revision']}"
        rows.append([model, str(r["task"]), *cells(r)])
    return rows


def model_task_table(
    cells: Cells, names: dict[str, str], avg: bool = True, first_rows: Sequence[Sequence[str]] = ()
) -> str:
    """Rows per model (sorted), columns per task (sorted) and, with ``avg``, the Avg. column
    (cell (model, None)); a row "All models" when cells (None, task) exist."""
    models = sorted({m for m, _ in cells if m is not None})
    tasks = sorted({t for _, t in cells if t is not None})
    columns: list[str | None] = [*tasks, None] if avg else list(tasks)
    rows = [list(r) for r in first_rows]
    rows += [[names.get(m, m), *(cells.get((m, t), DASH) for t in columns)] for m in models]
    if any(m is None for m, _ in cells):
        rows.append(["*All models (Fisher-z)*", *(cells.get((None, t), DASH) for t in columns)])
    return markdown_table(["Model", *tasks, *([AVG] if avg else [])], rows)


@dataclass(frozen=True)
class Judged:
    """One :func:`verdict`, as data: what :func:`judged` collects (e.g. for a table of the
    papers' findings per model)."""

    finding: str
    statistic: str
    value: float | None
    interval: tuple[float | None, float | None] | None
    n: int
    threshold: float
    min_n: int
    unit: str
    above: bool
    digits: int
    outcome: str
    """``agrees``, ``does not agree``, ``cannot tell`` or ``too few to tell``."""


_JUDGED: ContextVar[list[Judged] | None] = ContextVar("judged", default=None)


@contextmanager
def judged() -> Iterator[list[Judged]]:
    """Collect every :func:`verdict` made in this block (this thread), in order."""
    found: list[Judged] = []
    token = _JUDGED.set(found)
    try:
        yield found
    finally:
        _JUDGED.reset(token)


def verdict(
    finding: str,
    statistic: str,
    value: float | None,
    interval: tuple[float | None, float | None] | None,
    n: int,
    threshold: float,
    *,
    min_n: int,
    unit: str,
    above: bool = True,
    digits: int = 2,
) -> str:
    """One line saying whether this model and data agree with a paper's ``finding``, which holds
    where ``statistic`` exceeds ``threshold`` (``above``) or lies below it: *agrees* where the
    95% ``interval`` (the value alone without one) lies wholly on the finding's side, *does not
    agree* wholly on the other, *cannot tell* where it spans the threshold (or the value or an
    interval asked for is undefined), *too few to tell* with fewer than ``min_n`` ``unit`` (the
    line then says how many are needed)."""
    side, other = (">", "<=") if above else ("<", ">=")
    shown = f"{statistic} {fmt(value, digits=digits)}"
    low, high = interval if interval is not None else (value, value)
    if interval is not None:
        shown += f" [{fmt(low, digits=digits)}, {fmt(high, digits=digits)}]"
    t = fmt(threshold, digits=digits)
    if n < min_n:
        outcome, tail = "too few to tell", ""
    elif value is None or math.isnan(value) or low is None or high is None:
        outcome, tail = "cannot tell", " (undefined)"
    elif low > threshold if above else high < threshold:
        outcome, tail = "agrees", f" {side} {t}"
    elif high <= threshold if above else low >= threshold:
        outcome, tail = "does not agree", f" {other} {t}"
    else:
        outcome, tail = "cannot tell", f" spans {t}"
    if (found := _JUDGED.get()) is not None:
        found.append(Judged(finding, statistic, value, interval, n, threshold, min_n, unit,
                            above, digits, outcome))  # fmt: skip
    count = f"n = {n} {unit}" + (f"; at least {min_n} needed" if n < min_n else "")
    return f"**Verdict: {outcome}.** {finding}: {shown}{tail} ({count})."
