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

import click
import polars as pl

from layerdiv.analyze.options import Estimator, Scale
from layerdiv.analyze.spill import Spill
from layerdiv.errors import LayerdivError
from layerdiv.measurements import (
    all_optional_tables,
    measurement_of,
    table_name_problem,
    table_schemas,
)
from layerdiv.registry import Registry
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
    deferred: list[tuple[Any, Path]] | None = None
    """The PNG figures linked so far, each with its file, to be drawn once every section is
    written (``layerdiv.analyze.report.render`` draws them on every CPU at once); None: each is
    drawn where it is linked."""


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
    options: Mapping[str, str | click.Option] = field(default_factory=dict)
    """The keys of ``Context.options`` it reads, each with what it switches (the keys that
    ``run_analysis(options=...)`` accepts are those of every registered analysis): its help, or
    a ``click.Option`` named as the key, which is also an option of the ``analyze`` and
    ``report`` commands (:func:`command_options`; its help the key's)."""
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
    """An analysis that cannot be registered (a name taken by another analysis's code, a table
    name that is no identifier), or analyses whose ``after`` form a cycle."""


_ORIGINS: dict[str, str] = {}
"""Analysis name -> the entry point that registered it (``name = module:attribute``)."""
_PROBLEMS: list[str] = []
"""One line per analysis of another distribution left out (:func:`plugin_problems`)."""


def _module(analysis: Analysis) -> str:
    return str(getattr(analysis.tables, "__module__", None) or "")


def builtin(analysis: Analysis) -> bool:
    """Whether ``analysis`` is one of layerdiv's own (its code in this package): an exception in
    one of another distribution's is its own one-line note (:func:`origin`), never a
    traceback, and leaves the others' results alone."""
    return _module(analysis).split(".")[0] == "layerdiv"


def origin(analysis: Analysis) -> str:
    """``analysis`` as a note names it: its name and where it comes from (its entry point in
    :data:`ENTRY_POINTS`, else its module)."""
    where = _ORIGINS.get(analysis.name)
    source = f"entry point {ENTRY_POINTS}: {where}" if where else f"module {_module(analysis)}"
    return f"analysis {analysis.name!r} ({source})"


def register(analysis: Analysis) -> Analysis:
    """Add ``analysis`` to the registry (after those already there; the same module registering
    a name again replaces it in place, so a reloaded module does not run twice). Returns it.
    Refuses (:class:`RegistryError`) a name another module's analysis has (a built-in's), and a
    name that is no identifier."""
    if not isinstance(analysis, Analysis):
        raise RegistryError(f"register was given a {type(analysis).__name__}, not an Analysis")
    if problem := table_name_problem(analysis.name):
        raise RegistryError(f"analysis {analysis.name!r}: its name is no identifier ({problem})")
    for key, option in analysis.options.items():
        if isinstance(option, click.Option) and option.name != key:
            raise RegistryError(
                f"analysis {analysis.name!r}: option {key!r} is given by a command-line option "
                f"whose parameter is {option.name!r}; name the key as its option's parameter"
            )
    known = ANALYSES.get(analysis.name)  # the entry points' analyses come first
    if known is not None and _module(known) != _module(analysis):
        raise RegistryError(
            f"analysis {analysis.name!r} of {_module(analysis)}: the name is taken by "
            f"{origin(known)}; give it a name of its own"
        )
    ANALYSES.put(analysis.name, analysis)
    return analysis


def unregister(name: str) -> None:
    """Remove a registered analysis (tests)."""
    ANALYSES.remove(name)
    _ORIGINS.pop(name, None)


def _add(entry: Any, analysis: Any) -> None:
    """Register the object ``analysis`` that entry point ``entry`` names; where that fails (an
    object that is not an Analysis, a taken name), one line in :data:`_PROBLEMS` naming the
    entry point instead."""
    where = _where(entry)
    known = ANALYSES.by_name.get(entry.name)
    if known is not None and _module(known) == entry.value.partition(":")[0]:
        return  # registered by its own module already
    if known is not None:
        _PROBLEMS.append(
            f"{where} left out: {entry.name!r} is the name of {origin(known)}; rename its entry "
            "point"
        )
        return
    try:
        register(analysis)
    except RegistryError as err:
        _PROBLEMS.append(f"{where} left out: {err}")
        return
    if not builtin(analysis):
        _ORIGINS[analysis.name] = f"{entry.name} = {entry.value}"


def plugin_problems() -> list[str]:
    """One line per analysis left out (an entry point that failed to load or names no
    :class:`Analysis`, a taken name, an unknown table in ``needs`` or analysis in ``after``):
    notes of every ``analyze`` and ``report``."""
    registered()
    return [*_PROBLEMS, *_runnable(list(ANALYSES))[1]]


def _where(entry: Any) -> str:
    return f"analysis plug-in {entry.name} = {entry.value} (entry point {ENTRY_POINTS})"


def _failed(entry: Any, err: Exception) -> None:
    """A line in :data:`_PROBLEMS` for an entry point that failed to load."""
    _PROBLEMS.append(f"{_where(entry)} left out: it failed to load ({type(err).__name__}: {err})")


ANALYSES: Registry[Analysis] = Registry("analysis", ENTRY_POINTS, _add, _failed)
"""Every analysis by name: those of the entry point group :data:`ENTRY_POINTS`, the built-in ones
first, by their ``order`` (``layerdiv.registry.loaded``), then other distributions' (one that
fails: a line in :func:`plugin_problems`), then those registered by :func:`register`."""


def registered() -> list[Analysis]:
    """Every registered analysis (those of the entry point group :data:`ENTRY_POINTS`, the built-in
    ones first, then those registered by :func:`register`), in the order they run:
    registration order, each moved after the analyses it names in ``after`` (a topological
    order). An analysis that needs a table no table schema or registered measurement declares,
    or runs after an analysis that is not registered (or left out), is left out, with a line in
    :func:`plugin_problems`; a cycle is refused (:class:`RegistryError`)."""
    return _ordered(_runnable(list(ANALYSES))[0])


def option_help(analyses: Iterable[Analysis]) -> dict[str, str]:
    """Every option key of ``analyses`` with its help (:attr:`Analysis.options`)."""
    return {
        key: option.help or "" if isinstance(option, click.Option) else option
        for a in analyses
        for key, option in a.options.items()
    }


def command_options() -> list[click.Option]:
    """The options of the ``analyze`` and ``report`` commands that the registered analyses
    declare (:attr:`Analysis.options`), each once, in the analyses' order."""
    found = {
        key: option
        for a in registered()
        for key, option in a.options.items()
        if isinstance(option, click.Option)
    }
    return list(found.values())


def _runnable(analyses: list[Analysis]) -> tuple[list[Analysis], list[str]]:
    """``analyses`` less those whose ``needs`` name a table no schema or registered measurement
    declares, or whose ``after`` names an analysis not among them (repeated until none is left
    out: an analysis after a left-out one is left out too); and a line on each left out."""
    tables = set(table_schemas()) | set(all_optional_tables())
    lines: list[str] = []
    while True:
        names = {a.name for a in analyses}
        problems = {
            a.name: f"{origin(a)} left out: it {why}"
            for a in analyses
            for why in [
                *(f"needs table {t!r}, which no measurement writes" for t in a.needs
                  if t not in tables),
                *(f"runs after {n!r}, which is not registered" for n in a.after
                  if n not in names),
            ][:1]
        }  # fmt: skip
        if not problems:
            return analyses, lines
        lines.extend(problems.values())
        analyses = [a for a in analyses if a.name not in problems]


def _ordered(analyses: list[Analysis]) -> list[Analysis]:
    """``analyses`` in a topological order of ``after``: each at its registration place unless
    an analysis it follows comes later (then it runs right after the last of those)."""
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


def table_problem(new: Any, taken: Iterable[str]) -> str | None:
    """What is wrong with what an analysis's ``tables`` returned (it must be a dict of Polars
    DataFrames under identifiers no earlier table has), or None."""
    if not isinstance(new, dict):
        return f"returned a {type(new).__name__}, not a dict of tables"
    taken = set(taken)
    for name, frame in new.items():
        if problem := table_name_problem(name):
            return f"returned {name!r}: {problem}"
        if name in taken:
            return f"returned table {name!r}, which exists (another analysis's)"
        if not isinstance(frame, pl.DataFrame):
            return f"returned table {name!r} as a {type(frame).__name__}, not a Polars DataFrame"
    return None
