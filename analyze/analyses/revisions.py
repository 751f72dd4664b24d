"""Checkpoints: the main summaries of every revision of a model against its training step, for
the models that the store holds at several revisions (``extract --revision``; methods §12 for the
loss, §2-3 for the full-stack scores)."""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.law import mean_loss
from layerdiv.analyze.markdown import fmt, markdown_table
from layerdiv.analyze.options import ESTIMATORS
from layerdiv.analyze.registry import Analysis, Context, ReportContext
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY, MODEL_KEY

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


def step_figure(table: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """One panel per quantity of :data:`QUANTITIES` that ``table`` holds: its value against the
    training step, a line per (model, task) through that model's revisions (those with a
    recorded step; the panel counts the others)."""
    models = sorted(table["model"].unique())
    colors = plots.model_colors(models)
    tasks = sorted(table["task"].unique())
    dashes: list[plots.Dash] = ["solid", "dash", "dot", "dashdot"]
    panels = []
    for quantity, title in QUANTITIES.items():
        rows = table.filter(pl.col("quantity") == quantity)
        if not rows.height:
            continue
        panel = plots.Panel(title, xlabel="training step", ylabel=title)
        for (model, task), sub in rows.sort("step").group_by(*CURVE, maintain_order=True):
            known = sub.filter(pl.col("step").is_not_null())
            panel.series.append(
                plots.Series(
                    f"{names.get(str(model), str(model))} · {task}",
                    known["step"].to_list(),
                    known["value"].to_list(),
                    color=colors[str(model)],
                    dash=dashes[tasks.index(task) % len(dashes)],
                    hover=[f"revision {r}" for r in known["revision"]],
                )
            )
        unplaced = rows.filter(pl.col("step").is_null()).height
        if unplaced:
            panel.notes.append(f"{unplaced} value(s) of revisions without a step not drawn")
        panels.append(panel)
    return plots.Figure(
        "Checkpoints against the training step",
        panels,
        cols=min(2, len(panels)),
    )


def report(ctx: ReportContext) -> str:
    """A table of every revision's summaries, by step, and the figure of them against it."""
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
        p
        for p in [
            "Models stored at several revisions (`extract --revision`, with `--step` and "
            "`--tokens-seen` or a `stepN` name): the full-stack scores of each choice task "
            f"(estimator `{ESTIMATORS[0]}`) and the model's own next-token loss on each text task, "
            "revision by revision.",
            markdown_table(header, rows),
            plots.figure_link(
                ctx,
                "revisions.png",
                "Checkpoints against the training step",
                lambda: step_figure(table, plots.short_names(ctx.names)),
            )
            if table.filter(pl.col("step").is_not_null()).height
            else "",
        ]
        if p
    )


ANALYSIS = Analysis(
    name="revisions",
    title="Checkpoints: summaries against the training step",
    tables=tables,
    report=report,
    kinds=("choice", "text"),
    among=several_revisions,
    by_revision=True,
    after=("paper",),
    order=200,
)
