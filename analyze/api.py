"""The Python API of the analysis stage: every table of the paper from a store, as Polars frames.

>>> from layerdiv.analyze import analyze, scores
>>> results = analyze("layerdiv-store", tasks=["sst2"])     # doctest: +SKIP
>>> results.scores                                          # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import polars as pl

from layerdiv.analyze.decomposition import instance_curves
from layerdiv.analyze.options import Estimator, Lens
from layerdiv.analyze.registry import Context, partition_engine, registered
from layerdiv.analyze.spill import Spill
from layerdiv.store import Store

StoreLike = Store | str | Path


def open_store(store: StoreLike) -> Store:
    """A checked :class:`Store` (a path is opened; raises ``StoreError`` on bad input)."""
    return store if isinstance(store, Store) else Store(store)


@dataclass
class Results:
    """Every result table of one analysis, by name (:meth:`tables`) and as attributes
    (``results.scores``). Scores are fractions (accuracy 0.55, not 55) and ``j`` counts
    components (1 = the embedding alone, L = the full stack).

    ``manifests``: per (model, task), provenance of the analysed partitions (``Store.manifests``).
    The ``paper`` analysis (METHODS.md sections 2-6) adds:

    - ``scores``: per (model, task, estimator): accuracy, mse, bias, diversity of the full stack
      (means over instances), n_instances, n_components, n_options, majority_accuracy.
    - ``instance_scores``: per (model, task, estimator, instance): gold, pred, correct, mse, bias,
      diversity (spilled: kept on disk, read when asked for).
    - ``curves``: per (model, task, estimator, j): accuracy, mse, bias, diversity of the first j
      components (means over instances), relative_depth j / L, and the name and kind of
      component j (section 3).
    - ``modules``: per (model, task, estimator, kind X): n_components |X|, bias and diversity
      (means over instances and the components of kind X), bias_share, diversity_share (Eqs. 9-10).
    - ``correlations``: per (model, task, estimator, metric, method): r, p, significant
      (section 4); ``correlation_means``: their Fisher-z averages over tasks, models and overall.
    - ``depth_curves``: per (model, estimator, j): accuracy and mse averaged over tasks, with
      marginal gains; ``depth_fits``: per (model, estimator): acc = a + b log j and
      mse = c / j^alpha + L0, with errors (section 5).
    - ``information_curves``: per (model, task, j): I(prefix_j; Y), its gain, error and Eq. 12
      bounds; ``information``: per (model, task): H(Y), relevancy, I(full; Y), bounds, error, gains
      by half (section 6).
    - ``saturation``: per (model, task): the depth at which accuracy saturates.

    Every other registered analysis (:mod:`layerdiv.analyze.registry`) adds its own tables.

    Tables with one row per instance are *spilled*: written to a temporary folder (under
    ``$TMPDIR``) while the analysis runs, so that its memory does not grow with the store, and read
    from there when asked for, as long as these results live."""

    by_name: dict[str, pl.DataFrame]
    """The tables held in memory (every table but the spilled ones)."""
    lens: Lens
    min_params: float
    notes: list[str] = field(default_factory=list)
    """Lines for the user from the analyses (e.g. what could not be computed and how to get it)."""
    problems: list[str] = field(default_factory=list)
    """One line per unreadable partition that was left out (``Store.problems``)."""
    spill: Spill = field(default_factory=Spill, repr=False)
    """The spilled tables (their folder is removed with these results)."""
    analyses: list[str] = field(default_factory=list)
    """The registered analyses that ran: those whose task kinds the selection holds."""

    def __getattr__(self, name: str) -> pl.DataFrame:
        tables = self.__dict__.get("by_name", {})
        if name in tables:
            return tables[name]
        spill = self.__dict__.get("spill")
        if spill is not None and name in spill.names():
            return spill.tables()[name].collect()
        every = ", ".join([*tables, *(spill.names() if spill is not None else [])])
        raise AttributeError(f"no result table {name!r}; the tables are {every}")

    def names(self) -> list[str]:
        """The name of every result table (those in memory, then the spilled ones)."""
        return [*self.by_name, *self.spill.names()]

    def tables(self) -> dict[str, pl.DataFrame]:
        """Every result table by name, the spilled ones read into memory."""
        return {**self.by_name, **{k: v.collect() for k, v in self.spill.tables().items()}}

    def write(self, out: str | Path, fmt: str, settings: Mapping[str, Any]) -> Path:
        """Write every table as ``<out>/<name>.<fmt>`` (what ``layerdiv analyze`` does), the
        spilled ones streamed from their files (:func:`~layerdiv.analyze.output.write_tables`)."""
        from layerdiv.analyze.output import write_tables

        return write_tables({**self.by_name, **self.spill.tables()}, out, fmt, settings)


@partition_engine
def analyze(
    store: StoreLike,
    models: Iterable[str] = (),
    tasks: Iterable[str] = (),
    lens: Lens = "final",
    min_params: float = 0,
    progress: bool = False,
    options: Mapping[str, Any] | None = None,
) -> Results:
    """Run every registered analysis (:func:`~layerdiv.analyze.registry.registered`) on the
    selected partitions.

    ``models`` (hub ids or slugs) and ``tasks`` filter the store (empty = all); ``lens`` is
    ``final`` or ``prefix`` (METHODS.md 3); ``min_params`` restricts the depth-efficiency tables
    to models with at least that many parameters (the paper's Fig. 6 uses 1e9); ``options`` are
    analysis-specific switches. Unreadable partitions outside the filters are left out and listed
    in ``Results.problems``."""
    st = open_store(store)
    models, tasks = list(models), list(tasks)
    ctx = Context(
        store=st,
        parts=st.select(models, tasks),
        lens=lens,
        min_params=min_params,
        progress=progress,
        options=dict(options or {}),
        notes=[],
    )
    tables = {"manifests": st.manifests(models, tasks).filter(pl.col("n_done") > 0)}
    ran = []
    for analysis in registered():
        parts = analysis.applies_to(ctx.parts)
        if not parts:
            continue
        ran.append(analysis.name)
        new = analysis.tables(replace(ctx, parts=parts), MappingProxyType(dict(tables)))
        clash = sorted(set(new) & (set(tables) | set(ctx.spill.names())))
        if clash:
            raise ValueError(f"analysis {analysis.name!r} returns tables that exist: {clash}")
        tables.update(new)
    problems = st.problems(models, tasks)
    return Results(tables, lens, min_params, ctx.notes, problems, ctx.spill, ran)


def scores(
    store: StoreLike, models: Iterable[str] = (), tasks: Iterable[str] = (), lens: Lens = "final"
) -> pl.DataFrame:
    """Per (model, task, estimator): full-stack accuracy, MSE, bias and diversity with the
    majority-class baseline (``analyze(...).scores``)."""
    return analyze(store, models, tasks, lens).scores


@partition_engine
def junction_curves(
    store: StoreLike, models: Iterable[str] = (), tasks: Iterable[str] = (), lens: Lens = "final"
) -> pl.DataFrame:
    """Per (model, task, estimator, instance, j): the layer-addition scores of every instance
    before averaging (large: N x L x 2 rows per partition)."""
    from layerdiv.analyze.analyses.paper import tagged

    st = open_store(store)
    return pl.concat(
        [tagged(instance_curves(info, lens), info) for info in st.select(models, tasks)]
    )


def task_summary(results: Results, estimator: Estimator = "paper") -> pl.DataFrame:
    """One row per (model, task) for people: accuracy beside the majority-class baseline, MSE,
    bias and diversity of ``estimator``, and the saturation depth of accuracy."""
    return (
        results.scores.filter(pl.col("estimator") == estimator)
        .join(
            results.saturation.select("model", "task", "saturation_j", "saturation_fraction"),
            on=["model", "task"],
        )
        .select(
            "model",
            "task",
            "n_instances",
            "n_components",
            "accuracy",
            "majority_accuracy",
            "mse",
            "bias",
            "diversity",
            "saturation_j",
            "saturation_fraction",
        )
    )


def ls(store: StoreLike, models: Iterable[str] = (), tasks: Iterable[str] = ()) -> pl.DataFrame:
    """What the store holds: one row per (model, task) with instance counts and dates (readable
    partitions only; ``Store.problems`` lists the others)."""
    return (
        open_store(store)
        .manifests(models, tasks)
        .select(
            "model_id",
            "task",
            "n_done",
            "n_requested",
            "n_components",
            "n_options",
            "n_params",
            "dtype",
            "created_at",
        )
    )


def query(
    store: StoreLike, sql: str, models: Iterable[str] = (), tasks: Iterable[str] = ()
) -> pl.DataFrame:
    """Run SQL against the views ``components``, ``instances`` and ``manifests`` (DuckDB, with no
    file-system access: see ``Store.duckdb``); the result of the last statement."""
    return open_store(store).duckdb(models, tasks).sql(sql).pl()
