"""The figures of the reference paper's report section (:mod:`.paper`): Figs. 3-6 as
:class:`~layerdiv.analyze.plots.Figure` specs, drawn from the tables of the ``paper`` analysis.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from layerdiv.analyze import plots, stats
from layerdiv.analyze.markdown import (
    AVG,
    DASH,
)
from layerdiv.analyze.metrics import CORRELATED, METRICS
from layerdiv.analyze.registry import (
    ReportContext,
)
from layerdiv.schemas import COMPONENT_KINDS
from layerdiv.store.key import KEY

GAIN_WINDOW = 5
"""Marginal gains in Fig. 6 are shown as a centred rolling mean over this many components."""


def correlation_spec(ctx: ReportContext, scale: str) -> plots.Figure:
    """Fig. 3: heatmaps of r (models x tasks + Avg.), one per (method, metric); ``*`` marks
    in the task columns an r whose bootstrap interval over instances excludes 0 (``significant``
    of :func:`~layerdiv.analyze.stats.correlations`); Avg. is the Fisher-z mean over tasks."""
    names = plots.short_names(ctx.names)
    chosen = pl.col("estimator") == ctx.estimator
    corr = ctx.tables["correlations"].filter(chosen)
    means = ctx.tables["correlation_means"].filter(
        chosen & pl.col("task").is_null() & pl.col("model").is_not_null()
    )
    models, tasks = sorted(corr["model"].unique()), sorted(corr["task"].unique())
    columns = [*tasks, AVG]
    labels = [names.get(m, m) for m in models]
    panels = []
    for method in stats.METHODS:
        for metric in CORRELATED:
            pick = (pl.col("method") == method) & (pl.col("metric") == metric.name)
            cells = {
                (r["model"], r["task"]): r["r"] for r in corr.filter(pick).iter_rows(named=True)
            }
            stars = {
                (r["model"], r["task"])
                for r in corr.filter(pick & pl.col("significant")).iter_rows(named=True)
            }
            cells |= {(r["model"], AVG): r["r"] for r in means.filter(pick).iter_rows(named=True)}
            z = plots.grid(cells, models, columns)
            text = [
                [
                    DASH if v is None else f"{v:.2f}" + ("*" if (m, c) in stars else "")
                    for v, c in zip(row, columns, strict=True)
                ]
                for row, m in zip(z, models, strict=True)
            ]
            hover = [
                [
                    f"{names.get(m, m)} · {c}<br>{method} r(accuracy, {metric.signed}) = {t}"
                    for c, t in zip(columns, row, strict=True)
                ]
                for m, row in zip(models, text, strict=True)
            ]
            heat = plots.Heatmap(
                z,
                columns,
                labels,
                "correlation r",
                cmap="RdBu_r",
                zmin=-1,
                zmax=1,
                text=text,
                hover=hover,
            )
            title = f"{method.capitalize()}: accuracy vs {metric.signed}"
            panels.append(plots.Panel(title, heatmap=heat))
    return plots.Figure(
        "Fig. 3 — correlation with accuracy across junction points j = 1..L",
        panels,
        cols=len(CORRELATED),
        panel_size=(1.6 + 0.6 * len(columns), 1.5 + 0.38 * len(models)),
        caption=f"estimator {ctx.estimator}, scale {scale}; * 95% interval over instances "
        "excludes 0; Avg. = Fisher-z mean over tasks",
    )


def module_spec(ctx: ReportContext) -> plots.Figure:
    """Fig. 4: stacked horizontal bars of each module kind's share of bias and of diversity."""
    names = plots.short_names(ctx.names)
    shares = stats.module_shares_by_model(
        ctx.tables["modules"], ctx.estimator, ctx.tables["manifests"]
    )
    models = sorted(shares["model"].unique())
    kinds = [k for k in COMPONENT_KINDS if k in set(shares["kind"])]
    labels = [names.get(m, m) for m in models]
    panels = []
    for column, title in (
        ("bias_share", "Bias (Eqs. 9-10)"),
        ("diversity_share", "Diversity (Eqs. 9-10)"),
    ):
        series = []
        for kind in kinds:
            values = [
                100 * shares.filter((pl.col("model") == m) & (pl.col("kind") == kind))[column].sum()
                for m in models
            ]
            series.append(
                plots.Series(kind, values, labels, color=plots.KIND_COLORS[kind], bar=True)
            )
        panels.append(
            plots.Panel(
                title,
                series,
                xlabel="share of the total (%)",
                xrange=(0, 100),
                bars="stack",
                horizontal=True,
            )
        )
    return plots.Figure(
        "Fig. 4 — share of bias and diversity by module, mean over tasks "
        f"(estimator {ctx.estimator})",
        panels,
        panel_size=(5.5, 0.8 + 0.4 * len(models)),
    )


def curves_spec(ctx: ReportContext, scale: str, model: str) -> plots.Figure:
    """Fig. 5 for one model: accuracy, MSE, bias and diversity of the first j components,
    z-scored across j, one panel per task; hover shows the component added at j and the
    metric's value in its unit."""
    by = [*KEY, "estimator"]
    frame = (
        ctx.tables["curves"]
        .filter((pl.col("model") == model) & (pl.col("estimator") == ctx.estimator))
        .with_columns(*(stats.zscore(m, by).alias(f"z_{m}") for m in METRICS))
        .sort("task", "j")
    )
    name = plots.short_names(ctx.names).get(model, model)
    panels = []
    for task in sorted(frame["task"].unique()):
        sub = frame.filter(pl.col("task") == task)
        series = []
        for metric in METRICS.values():
            unit = metric.unit(ctx.estimator)
            hover = [
                f"{name} · {task}<br>j = {j}: {c}<br>"
                f"{metric.title} {v * unit.scale:.3f} {unit.label}"
                for j, c, v in zip(sub["j"], sub["component"], sub[metric.name], strict=True)
            ]
            series.append(
                plots.Series(
                    metric.title,
                    sub["j"].to_list(),
                    sub[f"z_{metric.name}"].to_list(),
                    color=metric.color,
                    dash=DASHES[metric.line],
                    marker=None,
                    hover=hover,
                    x_relative=sub["relative_depth"].to_list(),
                )
            )
        panels.append(
            plots.Panel(task, series, xlabel="components in prefix j", ylabel="z-score across j")
        )
    return plots.Figure(
        f"Fig. 5 — {name}: standardized layer-addition curves",
        panels,
        cols=min(4, len(panels)),
        panel_size=(3.6, 2.8),
        depth_switch="components in prefix j",
        caption=f"estimator {ctx.estimator}, scale {scale}",
    )


def depth_spec(ctx: ReportContext, scale: str, min_params: float) -> plots.Figure:
    """Fig. 6: accuracy and MSE averaged over tasks against the number of components with their
    fits (dashed; R² in the notes), and the marginal accuracy gain per added component (rolling
    mean); the HTML figure switches x between j and j / L so that models overlay."""
    names = plots.short_names(ctx.names)
    chosen = pl.col("estimator") == ctx.estimator
    depth = ctx.tables["depth_curves"].filter(chosen).sort("n_params", "j")
    fits = {r["model"]: r for r in ctx.tables["depth_fits"].filter(chosen).iter_rows(named=True)}
    mse = METRICS["mse"].unit(ctx.estimator)
    acc = plots.Panel("Accuracy (dashed: a + b ln j)", ylabel="accuracy, mean over tasks (%)")
    loss = plots.Panel("MSE (dashed: c / j^α + L0)", ylabel=f"MSE, mean over tasks ({mse.label})")
    gain = plots.Panel(
        "Marginal gain of adding component j",
        ylabel=f"gain per component (points, mean of {GAIN_WINDOW})",
        lines=[plots.RefLine(0)],
    )
    models = list(depth["model"].unique(maintain_order=True))
    for model, color in plots.model_colors(models).items():
        sub = depth.filter(pl.col("model") == model)
        j = sub["j"].to_numpy().astype(float)
        fit, label = fits[model], names.get(model, model)
        rel = (j / j.max()).tolist()
        rolled = sub["accuracy_gain"].rolling_mean(GAIN_WINDOW, center=True, min_samples=1)
        fitted_loss = stats.inverse_depth(j, fit["loss_c"], fit["loss_alpha"], fit["loss_l0"])
        line = {"color": color, "marker": None, "x_relative": rel}
        acc.series += [
            plots.Series(label, j.tolist(), (100 * sub["accuracy"].to_numpy()).tolist(), **line),
            plots.Series(
                label,
                j.tolist(),
                (100 * (fit["acc_a"] + fit["acc_b"] * np.log(j))).tolist(),
                dash="dash",
                legend=False,
                width=0.9,
                **line,
            ),
        ]
        shown = mse.scale * sub["mse"].to_numpy()
        loss.series.append(plots.Series(label, j.tolist(), shown.tolist(), **line))
        if not fit["loss_at_bound"]:  # else c, α and L0 mean nothing (the table's †): no line
            loss.series.append(
                plots.Series(
                    label,
                    j.tolist(),
                    (mse.scale * fitted_loss).tolist(),
                    dash="dash",
                    legend=False,
                    width=0.9,
                    **line,
                )
            )
        gain.series.append(
            plots.Series(label, j.tolist(), (100 * rolled.to_numpy()).tolist(), **line)
        )
        whose = f"{label}: " if len(models) > 1 else ""  # one model: the legend names it
        acc.notes.append(whose + plots.r2_text(fit["acc_r2"]))
        low, high = float(np.nanmin(shown)), float(np.nanmax(shown))
        loss.notes += [
            whose
            + (
                "no fit: α at an end of its range (†)"
                if fit["loss_at_bound"]
                else plots.r2_text(fit["loss_r2"])
            ),
            f"{whose}range {low:.4g} to {high:.4g}: {100 * (high - low) / high:.2g}% of the MSE",
        ]
    if not any(s.dash == "dash" for s in loss.series):
        loss.title = "MSE"
    for panel in (acc, loss, gain):
        panel.xlabel = "components in prefix j"
    which = f"models with ≥ {min_params:.3g} parameters" if min_params else "all models"
    return plots.Figure(
        f"Fig. 6 — depth efficiency, {which}",
        [acc, loss, gain],
        cols=3,
        panel_size=(5.0, 4.0),
        depth_switch="components in prefix j",
        caption=f"estimator {ctx.estimator}, scale {scale}; poor fit: R² < {plots.POOR_FIT_R2:g}",
    )


DASHES: dict[str, plots.Dash] = {"-": "solid", "--": "dash", "-.": "dashdot", ":": "dot"}
