"""The Python API of the analysis stage: every table of the paper from a store, as Polars frames.

>>> import layerdiv
>>> results = layerdiv.run_analysis(path, tasks="boolq")
>>> results.scores.select("model", "estimator", "accuracy").shape
(4, 3)
>>> tuple(layerdiv.analyze.task_summary(results).columns[-3:])
('diversity', 'saturation_j', 'saturation_fraction')
"""

from __future__ import annotations

import html
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import polars as pl

from layerdiv.analyze import cluster
from layerdiv.analyze.decomposition import instance_curves
from layerdiv.analyze.options import ESTIMATORS, FORMATS, SCALES, Estimator, Executor, Scale
from layerdiv.analyze.overlap import mark_subsets
from layerdiv.analyze.registry import (
    Context,
    NoData,
    builtin,
    option_help,
    origin,
    partition_engine,
    plugin_problems,
    registered,
    table_problem,
    using,
)
from layerdiv.analyze.spill import Spill
from layerdiv.errors import LayerdivError, LayerdivWarning
from layerdiv.schemas.kinds import KINDS
from layerdiv.store import Store
from layerdiv.store.key import KEY
from layerdiv.store.location import human_bytes, is_url
from layerdiv.store.reader import Names, as_names

StoreLike = Store | str | Path


class AnalysisError(LayerdivError, ValueError):
    """An analysis asked for with an unknown option, estimator or scale."""


def open_store(store: StoreLike) -> Store:
    """A checked :class:`Store` (a path is opened; raises ``StoreError`` on bad input)."""
    return store if isinstance(store, Store) else Store(store)


def _choice(what: str, value: Any, allowed: Any) -> None:
    if value not in allowed:
        raise AnalysisError(f"unknown {what} {value!r}: use one of {', '.join(map(str, allowed))}")


@dataclass
class Results:
    """Every result table of one analysis, by name (:meth:`tables`) and as attributes
    (``results.scores``). Scores are fractions (accuracy 0.55, not 55) and ``j`` counts
    components (1 = the embedding alone, L = the full stack).

    ``manifests``: per (model, task), provenance of the analysed partitions (``Store.manifests``),
    and ``subset_of``: the other tasks of the same model that hold every one of its instances
    (null: none; :mod:`layerdiv.analyze.overlap`), left out of every average over tasks.
    The ``paper`` analysis (methods §2-6) adds:

    - ``scores``: per (model, task, estimator): accuracy, mse, bias, diversity of the full stack
      (means over instances), n_instances, n_components, n_options, majority_accuracy.
    - ``instance_scores``: per (model, task, estimator, instance): gold, pred, correct, mse, bias,
      diversity (spilled: kept on disk, read when asked for).
    - ``curves``: per (model, task, estimator, j): accuracy, mse, bias, diversity of the first j
      components (means over instances), relative_depth j / L, and the index (``component`` =
      j - 1, as in the store), name and kind of component j (methods §3).
    - ``modules``: per (model, task, estimator, kind X): n_components |X|, bias and diversity
      (means over instances and the components of kind X), bias_share, diversity_share (Eqs. 9-10).
    - ``correlations``: per (model, task, estimator, metric, method): r, p (across junction
      points), low, high (r's bootstrap interval over instances), n_units, significant (the
      interval excludes 0) (methods §4); ``correlation_means``: their Fisher-z averages over
      tasks, models and overall.
    - ``depth_curves``: per (model, estimator, j): accuracy and mse averaged over tasks, with
      marginal gains; ``depth_fits``: per (model, estimator): acc = a + b log j and
      mse = c / j^alpha + L0, with errors (methods §5).
    - ``information_curves``: per (model, task, j): I(prefix_j; Y), its gain, error and Eq. 12
      bounds; ``information``: per (model, task): H(Y), relevancy, I(full; Y), bounds, error, gains
      by half (methods §6).
    - ``saturation``: per (model, task): the depth at which accuracy saturates.
    - ``gain_halves``: per (model, task, estimator, instance): the instance's mean accuracy gain
      per component over the first and the second half of the stack and their difference (what
      the submodularity verdict resamples).

    Every other registered analysis (:mod:`layerdiv.analyze.registry`) adds its own tables.

    Tables with one row per instance are *spilled*: written to a temporary folder (under
    ``$TMPDIR``) while the analysis runs, so that its memory does not grow with the store, and read
    from there when asked for, as long as these results live."""

    by_name: dict[str, pl.DataFrame]
    """The tables held in memory (every table but the spilled ones)."""
    scale: Scale
    min_params: float
    notes: list[str] = field(default_factory=list)
    """Lines for the user from the analyses (e.g. what could not be computed and how to get it)."""
    problems: list[str] = field(default_factory=list)
    """One line per unreadable partition that was left out (``Store.problems``)."""
    spill: Spill = field(default_factory=Spill, repr=False)
    """The spilled tables (their folder is removed with these results)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """How they were computed (store, models, tasks, scale, min_params, options): what
    :meth:`write` records in the folder's index."""
    analyses: list[str] = field(default_factory=list)
    """The registered analyses that ran: those whose task kinds the selection holds, in
    partitions that hold the tables they need."""
    coverage: dict[str, list[str]] = field(default_factory=dict)
    """Per analysis that ran on some of its partitions only, the lines naming those extracted
    without a table it needs and the option that adds it (its report section opens with them;
    an analysis that ran on none gets them in :attr:`notes`)."""
    remarks: list[str] = field(default_factory=list)
    """Lines for the report's reader that are no warning (e.g. how the data were chosen): the
    report shows them as paragraphs under its header, where :attr:`notes` are warning boxes."""

    def _table(self, name: str) -> pl.DataFrame | None:
        tables = self.__dict__.get("by_name", {})
        if name in tables:
            return tables[name]
        spill = self.__dict__.get("spill")
        if spill is not None and name in spill.names():
            return spill.tables()[name].collect()
        return None

    def _missing(self, name: str) -> str:
        spill = self.__dict__.get("spill")
        every = [*self.__dict__.get("by_name", {}), *(spill.names() if spill is not None else [])]
        return f"no result table {name!r}; the tables are {', '.join(every)}"

    def __getattr__(self, name: str) -> pl.DataFrame:
        table = self._table(name)
        if table is None:
            raise AttributeError(self._missing(name))
        return table

    def __getitem__(self, name: str) -> pl.DataFrame:
        """``results["scores"]`` is ``results.scores``."""
        table = self._table(name)
        if table is None:
            raise KeyError(self._missing(name))
        return table

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.names()})

    def shapes(self) -> dict[str, tuple[int, int]]:
        """(rows, columns) of every result table (the spilled ones counted without reading
        them)."""
        from layerdiv.analyze.output import n_rows

        lazy = self.spill.tables()
        return {
            **{n: f.shape for n, f in self.by_name.items()},
            **{n: (n_rows(f), len(f.collect_schema())) for n, f in lazy.items()},
        }

    def __repr__(self) -> str:
        shapes = self.shapes()
        width = max(map(len, shapes), default=0)
        lines = [
            f"Results(scale={self.scale!r}, min_params={self.min_params:g}): {len(shapes)} tables",
            *(
                f"  {n:<{width}}  {r:>8,} x {c}{'  (empty)' if not r else ''}"
                for n, (r, c) in shapes.items()
            ),
            *(f"note: {line}" for line in self.notes),
            *(f"left out: {line}" for line in self.problems),
        ]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td><code>{html.escape(n)}</code></td><td>{r:,}</td><td>{c}</td></tr>"
            for n, (r, c) in self.shapes().items()
        )
        notes = "".join(f"<li>{html.escape(line)}</li>" for line in [*self.notes, *self.problems])
        return (
            f"<p><b>Results</b> (scale <code>{html.escape(self.scale)}</code>, min_params "
            f"{self.min_params:g}): {len(self.names())} tables, each an attribute "
            "(<code>results.scores</code>)</p>"
            f"<table><tr><th>table</th><th>rows</th><th>columns</th></tr>{rows}</table>"
            + (f"<p>Notes:</p><ul>{notes}</ul>" if notes else "")
        )

    def names(self) -> list[str]:
        """The name of every result table (those in memory, then the spilled ones)."""
        return [*self.by_name, *self.spill.names()]

    def tables(self) -> dict[str, pl.DataFrame]:
        """Every result table by name, the spilled ones read into memory."""
        return {**self.by_name, **{k: v.collect() for k, v in self.spill.tables().items()}}

    def write(
        self, out: str | Path, fmt: str = FORMATS[0], settings: Mapping[str, Any] | None = None
    ) -> Path:
        """Write every table as ``<out>/<name>.<fmt>`` with an index of how they were made
        (``settings``, default :attr:`settings`), all at once: what ``layerdiv analyze`` does,
        the spilled tables streamed from their files
        (:func:`~layerdiv.analyze.output.write_tables`). Refuses (``OutputError``) a folder
        inside the analysed store, and one that holds anything but an earlier result."""
        from layerdiv.analyze.output import refuse_inside, write_tables

        out = Path(out).expanduser()
        store = self.settings.get("store")
        if store is not None and not is_url(store):
            refuse_inside(out, store)
        tables: dict[str, pl.DataFrame | pl.LazyFrame] = {**self.by_name, **self.spill.tables()}
        return write_tables(tables, out, fmt, self.settings if settings is None else settings)


@partition_engine
def run_analysis(
    store: StoreLike,
    models: Names = (),
    tasks: Names = (),
    scale: Scale = "final",
    min_params: float = 0,
    progress: bool = False,
    options: Mapping[str, Any] | None = None,
    maps: str | None = None,
    *,
    executor: Executor = "local",
    ray_address: str | None = None,
    lens: str | None = None,
) -> Results:
    """Run every registered analysis (:func:`~layerdiv.analyze.registry.registered`) on the
    selected partitions (``layerdiv.run_analysis``; ``analyze`` in this module is the same
    function).

    ``models`` (hub ids or slugs) and ``tasks`` filter the store (a name or a list; empty = all);
    ``scale`` is ``final`` or ``prefix`` (methods §3; ``lens=``, its former name, is refused
    with a message naming it); ``min_params`` restricts the
    depth-efficiency tables to models with at least that many parameters (the paper's Fig. 6 uses
    1e9); ``options`` are analysis-specific switches (e.g. ``{"reweight": True}``); ``maps``
    (``all`` or ``SOURCE:TARGET[,...]``) also maps every layer of one model's states onto every
    layer of another's (the ``maps`` option, methods §11). Unknown
    names and options raise a ``LayerdivError`` listing the known ones. ``executor`` ``ray``
    runs the per-partition work as Ray tasks on the cluster at ``ray_address`` (else
    ``$RAY_ADDRESS``), the reduction here: the same tables (:mod:`layerdiv.analyze.cluster`).
    What could not be computed is in ``Results.notes`` and is also warned (``LayerdivWarning``);
    unreadable partitions outside the filters are left out and listed in ``Results.problems``.

    >>> results = run_analysis(path, models="org/small", tasks=["boolq", "mnli"])
    >>> sorted(results.scores["task"].unique())
    ['boolq', 'mnli']
    >>> run_analysis(path, options={"reweigth": True})
    Traceback (most recent call last):
    layerdiv.analyze.api.AnalysisError: unknown option 'reweigth': use one of reweight, ...
    """
    if lens is not None:
        raise AnalysisError(
            f"lens={lens!r}: the junction scale is now the keyword scale= ({', '.join(SCALES)}); "
            "the logit lens of running text is extract --lens"
        )
    _choice("scale", scale, SCALES)
    if maps is not None:
        options = {**(options or {}), "maps": maps}
    analyses = registered()
    known = option_help(analyses)
    for key in options or {}:
        _choice("option", key, known)
    st = open_store(store)
    models, tasks = as_names(models), as_names(tasks)
    ctx = Context(
        store=st,
        parts=st.select(models, tasks),
        scale=scale,
        min_params=min_params,
        progress=progress,
        options=dict(options or {}),
        notes=[*st.incomplete(models, tasks), *plugin_problems()],
    )
    manifests = st.manifests(models, tasks).filter(pl.col("n_done") > 0)
    tables = {"manifests": mark_subsets(manifests, ctx.parts)}
    ran, coverage = [], {}
    with cluster.executor(executor, ray_address) as runner, using(runner):
        for analysis in analyses:
            lacking: list[str] = []
            parts = analysis.applies_to(ctx.parts, lacking)
            if not parts:
                ctx.notes.extend(lacking)
                continue
            try:
                new = analysis.tables(replace(ctx, parts=parts), MappingProxyType(dict(tables)))
            except NoData as err:
                ctx.notes.extend([*lacking, f"analysis {analysis.name!r} left out: {err}"])
                continue
            except Exception as err:  # another distribution's: its note, the others run
                if builtin(analysis):
                    raise
                ctx.notes.append(f"{origin(analysis)} left out: {type(err).__name__}: {err}")
                continue
            if problem := table_problem(new, [*tables, *ctx.spill.names()]):
                if builtin(analysis):
                    raise ValueError(f"analysis {analysis.name!r} {problem}")
                ctx.notes.append(f"{origin(analysis)} left out: it {problem}")
                continue
            ran.append(analysis.name)
            if lacking:
                coverage[analysis.name] = lacking
            tables.update(new)
    for note in [*ctx.notes, *(line for lines in coverage.values() for line in lines)]:
        warnings.warn(note, LayerdivWarning, stacklevel=3)
    settings = {
        "store": str(st.root),
        "models": models,
        "tasks": tasks,
        "scale": scale,
        "min_params": min_params,
        **dict(options or {}),
    }
    problems = st.problems(models, tasks)
    return Results(
        tables, scale, min_params, ctx.notes, problems, ctx.spill, settings, ran, coverage
    )


analyze = run_analysis
"""The same function under the module's former name (``layerdiv analyze`` calls it)."""


def scores(
    store: StoreLike, models: Names = (), tasks: Names = (), scale: Scale = "final"
) -> pl.DataFrame:
    """Per (model, task, estimator): full-stack accuracy, MSE, bias and diversity with the
    majority-class baseline (``analyze(...).scores``)."""
    return analyze(store, models, tasks, scale).scores


@partition_engine
def junction_curves(
    store: StoreLike, models: Names = (), tasks: Names = (), scale: Scale = "final"
) -> pl.DataFrame:
    """Per (model, task, estimator, instance, j): the layer-addition scores of every instance
    before averaging (large: N x L x 2 rows per partition)."""
    from layerdiv.analyze.frames import tag

    st = open_store(store)
    return pl.concat([tag(instance_curves(info, scale), info) for info in st.select(models, tasks)])


SUMMARY_SCHEMA = pl.Schema(
    {
        **dict.fromkeys(KEY, pl.String),
        "n_instances": pl.Int64,
        "n_components": pl.Int64,
        "accuracy": pl.Float64,
        "majority_accuracy": pl.Float64,
        "mse": pl.Float64,
        "bias": pl.Float64,
        "diversity": pl.Float64,
        "saturation_j": pl.Int16,
        "saturation_fraction": pl.Float64,
    }
)
"""The columns of :func:`task_summary`."""


def task_summary(results: Results, estimator: Estimator = "paper") -> pl.DataFrame:
    """One row per (model, task) for people: accuracy beside the majority-class baseline, MSE,
    bias and diversity of ``estimator``, and the saturation depth of accuracy.

    Choice tasks only: running text has no options and no accuracy (its tables are the
    ``text_*`` ones, and ``ls`` counts its documents), so results that hold none give an empty
    frame with the same columns."""
    _choice("estimator", estimator, ESTIMATORS)
    if "scores" not in results.names():
        return pl.DataFrame(schema=SUMMARY_SCHEMA)
    return (
        results.scores.filter(pl.col("estimator") == estimator)
        .join(
            results.saturation.select(*KEY, "saturation_j", "saturation_fraction"),
            on=[*KEY],
        )
        .select(SUMMARY_SCHEMA.names())
        .cast(SUMMARY_SCHEMA)
    )


def ls(store: StoreLike, models: Names = (), tasks: Names = ()) -> pl.DataFrame:
    """What the store holds: one row per (model, task) with its counts of ``units`` (instances
    of a choice task, documents of a text task), components and options (null for a text task,
    which has none), tables, the size of its files on disk (``size``) and dates (readable
    partitions only; ``Store.problems`` lists the others)."""
    st = open_store(store)
    sizes = st.sizes(models, tasks).select(
        *KEY, pl.col("bytes").map_elements(human_bytes, return_dtype=pl.String).alias("size")
    )
    return (
        st.manifests(models, tasks)
        .join(sizes, on=list(KEY), how="left", maintain_order="left")
        .select(
            "model_id",
            *(c for c in KEY if c != "model"),
            "n_done",
            "n_requested",
            pl.col("kind").replace_strict({k: v.units for k, v in KINDS.items()}).alias("units"),
            "n_components",
            pl.when(pl.col("n_options") > 0).then("n_options").alias("n_options"),
            "tables",
            "size",
            "n_params",
            "dtype",
            "created_at",
            "weights",
        )
    )


def weights_notes(manifests: pl.DataFrame) -> list[str]:
    """One line per model whose weights were made from the files given rather than loaded as
    they are (the manifests' ``weights``, e.g. a GGUF quantization dequantized to float32)."""
    rows = manifests.filter(pl.col("weights").is_not_null()).select("model_id", "weights")
    return [f"{m}: weights {w}" for m, w in rows.unique(maintain_order=True).iter_rows()]


def query(store: StoreLike, sql: str, models: Names = (), tasks: Names = ()) -> pl.DataFrame:
    """Run SQL against the views ``components``, ``instances``, ``manifests`` and the optional
    tables the selected partitions hold (DuckDB, with no file-system access: see
    ``Store.duckdb``); the result of the last statement, as a Polars frame. SQL that DuckDB
    refuses (a table that is not there, a typo) raises a ``QueryError`` naming the views.

    >>> query(path, "SELECT task, count(*) AS n FROM instances GROUP BY task ORDER BY task")
    shape: (2, 2)
    ┌───────┬─────┐
    │ task  ┆ n   │
    │ ---   ┆ --- │
    │ str   ┆ i64 │
    ╞═══════╪═════╡
    │ boolq ┆ 12  │
    │ mnli  ┆ 12  │
    └───────┴─────┘
    """
    return open_store(store).query(sql, models, tasks)
