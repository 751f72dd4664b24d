"""The ``layerdiv`` command line.

Commands that read the cache never import torch; ``extract`` and ``demo`` import it lazily.
"""

from __future__ import annotations

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
        acc = "" if s.accuracy_new is None else f", accuracy {100 * s.accuracy_new:.1f}%"
        click.echo(
            f"{s.task}: {s.n_done}/{s.n_requested} instances stored ({s.n_new} new in "
            f"{s.seconds:.1f} s{acc}; max decomposition error {s.max_sum_error:.1e}"
            + (f"; {s.n_truncated} prompts left-truncated to the context" if s.n_truncated else "")
            + ")"
        )
    click.echo(f"store: {store}")


# --- analysis commands ---------------------------------------------------------------------


if __name__ == "__main__":
    main()
