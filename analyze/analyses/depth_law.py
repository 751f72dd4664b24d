"""The depth loss law across the store's models (methods §12): per text task, the law
L = c_w w^-a_w + c_l l^-a_l + c_D D^-a_D + E fitted to one point per (model, revision) (width,
depth, tokens seen and the model's mean own loss), as ``layerdiv fit-law --store`` fits it, with
the partial-residual figure (the inverse-depth paper's Fig. 2f). A task whose points cannot be
fitted (one model, too few points, a revision without its tokens seen) is named in a note."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import partial

import polars as pl

from layerdiv.analyze import law, plots
from layerdiv.analyze.markdown import fmt, markdown_table, verdict
from layerdiv.analyze.registry import Analysis, Context, NoData, ReportContext
from layerdiv.errors import LayerdivError
from layerdiv.store import PartitionInfo
from layerdiv.store.key import MODEL_KEY


def enough_points(parts: list[PartitionInfo]) -> list[PartitionInfo]:
    """The partitions of the text tasks that hold at least :data:`~layerdiv.analyze.law.MIN_POINTS`
    (model, revision) points; on fewer the law cannot be fitted (``layerdiv fit-law --store S
    --task T`` says so in one line), and the section says why (:func:`too_few`)."""
    points: dict[str, set[tuple[str, str]]] = {}
    for p in parts:
        points.setdefault(p.task, set()).add((p.model, p.key.revision))
    return [p for p in parts if len(points[p.task]) >= law.MIN_POINTS]


def too_few(manifests: pl.DataFrame) -> str:
    """Why the law was not fitted on any text task of ``manifests``: its points per task, and
    what adds them."""
    text = manifests.filter(pl.col("kind").is_in(law.KINDS_WITH_LOSS))
    points = text.group_by("task").agg(pl.struct(*MODEL_KEY).n_unique().alias("n")).sort("task")
    held = ", ".join(f"{n} on {task}" for task, n in points.iter_rows())
    return (
        f"Not fitted: the law has {law.N_PARAMS} parameters, so it needs at least "
        f"{law.MIN_POINTS} points (models or revisions, each with its tokens seen) on one text "
        f"task, and this store holds {held}. Extract more models on a text task "
        "(`layerdiv extract --model M --task T --tokens-seen D`) and run `layerdiv report` "
        "again; `layerdiv fit-law --store S --task T` fits it alone."
    )


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """``depth_law`` (per task, a row per parameter of :data:`~layerdiv.analyze.law.PARAMETERS`:
    estimate, se, ci_low, ci_high, in the units of width, depth and tokens seen),
    ``depth_law_fit`` (per task: points, objective at the optimum, gradient norm, bootstrap fits)
    and ``depth_law_points`` (per task, the fitted points with L_hat) for every text task whose
    points can be fitted (methods §12; :func:`~layerdiv.analyze.law.fit_law`, its defaults)."""
    ctx = replace(ctx, parts=enough_points(ctx.parts))
    if not ctx.parts:
        return {}  # the section says why (too_few)
    models = sorted({p.model for p in ctx.parts})
    fitted: dict[str, list[pl.DataFrame]] = {"depth_law": [], "depth_law_fit": [],
                                              "depth_law_points": []}  # fmt: skip
    why = []
    for task in sorted({p.task for p in ctx.parts}):
        try:
            fit = law.fit_law(law.store_points(ctx.store, task, models))
        except LayerdivError as err:  # LawError, or a store's refusal of its points
            why.append(f"task {task}: {err}")
            continue
        for name, frame in (("depth_law", fit.table), ("depth_law_fit", fit.summary()),
                            ("depth_law_points", fit.points)):  # fmt: skip
            fitted[name].append(frame.select(pl.lit(task).alias("task"), pl.all()))
    if not fitted["depth_law"]:
        raise NoData("the depth law was not fitted: " + "; ".join(why))
    ctx.notes += [f"depth law not fitted on {line}" for line in why]
    return {name: pl.concat(frames) for name, frames in fitted.items()}


MIN_POINTS = 2 * law.N_PARAMS
"""Points below which the law's depth exponent cannot tell (two per parameter)."""

DEPTH_EXPONENT = 0.5
"""The inverse-depth paper's loss term ∝ 1/l (alpha_depth = 1) holds where alpha_depth's
interval lies above this: halfway between no depth term (0) and 1/l."""


def law_verdict(table: pl.DataFrame, n: int) -> str:
    """The verdict on the inverse-depth paper's depth term ∝ 1/l: alpha_depth above
    :data:`DEPTH_EXPONENT`, its 2.5-97.5% bootstrap interval."""
    r = table.filter(pl.col("parameter") == "alpha_depth").row(0, named=True)
    return verdict("the loss's depth term falls roughly as 1/l", "α_depth", r["estimate"],
                   (r["ci_low"], r["ci_high"]), n, DEPTH_EXPONENT, min_n=MIN_POINTS,
                   unit="(model, revision) points")  # fmt: skip


def report(ctx: ReportContext) -> str:
    """Per task: the parameters with their intervals, how the fit was made, and the figure; or
    why no task could be fitted."""
    if "depth_law_fit" not in ctx.tables:
        return too_few(ctx.tables["manifests"])
    parts = [
        "One point per (model, revision) of the store on a text task: width w (`hidden_size`), "
        "depth l (decoder blocks), training tokens D (`--tokens-seen`) and the mean of the "
        "model's own next-token loss; the law fitted by least squares on log loss from several "
        "starts, standard errors from the Jacobian, 2.5-97.5% bootstrap percentile intervals "
        "(as `layerdiv fit-law --store S --task T` fits it). The figure shows each term's "
        "partial residuals L - (L_hat - term) against its variable with the fitted term."
    ]
    summary = ctx.tables["depth_law_fit"]
    for row in summary.iter_rows(named=True):
        task = row["task"]
        table = ctx.tables["depth_law"].filter(pl.col("task") == task).drop("task")
        points = ctx.tables["depth_law_points"].filter(pl.col("task") == task).drop("task")
        rows = [
            [
                r["parameter"],
                *(fmt(r[c], digits=4) for c in ("estimate", "se", "ci_low", "ci_high")),
            ]
            for r in table.iter_rows(named=True)
        ]
        parts += [
            f"### Task {task}",
            f"{row['n_fitted']} points of {row['n_points']}; objective (mean squared log "
            f"residual) {row['objective']:.3g} at the optimum (gradient norm "
            f"{row['gradient_norm']:.2g}); {row['n_bootstrap']} bootstrap fits.",
            markdown_table(["Parameter", "Estimate", "s.e.", "2.5%", "97.5%"], rows),
            law_verdict(table, row["n_fitted"]),
            plots.figure_link(
                ctx,
                f"depth_law_{task}.png",
                f"Depth law, task {task}",
                partial(
                    law.law_spec, table, points, f"Depth loss law on {task}: partial residuals"
                ),
            ),
        ]
    return "\n\n".join(p for p in parts if p)


ANALYSIS = Analysis(
    name="depth_law",
    title="The depth loss law across models",
    tables=tables,
    report=report,
    methods=(12,),
    kinds=law.KINDS_WITH_LOSS,
    order=210,
)
