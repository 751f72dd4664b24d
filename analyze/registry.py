"""The analyses ``layerdiv analyze`` runs and ``layerdiv report`` renders, registered in one place.

An analysis is an :class:`Analysis`, registered through the entry point group
:data:`ENTRY_POINTS` (the entry point names the :class:`Analysis` object) on first use: a built-in
one (a module of ``layerdiv/analyze/analyses/`` for the core tables, of its measurement's folder
``layerdiv/measurements/<name>/`` for a measurement's) in layerdiv's ``pyproject.toml``, in the
order of their :attr:`Analysis.order` (that of the report's sections), another distribution's in
its own; or in one process with :func:`register`. This module imports none of them. An analysis
declares the optional tables it reads (:attr:`Analysis.needs`: it gets the partitions that hold
them, and the others one note naming the ``extract`` option that adds them) and the analyses
whose tables it reads (:attr:`Analysis.after`: they run before it); the analyses run in
registration order where ``after`` allows (:func:`registered`). See docs/development.md, "Adding
an analysis".
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import polars as pl

from layerdiv.analyze.options import Estimator, Scale
from layerdiv.analyze.spill import Spill
from layerdiv.errors import LayerdivError
from layerdiv.measurements import all_optional_tables, measurement_of
from layerdiv.measurements.registry import loaded
from layerdiv.store import PartitionInfo, Store

ENTRY_POINTS = "layerdiv.analyses"
"""The entry point group whose entries (each an :class:`Analysis`) are registered on first use."""


class NoData(LayerdivError):
    """An analysis has no rows to compute from (e.g. a text partition whose documents are all
    too short for a split point): ``analyze`` leaves that analysis out with a note naming it and
    the message, and runs the others."""


@dataclass
class Context:
    """What an analysis computes its tables from."""

    store: Store
    """The opened, checked store."""
    parts: list[PartitionInfo]
    """The selected partitions that hold data."""
    scale: Scale
    min_params: float
    progress: bool
    options: Mapping[str, Any] = field(default_factory=dict)
    """Analysis-specific switches, e.g. ``{"reweight": True}``."""
    notes: list[str] = field(default_factory=list)
    """Lines for the user, e.g. what an analysis could not compute and how to get it."""
    shared: dict[str, Any] = field(default_factory=dict)
    """What one analysis computes and a later one of the same run reuses (e.g. one pass over a
    partition's tokens, :func:`layerdiv.analyze.text.text_passes`)."""
    spill: Spill = field(default_factory=Spill)
    """Where an analysis appends, partition by partition, a table with one row per instance (not
    returned by ``tables``: it would grow the memory with the store)."""


@dataclass
class ReportContext:
    """What an analysis renders its report section from."""

    tables: Mapping[str, pl.DataFrame]
    """Every result table held in memory, by name (not the spilled ones)."""
    estimator: Estimator
    names: dict[str, str]
    """Store slug -> model id as given at extraction."""
    figures: Path
    """Folder for PNG figures; the report links them as ``figures/<file>``."""
    notes: list[str] = field(default_factory=list)
    scale: Scale = "final"
    """The scale the tables were computed with (methods §3)."""
    min_params: float = 0
    """The model-size filter of the depth-efficiency tables."""
    formats: tuple[str, ...] = ("md",)
    """The report formats being written (``md``, ``html``): PNG figures are drawn for ``md``,
    interactive ones for ``html`` (:func:`~layerdiv.analyze.plots.figure_link`)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The analysis-specific switches the tables were computed with (``Context.options``)."""
    interactive: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Plotly figures (as JSON-able dicts) by the file name of the PNG they stand for in the
    HTML report."""


@dataclass(frozen=True)
class Analysis:
    """One analysis: its tables and, optionally, its section of the report."""

    name: str
    """Registry key, e.g. ``paper``, ``depth``, ``heads``."""
    title: str
    """Heading of its report section."""
    tables: Callable[[Context, Mapping[str, pl.DataFrame]], dict[str, pl.DataFrame]]
    """Gets the tables of the analyses run before it; returns its own (names unique)."""
    report: Callable[[ReportContext], str] | None = None
    """Markdown of its section (draws its figures into ``ctx.figures``); None = no section."""
    options: Mapping[str, str] = field(default_factory=dict)
    """The keys of ``Context.options`` it reads, each with what it switches (the keys that
    ``run_analysis(options=...)`` accepts are those of every registered analysis)."""
    methods: tuple[int | str, ...] = ()
    """The sections of the methods page (:mod:`layerdiv.analyze.methods`) that define its
    quantities; its report section links them under its heading."""
    kinds: tuple[str, ...] = ("choice",)
    """Task kinds (the manifest's ``kind``: ``choice``, ``text``) it applies to: it gets the
    selected partitions of those kinds only, and does not run (no tables, no section) when the
    selection holds none."""
    needs: tuple[str, ...] = ()
    """The optional tables (of the measurements, ``layerdiv.measurements``) it reads: it gets the
    partitions of its kinds that hold every one, and does not run when none does; the partitions
    extracted without one are named in one line (:func:`not_extracted`) with the ``extract``
    option that adds it: at the head of its report section where it ran on the others, a note
    where it ran on none."""
    after: tuple[str, ...] = ()
    """The analyses whose tables it reads (``prior``): they run before it."""
    among: Callable[[list[PartitionInfo]], list[PartitionInfo]] | None = None
    """Narrows the partitions of its kinds further (e.g. models with several revisions)."""
    by_revision: bool = False
    """Its report reads ``model`` and ``revision`` apart (e.g. a figure against the step);
    every other report gets tables whose ``model`` names the revision too
    (``layerdiv.analyze.report.revisions_apart``), so that it never pools a model's revisions."""
    order: int = 0
    """Its place among the analyses of its distribution (the built-in ones: the order of the
    report's sections, where ``after`` allows)."""

    def applies_to(
        self, parts: Iterable[PartitionInfo], notes: list[str] | None = None
    ) -> list[PartitionInfo]:
        """The partitions of ``parts`` whose task kind this analysis applies to and that hold
        every table it :attr:`needs`; with ``notes``, one note per table some lack
        (:func:`not_extracted`)."""
        mine = [p for p in parts if p.manifest.kind in self.kinds]
        mine = self.among(mine) if self.among else mine
        for table in self.needs:
            if notes is not None and (line := not_extracted(mine, table, self.title)):
                notes.append(line)
            mine = [p for p in mine if table in p.tables]
        return mine


def not_extracted(parts: Iterable[PartitionInfo], table: str, what: str) -> str:
    """The one note on the partitions of ``parts`` extracted without the optional ``table``:
    ``what`` is not computed for them, and the ``extract`` option of the measurement that writes
    ``table`` adds it (``layerdiv.measurements``); empty when none lacks it. A partition whose
    ``table`` only some chunks hold is not named: ``PartitionInfo.incomplete`` names the command
    that completes it. Empty too where no registered measurement writes ``table`` (an analysis of
    a measurement that is not installed): no partition can hold it, and no option adds it."""
    parts = list(parts)
    never = [p.key.label for p in parts if table not in p.lacking]
    if not never or table not in all_optional_tables():
        return ""
    which = "any partition" if len(never) == len(parts) > 1 else ", ".join(never)
    m = measurement_of(table)
    takes = [s for s in m.settings if s.option.opts[0] == m.flag]  # --states K: give its default
    flag = f"{m.flag} {takes[0].default}" if takes else m.flag
    return f"{what}: not extracted for {which} (`layerdiv extract {flag}` adds it)."


F = TypeVar("F", bound=Callable[..., Any])
P = TypeVar("P")
T = TypeVar("T")


def partition_engine(fn: F) -> F:
    """Decorator: run ``fn`` with Polars' in-memory engine. Analyses query one partition at a
    time (frames of a few MB), on which it is faster than the streaming engine, Polars' default
    (docs/benchmarks.md, "Analysis at paper scale")."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with pl.Config(engine_affinity="in-memory"):
            return fn(*args, **kwargs)

    return cast(F, run)


PARTITION_WORKERS = 4
"""Partitions the local executor works on at once (:func:`map_partitions`)."""


class PartitionExecutor(Protocol):
    """Where the per-partition work of the analyses runs; the reduction stays on the driver."""

    def map(self, fn: Callable[[P], T], parts: Iterable[P]) -> Iterator[T]:
        """``fn(p) for p in parts``, yielded in that order."""
        ...


class LocalExecutor:
    """Threads of this process, :data:`PARTITION_WORKERS` partitions at a time: one partition's
    queries are small and leave cores idle, and Polars and Parquet reading release the GIL
    (docs/benchmarks.md, "Analysis at paper scale"). At most that many results wait to be taken,
    so memory holds a bounded number of partitions' working sets."""

    def map(self, fn: Callable[[P], T], parts: Iterable[P]) -> Iterator[T]:
        with ThreadPoolExecutor(PARTITION_WORKERS) as pool:
            running: deque[Future[T]] = deque()
            for part in parts:
                running.append(pool.submit(fn, part))
                if len(running) == PARTITION_WORKERS:
                    yield running.popleft().result()
            while running:
                yield running.popleft().result()


_EXECUTOR: ContextVar[PartitionExecutor | None] = ContextVar("executor", default=None)
"""The executor of the running analysis (:func:`using`); None: a :class:`LocalExecutor`."""


@contextmanager
def using(executor: PartitionExecutor) -> Iterator[None]:
    """Run the :func:`map_partitions` calls of this block (this thread) on ``executor``."""
    token = _EXECUTOR.set(executor)
    try:
        yield
    finally:
        _EXECUTOR.reset(token)


def map_partitions(fn: Callable[[P], T], parts: Iterable[P]) -> Iterator[T]:
    """``fn(p) for p in parts``, yielded in that order, on the executor of the running analysis
    (:func:`using`; threads of this process unless told otherwise). Every analysis runs its
    per-partition work through here: ``fn`` must not change what it closes over (on a cluster it
    runs on a copy)."""
    return (_EXECUTOR.get() or LocalExecutor()).map(fn, parts)


def with_data(
    fn: Callable[[PartitionInfo], T], parts: Iterable[PartitionInfo], notes: list[str], what: str
) -> list[T]:
    """:func:`map_partitions` of ``fn``, leaving out each partition for which ``fn`` raises
    :class:`NoData` with a note (``what`` it would have given): a part of an analysis that some
    partitions cannot feed, while the rest of the analysis runs."""

    def attempt(part: PartitionInfo) -> T | NoData:
        try:
            return fn(part)
        except NoData as err:
            return err

    out = []
    for got in map_partitions(attempt, parts):
        if isinstance(got, NoData):
            notes.append(f"{what} left out: {got}")
        else:
            out.append(got)
    return out


class RegistryError(LayerdivError, ValueError):
    """Analyses whose ``after`` cannot be followed (an unknown analysis, or a cycle)."""


_REGISTRY: dict[str, Analysis] = {}
_LOADED: list[bool] = []


def register(analysis: Analysis) -> Analysis:
    """Add ``analysis`` to the registry (after those already there; registering a name again
    replaces it in place, so a reloaded module does not run twice). Returns it."""
    _load()  # the entry points' analyses come first
    _REGISTRY[analysis.name] = analysis
    return analysis


def unregister(name: str) -> None:
    """Remove a registered analysis (tests)."""
    _REGISTRY.pop(name, None)


def _load() -> None:
    """Register, once per process, the analyses of the entry point group :data:`ENTRY_POINTS`
    (the built-in ones first, by their ``order``: ``layerdiv.measurements.registry.loaded``)."""
    if not _LOADED:
        _LOADED.append(True)
        for analysis in loaded(ENTRY_POINTS, _REGISTRY):
            register(analysis)


def registered() -> list[Analysis]:
    """Every registered analysis (those of the entry point group :data:`ENTRY_POINTS`, the
    built-in ones first, then those registered by :func:`register`), in the order they run:
    registration order, each moved after the analyses it names in ``after`` (a topological
    order). Refuses (:class:`RegistryError`) an ``after`` naming no analysis, or a cycle."""
    _load()
    return _ordered(list(_REGISTRY.values()))


def _ordered(analyses: list[Analysis]) -> list[Analysis]:
    """``analyses`` in a topological order of ``after``: each at its registration place unless
    an analysis it follows comes later (then it runs right after the last of those)."""
    names = {a.name for a in analyses}
    for a in analyses:
        unknown = [n for n in a.after if n not in names]
        if unknown:
            raise RegistryError(
                f"analysis {a.name!r} runs after {unknown[0]!r}, which is not registered"
            )
    out: list[Analysis] = []
    waiting = list(analyses)
    while waiting:
        done = {a.name for a in out}
        ready = next((a for a in waiting if set(a.after) <= done), None)
        if ready is None:
            cycle = ", ".join(a.name for a in waiting)
            raise RegistryError(f"analyses {cycle} each run after another of them (a cycle)")
        out.append(ready)
        waiting.remove(ready)
    return out
