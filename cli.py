"""The ``layerdiv`` command line.

Commands that read the cache never import torch; ``extract`` and ``demo`` import it lazily.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from layerdiv.analyze.options import ESTIMATORS, EXECUTORS, FORMATS, SCALES
from layerdiv.demo import FULL, QUICK
from layerdiv.errors import LayerdivError, LayerdivWarning, one_line
from layerdiv.extract.config import DEFAULT_STORE, ExtractConfig
from layerdiv.extract.launchers import Shard, pick_device
from layerdiv.measurements.lens_stats import DEFAULT_RIDGE
from layerdiv.schemas import LEARNED_LENS_KINDS
from layerdiv.schemas.kinds import KINDS
from layerdiv.version import __version__

HELP_OPTIONS = ["-h", "--help"]
"""Every command's help option."""
MAX_ROWS = 40
"""Rows ``layerdiv query`` prints unless told otherwise."""


def user_error(err: BaseException) -> str | None:
    """The one line to print for an error that bad input causes (a ``LayerdivError``, an SQL
    error, a file that cannot be read or written), or None for a bug (shown as a traceback)."""
    package = type(err).__module__.split(".")[0]
    if isinstance(err, LayerdivError):
        return one_line(err)
    if package in ("duckdb", "_duckdb"):
        return f"the SQL failed: {one_line(err)}"
    if package == "polars" or isinstance(err, OSError):
        return f"cannot read or write: {one_line(err)}"
    return None


class _Main(click.Group):
    """The command group; every command's user errors end here: one line, exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with warnings.catch_warnings():  # the commands print the analyses' notes themselves
                warnings.simplefilter("ignore", LayerdivWarning)
                return super().invoke(ctx)
        except Exception as err:
            message = user_error(err)
            if message is None:
                raise
            raise click.ClickException(message) from None


def fail_after(problems: list[str]) -> None:
    """Print each problem as an error line and exit 1, after a command did what it could."""
    for problem in problems:
        click.echo(f"Error: {problem}", err=True)
    if problems:
        raise click.exceptions.Exit(1)


@click.group(cls=_Main, context_settings={"help_option_names": HELP_OPTIONS})
@click.version_option(__version__, prog_name="layerdiv")
def main() -> None:
    """Bias-diversity decomposition of a language model's residual stream.

    Extract once (GPU or CPU), then analyze the cache anywhere without the model.
    """


store_option = click.option(
    "--store",
    default=DEFAULT_STORE,
    show_default=True,
    help="Store folder, or the URL of a published store, read-only (s3://bucket/prefix, gs://...; "
    "see docs/cluster.md, 'Stores on object storage').",
)


# --- extraction commands -------------------------------------------------------------------


class _Extract(click.Command):
    """``extract``, whose options are those ``ExtractConfig`` declares (its fields' and every
    registered measurement's, ``layerdiv.measurements``), read when the command runs or shows
    its help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from layerdiv.measurements.registry import reserve

        super().__init__(*args, **kwargs)
        reserve(
            self.name or "extract", [*ExtractConfig.field_options(), click.Option(HELP_OPTIONS)]
        )

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        help_option = self.get_help_option(ctx)
        return [*ExtractConfig.options(), *([help_option] if help_option is not None else [])]


@main.command(cls=_Extract)
def extract(**options: Any) -> None:
    """Run MODEL once over each task and cache every component's option logits (or, for a text
    task, every token's per-block dot products), and the optional measurements asked for."""
    import sys

    from layerdiv.extract.interrupt import Interrupted
    from layerdiv.extract.kinds import task_kind
    from layerdiv.extract.runner import run_extract

    shard: Shard = options["shard"]
    cfg = ExtractConfig.from_options(
        options, device=_device_for(options["device"], shard), shard=(shard.index, shard.count)
    )
    if shard.source != "--shard":
        click.echo(f"{shard.describe()}, device {cfg.device}")
    try:
        summaries = run_extract(cfg)
    except Interrupted as err:
        click.echo(f"Error: {err}", err=True)
        sys.exit(err.exit_code)
    for s in summaries:
        for note in s.notes:
            click.echo(f"{s.task}: note: {note}")
        stored = f"{s.task}: {s.n_done}/{s.n_requested} {KINDS[s.kind].units} stored"
        if not s.n_new:
            units = KINDS[s.kind].units
            added = f"none new; tables added to {s.n_added} stored {units}" if s.n_added else ""
            click.echo(f"{stored} ({added or 'nothing to do'})")
            continue
        click.echo(f"{stored} ({task_kind(s.kind).summary(s)})")
    click.echo(f"store: {cfg.store}")


def _device_for(device: str, shard: Shard) -> str:
    """The device, with a launcher's LOCAL_RANK picking the GPU (see ``extract.launchers``)."""
    if shard.local_rank is None:
        return device
    import torch

    return pick_device(device, shard, torch.cuda.device_count())


@main.command()
@click.option(
    "--out",
    default="layerdiv-demo",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for the demo's tasks, store, result tables and report.",
)
@click.option("--n", type=click.IntRange(min=10), default=None,
              help=f"Instances per choice task and model (balanced classes) [default: "
                   f"{FULL.n}; {QUICK.n} with --quick].")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--quick", is_flag=True,
              help="Every section on fewer instances and documents, multi-hop attribution on "
                   "SmolLM2 alone (what `make test` runs; its report says so).")  # fmt: skip
def demo(out: str, n: int | None, seed: int, quick: bool) -> None:
    """Offline end to end: SmolLM2-135M-Instruct and Gemma 3 270M on three choice tasks and on
    running text (with the logit lens, the future effects, attention sinks, and attribution on
    multi-hop questions) made from packaged data (extract, analyze, report, and a comparison of
    the two on relative depth), then a summary. A second run reuses the cache."""
    from layerdiv.demo import run_demo

    run_demo(Path(out), n, seed, QUICK if quick else FULL)


# --- analysis commands ---------------------------------------------------------------------
# Read the cache only (no torch). Bad input exits 1 with one line; outputs appear all at once.

models_option = click.option(
    "--model",
    "models",
    multiple=True,
    metavar="ID",
    help="Only this model (hub id or store slug); repeat for several. Default: all.",
)
tasks_option = click.option(
    "--task",
    "tasks",
    multiple=True,
    metavar="NAME",
    help="Only this task; repeat for several. Default: all.",
)
scale_option = click.option(
    "--scale",
    type=click.Choice(SCALES),
    default=SCALES[0],
    show_default=True,
    help="Junction scores with the final norm's scale frozen, or each prefix rescaled by its "
    "own rms (methods §1, §3).",
)


def _renamed_lens(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        raise click.UsageError(
            f"--lens {value}: the junction scale is now --scale ({' | '.join(SCALES)}); the logit "
            "lens of running text is an extraction option (layerdiv extract --lens)"
        )


renamed_lens_option = click.option(
    "--lens", hidden=True, expose_value=False, callback=_renamed_lens, help="Renamed --scale."
)


def _parse_min_params(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if math.isnan(value):
        raise click.BadParameter("a number of parameters (e.g. 1e9), not nan")
    return value


min_params_option = click.option(
    "--min-params",
    type=float,
    callback=_parse_min_params,
    default=0.0,
    show_default=True,
    metavar="N",
    help="Depth efficiency (Fig. 6) only for models with at least N parameters (paper: 1e9).",
)


executor_option = click.option(
    "--executor",
    type=click.Choice(EXECUTORS),
    default=EXECUTORS[0],
    show_default=True,
    help="Where the per-partition work runs: threads here, or Ray tasks on a cluster (the ray "
    "extra; docs/cluster.md, 'Analysis on Ray'). The tables are the same.",
)


ray_address_option = click.option(
    "--ray-address",
    default=None,
    metavar="HOST:PORT",
    help="The Ray cluster of --executor ray (default: $RAY_ADDRESS; auto: this node's cluster).",
)


class _Analyses(click.Command):
    """``analyze`` or ``report``: its own options, then those the registered analyses declare
    (``layerdiv.analyze.registry.command_options``), read when the command runs or shows its
    help."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        from layerdiv.analyze.registry import command_options

        help_option = self.get_help_option(ctx)
        return [*self.params, *command_options(), *([help_option] if help_option else [])]


def _analysis_values(values: dict[str, Any]) -> dict[str, Any]:
    """The analysis options given (``run_analysis(options=...)``): the values of
    ``command_options`` (by parameter name), those not given left out."""
    return {k: v for k, v in values.items() if v is not None}


def analysis_options(command: Callable[..., None]) -> Callable[..., None]:
    """The store, selection, junction scale, model-size and executor options shared by
    ``analyze`` and ``report`` (the analyses' own: :class:`_Analyses`)."""
    for option in (
        ray_address_option,
        executor_option,
        min_params_option,
        scale_option,
        renamed_lens_option,
        tasks_option,
        models_option,
        store_option,
    ):
        command = option(command)
    return command


@main.command("analyze", cls=_Analyses)
@analysis_options
@click.option(
    "--out",
    default="layerdiv-results",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for the result tables (an earlier result folder there is replaced; a folder "
    "holding anything else is refused).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default=FORMATS[0],
    show_default=True,
    help="Table file format.",
)
def analyze_command(
    store: str,
    models: tuple[str, ...],
    tasks: tuple[str, ...],
    scale: Any,
    min_params: float,
    executor: Any,
    ray_address: str | None,
    out: str,
    fmt: str,
    **analysis: Any,
) -> None:
    """Run every registered analysis (scores, curves, module shares, correlations, depth
    efficiency, information, ...) on the cache and write every result table to OUT."""
    from layerdiv.analyze.api import analyze
    from layerdiv.analyze.output import refuse_inside

    refuse_inside(out, store)
    options = _analysis_values(analysis)
    results = analyze(store, models, tasks, scale, min_params, progress=True, options=options,
                      executor=executor, ray_address=ray_address)  # fmt: skip
    results.write(out, fmt)
    click.echo(f"wrote {len(results.names())} tables ({fmt}) to {out}")
    for note in results.notes:
        click.echo(note)
    fail_after(results.problems)


@main.command("report", cls=_Analyses)
@analysis_options
@click.option(
    "--estimator",
    type=click.Choice(ESTIMATORS),
    default=ESTIMATORS[0],
    show_default=True,
    help="Which MSE/bias/diversity estimator the report shows (methods §2).",
)
@click.option(
    "--out",
    default="layerdiv-report",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for report.md and figures/ and/or report.html (an earlier report there is "
    "replaced; a folder holding anything else is refused).",
)
@click.option(
    "--format",
    "fmt",
    default="md",
    show_default=True,
    metavar="md|html|md,html",
    help="report.md with PNG figures, report.html (one self-contained interactive page with a "
    "per-instance explorer; the html extra), or both.",
)
@click.option(
    "--explorer-instances",
    default="200",
    show_default=True,
    metavar="N|all",
    help="Instances per (model, task) the HTML explorer embeds (stratified by correct / wrong).",
)
def report_command(
    store: str,
    models: tuple[str, ...],
    tasks: tuple[str, ...],
    scale: Any,
    min_params: float,
    executor: Any,
    ray_address: str | None,
    estimator: Any,
    out: str,
    fmt: str,
    explorer_instances: str,
    **analysis: Any,
) -> None:
    """Write the report: a section per registered analysis (the paper's Table 1 and Figs. 3-6
    first), as Markdown with PNG figures and/or as an interactive HTML page."""
    from layerdiv.analyze.api import analyze
    from layerdiv.analyze.output import refuse_inside
    from layerdiv.analyze.report import report_formats, write_report

    formats = report_formats(fmt)
    if "html" in formats:
        from layerdiv.analyze.html import check_available

        check_available()
    if explorer_instances != "all" and not (
        explorer_instances.isdigit() and int(explorer_instances) > 0
    ):
        raise click.BadParameter(f"{explorer_instances!r}: give a positive number or all",
                                 param_hint="--explorer-instances")  # fmt: skip
    n_explorer = None if explorer_instances == "all" else int(explorer_instances)
    refuse_inside(out, store)
    options = _analysis_values(analysis)
    results = analyze(store, models, tasks, scale, min_params, progress=True, options=options,
                      executor=executor, ray_address=ray_address)  # fmt: skip
    path, notes = write_report(results, out, estimator, store, formats, n_explorer)
    click.echo(f"wrote {path}")
    for note in notes:
        click.echo(note)
    fail_after(results.problems)


@main.command("query", context_settings={"ignore_unknown_options": True})
@click.argument("sql")
@store_option
@models_option
@tasks_option
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the last statement's result to this .parquet or .csv file (outside the store) "
    "instead of printing.",
)
@click.option(
    "--max-rows",
    type=click.IntRange(min=1),
    default=MAX_ROWS,
    show_default=True,
    help="Rows to print at most per result.",
)
def query_command(
    sql: str,
    store: str,
    models: tuple[str, ...],
    tasks: tuple[str, ...],
    out: str | None,
    max_rows: int,
) -> None:
    """Run SQL on the store's views (DuckDB): components, instances and manifests, the optional
    tables where extracted, and the running-text tables (documents, tokens, token_blocks, ...);
    print every result. The SQL cannot read or write files: the store stays as it is.

    Example: layerdiv query "SELECT model, task, count(*) FROM instances GROUP BY ALL"
    """
    import duckdb

    from layerdiv.analyze.output import file_format, refuse_inside, write_reader
    from layerdiv.store import Store
    from layerdiv.store.atomic import atomic_path

    fmt = None
    if out:
        fmt = file_format(out)
        refuse_inside(out, store)
    st = Store(store)
    con = st.duckdb(models, tasks)
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as err:
        raise st.query_error(err, models, tasks) from err
    if not statements:
        raise click.UsageError("no SQL statement given")
    shown = False
    try:
        for i, statement in enumerate(statements):
            try:
                relation = con.sql(statement.query)
                last = i == len(statements) - 1
                if out and fmt and last:
                    if relation is None:
                        raise click.UsageError("--out needs a last statement that returns rows")
                    with atomic_path(Path(out)) as tmp:
                        write_reader(relation.to_arrow_reader(), tmp, fmt)
                    click.echo(f"wrote {out}")
                elif relation is not None and not out:
                    if shown:
                        click.echo()
                    for text in preview(relation, max_rows):
                        click.echo(text)
                    shown = True
            except duckdb.Error as err:
                raise st.query_error(err, models, tasks, (i + 1, len(statements))) from err
        if not out and not shown:
            click.echo("OK (no statement returns rows)")
    finally:  # also after a failing statement: what the views leave out
        for note in st.incomplete(models, tasks):
            click.echo(f"Note: {note}", err=True)
    fail_after(st.problems(models, tasks))


def show(frame: Any) -> str:
    """A frame as a text table: every row and column, no types, no shape line."""
    import polars as pl

    with pl.Config(
        tbl_rows=-1,
        tbl_cols=-1,
        tbl_width_chars=1000,
        fmt_str_lengths=60,
        tbl_hide_column_data_types=True,
        tbl_hide_dataframe_shape=True,
    ):
        return str(frame)


def preview(relation: Any, max_rows: int) -> Iterator[str]:
    """The first ``max_rows`` rows of a DuckDB relation as a text table, as soon as they are
    known; then, once the rest is counted (the query runs once), how many more there are."""
    import polars as pl
    import pyarrow as pa

    reader = relation.to_arrow_reader(max_rows)
    batches = iter(reader)
    kept: list[pa.RecordBatch] = []
    total = 0
    for batch in batches:
        kept.append(batch.slice(0, max_rows - total))
        total += batch.num_rows
        if total >= max_rows:
            break
    yield show(pl.from_arrow(pa.Table.from_batches(kept, schema=reader.schema)))
    total += sum(batch.num_rows for batch in batches)
    if total > max_rows:
        yield (
            f"{total - max_rows:,} more rows not shown ({total:,} in all): "
            "raise --max-rows, or write them all with --out FILE"
        )


@main.command("ls")
@store_option
@models_option
@tasks_option
def ls_command(store: str, models: tuple[str, ...], tasks: tuple[str, ...]) -> None:
    """List what the store holds: models, tasks, instance counts, extraction dates; and every
    partition that cannot be read (exit 1)."""
    from layerdiv.analyze.api import ls, weights_notes
    from layerdiv.store import Store

    # Every manifest read lives until the listing is printed: the cyclic garbage collector's
    # passes over them would free nothing (a sixth of the CPU time of `ls` on 8,000 partitions,
    # benchmarks/bench_ls.py). It runs again once the listing is done.
    enabled = gc.isenabled()
    gc.disable()
    try:
        st = Store(store)
        table = ls(st, models, tasks)
        click.echo(show(table.drop("weights")))
        for line in weights_notes(table):
            click.echo(f"Note: {line}")
        for note in st.incomplete(models, tasks):
            click.echo(f"Note: {note}")
        fail_after(st.problems(models, tasks))
    finally:
        if enabled:
            gc.enable()


@main.command("fit-law")
@click.option(
    "--points",
    type=click.Path(dir_okay=False),
    help="A CSV or Parquet file of points with the columns width, depth, tokens, loss.",
)
@click.option("--store", help="A store: one point per model/revision (with --task).")
@click.option("--task", help="The text task whose model loss the points take (with --store).")
@click.option(
    "--exclude-highest",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="N",
    help="Keep the points whose loss is strictly below the N-th highest (the paper: 40 of 245).",
)
@click.option(
    "--bootstrap",
    type=click.IntRange(min=0),
    default=200,
    show_default=True,
    metavar="B",
    help="Resamples for the 95% percentile intervals.",
)
@click.option(
    "--heldout",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="K",
    help="Random 20% splits held out: the mean absolute relative error on them.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Of bootstrap and splits.")
@click.option(
    "--out",
    default="layerdiv-law",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for depth_law, depth_law_fit and depth_law.png (an earlier result is replaced).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default=FORMATS[1],
    show_default=True,
    help="Table file format.",
)
def fit_law_command(
    points: str | None,
    store: str | None,
    task: str | None,
    exclude_highest: int,
    bootstrap: int,
    heldout: int,
    seed: int,
    out: str,
    fmt: str,
) -> None:
    """Fit the depth loss law L = c_w w^-a_w + c_l l^-a_l + c_D D^-a_D + E (methods §12) by
    least squares on log loss, with standard errors, bootstrap intervals and held-out error."""
    from layerdiv.analyze import plots
    from layerdiv.analyze.law import fit_law, law_figure, read_points, store_points
    from layerdiv.analyze.output import result_dir, write_frame
    from layerdiv.store import Store

    if (points is None) == (store is None) or (store is not None and task is None):
        raise click.UsageError("give either --points FILE or --store S --task T")
    if points is not None:
        frame = read_points(points)
    else:
        assert store is not None and task is not None
        frame = store_points(Store(store), task)
    fit = fit_law(frame, exclude_highest, bootstrap, heldout, seed)
    settings = {"points": points, "store": store, "task": task, "exclude_highest": exclude_highest,
                "bootstrap": bootstrap, "heldout": heldout, "seed": seed}  # fmt: skip
    with result_dir(out, {"settings": settings}) as tmp:
        write_frame(fit.table, tmp / f"depth_law.{fmt}", fmt)
        write_frame(fit.summary(), tmp / f"depth_law_fit.{fmt}", fmt)
        if plots.available():
            law_figure(fit, tmp / "depth_law.png")
    click.echo(show(fit.table))
    click.echo(
        f"objective (mean squared log residual) {fit.objective:.6g} over {fit.n_fitted} of "
        f"{fit.n_points} points, at the optimum (gradient norm {fit.gradient_norm:.2g}); "
        f"{fit.n_bootstrap} bootstrap fits"
    )
    if fit.heldout_error is not None:
        click.echo(
            f"held-out mean absolute relative error {fit.heldout_error:.4g} ({fit.n_heldout} "
            f"of {heldout} splits identify the law)"
        )
    click.echo(f"wrote {out}")


@main.command("fit-lens")
@click.option("--store", required=True, help="The store holding the training task's partition.")
@click.option("--model", required=True, help="The model (as extracted: id, folder or alias).")
@click.option("--task", required=True, help="The text task the lens is trained on (TRAIN).")
@click.option(
    "--kind",
    type=click.Choice(list(LEARNED_LENS_KINDS)),
    required=True,
    help="ls: least squares in closed form from the sums of extract --lens-stats (no model); "
    "tuned: the tuned-lens recipe (runs the model).",
)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="The translators file.")
@click.option(
    "--ridge",
    type=click.FloatRange(min=0),
    default=DEFAULT_RIDGE,
    show_default=True,
    help="lambda of the least-squares lens, times the mean diagonal of h_l's centred covariance.",
)
@click.option("--steps", type=click.IntRange(min=1), default=100, show_default=True,
              help="tuned: optimiser steps.")  # fmt: skip
@click.option("--tokens-per-step", type=click.IntRange(min=1), default=256, show_default=True,
              help="tuned: tokens per step (whole documents).")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="tuned: the documents' order.")
@click.option(
    "--init",
    type=click.Choice(["zero", "ls"]),
    default="zero",
    show_default=True,
    help="tuned: start from zero (the recipe) or from the least-squares lens (needs the sums).",
)
@click.option("--device", default="auto", show_default=True, help="tuned: auto, cuda, cpu, ...")
@click.option("--dtype", default="auto", show_default=True, help="tuned: auto, fp32, bf16, fp16.")
def fit_lens_command(
    store: str,
    model: str,
    task: str,
    kind: str,
    out: str,
    ridge: float,
    steps: int,
    tokens_per_step: int,
    seed: int,
    init: str,
    device: str,
    dtype: str,
) -> None:
    """Fit a learned lens (methods §17) on a text task of the store and write its per-block
    translators (safetensors) with the model's weights fingerprint and the training task."""
    from layerdiv.extract.lens_fit import STATES_SOURCE, TunedSettings, fit_lens
    from layerdiv.store import Store

    (info,) = Store(store).select([model], [task])
    if kind == "tuned":
        click.echo(f"tuned lens trained on states from {STATES_SOURCE} ({info.where})")
    settings = TunedSettings(steps, tokens_per_step, seed, init)
    fitted = fit_lens(info, kind, model, Path(out), settings, ridge, device, dtype)
    if kind == "ls":
        click.echo(f"least-squares lens of {fitted.n_blocks} blocks from the sums over "
                   f"{fitted.settings['tokens']} tokens of {info.where}")  # fmt: skip
    click.echo(f"wrote {out} ({fitted.kind}, fingerprint {fitted.fingerprint[:12]})")


@main.command("merge")
@click.argument("sources", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option(
    "--into",
    required=True,
    type=click.Path(),
    help="The merged store: created, or an existing store that keeps what it holds.",
)
def merge_command(sources: tuple[str, ...], into: str) -> None:
    """Combine stores extracted on different machines (e.g. the shards of one run) into INTO.

    A partition held by several stores must be the same extraction in each; no instance is
    stored twice; INTO changes all at once or not at all."""
    from layerdiv.store.merge import merge_stores

    merged = merge_stores(sources, into)
    for p in merged:
        click.echo(f"{' '.join(p.key.dirs())}: {p.n_done} instances ({p.n_added} new)")
    click.echo(f"merged {len(sources)} store(s) into {into}")


if __name__ == "__main__":
    main()
