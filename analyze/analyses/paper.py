"""The reference paper's analysis (methods §2-6): scores, layer-addition curves, module
shares, correlations, depth efficiency, saturation and the information-theoretic view, with its
report section (Table 1, Figs. 3-6) and figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path

import numpy as np
import polars as pl
from tqdm import tqdm

from layerdiv.analyze import plots, stats
from layerdiv.analyze.decomposition import partition_scores
from layerdiv.analyze.markdown import AVG, DASH, Cells, fmt, markdown_table, model_task_table
from layerdiv.analyze.metrics import ACCURACY, CORRELATED, METRICS
from layerdiv.analyze.options import ESTIMATORS
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    map_partitions,
    register,
)
from layerdiv.analyze.text import tag as tagged
from layerdiv.schemas import COMPONENT_KINDS
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY

# --- tables --------------------------------------------------------------------------------


def _component_names(parts: list[PartitionInfo]) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                **dict(p.key.items()),
                "j": j,
                "component": j - 1,
                "name": c.name,
                "kind": c.kind,
            }
            for p in parts
            for j, c in enumerate(p.manifest.components, start=1)
        ],
        schema={
            **dict.fromkeys(KEY, pl.String),
            "j": pl.Int16,
            "component": pl.Int16,
            "name": pl.String,
            "kind": pl.String,
        },
    )


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """Every table of methods §2-6 for the selected partitions (see
    :class:`~layerdiv.analyze.api.Results` for each table's columns). ``instance_scores`` goes to
    ``ctx.spill`` partition by partition; only per-partition aggregates stay in memory."""
    manifests = prior["manifests"]

    def reduce(info: PartitionInfo) -> tuple[pl.DataFrame, dict[str, pl.DataFrame]]:
        """The partition's instance scores (to spill) and the aggregates kept of it."""
        scores = partition_scores(info, ctx.scale)
        instances = scores.instances.sort("estimator", "instance")
        n_options = manifests.join(
            pl.DataFrame([dict(info.key.items())]), on=[*KEY], how="semi"
        ).select(*KEY, "n_options")
        info_curves = stats.information_curves(tagged(scores.prefix_preds, info), n_options)
        return tagged(instances, info), {
            "curves": tagged(scores.curves, info),
            "modules": tagged(scores.modules, info),
            "counts": tagged(
                instances.group_by("estimator").agg(pl.len().cast(pl.Int64).alias("n_instances")),
                info,
            ),
            "golds": tagged(
                instances.filter(pl.col("estimator") == ESTIMATORS[0])
                .group_by("gold")
                .agg(pl.len().alias("count")),
                info,
            ),
            "information_curves": info_curves,
            "information": stats.information_summary(
                info_curves, tagged(scores.component_preds, info)
            ),
        }

    kept: dict[str, list[pl.DataFrame]] = {}
    # partitions come sorted by (model, task) and results in their order: so are the tables
    for instances, frames in tqdm(
        map_partitions(reduce, ctx.parts),
        total=len(ctx.parts),
        desc="analysing",
        unit="partition",
        disable=None if ctx.progress else True,
    ):
        ctx.spill.append("instance_scores", instances)
        for name, frame in frames.items():
            kept.setdefault(name, []).append(frame)

    def gather(name: str) -> pl.DataFrame:
        return pl.concat(kept[name])

    curves = (
        gather("curves")
        .join(_component_names(ctx.parts), on=[*KEY, "j"])
        .with_columns(  # methods §7: j / L, so that models of different depth overlay
            (pl.col("j") / pl.col("j").max().over(*KEY)).alias("relative_depth")
        )
        .sort(*KEY, "estimator", "j")
    )
    counts = gather("counts")
    corr = stats.correlations(curves)
    depth = stats.depth_curves(curves, manifests, ctx.min_params)
    if depth.is_empty():
        largest = float(manifests["n_params"].max())  # type: ignore[arg-type]
        ctx.notes.append(
            f"depth_curves and depth_fits are empty: no selected model has min_params="
            f"{ctx.min_params:.3g} parameters or more (the largest has {largest:.3g}); lower it."
        )
    return {
        "scores": _score_table(curves, counts, gather("golds"), manifests),
        "curves": curves,
        "modules": _module_shares(gather("modules"), counts),
        "correlations": corr,
        "correlation_means": stats.fisher_z_means(corr),
        "depth_curves": depth,
        "depth_fits": stats.depth_fits(depth),
        "information_curves": gather("information_curves"),
        "information": gather("information"),
        "saturation": stats.saturation(curves),
    }


def _score_table(
    curves: pl.DataFrame, counts: pl.DataFrame, golds: pl.DataFrame, manifests: pl.DataFrame
) -> pl.DataFrame:
    """The full-stack scores: the curves at j = L, with sizes and the majority baseline."""
    sizes = manifests.select(*KEY, "n_components", "n_options")
    return (
        curves.join(sizes, on=[*KEY])
        .filter(pl.col("j") == pl.col("n_components"))
        .join(counts, on=[*KEY, "estimator"])
        .join(stats.majority_baseline(golds), on=[*KEY])
        .select(
            *KEY,
            "estimator",
            "n_instances",
            "n_components",
            "n_options",
            *METRICS,
            "majority_accuracy",
            "majority_option",
        )
        .sort(*KEY, "estimator")
    )


def _module_shares(sums: pl.DataFrame, counts: pl.DataFrame) -> pl.DataFrame:
    """bias_X, diversity_X (means over instances and components of kind X) and the shares
    share_X = |X| bias_X / (L bias) = sum over X / sum over all components (paper Eqs. 9-10,
    Fig. 4), from the per-partition sums."""
    by = [*KEY, "estimator"]
    n = pl.col("n_instances") * pl.col("n_components")
    return (
        sums.join(counts, on=by)
        .with_columns(
            (pl.col("bias_sum") / n).alias("bias"),
            (pl.col("diversity_sum") / n).alias("diversity"),
            (pl.col("bias_sum") / pl.col("bias_sum").sum().over(by)).alias("bias_share"),
            (pl.col("diversity_sum") / pl.col("diversity_sum").sum().over(by)).alias(
                "diversity_share"
            ),
        )
        .select(*by, "kind", "n_components", "bias", "diversity", "bias_share", "diversity_share")
        .sort(*by, "kind")
    )


# --- report tables -------------------------------------------------------------------------


def table1(ctx: ReportContext) -> str:
    """The paper's Table 1 layout: per metric, models x tasks with the Avg. column (mean over the
    model's tasks), in the metric's unit for the estimator; the accuracy table starts with the
    majority-class baseline."""
    frame = ctx.tables["scores"].filter(pl.col("estimator") == ctx.estimator)
    majority = frame.group_by("task").agg(pl.col("majority_accuracy").mean()).sort("task")
    pct = ACCURACY.unit(ctx.estimator)
    baseline = [
        "*Majority class*",
        *(fmt(v, pct.scale, pct.digits) for v in majority["majority_accuracy"]),
        fmt(majority["majority_accuracy"].mean(), pct.scale, pct.digits),  # type: ignore[arg-type]
    ]
    parts = []
    for metric in METRICS.values():
        unit = metric.unit(ctx.estimator)
        cells: Cells = {
            (m, t): fmt(v, unit.scale, unit.digits)
            for m, t, v in frame.select(*KEY, metric.name).iter_rows()
        }
        avg = frame.group_by("model").agg(pl.col(metric.name).mean())
        cells.update({(m, None): fmt(v, unit.scale, unit.digits) for m, v in avg.iter_rows()})
        first = [baseline] if metric is ACCURACY else []
        parts.append(
            f"#### {metric.heading(ctx.estimator)}\n\n"
            + model_task_table(cells, ctx.names, first_rows=first)
        )
    return "\n\n".join(parts)


def correlation_table(ctx: ReportContext) -> str:
    """The Fig. 3 table: per metric, models x tasks of "Pearson r / Spearman rho" (``*`` marks
    p < 0.05), the Avg. column and the all-models row as Fisher-z averages (not tested)."""
    parts = []
    for metric in CORRELATED:
        chosen = (pl.col("estimator") == ctx.estimator) & (pl.col("metric") == metric.name)
        tested = (
            ctx.tables["correlations"]
            .filter(chosen)
            .with_columns(
                pl.when(pl.col("significant")).then(pl.lit("*")).otherwise(pl.lit("")).alias("mark")
            )
        )
        means = ctx.tables["correlation_means"].filter(chosen)
        means = means.with_columns(pl.lit("").alias("mark"))
        pairs: dict[tuple[str | None, str | None], dict[str, str]] = {}
        for frame in (tested, means):
            for m, t, method, r, mark in frame.select(*KEY, "method", "r", "mark").iter_rows():
                pairs.setdefault((m, t), {})[method] = fmt(r, digits=2) + mark
        cells: Cells = {
            key: " / ".join(v.get(x, DASH) for x in stats.METHODS) for key, v in pairs.items()
        }
        parts.append(f"#### Accuracy vs {metric.signed}\n\n" + model_task_table(cells, ctx.names))
    return "\n\n".join(parts)


def module_table(ctx: ReportContext) -> str:
    """Fig. 4: per model, the share of bias and of diversity held by each module kind (paper
    Eqs. 9-10), averaged over tasks, beside the share of components of that kind."""
    shares = stats.module_shares_by_model(ctx.tables["modules"], ctx.estimator)
    kinds = [k for k in COMPONENT_KINDS if k in set(shares["kind"])]
    columns = ("component_share", "bias_share", "diversity_share")
    values = {(m, k): r for m, k, *r in shares.select("model", "kind", *columns).iter_rows()}
    rows = [
        [ctx.names.get(m, m)]
        + [
            " / ".join(fmt(values[(m, k)][i], 100) if (m, k) in values else DASH for k in kinds)
            for i in range(len(columns))
        ]
        for m in sorted(shares["model"].unique())
    ]
    label = " / ".join(kinds)
    header = [
        "Model",
        f"Components % ({label})",
        f"Bias share % ({label})",
        f"Diversity share % ({label})",
    ]
    return markdown_table(header, rows)


def depth_table(ctx: ReportContext) -> str:
    """Fig. 6 fits: acc(j) = a + b log j and mse(j) = c / j^alpha + L0 with standard errors, and
    the mean marginal accuracy gain per component in each half of the stack."""
    fits = ctx.tables["depth_fits"].filter(pl.col("estimator") == ctx.estimator)
    depth = ctx.tables["depth_curves"].filter(pl.col("estimator") == ctx.estimator)
    half = pl.col("j") > pl.col("j").max().over("model") / 2
    gains = {
        r[0]: (r[1], r[2])
        for r in depth.group_by("model")
        .agg(
            pl.col("accuracy_gain").filter(~half).mean(),
            pl.col("accuracy_gain").filter(half).mean().alias("second"),
        )
        .iter_rows()
    }
    mse = METRICS["mse"].unit(ctx.estimator)
    rows = []
    for r in fits.sort("n_params").iter_rows(named=True):
        first, second = gains[r["model"]]
        rows.append(
            [
                ctx.names.get(r["model"], r["model"]),
                f"{r['n_params'] / 1e9:.2f}",
                str(r["n_components"]),
                f"{fmt(r['acc_b'], 100, 2)} ± {fmt(r['acc_b_se'], 100, 2)}",
                fmt(r["acc_r2"], digits=3),
                f"{fmt(r['loss_alpha'], digits=2)} ± {fmt(r['loss_alpha_se'], digits=2)}"
                + (" †" if r["loss_at_bound"] else ""),
                f"{fmt(r['loss_l0'], mse.scale, 2)} ± {fmt(r['loss_l0_se'], mse.scale, 2)}",
                fmt(r["loss_r2"], digits=3),
                f"{fmt(first, 100, 3)} / {fmt(second, 100, 3)}",
            ]
        )
    header = [
        "Model",
        "Params (B)",
        "L",
        "b in acc = a + b ln j (points)",
        "R²",
        "α in MSE = c/j^α + L0",
        f"L0 ({mse.label})",
        "R²",
        "Mean acc. gain per layer, 1st / 2nd half (points)",
    ]
    return markdown_table(header, rows)


def saturation_table(ctx: ReportContext) -> str:
    """Per model x task: the saturation depth j of L components."""
    cells: Cells = {
        (m, t): f"{j}/{n}"
        for m, t, j, n in ctx.tables["saturation"]
        .select(*KEY, "saturation_j", "n_components")
        .iter_rows()
    }
    return model_task_table(cells, ctx.names, avg=False)


def information_table(ctx: ReportContext) -> str:
    """Methods §6 per (model, task): n, H(Y), relevancy, I(full stack; Y), the Eq. 12 bounds beside
    the measured error, and the mean gain of I per component in each half of the stack."""
    rows = [
        [
            ctx.names.get(r["model"], r["model"]),
            r["task"],
            str(r["n"]),
            fmt(r["entropy_y"], digits=3),
            fmt(r["relevancy"], digits=3),
            fmt(r["mutual_info"], digits=3),
            fmt(r["error_lower"], 100),
            fmt(r["error"], 100),
            fmt(r["error_upper"], 100),
            f"{fmt(r['gain_first_half'], 1000, 2)} / {fmt(r['gain_second_half'], 1000, 2)}",
        ]
        for r in ctx.tables["information"].iter_rows(named=True)
    ]
    header = [
        "Model",
        "Task",
        "n",
        "H(Y) (bits)",
        "Relevancy Σ I(u_c;Y) (bits)",
        "I(prefix_L;Y) (bits)",
        "Lower bound (%)",
        "Error (%)",
        "Upper bound (%)",
        "Mean gain of I, 1st / 2nd half (mbit)",
    ]
    return markdown_table(header, rows)


# --- figures -------------------------------------------------------------------------------

GAIN_WINDOW = 5
"""Marginal gains in Fig. 6 are shown as a centred rolling mean over this many components."""


def correlation_figure(ctx: ReportContext, path: Path, scale: str) -> Path:
    """Fig. 3: heatmaps of r (models x tasks + Avg.), one per (method, metric); ``*`` marks
    p < 0.05 in the task columns; Avg. is the Fisher-z mean over tasks."""
    names = plots.short_names(ctx.names)
    corr = ctx.tables["correlations"].filter(pl.col("estimator") == ctx.estimator)
    means = ctx.tables["correlation_means"].filter(
        (pl.col("estimator") == ctx.estimator)
        & pl.col("task").is_null()
        & pl.col("model").is_not_null()
    )
    models, tasks = sorted(corr["model"].unique()), sorted(corr["task"].unique())
    columns = [*tasks, "Avg."]
    fig = plots.new_figure(
        figsize=(3 * (1.6 + 0.6 * len(columns)), 2 * (1.2 + 0.38 * len(models))),
        layout="constrained",
    )
    axes = fig.subplots(len(stats.METHODS), len(CORRELATED), squeeze=False)
    image = None
    for row, method in enumerate(stats.METHODS):
        for col, metric in enumerate(CORRELATED):
            ax = axes[row][col]
            grid = np.full((len(models), len(columns)), np.nan)
            marks = np.zeros_like(grid, dtype=bool)
            chosen = (pl.col("method") == method) & (pl.col("metric") == metric.name)
            for r in corr.filter(chosen).iter_rows(named=True):
                i, k = models.index(r["model"]), tasks.index(r["task"])
                grid[i, k], marks[i, k] = r["r"], r["significant"]
            for r in means.filter(chosen).iter_rows(named=True):
                grid[models.index(r["model"]), -1] = r["r"]
            image = ax.imshow(grid, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
            for (i, k), value in np.ndenumerate(grid):
                if not np.isnan(value):
                    ax.text(
                        k,
                        i,
                        f"{value:.2f}" + ("*" if marks[i, k] else ""),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if abs(value) > 0.6 else "black",
                    )
            ax.set_xticks(range(len(columns)), columns, rotation=45, ha="right", fontsize=8)
            ax.set_yticks(range(len(models)), [names.get(m, m) for m in models], fontsize=8)
            ax.axvline(len(tasks) - 0.5, color="black", linewidth=1)
            ax.set_title(f"{method.capitalize()}: accuracy vs {metric.signed}", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="correlation r across junction points")
    fig.suptitle(
        f"Fig. 3 — correlation with accuracy across junction points j = 1..L\n"
        f"estimator {ctx.estimator}, scale {scale}; * two-sided p < {stats.SIGNIFICANCE}; "
        "Avg. = Fisher-z mean over tasks",
        fontsize=11,
    )
    return plots.save(fig, path)


def module_figure(ctx: ReportContext, path: Path) -> Path:
    """Fig. 4: stacked horizontal bars of each module kind's share of bias and of diversity."""
    names = plots.short_names(ctx.names)
    shares = stats.module_shares_by_model(ctx.tables["modules"], ctx.estimator)
    models = sorted(shares["model"].unique())
    kinds = [k for k in COMPONENT_KINDS if k in set(shares["kind"])]
    fig = plots.new_figure(figsize=(11, 1.5 + 0.4 * len(models)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    labels = [names.get(m, m) for m in models]
    for ax, column, title in zip(
        axes, ("bias_share", "diversity_share"), ("Bias", "Diversity"), strict=True
    ):
        left = np.zeros(len(models))
        for kind in kinds:
            values = np.array(
                [
                    (shares.filter((pl.col("model") == m) & (pl.col("kind") == kind))[column].sum())
                    * 100
                    for m in models
                ]
            )
            ax.barh(labels, values, left=left, color=plots.KIND_COLORS[kind], label=kind)
            left += values
        ax.set_xlim(0, 100)
        ax.set_xlabel("share of the total (%)")
        ax.set_title(f"{title} (Eqs. 9-10)")
        ax.invert_yaxis()
    axes[1].legend(title="module", loc="lower right", fontsize=8)
    fig.suptitle(
        "Fig. 4 — share of bias and diversity by module, mean over tasks "
        f"(estimator {ctx.estimator})",
        fontsize=11,
    )
    return plots.save(fig, path)


def curves_figure(ctx: ReportContext, scale: str, model: str, path: Path) -> Path:
    """Fig. 5 for one model: accuracy, MSE, bias and diversity of the first j components,
    z-scored across j, one panel per task."""
    by = [*KEY, "estimator"]
    frame = (
        ctx.tables["curves"]
        .filter((pl.col("model") == model) & (pl.col("estimator") == ctx.estimator))
        .with_columns(*(stats.zscore(m, by) for m in METRICS))
        .sort("task", "j")
    )
    tasks = sorted(frame["task"].unique())
    ncols = min(4, len(tasks))
    nrows = -(-len(tasks) // ncols)
    width, height = 3.4 * ncols + 0.9, 2.6 * nrows + 1.5
    # One figure per model: a fixed layout (in inches) draws much faster than a layout engine.
    fig = plots.new_figure(figsize=(width, height))
    fig.subplots_adjust(
        left=0.75 / width,
        right=1 - 0.15 / width,
        top=1 - 0.55 / height,
        bottom=1.0 / height,
        wspace=0.08,
        hspace=0.35,
    )
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True)
    for ax, task in zip(axes.flat, tasks, strict=False):
        sub = frame.filter(pl.col("task") == task)
        for metric in METRICS.values():
            ax.plot(
                sub["j"],
                sub[metric.name],
                metric.line,
                color=metric.color,
                label=metric.title,
                linewidth=1.3,
            )
        ax.set_title(task, fontsize=10)
        ax.grid(alpha=0.3)
    for index, ax in enumerate(axes.flat):
        if index >= len(tasks):
            ax.set_visible(False)
        elif index + ncols >= len(tasks):  # the lowest panel of its column
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel("components in prefix j")
    for ax in axes[:, 0]:
        ax.set_ylabel("z-score across j")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncols=4, frameon=False)
    name = plots.short_names(ctx.names).get(model, model)
    fig.suptitle(
        f"Fig. 5 — {name}: standardized layer-addition curves "
        f"(estimator {ctx.estimator}, scale {scale})",
        fontsize=11,
    )
    return plots.save(fig, path)


def depth_figure(ctx: ReportContext, path: Path, scale: str, min_params: float) -> Path:
    """Fig. 6: accuracy and MSE averaged over tasks against the number of components with their
    fits (dashed), and the marginal accuracy gain per added component (rolling mean)."""
    names = plots.short_names(ctx.names)
    chosen = pl.col("estimator") == ctx.estimator
    depth = ctx.tables["depth_curves"].filter(chosen).sort("n_params", "j")
    fits = {r["model"]: r for r in ctx.tables["depth_fits"].filter(chosen).iter_rows(named=True)}
    mse = METRICS["mse"].unit(ctx.estimator)
    fig = plots.new_figure(figsize=(15, 4.6), layout="constrained")
    axes = fig.subplots(1, 3)
    colors = iter(plots.colors(len(fits)))
    for model in depth["model"].unique(maintain_order=True):
        sub = depth.filter(pl.col("model") == model)
        j = sub["j"].to_numpy().astype(float)
        fit, color = fits[model], next(colors)
        label = names.get(model, model)
        axes[0].plot(j, 100 * sub["accuracy"].to_numpy(), color=color, label=label, linewidth=1.2)
        axes[0].plot(
            j, 100 * (fit["acc_a"] + fit["acc_b"] * np.log(j)), "--", color=color, linewidth=0.9
        )
        axes[1].plot(j, mse.scale * sub["mse"].to_numpy(), color=color, label=label, linewidth=1.2)
        axes[1].plot(
            j,
            mse.scale * stats.inverse_depth(j, fit["loss_c"], fit["loss_alpha"], fit["loss_l0"]),
            "--",
            color=color,
            linewidth=0.9,
        )
        gain = sub["accuracy_gain"].rolling_mean(GAIN_WINDOW, center=True, min_samples=1)
        axes[2].plot(j, 100 * gain.to_numpy(), color=color, label=label, linewidth=1.2)
    axes[0].set_ylabel("accuracy, mean over tasks (%)")
    axes[0].set_title("Accuracy (dashed: a + b ln j)")
    axes[1].set_ylabel(f"MSE, mean over tasks ({mse.label})")
    axes[1].set_title("MSE (dashed: c / j^α + L0)")
    axes[2].set_ylabel(f"accuracy gain per component (points, rolling mean of {GAIN_WINDOW})")
    axes[2].set_title("Marginal gain of adding component j")
    axes[2].axhline(0, color="black", linewidth=0.8)
    for ax in axes:
        ax.set_xlabel("components in prefix j")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncols=2)
    which = f"models with ≥ {min_params:.3g} parameters" if min_params else "all models"
    fig.suptitle(
        f"Fig. 6 — depth efficiency, {which} (estimator {ctx.estimator}, scale {scale})",
        fontsize=11,
    )
    return plots.save(fig, path)


# --- interactive figures (the HTML report) -------------------------------------------------

DASHES = {"-": "solid", "--": "dash", "-.": "dashdot", ":": "dot"}


def curves_plotly(ctx: ReportContext, scale: str, model: str) -> object:
    """Fig. 5 for one model, interactive: the z-scored curves of :func:`curves_figure`; hover
    shows the component added at j and the metric's value in its unit."""
    by = [*KEY, "estimator"]
    frame = (
        ctx.tables["curves"]
        .filter((pl.col("model") == model) & (pl.col("estimator") == ctx.estimator))
        .with_columns(*(stats.zscore(m, by).alias(f"z_{m}") for m in METRICS))
        .sort("task", "j")
    )
    tasks = sorted(frame["task"].unique())
    ncols = min(4, len(tasks))
    nrows = -(-len(tasks) // ncols)
    fig = plots.subplots(
        rows=nrows, cols=ncols, subplot_titles=tasks, shared_xaxes=True, shared_yaxes=True,
        vertical_spacing=0.3 / nrows, horizontal_spacing=0.04,
    )  # fmt: skip
    name = plots.short_names(ctx.names).get(model, model)
    absolute, relative = [], []
    for i, task in enumerate(tasks):
        sub = frame.filter(pl.col("task") == task)
        for metric in METRICS.values():
            unit = metric.unit(ctx.estimator)
            fig.add_scatter(
                x=sub["j"].to_list(),
                y=sub[f"z_{metric.name}"].to_list(),
                customdata=list(zip(sub["component"].to_list(),
                                    (sub[metric.name] * unit.scale).to_list(), strict=True)),
                name=metric.title, legendgroup=metric.name, showlegend=i == 0,
                line={"color": metric.color, "dash": DASHES[metric.line], "width": 1.5},
                hovertemplate=f"{name} · {task}<br>j = %{{x}}: %{{customdata[0]}}<br>"
                f"{metric.title} %{{customdata[1]:.3f}} {unit.label} (z %{{y:.2f}})<extra></extra>",
                row=i // ncols + 1, col=i % ncols + 1,
            )  # fmt: skip
            absolute.append(sub["j"].to_list())
            relative.append(sub["relative_depth"].to_list())
    fig.update_xaxes(title_text="components in prefix j", row=nrows)
    fig.update_yaxes(title_text="z-score across j", col=1)
    fig.update_layout(
        title=f"Fig. 5 — {name}: standardized layer-addition curves "
        f"(estimator {ctx.estimator}, scale {scale})",
        height=260 * nrows + 170, margin={"t": 120}, hovermode="closest",
    )  # fmt: skip
    plots.depth_switch(fig, absolute, relative, "components in prefix j")
    return fig


def depth_plotly(ctx: ReportContext, scale: str, min_params: float) -> object:
    """Fig. 6, interactive: accuracy and MSE over tasks against j with their fits (dashed), and
    the marginal gain; the x axis switches between j and j / L so that models overlay."""
    names = plots.short_names(ctx.names)
    chosen = pl.col("estimator") == ctx.estimator
    depth = ctx.tables["depth_curves"].filter(chosen).sort("n_params", "j")
    fits = {r["model"]: r for r in ctx.tables["depth_fits"].filter(chosen).iter_rows(named=True)}
    mse = METRICS["mse"].unit(ctx.estimator)
    fig = plots.subplots(rows=1, cols=3, subplot_titles=(
        "Accuracy (dashed: a + b ln j)", "MSE (dashed: c / j^α + L0)",
        "Marginal gain of adding component j"))  # fmt: skip
    colors = iter(plots.colors(len(fits)))
    absolute, relative = [], []
    for model in depth["model"].unique(maintain_order=True):
        sub = depth.filter(pl.col("model") == model)
        j = sub["j"].to_numpy().astype(float)
        fit, color, label = fits[model], plots.css_color(next(colors)), names.get(model, model)
        gain = sub["accuracy_gain"].rolling_mean(GAIN_WINDOW, center=True, min_samples=1)
        curves = [
            (1, 100 * sub["accuracy"].to_numpy(), "accuracy", "%", "solid"),
            (1, 100 * (fit["acc_a"] + fit["acc_b"] * np.log(j)), "accuracy fit", "%", "dash"),
            (2, mse.scale * sub["mse"].to_numpy(), "MSE", mse.label, "solid"),
            (2, mse.scale * stats.inverse_depth(j, fit["loss_c"], fit["loss_alpha"],
                                                fit["loss_l0"]), "MSE fit", mse.label, "dash"),
            (3, 100 * gain.to_numpy(), "accuracy gain", "points", "solid"),
        ]  # fmt: skip
        for col, values, what, unit, dash in curves:
            fig.add_scatter(
                x=j.tolist(), y=values.tolist(), name=label, legendgroup=model,
                showlegend=what == "accuracy", line={"color": color, "dash": dash, "width": 1.3},
                hovertemplate=f"{label}, mean over tasks<br>j = %{{x}}<br>{what} "
                f"%{{y:.3f}} {unit}<extra></extra>",
                row=1, col=col,
            )  # fmt: skip
            absolute.append(j.tolist())
            relative.append((j / j.max()).tolist())
    fig.update_xaxes(title_text="components in prefix j")
    fig.update_yaxes(title_text="accuracy, mean over tasks (%)", col=1)
    fig.update_yaxes(title_text=f"MSE, mean over tasks ({mse.label})", col=2)
    fig.update_yaxes(title_text="gain per component (points)", col=3)
    which = f"models with ≥ {min_params:.3g} parameters" if min_params else "all models"
    fig.update_layout(
        title=f"Fig. 6 — depth efficiency, {which} (estimator {ctx.estimator}, scale {scale})",
        height=480, margin={"t": 120},
    )  # fmt: skip
    plots.depth_switch(fig, absolute, relative, "components in prefix j")
    return fig


def module_plotly(ctx: ReportContext) -> object:
    """Fig. 4, interactive: each module kind's share of bias and of diversity per model."""
    names = plots.short_names(ctx.names)
    shares = stats.module_shares_by_model(ctx.tables["modules"], ctx.estimator)
    models = sorted(shares["model"].unique())
    kinds = [k for k in COMPONENT_KINDS if k in set(shares["kind"])]
    fig = plots.subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        subplot_titles=("Bias (Eqs. 9-10)", "Diversity (Eqs. 9-10)"),
    )
    labels = [names.get(m, m) for m in models]
    for col, column in enumerate(("bias_share", "diversity_share"), start=1):
        for kind in kinds:
            values = [
                100 * shares.filter((pl.col("model") == m) & (pl.col("kind") == kind))[column].sum()
                for m in models
            ]
            fig.add_bar(
                x=values, y=labels, orientation="h", name=kind, legendgroup=kind,
                showlegend=col == 1, marker_color=plots.KIND_COLORS[kind],
                hovertemplate=f"%{{y}}: {kind} %{{x:.1f}}% of the "
                f"{column.split('_')[0]}<extra></extra>",
                row=1, col=col,
            )  # fmt: skip
    fig.update_xaxes(title_text="share of the total (%)", range=[0, 100])
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(
        barmode="stack", height=180 + 28 * len(models),
        title="Fig. 4 — share of bias and diversity by module, mean over tasks "
        f"(estimator {ctx.estimator})",
    )  # fmt: skip
    return fig


def correlation_plotly(ctx: ReportContext, scale: str) -> object:
    """Fig. 3, interactive: r per (model, task) and the Fisher-z average, one heatmap per method
    and metric; hover shows r and whether p < the significance level."""
    names = plots.short_names(ctx.names)
    chosen = pl.col("estimator") == ctx.estimator
    corr = ctx.tables["correlations"].filter(chosen)
    means = ctx.tables["correlation_means"].filter(
        chosen & pl.col("task").is_null() & pl.col("model").is_not_null()
    )
    models = sorted(corr["model"].unique())
    tasks = sorted(corr["task"].unique())
    columns = [*tasks, AVG]
    methods = list(stats.METHODS)
    titles = [f"{m.capitalize()}: accuracy vs {c.signed}" for m in methods for c in CORRELATED]
    fig = plots.subplots(rows=len(methods), cols=len(CORRELATED), subplot_titles=titles,
                         shared_yaxes=True, vertical_spacing=0.12)  # fmt: skip
    labels = [names.get(m, m) for m in models]
    for row, method in enumerate(methods, start=1):
        for col, metric in enumerate(CORRELATED, start=1):
            grid = np.full((len(models), len(columns)), np.nan)
            marks = np.full(grid.shape, "", dtype=object)
            pick = (pl.col("method") == method) & (pl.col("metric") == metric.name)
            for r in corr.filter(pick).iter_rows(named=True):
                i, k = models.index(r["model"]), tasks.index(r["task"])
                grid[i, k] = r["r"]
                marks[i, k] = "*" if r["significant"] else ""
            for r in means.filter(pick).iter_rows(named=True):
                grid[models.index(r["model"]), -1] = r["r"]
            text = [[DASH if np.isnan(v) else f"{v:.2f}{m}" for v, m in zip(g, s, strict=True)]
                    for g, s in zip(grid, marks, strict=True)]  # fmt: skip
            fig.add_heatmap(
                z=[[None if np.isnan(v) else float(v) for v in g] for g in grid],
                x=columns, y=labels, text=text, texttemplate="%{text}",
                colorscale="RdBu", reversescale=True, zmin=-1, zmax=1, showscale=row == col == 1,
                colorbar={"title": {"text": "r"}},
                hovertemplate=f"%{{y}} · %{{x}}<br>{method} r(accuracy, {metric.signed}) = "
                "%{text}<extra></extra>",
                row=row, col=col,
            )  # fmt: skip
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(
        title="Fig. 3 — correlation with accuracy across junction points j = 1..L "
        f"(estimator {ctx.estimator}, scale {scale}; * p < {stats.SIGNIFICANCE})",
        height=260 * len(methods) + 60 + 14 * len(models),
    )  # fmt: skip
    return fig


# --- the report section --------------------------------------------------------------------


def report(ctx: ReportContext) -> str:
    """Table 1, the Fig. 3 correlations, Fig. 4 module shares, Figs. 5-6, saturation and the
    information-theoretic view, with their figures."""
    est, scale, min_params = ctx.estimator, ctx.scale, ctx.min_params
    fits = ctx.tables["depth_fits"]
    depth_models = fits["model"].n_unique()
    size_filter = (
        f"models with at least {min_params:.3g} parameters"
        if min_params > 0
        else "all models; the paper uses `--min-params 1e9`"
    )
    units = ", ".join(
        f"{m.title} in {m.unit(est).meaning}" for m in METRICS.values() if m is not ACCURACY
    )
    models = sorted(ctx.tables["curves"]["model"].unique())
    fig5 = [
        plots.figure_link(
            ctx,
            f"fig5_curves_{m}.png",
            "Fig. 5 standardized curves",
            partial(curves_figure, ctx, scale, m),
            partial(curves_plotly, ctx, scale, m),
        )
        for m in tqdm(models, desc="Fig. 5", unit="model", disable=None)
    ]
    fig6 = (
        plots.figure_link(
            ctx,
            "fig6_depth.png",
            "Fig. 6 depth efficiency",
            lambda path: depth_figure(ctx, path, scale, min_params),
            lambda: depth_plotly(ctx, scale, min_params),
        )
        if fits.height
        else ""
    )
    sections = [
        "### Table 1: full-stack scores",
        f"Means over instances, accuracy in %, {units}. Estimator `{est}`. Avg. is the mean over "
        "the model's tasks. The majority class row is the accuracy of always answering the most "
        "frequent gold option.",
        table1(ctx),
        "### Fig. 3: correlation of accuracy with MSE, bias and diversity across junction points",
        "Each cell: Pearson r / Spearman ρ across the junction points j = 1..L of the "
        "layer-addition curves between accuracy_j and −MSE_j, −bias_j or diversity_j (lower MSE "
        f"and bias are better). `*`: two-sided p < {stats.SIGNIFICANCE} (t test, L − 2 degrees "
        "of freedom). Avg. and the all-models row are Fisher-z averages and are not tested. "
        f"Estimator `{est}`, scale `{scale}`.",
        correlation_table(ctx),
        plots.figure_link(
            ctx,
            "fig3_correlations.png",
            "Fig. 3 correlations",
            lambda path: correlation_figure(ctx, path, scale),
            lambda: correlation_plotly(ctx, scale),
        ),
        "### Fig. 4: share of bias and diversity by module",
        "Paper Eqs. 9-10: the share of module kind X is |X| bias_X / (L bias) (and the same for "
        "diversity), averaged over tasks; the shares of a model sum to 100. The component column "
        f"is |X| / L for comparison. Estimator `{est}`.",
        module_table(ctx),
        plots.figure_link(
            ctx,
            "fig4_module_shares.png",
            "Fig. 4 module shares",
            lambda p: module_figure(ctx, p),
            lambda: module_plotly(ctx),
        ),
        "### Fig. 5: standardized layer-addition curves",
        "Accuracy, MSE, bias and diversity of the first j components, each standardized across j "
        f"within (model, task) (z-score). Estimator `{est}`, scale `{scale}`.",
        "\n\n".join(link for link in fig5 if link),
        "### Fig. 6: depth efficiency",
        f"Accuracy and MSE averaged over tasks per model ({depth_models} model(s): "
        f"{size_filter}), with the fits acc(j) = a + b ln j and MSE(j) = c / j^α + L0 "
        "(± standard errors) and the mean marginal gain of accuracy per added component in each "
        f"half of the stack. Estimator `{est}`. †: the best α lies at an end of the range "
        f"searched ({stats.ALPHA_GRID[0]:g} to {stats.ALPHA_GRID[-1]:g}): the MSE curve is not "
        "an inverse power of depth (α → 0 means it is closer to a logarithm), so c, α and L0 "
        "are not meaningful.",
        depth_table(ctx) if depth_models else "No model passes the size filter.",
        fig6,
        "### Saturation depth",
        "The smallest j such that every prefix of j or more components has accuracy within 1 "
        "point below the full model's (j/L).",
        saturation_table(ctx),
        "### Information-theoretic view (methods §6)",
        "Plug-in estimates in bits over the instances of each task, with the argmax predictions "
        "of single components and of prefixes as the variables. The bounds are paper Eq. 12 "
        "(H(Y) − I − 1)/log₂K ≤ error ≤ (H(Y) − I)/2 with I = I(prefix_L; Y). Plug-in mutual "
        "information is biased upwards for small n.",
        information_table(ctx),
    ]
    return "\n\n".join(s for s in sections if s)


register(
    Analysis(
        name="paper",
        title="The paper's analysis: bias, diversity and depth",
        methods=(1, 2, 3, 4, 5, 6),
        tables=tables,
        report=report,
    )
)
