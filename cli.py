"""The ``layerdiv`` command line.

Commands that read the cache never import torch; ``extract`` and ``demo`` import it lazily.
"""

from __future__ import annotations

from collections.abc import Callable

import click

from layerdiv import __version__

DEFAULT_STORE = "layerdiv-store"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="layerdiv")
def main() -> None:
    """Bias-diversity decomposition of a language model's residual stream.

    Extract once (GPU or CPU), then analyze the cache anywhere without the model.
    """


store_option = click.option(
    "--store",
    default=DEFAULT_STORE,
    show_default=True,
    type=click.Path(file_okay=False),
    help="Store (cache) directory.",
)


# --- extraction commands -------------------------------------------------------------------


def _parse_shard(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in value.split("/"))
    except ValueError:
        raise click.BadParameter("use i/N, e.g. 0/4") from None
    if not 0 <= i < n:
        raise click.BadParameter(f"need 0 <= i < N, got {value}")
    return i, n


def _parse_batch_size(ctx: click.Context, param: click.Parameter, value: str) -> int | None:
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter("a positive integer or 'auto'")
    return int(value)


@main.command()
@click.option("--model", required=True, help="Hub id, local folder, or smollm2-135m-instruct.")
@click.option(
    "--task",
    "tasks",
    multiple=True,
    required=True,
    help="Built-in task name or task YAML path (repeatable).",
)
@store_option
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit).")
@click.option("--gguf-file", default=None, help="GGUF file in the model folder or repo.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Instances per task.")
@click.option(
    "--batch-size",
    default="auto",
    show_default=True,
    callback=_parse_batch_size,
    help="Instances per batch, or auto (length-sorted batches up to a token budget).",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "bf16", "fp16", "fp32"]),
    default="auto",
    show_default=True,
)
@click.option("--device", default="auto", show_default=True, help="auto, cuda, cuda:1, mps, cpu.")
@click.option(
    "--device-map",
    type=click.Choice(["auto"]),
    default=None,
    help="auto: spread a model larger than one GPU over the GPUs, CPU and disk (accelerate).",
)
@click.option(
    "--shard",
    default="0/1",
    show_default=True,
    callback=_parse_shard,
    help="Do chunk share i of N.",
)
@click.option("--overwrite", is_flag=True, help="Replace a partition holding another extraction.")
@click.option("--trust-remote-code", is_flag=True, help="Run model code from its hub repo.")
@click.option(
    "--allow-softcap", is_flag=True, help="Decompose pre-soft-cap logits (flagged approximate)."
)
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Instances per stored part (the unit of resumption).",
)
def extract(
    model: str,
    tasks: tuple[str, ...],
    store: str,
    revision: str | None,
    gguf_file: str | None,
    limit: int | None,
    batch_size: int | None,
    dtype: str,
    device: str,
    device_map: str | None,
    shard: tuple[int, int],
    overwrite: bool,
    trust_remote_code: bool,
    allow_softcap: bool,
    chunk_size: int,
) -> None:
    """Run MODEL once over each task and cache every component's option logits."""
    from pathlib import Path

    from layerdiv.extract.errors import EXTRACT_ERRORS
    from layerdiv.extract.runner import ExtractConfig, run_extract

    cfg = ExtractConfig(
        model=model,
        tasks=list(tasks),
        store=Path(store),
        revision=revision,
        gguf_file=gguf_file,
        limit=limit,
        batch_size=batch_size,
        dtype=dtype,
        device=device,
        device_map=device_map,
        shard=shard,
        overwrite=overwrite,
        trust_remote_code=trust_remote_code,
        allow_softcap=allow_softcap,
        chunk_size=chunk_size,
    )
    try:
        summaries = run_extract(cfg)
    except EXTRACT_ERRORS as err:
        raise click.ClickException(str(err)) from err
    for s in summaries:
        if not s.n_new:
            click.echo(f"{s.task}: {s.n_done}/{s.n_requested} instances stored (nothing to do)")
            continue
        acc = "" if s.accuracy_new is None else f", accuracy {100 * s.accuracy_new:.1f}%"
        click.echo(
            f"{s.task}: {s.n_done}/{s.n_requested} instances stored ({s.n_new} new in "
            f"{s.seconds:.1f} s{acc}; max decomposition error {s.max_sum_error:.1e}"
            + (f"; {s.n_truncated} prompts left-truncated to the context" if s.n_truncated else "")
            + ")"
        )
    click.echo(f"store: {store}")


@main.command()
@click.option(
    "--out",
    default="layerdiv-demo",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for the demo's tasks, store, result tables and report.",
)
@click.option("--n", type=click.IntRange(min=10), default=300, show_default=True,
              help="Instances per task (balanced classes).")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
def demo(out: str, n: int, seed: int) -> None:
    """Offline end to end: SmolLM2 on three tasks made from packaged data (extract, analyze,
    report), then a summary. A second run reuses the cache."""
    from pathlib import Path

    from layerdiv.demo import DemoDataError, run_demo

    try:
        run_demo(Path(out), n, seed)
    except DemoDataError as err:
        raise click.ClickException(str(err)) from err


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
lens_option = click.option(
    "--lens",
    type=click.Choice(["final", "prefix"]),
    default="final",
    show_default=True,
    help="Junction scores with the final norm's scale frozen, or each prefix rescaled by its "
    "own rms (logit lens; METHODS.md sections 1 and 3).",
)
min_params_option = click.option(
    "--min-params",
    type=float,
    default=0.0,
    show_default=True,
    metavar="N",
    help="Depth efficiency (Fig. 6) only for models with at least N parameters (paper: 1e9).",
)


def analysis_options(command: Callable[..., None]) -> Callable[..., None]:
    """The store, selection, lens and model-size options shared by ``analyze`` and ``report``."""
    for option in (min_params_option, lens_option, tasks_option, models_option, store_option):
        command = option(command)
    return command


@main.command("analyze")
@analysis_options
@click.option(
    "--out",
    default="layerdiv-results",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Directory for the result tables.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["parquet", "csv"]),
    default="parquet",
    show_default=True,
    help="Table file format.",
)
def analyze_command(
    store: str,
    models: tuple[str, ...],
    tasks: tuple[str, ...],
    lens: str,
    min_params: float,
    out: str,
    fmt: str,
) -> None:
    """Compute every result table (scores, curves, module shares, correlations, depth
    efficiency, information) from the cache and write them to OUT."""
    from layerdiv.analyze.api import analyze
    from layerdiv.analyze.cli_support import clean_errors
    from layerdiv.analyze.output import write_tables

    with clean_errors():
        results = analyze(store, models, tasks, lens, min_params, progress=True)  # type: ignore[arg-type]
        settings = {
            "store": store,
            "models": list(models),
            "tasks": list(tasks),
            "lens": lens,
            "min_params": min_params,
        }
        write_tables(results.tables(), out, fmt, settings)
    click.echo(f"wrote {len(results.tables())} tables ({fmt}) to {out}")


@main.command("report")
@analysis_options
@click.option(
    "--estimator",
    type=click.Choice(["paper", "ensemble"]),
    default="paper",
    show_default=True,
    help="Which MSE/bias/diversity estimator the report shows (METHODS.md section 2).",
)
@click.option(
    "--out",
    default="layerdiv-report",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Directory for report.md and figures/.",
)
def report_command(
    store: str,
    models: tuple[str, ...],
    tasks: tuple[str, ...],
    lens: str,
    min_params: float,
    estimator: str,
    out: str,
) -> None:
    """Write a Markdown report (the paper's Table 1, Figs. 3-6 tables and PNG figures)."""
    from layerdiv.analyze.api import analyze
    from layerdiv.analyze.cli_support import clean_errors
    from layerdiv.analyze.report import write_report

    with clean_errors():
        results = analyze(store, models, tasks, lens, min_params, progress=True)  # type: ignore[arg-type]
        path, notes = write_report(results, out, estimator, store)  # type: ignore[arg-type]
    click.echo(f"wrote {path}")
    for note in notes:
        click.echo(note)


@main.command("query")
@click.argument("sql")
@store_option
@models_option
@tasks_option
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the result to this .parquet or .csv file instead of printing it.",
)
@click.option("--max-rows", type=int, default=40, show_default=True, help="Rows to print at most.")
def query_command(
    sql: str,
    store: str,
    models: tuple[str, ...],
    tasks: tuple[str, ...],
    out: str | None,
    max_rows: int,
) -> None:
    """Run SQL on the views components, instances and manifests (DuckDB).

    Example: layerdiv query "SELECT model, task, count(*) FROM instances GROUP BY ALL"
    """
    from layerdiv.analyze.cli_support import clean_errors, show
    from layerdiv.analyze.output import atomic_file, file_format
    from layerdiv.store import Store

    with clean_errors():
        fmt = file_format(out) if out else None
        relation = Store(store).duckdb(models, tasks).sql(sql)
        if relation is None:
            click.echo("OK (the statement returns no rows)")
        elif out:
            with atomic_file(out) as tmp:
                getattr(relation, f"write_{fmt}")(str(tmp))
            click.echo(f"wrote {out}")
        else:
            click.echo(show(relation.limit(max_rows + 1).pl(), max_rows))


@main.command("ls")
@store_option
def ls_command(store: str) -> None:
    """List what the store holds: models, tasks, instance counts, extraction dates."""
    from layerdiv.analyze.api import ls
    from layerdiv.analyze.cli_support import clean_errors, show

    with clean_errors():
        table = ls(store)
    click.echo(show(table, max_rows=max(table.height, 1)))


if __name__ == "__main__":
    main()
