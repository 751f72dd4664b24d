"""Checkpoints: the main summaries of every revision of a model against its training step, for
the models that the store holds at several revisions (``extract --revision``; methods §12 for the
loss, §2-3 for the full-stack scores)."""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

from layerdiv.analyze.markdown import fmt, markdown_table
from layerdiv.analyze.options import ESTIMATORS
from layerdiv.analyze.registry import Analysis, Context, ReportContext, register
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY, MODEL_KEY
from layerdiv.store.reader import mean_loss

QUANTITIES = {
    "accuracy": "full-stack accuracy",
    "mse": "full-stack MSE",
    "diversity": "full-stack diversity",
    "loss": "own next-token loss (nats)",
}
"""What the table follows across revisions: the full-stack scores of a choice task (estimator
``paper``, methods §2) and the model's loss on a text task (methods §12)."""

CURVE = [c for c in KEY if c != "revision"]
"""What one line of the figure follows across revisions: a model on a task."""

SCHEMA = {
    **dict.fromkeys(KEY, pl.String),
    "step": pl.Int64,
    "tokens_seen": pl.Int64,
    "quantity": pl.String,
    "value": pl.Float64,
}


def several_revisions(parts: list[PartitionInfo]) -> list[PartitionInfo]:
    """The partitions of the models that have more than one revision among ``parts``."""
    revisions: dict[str, set[str]] = {}
    for p in parts:
        revisions.setdefault(p.model, set()).add(p.key.revision)
    return [p for p in parts if len(revisions[p.model]) > 1]


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """``revision_summary``: per (model, revision, task) and quantity of :data:`QUANTITIES`, its
    value with the revision's step and tokens seen (null where not recorded)."""
    frames = []
    if "scores" in prior:
        choice = [*QUANTITIES][:3]
        frames.append(
            prior["scores"]
            .filter(pl.col("estimator") == ESTIMATORS[0])
            .unpivot(choice, index=[*KEY], variable_name="quantity", value_name="value")
        )
    loss = mean_loss(ctx.store, ctx.parts).filter(pl.col("n_tokens") > 0)
    frames.append(
        loss.select(*KEY, pl.lit("loss").alias("quantity"), pl.col("loss").alias("value"))
    )
    keys = pl.DataFrame([dict(p.key.items()) for p in ctx.parts])
    steps = ctx.store.models().select(*MODEL_KEY, "step", "tokens_seen")
    table = (
        pl.concat([f.cast({"value": pl.Float64}) for f in frames])
        .join(keys, on=[*KEY], how="semi")
        .join(steps, on=[*MODEL_KEY], how="left")
        .select(list(SCHEMA))
        .cast(SCHEMA)  # type: ignore[arg-type]
        .sort(*CURVE, "quantity", "step", "revision", nulls_last=True)
    )
    return {"revision_summary": table}


def report(ctx: ReportContext) -> str:
    """A table of every revision's summaries, by step."""
    table = ctx.tables["revision_summary"]
    rows = [
        [
            ctx.names.get(r["model"], r["model"]),
            r["revision"],
            r["task"],
            "–" if r["step"] is None else str(r["step"]),
            "–" if r["tokens_seen"] is None else f"{r['tokens_seen']:,}",
            r["quantity"],
            fmt(r["value"], digits=4),
        ]
        for r in table.iter_rows(named=True)
    ]
    header = ["Model", "Revision", "Task", "Step", "Tokens seen", "Quantity", "Value"]
    return "\n\n".join(
        [
            "Models stored at several revisions (`extract --revision`, with `--step` and "
            "`--tokens-seen` or a `stepN` name): the full-stack scores of each choice task "
            f"(estimator `{ESTIMATORS[0]}`) and the model's own next-token loss on each text task, "
            "revision by revision.",
            markdown_table(header, rows),
        ]
    )


register(
    Analysis(
        name="revisions",
        title="Checkpoints: summaries against the training step",
        tables=tables,
        report=report,
        kinds=("choice", "text"),
        among=several_revisions,
    )
)
