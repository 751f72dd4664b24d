"""Helpers the analyses share: the selected partitions, the key columns of a partition's frames,
the partitions that hold an optional table, means over instances, and the means over a model's
tasks that the figures draw."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import polars as pl

from layerdiv.analyze.overlap import independent
from layerdiv.analyze.registry import not_extracted
from layerdiv.store import PartitionInfo, Store


def tag(frame: pl.DataFrame, info: PartitionInfo) -> pl.DataFrame:
    """``frame`` with the partition's key columns as its first columns."""
    return frame.select(*info.key_columns(), pl.all())


def with_table(
    parts: Sequence[PartitionInfo], table: str, notes: list[str] | None = None, what: str = ""
) -> list[PartitionInfo]:
    """The partitions of ``parts`` whose optional ``table`` is complete
    (:attr:`~layerdiv.store.PartitionInfo.tables`), for a part of an analysis (what the whole
    analysis reads is its ``needs``); with ``notes``, the note on those extracted without it
    (:func:`~layerdiv.analyze.registry.not_extracted`: ``what`` is not computed for them)."""
    if notes is not None and (line := not_extracted(parts, table, what)):
        notes.append(line)
    return [p for p in parts if table in p.tables]


def by_model(
    frame: pl.DataFrame,
    manifests: pl.DataFrame,
    keys: Sequence[str],
    columns: Iterable[str],
    by: Sequence[str] = (),
    weight: str | None = None,
) -> pl.DataFrame:
    """Means over a model's tasks of ``columns`` per (model, ``by``, ``keys``), sorted; a task
    whose instances another task of ``frame`` holds left out (``independent``, kept apart by
    ``by``: e.g. the lens readout). With ``weight`` (e.g. ``n_tokens``), the weighted means
    sum(w x) / sum of w where x is not null (null where no task has the column)."""

    def mean(c: str) -> pl.Expr:
        if weight is None:
            return pl.col(c).mean()
        w = pl.col(weight)
        return ((pl.col(c) * w).sum() / w.filter(pl.col(c).is_not_null()).sum()).alias(c)

    group = ["model", *by, *keys]
    return (
        independent(frame, manifests, by=by)
        .group_by(group)
        .agg(mean(c) for c in columns)
        .sort(group)
    )


def selected(
    store: Store | str | Path, models: Iterable[str], tasks: Iterable[str]
) -> list[PartitionInfo]:
    """The partitions of ``store`` (a path is opened) that the model and task filters select."""
    st = store if isinstance(store, Store) else Store(store)
    return st.select(list(models), list(tasks))


def listing(parts: list[PartitionInfo], most: int = 4) -> str:
    """Partitions by model (``model (task, task)``), the first ``most`` models only."""
    tasks: dict[str, list[str]] = {}
    for p in parts:
        tasks.setdefault(p.model, []).append(p.key.within_model)
    shown = [f"{m} ({', '.join(t)})" for m, t in list(tasks.items())[:most]]
    more = len(tasks) - most
    return "; ".join(shown) + (f" and {more} more model(s)" if more > 0 else "")


def instance_means(
    frame: pl.DataFrame, columns: Iterable[str], keys: Iterable[str] = ("component",)
) -> pl.DataFrame:
    """Means over instances and their standard deviations (``<column>_std``)."""
    keys = list(keys)
    return (
        frame.group_by(keys)
        .agg(
            pl.len().cast(pl.Int64).alias("n_instances"),
            *(pl.col(c).mean() for c in columns),
            *(pl.col(c).std().alias(f"{c}_std") for c in columns),
        )
        .sort(keys)
    )


def unit_lengths(info: PartitionInfo) -> pl.LazyFrame:
    """Per unit of ``info`` (a document; a choice task's instance, as ``doc``): its ``n_tokens``
    T, the tokens fed to the model."""
    if info.manifest.kind == "choice":
        return info.scan("instances").select(pl.col("instance").alias("doc"), "n_tokens")
    return info.scan("documents").select("doc", "n_tokens")
