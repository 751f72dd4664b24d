"""PNG figures for the report (paper Figs. 3-6), drawn with matplotlib (the ``plot`` extra).

Figures are built with :class:`matplotlib.figure.Figure` directly: no pyplot state, no GUI backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
from matplotlib.figure import Figure
from tqdm import tqdm

from layerdiv.analyze.api import Results
from layerdiv.analyze.decomposition import Estimator
from layerdiv.analyze.stats import (
    CORRELATED,
    METHODS,
    SIGNIFICANCE,
    inverse_depth,
    module_shares_by_model,
    zscore,
)

DPI = 120
_KIND_COLORS = {"embed": "#7f7f7f", "attn": "#1f77b4", "mlp": "#ff7f0e", "bias": "#2ca02c"}
_METRIC_STYLE = {
    "accuracy": ("Accuracy", "black", "-"),
    "mse": ("MSE", "#d62728", "--"),
    "bias": ("Bias", "#1f77b4", "-."),
    "diversity": ("Diversity", "#2ca02c", ":"),
}
_SIGNED = {"mse": "−MSE", "bias": "−bias", "diversity": "diversity"}
GAIN_WINDOW = 5
"""Marginal gains in Fig. 6 are shown as a centred rolling mean over this many components."""


def short_names(names: dict[str, str]) -> dict[str, str]:
    """Model ids without their organisation (``org/name`` -> ``name``) when that stays unique."""
    short = {slug: model.rstrip("/").split("/")[-1] for slug, model in names.items()}
    return short if len(set(short.values())) == len(short) else dict(names)


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


def correlation_figure(
    results: Results, path: Path, estimator: Estimator, names: dict[str, str]
) -> Path:
    """Fig. 3: heatmaps of r (models x tasks + Avg.), one per (method, metric); ``*`` marks
    p < 0.05 in the task columns; Avg. is the Fisher-z mean over tasks."""
    corr = results.correlations.filter(pl.col("estimator") == estimator)
    means = results.correlation_means.filter(
        (pl.col("estimator") == estimator)
        & pl.col("task").is_null()
        & pl.col("model").is_not_null()
    )
    models, tasks = sorted(corr["model"].unique()), sorted(corr["task"].unique())
    columns = [*tasks, "Avg."]
    fig = Figure(
        figsize=(3 * (1.6 + 0.6 * len(columns)), 2 * (1.2 + 0.38 * len(models))),
        layout="constrained",
    )
    axes = fig.subplots(len(METHODS), len(CORRELATED), squeeze=False)
    image = None
    for row, method in enumerate(METHODS):
        for col, metric in enumerate(CORRELATED):
            ax = axes[row][col]
            grid = np.full((len(models), len(columns)), np.nan)
            marks = np.zeros_like(grid, dtype=bool)
            sub = corr.filter((pl.col("method") == method) & (pl.col("metric") == metric))
            for r in sub.iter_rows(named=True):
                i, k = models.index(r["model"]), tasks.index(r["task"])
                grid[i, k], marks[i, k] = r["r"], r["significant"]
            avg = means.filter((pl.col("method") == method) & (pl.col("metric") == metric))
            for r in avg.iter_rows(named=True):
                grid[models.index(r["model"]), -1] = r["r"]
            image = ax.imshow(grid, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
            for (i, k), value in np.ndenumerate(grid):
                if not np.isnan(value):
                    text = f"{value:.2f}" + ("*" if marks[i, k] else "")
                    ax.text(
                        k,
                        i,
                        text,
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if abs(value) > 0.6 else "black",
                    )
            ax.set_xticks(range(len(columns)), columns, rotation=45, ha="right", fontsize=8)
            ax.set_yticks(range(len(models)), [names.get(m, m) for m in models], fontsize=8)
            ax.axvline(len(tasks) - 0.5, color="black", linewidth=1)
            ax.set_title(f"{method.capitalize()}: accuracy vs {_SIGNED[metric]}", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="correlation r across junction points")
    fig.suptitle(
        f"Fig. 3 — correlation with accuracy across junction points j = 1..L\n"
        f"estimator {estimator}, lens {results.lens}; * two-sided p < {SIGNIFICANCE}; "
        "Avg. = Fisher-z mean over tasks",
        fontsize=11,
    )
    return _save(fig, path)


def module_figure(
    results: Results, path: Path, estimator: Estimator, names: dict[str, str]
) -> Path:
    """Fig. 4: stacked horizontal bars of each module kind's share of bias and of diversity."""
    shares = module_shares_by_model(results.modules, estimator)
    models = sorted(shares["model"].unique())
    kinds = [k for k in _KIND_COLORS if k in set(shares["kind"])]
    fig = Figure(figsize=(11, 1.5 + 0.4 * len(models)), layout="constrained")
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
            ax.barh(labels, values, left=left, color=_KIND_COLORS[kind], label=kind)
            left += values
        ax.set_xlim(0, 100)
        ax.set_xlabel("share of the total (%)")
        ax.set_title(f"{title} (Eqs. 9-10)")
        ax.invert_yaxis()
    axes[1].legend(title="module", loc="lower right", fontsize=8)
    fig.suptitle(
        f"Fig. 4 — share of bias and diversity by module, mean over tasks (estimator {estimator})",
        fontsize=11,
    )
    return _save(fig, path)


def curves_figure(
    results: Results, model: str, path: Path, estimator: Estimator, names: dict[str, str]
) -> Path:
    """Fig. 5 for one model: accuracy, MSE, bias and diversity of the first j components,
    z-scored across j, one panel per task."""
    by = ["model", "task", "estimator"]
    frame = (
        results.curves.filter((pl.col("model") == model) & (pl.col("estimator") == estimator))
        .with_columns(*(zscore(m, by) for m in _METRIC_STYLE))
        .sort("task", "j")
    )
    tasks = sorted(frame["task"].unique())
    ncols = min(4, len(tasks))
    nrows = -(-len(tasks) // ncols)
    width, height = 3.4 * ncols + 0.9, 2.6 * nrows + 1.5
    # One figure per model: a fixed layout (in inches) draws much faster than a layout engine.
    fig = Figure(figsize=(width, height))
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
        for metric, (label, color, style) in _METRIC_STYLE.items():
            ax.plot(sub["j"], sub[metric], style, color=color, label=label, linewidth=1.3)
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
    fig.suptitle(
        f"Fig. 5 — {names.get(model, model)}: standardized layer-addition curves "
        f"(estimator {estimator}, lens {results.lens})",
        fontsize=11,
    )
    return _save(fig, path)


def depth_figure(results: Results, path: Path, estimator: Estimator, names: dict[str, str]) -> Path:
    """Fig. 6: accuracy and MSE averaged over tasks against the number of components with their
    fits (dashed), and the marginal accuracy gain per added component (rolling mean)."""
    depth = results.depth_curves.filter(pl.col("estimator") == estimator).sort("n_params", "j")
    fits = {
        r["model"]: r
        for r in results.depth_fits.filter(pl.col("estimator") == estimator).iter_rows(named=True)
    }
    fig = Figure(figsize=(15, 4.6), layout="constrained")
    axes = fig.subplots(1, 3)
    colors = iter(_cycle(len(fits)))
    for model in depth["model"].unique(maintain_order=True):
        sub = depth.filter(pl.col("model") == model)
        j = sub["j"].to_numpy().astype(float)
        fit, color = fits[model], next(colors)
        label = names.get(model, model)
        axes[0].plot(j, 100 * sub["accuracy"].to_numpy(), color=color, label=label, linewidth=1.2)
        axes[0].plot(
            j, 100 * (fit["acc_a"] + fit["acc_b"] * np.log(j)), "--", color=color, linewidth=0.9
        )
        axes[1].plot(j, 100 * sub["mse"].to_numpy(), color=color, label=label, linewidth=1.2)
        axes[1].plot(
            j,
            100 * inverse_depth(j, fit["loss_c"], fit["loss_alpha"], fit["loss_l0"]),
            "--",
            color=color,
            linewidth=0.9,
        )
        gain = sub["accuracy_gain"].rolling_mean(GAIN_WINDOW, center=True, min_samples=1)
        axes[2].plot(j, 100 * gain.to_numpy(), color=color, label=label, linewidth=1.2)
    axes[0].set_ylabel("accuracy, mean over tasks (%)")
    axes[0].set_title("Accuracy (dashed: a + b ln j)")
    axes[1].set_ylabel("MSE, mean over tasks (×100)")
    axes[1].set_title("MSE (dashed: c / j^α + L0)")
    axes[2].set_ylabel(f"accuracy gain per component (points, rolling mean of {GAIN_WINDOW})")
    axes[2].set_title("Marginal gain of adding component j")
    axes[2].axhline(0, color="black", linewidth=0.8)
    for ax in axes:
        ax.set_xlabel("components in prefix j")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncols=2)
    which = (
        f"models with ≥ {results.min_params:.3g} parameters" if results.min_params else "all models"
    )
    fig.suptitle(
        f"Fig. 6 — depth efficiency, {which} (estimator {estimator}, lens {results.lens})",
        fontsize=11,
    )
    return _save(fig, path)


def _cycle(n: int) -> list[tuple[float, float, float, float]]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(max(n, 1))]


def draw_all(
    results: Results, folder: Path, estimator: Estimator, names: dict[str, str]
) -> dict[str, list[str]]:
    """Draw every figure into ``folder``; returns the paths by figure key (fig3 .. fig6)."""
    short = short_names(names)
    out: dict[str, list[str]] = {
        "fig3": [
            str(correlation_figure(results, folder / "fig3_correlations.png", estimator, short))
        ],
        "fig4": [str(module_figure(results, folder / "fig4_module_shares.png", estimator, short))],
        "fig5": [
            str(curves_figure(results, m, folder / f"fig5_curves_{m}.png", estimator, short))
            for m in tqdm(
                sorted(results.curves["model"].unique()), desc="Fig. 5", unit="model", disable=None
            )
        ],
    }
    if results.depth_fits.height:
        out["fig6"] = [str(depth_figure(results, folder / "fig6_depth.png", estimator, short))]
    return out
