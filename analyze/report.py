"""The Markdown report: the paper's Table 1, the Fig. 3 correlation table, Fig. 4 module shares,
depth efficiency, saturation and the information-theoretic view, with PNG figures for Figs. 3-6.

Every number is taken from a :class:`~layerdiv.analyze.api.Results`; nothing is typed in.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import polars as pl

from layerdiv import __version__
from layerdiv.analyze import stats
from layerdiv.analyze.api import Results
from layerdiv.analyze.decomposition import Estimator
from layerdiv.analyze.output import INDEX_NAME, atomic_dir
from layerdiv.analyze.stats import CORRELATED, SIGNIFICANCE

REPORT_NAME = "report.md"
AVG = "Avg."
DASH = "–"
_METRIC_TITLES = {
    "accuracy": "Accuracy (%)",
    "mse": "MSE (×100)",
    "bias": "Bias (×100)",
    "diversity": "Diversity (×100)",
}
_DIVERSITY_UNITS = {
    "paper": "logit units squared (Eq. 8: spread of the components' logits around their mean)",
    "ensemble": "probability squared (spread of the components' softmax outputs around their mean)",
}
_SIGNED = {"mse": "−MSE", "bias": "−Bias", "diversity": "Diversity"}


def model_names(results: Results) -> dict[str, str]:
    """Store slug -> the model id as the user gave it at extraction."""
    return dict(results.manifests.select("model", "model_id").unique().iter_rows())


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    if value is None or math.isnan(value):
        return DASH
    return f"{value * scale:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table (first column left-aligned, the rest right-aligned)."""
    rule = "|" + "|".join([":--", *["--:"] * (len(header) - 1)]) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


Cells = dict[tuple[str | None, str | None], str]
"""Formatted cells by (model, task); None stands for the average over models or over tasks."""


def _model_task_table(
    cells: Cells, names: dict[str, str], avg: bool = True, first_rows: Sequence[Sequence[str]] = ()
) -> str:
    """Rows per model (sorted), columns per task (sorted) and, with ``avg``, the Avg. column
    (cell (model, None)); a row "All models" when cells (None, task) exist."""
    models = sorted({m for m, _ in cells if m is not None})
    tasks = sorted({t for _, t in cells if t is not None})
    columns: list[str | None] = [*tasks, None] if avg else list(tasks)
    rows = [list(r) for r in first_rows]
    rows += [[names.get(m, m), *(cells.get((m, t), DASH) for t in columns)] for m in models]
    if any(m is None for m, _ in cells):
        rows.append(["*All models (Fisher-z)*", *(cells.get((None, t), DASH) for t in columns)])
    return markdown_table(["Model", *tasks, *([AVG] if avg else [])], rows)


def table1(results: Results, estimator: Estimator, names: dict[str, str]) -> str:
    """The paper's Table 1 layout: per metric, models x tasks with the Avg. column (mean over the
    model's tasks), ×100; the accuracy table starts with the majority-class baseline."""
    frame = results.scores.filter(pl.col("estimator") == estimator)
    majority = frame.group_by("task").agg(pl.col("majority_accuracy").mean()).sort("task")
    baseline = [
        "*Majority class*",
        *(_fmt(v, 100) for v in majority["majority_accuracy"]),
        _fmt(majority["majority_accuracy"].mean(), 100),  # type: ignore[arg-type]
    ]
    parts = []
    for metric, title in _METRIC_TITLES.items():
        cells: Cells = {
            (m, t): _fmt(v, 100) for m, t, v in frame.select("model", "task", metric).iter_rows()
        }
        avg = frame.group_by("model").agg(pl.col(metric).mean())
        cells.update({(m, None): _fmt(v, 100) for m, v in avg.iter_rows()})
        first = [baseline] if metric == "accuracy" else []
        parts.append(f"### {title}\n\n" + _model_task_table(cells, names, first_rows=first))
    return "\n\n".join(parts)


def correlation_table(results: Results, estimator: Estimator, names: dict[str, str]) -> str:
    """The Fig. 3 table: per metric, models x tasks of "Pearson r / Spearman rho" (``*`` marks
    p < 0.05), the Avg. column and the all-models row as Fisher-z averages (not tested)."""
    parts = []
    for metric in CORRELATED:
        chosen = (pl.col("estimator") == estimator) & (pl.col("metric") == metric)
        tested = results.correlations.filter(chosen).with_columns(
            pl.when(pl.col("significant")).then(pl.lit("*")).otherwise(pl.lit("")).alias("mark")
        )
        means = results.correlation_means.filter(chosen).with_columns(pl.lit("").alias("mark"))
        pairs: dict[tuple[str | None, str | None], dict[str, str]] = {}
        for frame in (tested, means):
            for m, t, method, r, mark in frame.select(
                "model", "task", "method", "r", "mark"
            ).iter_rows():
                pairs.setdefault((m, t), {})[method] = _fmt(r, digits=2) + mark
        cells: Cells = {
            key: " / ".join(v.get(x, DASH) for x in stats.METHODS) for key, v in pairs.items()
        }
        parts.append(f"### Accuracy vs {_SIGNED[metric]}\n\n" + _model_task_table(cells, names))
    return "\n\n".join(parts)


def module_table(results: Results, estimator: Estimator, names: dict[str, str]) -> str:
    """Fig. 4: per model, the share of bias and of diversity held by each module kind (paper
    Eqs. 9-10), averaged over tasks, beside the share of components of that kind."""
    shares = stats.module_shares_by_model(results.modules, estimator)
    kinds = [k for k in ("embed", "attn", "mlp", "bias") if k in set(shares["kind"])]
    columns = ("component_share", "bias_share", "diversity_share")
    values = {(m, k): r for m, k, *r in shares.select("model", "kind", *columns).iter_rows()}
    rows = [
        [names.get(m, m)]
        + [
            " / ".join(_fmt(values[(m, k)][i], 100) if (m, k) in values else DASH for k in kinds)
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


def depth_table(results: Results, estimator: Estimator, names: dict[str, str]) -> str:
    """Fig. 6 fits: acc(j) = a + b log j and mse(j) = c / j^alpha + L0 with standard errors, and
    the mean marginal accuracy gain per component in each half of the stack."""
    fits = results.depth_fits.filter(pl.col("estimator") == estimator)
    depth = results.depth_curves.filter(pl.col("estimator") == estimator)
    half = pl.col("j") > pl.col("j").max().over("model") / 2
    gains = dict(
        (r[0], (r[1], r[2]))
        for r in depth.group_by("model")
        .agg(
            pl.col("accuracy_gain").filter(~half).mean(),
            pl.col("accuracy_gain").filter(half).mean().alias("second"),
        )
        .iter_rows()
    )
    rows = []
    for r in fits.sort("n_params").iter_rows(named=True):
        first, second = gains[r["model"]]
        rows.append(
            [
                names.get(r["model"], r["model"]),
                f"{r['n_params'] / 1e9:.2f}",
                str(r["n_components"]),
                f"{_fmt(r['acc_b'], 100, 2)} ± {_fmt(r['acc_b_se'], 100, 2)}",
                _fmt(r["acc_r2"], digits=3),
                f"{_fmt(r['loss_alpha'], digits=2)} ± {_fmt(r['loss_alpha_se'], digits=2)}"
                + (" †" if r["loss_at_bound"] else ""),
                f"{_fmt(r['loss_l0'], 100, 2)} ± {_fmt(r['loss_l0_se'], 100, 2)}",
                _fmt(r["loss_r2"], digits=3),
                f"{_fmt(first, 100, 3)} / {_fmt(second, 100, 3)}",
            ]
        )
    header = [
        "Model",
        "Params (B)",
        "L",
        "b in acc = a + b ln j (pts)",
        "R²",
        "α in MSE = c/j^α + L0",
        "L0 (×100)",
        "R²",
        "Mean acc. gain per layer, 1st / 2nd half (pts)",
    ]
    return markdown_table(header, rows)


def saturation_table(results: Results, names: dict[str, str]) -> str:
    """Per model x task: the saturation depth j of L components."""
    cells: Cells = {
        (m, t): f"{j}/{n}"
        for m, t, j, n in results.saturation.select(
            "model", "task", "saturation_j", "n_components"
        ).iter_rows()
    }
    return _model_task_table(cells, names, avg=False)


def information_table(results: Results, names: dict[str, str]) -> str:
    """Section 6 per (model, task): n, H(Y), relevancy, I(full stack; Y), the Eq. 12 bounds beside
    the measured error, and the mean gain of I per component in each half of the stack."""
    rows = []
    for r in results.information.iter_rows(named=True):
        rows.append(
            [
                names.get(r["model"], r["model"]),
                r["task"],
                str(r["n"]),
                _fmt(r["entropy_y"], digits=3),
                _fmt(r["relevancy"], digits=3),
                _fmt(r["mutual_info"], digits=3),
                _fmt(r["error_lower"], 100),
                _fmt(r["error"], 100),
                _fmt(r["error_upper"], 100),
                f"{_fmt(r['gain_first_half'], 1000, 2)} / {_fmt(r['gain_second_half'], 1000, 2)}",
            ]
        )
    header = [
        "Model",
        "Task",
        "n",
        "H(Y) bits",
        "Relevancy Σ I(u_c;Y)",
        "I(prefix_L;Y)",
        "Lower bound (%)",
        "Error (%)",
        "Upper bound (%)",
        "Mean gain of I, 1st / 2nd half (mbit)",
    ]
    return markdown_table(header, rows)


def provenance_table(results: Results) -> str:
    """Per partition: model id, task, instances done of requested, dtype, revision, date."""
    rows = [
        [
            r["model_id"],
            r["task"],
            f"{r['n_done']}/{r['n_requested']}",
            str(r["n_components"]),
            str(r["n_options"]),
            r["dtype"],
            r["revision"] or DASH,
            r["created_at"],
        ]
        for r in results.manifests.sort("model", "task").iter_rows(named=True)
    ]
    header = [
        "Model",
        "Task",
        "Instances",
        "Components",
        "Options",
        "dtype",
        "Revision",
        "Extracted",
    ]
    return markdown_table(header, rows)


def render(
    results: Results, estimator: Estimator, store: str, figures: dict[str, list[str]] | str
) -> str:
    """The report's Markdown. ``figures`` maps a figure key to PNG paths (relative to the report),
    or is a sentence saying why there are none."""
    names = model_names(results)
    n_models, n_tasks = results.scores["model"].n_unique(), results.scores["task"].n_unique()

    def figs(key: str, caption: str) -> str:
        if isinstance(figures, str):
            return ""
        return "\n\n".join(f"![{caption}]({path})" for path in figures.get(key, []))

    note = f"\n\n> {figures}\n" if isinstance(figures, str) else ""
    depth_models = results.depth_fits["model"].n_unique()
    size_filter = (
        f"models with at least {results.min_params:.3g} parameters"
        if results.min_params > 0
        else "all models; the paper uses `--min-params 1e9`"
    )
    sections = [
        "# layerdiv report",
        f"Store `{store}`: {n_models} model(s) x {n_tasks} task(s). Estimator **`{estimator}`** "
        f"(METHODS.md section 2), lens **`{results.lens}`** (section 3). Generated by layerdiv "
        f"{__version__} on {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.{note}",
        "## Table 1: full-stack scores",
        f"Means over instances, ×100 (accuracy in %). Estimator `{estimator}`; its diversity is in "
        f"{_DIVERSITY_UNITS[estimator]}. Avg. is the mean over the model's tasks. The majority "
        "class row is the accuracy of always answering the most frequent gold option.",
        table1(results, estimator, names),
        "## Fig. 3: correlation of accuracy with MSE, bias and diversity across junction points",
        "Each cell: Pearson r / Spearman ρ across the junction points j = 1..L of the "
        "layer-addition curves between accuracy_j and −MSE_j, −bias_j or diversity_j (lower MSE "
        f"and bias are better). `*`: two-sided p < {SIGNIFICANCE} (t test, L − 2 degrees of "
        "freedom). Avg. and the all-models row are Fisher-z averages and are not tested. "
        f"Estimator `{estimator}`, lens `{results.lens}`.",
        correlation_table(results, estimator, names),
        figs("fig3", "Fig. 3 correlations"),
        "## Fig. 4: share of bias and diversity by module",
        "Paper Eqs. 9-10: the share of module kind X is |X| bias_X / (L bias) (and the same for "
        "diversity), averaged over tasks; the shares of a model sum to 100. The component column "
        f"is |X| / L for comparison. Estimator `{estimator}`.",
        module_table(results, estimator, names),
        figs("fig4", "Fig. 4 module shares"),
        "## Fig. 5: standardized layer-addition curves",
        "Accuracy, MSE, bias and diversity of the first j components, each standardized across j "
        f"within (model, task) (z-score). Estimator `{estimator}`, lens `{results.lens}`.",
        figs("fig5", "Fig. 5 standardized curves"),
        "## Fig. 6: depth efficiency",
        f"Accuracy and MSE averaged over tasks per model ({depth_models} model(s): {size_filter}), "
        "with the fits acc(j) = a + b ln j and "
        "MSE(j) = c / j^α + L0 (± standard errors) and the mean marginal gain of accuracy per "
        f"added component in each half of the stack. Estimator `{estimator}`. †: the best α lies "
        f"at an end of the range searched ({stats.ALPHA_GRID[0]:g} to {stats.ALPHA_GRID[-1]:g}): "
        "the MSE curve is not an inverse power of depth (α → 0 means it is closer to a "
        "logarithm), so c, α and L0 are not meaningful.",
        depth_table(results, estimator, names)
        if depth_models
        else "No model passes the size filter.",
        figs("fig6", "Fig. 6 depth efficiency"),
        "## Saturation depth",
        "The smallest j such that every prefix of j or more components has accuracy within 1 point "
        "below the full model's (j/L).",
        saturation_table(results, names),
        "## Information-theoretic view (METHODS.md section 6)",
        "Plug-in estimates in bits over the instances of each task, with the argmax predictions of "
        "single components and of prefixes as the variables. The bounds are paper Eq. 12 "
        "(H(Y) − I − 1)/log₂K ≤ error ≤ (H(Y) − I)/2 with I = I(prefix_L; Y). Plug-in mutual "
        "information is biased upwards for small n.",
        information_table(results, names),
        "## Provenance",
        provenance_table(results),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def write_report(
    results: Results, out: str | Path, estimator: Estimator = "paper", store: str = ""
) -> tuple[Path, list[str]]:
    """Write ``<out>/report.md`` and, when matplotlib is installed, ``<out>/figures/*.png``; all at
    once (nothing is left behind on failure). Returns the report's path and the notes to show
    (why figures are missing)."""
    notes: list[str] = []
    with atomic_dir(out) as tmp:
        try:
            from layerdiv.analyze import plots
        except ImportError:
            notes.append(
                "Figures were not drawn: matplotlib is not installed. Install the plot extra "
                "(`pip install 'layerdiv[plot]'`) and run `layerdiv report` again."
            )
            figures: dict[str, list[str]] | str = notes[0]
        else:
            drawn = plots.draw_all(results, tmp / "figures", estimator, model_names(results))
            figures = {k: [str(Path(p).relative_to(tmp)) for p in v] for k, v in drawn.items()}
        (tmp / REPORT_NAME).write_text(render(results, estimator, store, figures))
        index = {
            "report": REPORT_NAME,
            "estimator": estimator,
            "lens": results.lens,
            "store": store,
        }
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return Path(out) / REPORT_NAME, notes
