"""The reference paper's analysis (methods §2-6): scores, layer-addition curves, module
shares, correlations, depth efficiency, saturation and the information-theoretic view, with its
report section (Table 1, Figs. 3-6) and figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import numpy as np
import polars as pl
from tqdm import tqdm

from layerdiv.analyze import plots, stats
from layerdiv.analyze.analyses.paper_figures import (
    correlation_spec,
    curves_spec,
    depth_spec,
    module_spec,
)
from layerdiv.analyze.decomposition import partition_scores
from layerdiv.analyze.frames import tag
from layerdiv.analyze.markdown import (
    DASH,
    Cells,
    fmt,
    markdown_table,
    model_label,
    model_task_table,
    verdict,
)
from layerdiv.analyze.metrics import ACCURACY, CORRELATED, METRICS
from layerdiv.analyze.options import ESTIMATORS
from layerdiv.analyze.overlap import independent, left_out
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    map_partitions,
)
from layerdiv.schemas import COMPONENT_KINDS
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY, MODEL_KEY

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
    manifests, scale = prior["manifests"], ctx.scale  # what each partition's work reads

    def reduce(info: PartitionInfo) -> tuple[pl.DataFrame, dict[str, pl.DataFrame]]:
        """The partition's instance scores (to spill) and the aggregates kept of it."""
        scores = partition_scores(info, scale)
        instances = scores.instances.sort("estimator", "instance")
        n_options = manifests.join(
            pl.DataFrame([dict(info.key.items())]), on=[*KEY], how="semi"
        ).select(*KEY, "n_options")
        info_curves = stats.information_curves(tag(scores.prefix_preds, info), n_options)
        return tag(instances, info), {
            "curves": tag(scores.curves, info),
            "modules": tag(scores.modules, info),
            "counts": tag(
                instances.group_by("estimator").agg(pl.len().cast(pl.Int64).alias("n_instances")),
                info,
            ),
            "golds": tag(
                instances.filter(pl.col("estimator") == ESTIMATORS[0])
                .group_by("gold")
                .agg(pl.len().alias("count")),
                info,
            ),
            "information_curves": info_curves,
            "information": stats.information_summary(
                info_curves, tag(scores.component_preds, info)
            ),
            "gain_halves": tag(stats.gain_halves(scores.junctions), info),
            "correlation_intervals": tag(stats.correlation_intervals(scores.junctions), info),
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
    corr = stats.correlations(curves, gather("correlation_intervals"))
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
        "correlation_means": stats.fisher_z_means(corr, manifests),
        "depth_curves": depth,
        "depth_fits": stats.depth_fits(depth),
        "information_curves": gather("information_curves"),
        "information": gather("information"),
        "saturation": stats.saturation(curves),
        "gain_halves": gather("gain_halves"),
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
    distinct = independent(frame, ctx.tables["manifests"])  # what Avg. averages
    majority = frame.group_by("task").agg(pl.col("majority_accuracy").mean()).sort("task")
    pct = ACCURACY.unit(ctx.estimator)
    over_tasks = distinct.group_by("task").agg(pl.col("majority_accuracy").mean())
    baseline = [
        "*Majority class*",
        *(fmt(v, pct.scale, pct.digits) for v in majority["majority_accuracy"]),
        fmt(over_tasks["majority_accuracy"].mean(), pct.scale, pct.digits),  # type: ignore[arg-type]
    ]
    parts = []
    for metric in METRICS.values():
        unit = metric.unit(ctx.estimator)
        cells: Cells = {
            (m, t): fmt(v, unit.scale, unit.digits)
            for m, t, v in frame.select(model_label(), "task", metric.name).iter_rows()
        }
        avg = distinct.group_by(model_label()).agg(pl.col(metric.name).mean())
        cells.update({(m, None): fmt(v, unit.scale, unit.digits) for m, v in avg.iter_rows()})
        first = [baseline] if metric is ACCURACY else []
        parts.append(
            f"#### {metric.heading(ctx.estimator)}\n\n"
            + model_task_table(cells, ctx.names, first_rows=first)
        )
    return "\n\n".join(parts)


def correlation_table(ctx: ReportContext) -> str:
    """The Fig. 3 table: per metric, models x tasks of "Pearson r / Spearman rho" (``*`` marks
    an r whose bootstrap interval over instances excludes 0), the Avg. column and the
    all-models row as Fisher-z averages (not tested)."""
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
            rows = frame.select(model_label(), "task", "method", "r", "mark").iter_rows()
            for m, t, method, r, mark in rows:
                pairs.setdefault((m, t), {})[method] = fmt(r, digits=2) + mark
        cells: Cells = {
            key: " / ".join(v.get(x, DASH) for x in stats.METHODS) for key, v in pairs.items()
        }
        parts.append(f"#### Accuracy vs {metric.signed}\n\n" + model_task_table(cells, ctx.names))
    return "\n\n".join(parts)


def module_table(ctx: ReportContext) -> str:
    """Fig. 4: per model, the share of bias and of diversity held by each module kind (paper
    Eqs. 9-10), averaged over tasks, beside the share of components of that kind."""
    shares = stats.module_shares_by_model(
        ctx.tables["modules"], ctx.estimator, ctx.tables["manifests"]
    )
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


MIN_TASKS = 3
"""Tasks below which a model's correlation averaged over tasks cannot tell (its interval is
taken over tasks)."""


def correlation_verdicts(ctx: ReportContext) -> str:
    """Per model and correlated metric, the verdict on the reference paper's finding that
    accuracy rises with the metric (signed) across junction points: Spearman's rho averaged
    over the independent tasks by Fisher z, its interval over tasks (:func:`stats.fisher_mean`),
    above 0."""
    corr = independent(ctx.tables["correlations"], ctx.tables["manifests"]).filter(
        (pl.col("estimator") == ctx.estimator) & (pl.col("method") == "spearman")
    )  # a task whose instances are another's subset is not counted twice
    lines = []
    for (model,), sub in corr.group_by(model_label(), maintain_order=True):
        for metric in CORRELATED:
            r = sub.filter(pl.col("metric") == metric.name)["r"].to_numpy()
            if len(r) == 0:
                continue
            rho, interval = stats.fisher_mean(r)
            finding = (
                f"{ctx.names.get(str(model), str(model))}: accuracy rises with {metric.signed}"
            )
            lines.append("- " + verdict(finding, "mean Spearman ρ over tasks", rho, interval,
                                        int(np.isfinite(r).sum()), 0.0, min_n=MIN_TASKS,
                                        unit="tasks"))  # fmt: skip
    return "\n".join(lines)


def submodularity_verdicts(ctx: ReportContext) -> str:
    """Per model, the verdict on the reference paper's submodularity (the marginal accuracy
    gain of a component diminishes with depth): per instance, its mean gain per component over
    the first half of the stack minus the second's (``gain_halves``); the mean over the model's
    independent tasks of their means over instances, its bootstrap interval with each task's
    instances resampled (:func:`stats.unit_mean`; never the junction points), above 0. The models
    are those of ``depth_curves``."""
    models = ctx.tables["depth_curves"].select(*MODEL_KEY).unique()
    gains = (
        independent(ctx.tables["gain_halves"], ctx.tables["manifests"])
        .filter(pl.col("estimator") == ctx.estimator)
        .join(models, on=[*MODEL_KEY], how="semi")
    )
    lines = []
    for (model,), sub in gains.group_by(model_label(), maintain_order=True):
        groups = [t["gain_difference"].fill_null(np.nan).to_numpy()
                  for _, t in sub.group_by("task", maintain_order=True)]  # fmt: skip
        diff, interval, n = stats.unit_mean(groups)
        finding = (
            f"{ctx.names.get(str(model), str(model))}: accuracy gains diminish with depth "
            "(submodularity)"
        )
        lines.append("- " + verdict(finding, "mean gain per component, 1st − 2nd half (points)",
                                    diff, interval, n, 0.0, min_n=stats.MIN_INTERVAL_N,
                                    unit="instances"))  # fmt: skip
    return "\n".join(lines)


def saturation_table(ctx: ReportContext) -> str:
    """Per model x task: the saturation depth j of L components."""
    cells: Cells = {
        (m, t): f"{j}/{n}"
        for m, t, j, n in ctx.tables["saturation"]
        .select(model_label(), "task", "saturation_j", "n_components")
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
            partial(curves_spec, ctx, scale, m),
        )
        for m in tqdm(models, desc="Fig. 5", unit="model", disable=None)
    ]
    fig6 = (
        plots.figure_link(
            ctx,
            "fig6_depth.png",
            "Fig. 6 depth efficiency",
            lambda: depth_spec(ctx, scale, min_params),
        )
        if fits.height
        else ""
    )
    overlap = left_out(ctx.tables["scores"], ctx.tables["manifests"])
    sections = [
        "### Table 1: full-stack scores",
        f"Means over instances, accuracy in %, {units}. Estimator `{est}`. Avg. is the mean over "
        "the model's tasks. The majority class row is the accuracy of always answering the most "
        f"frequent gold option. {overlap}",
        table1(ctx),
        "### Fig. 3: correlation of accuracy with MSE, bias and diversity across junction points",
        "Each cell: Pearson r / Spearman ρ across the junction points j = 1..L of the "
        "layer-addition curves between accuracy_j and −MSE_j, −bias_j or diversity_j (lower MSE "
        "and bias are better). `*`: r's bootstrap 95% interval over the task's instances "
        "excludes 0 (the instances resampled, the curves averaged and correlated again; the "
        "junction points are neighbours on one curve, not independent, so the paper's t test "
        "over them, the table's `p`, is not used). Avg. and the all-models row are Fisher-z "
        "averages and are not tested. "
        f"Estimator `{est}`, scale `{scale}`. {overlap}",
        correlation_table(ctx),
        correlation_verdicts(ctx),
        plots.figure_link(
            ctx,
            "fig3_correlations.png",
            "Fig. 3 correlations",
            lambda: correlation_spec(ctx, scale),
        ),
        "### Fig. 4: share of bias and diversity by module",
        "Paper Eqs. 9-10: the share of module kind X is |X| bias_X / (L bias) (and the same for "
        "diversity), averaged over tasks; the shares of a model sum to 100. The component column "
        f"is |X| / L for comparison. Estimator `{est}`. {overlap}",
        module_table(ctx),
        plots.figure_link(
            ctx,
            "fig4_module_shares.png",
            "Fig. 4 module shares",
            lambda: module_spec(ctx),
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
        f"are not meaningful. {overlap}",
        depth_table(ctx) if depth_models else "No model passes the size filter.",
        submodularity_verdicts(ctx) if depth_models else "",
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


ANALYSIS = Analysis(
    name="paper",
    title="The paper's analysis: bias, diversity and depth",
    methods=(1, 2, 3, 4, 5, 6),
    tables=tables,
    report=report,
    order=10,
)
