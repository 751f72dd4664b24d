"""Statistics over the layer-addition curves: correlations (methods §4), depth efficiency
(methods §5), the information-theoretic view (methods §6), the demo's summaries, and the depth
score of an effect profile (methods §10).

Inputs are the frames of :mod:`layerdiv.analyze.api` (``curves`` has one row per model, task,
estimator and junction j; the count frames one row per prediction/gold pair). SciPy is imported
where it is used, so that ``layerdiv query`` and ``layerdiv ls`` start quickly.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import polars as pl

from layerdiv.analyze.metrics import CORRELATED
from layerdiv.analyze.options import ESTIMATORS
from layerdiv.analyze.overlap import independent
from layerdiv.store.key import KEY, MODEL_KEY

METHODS: tuple[Literal["pearson", "spearman"], ...] = ("pearson", "spearman")
R_CLIP = 1.0 - 1e-6
"""|r| is clipped to this before arctanh in Fisher-z averages, so that r = +-1 stays finite."""
_CURVE_KEYS = [*KEY, "estimator"]


def depth_score(v: np.ndarray) -> np.ndarray:
    """sum_l l v(l) / sum_l v(l) over the last axis (methods §10); NaN where v sums to 0."""
    total = v.sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(total > 0, (v @ np.arange(v.shape[-1], dtype=float)) / total, np.nan)


def correlations(curves: pl.DataFrame, intervals: pl.DataFrame) -> pl.DataFrame:
    """Per (model, task, estimator, metric, method): r and its two-sided p across junctions j,
    and from ``intervals`` (of :func:`correlation_intervals`) r's bootstrap interval over
    instances (``low``, ``high``, ``n_units``).

    r is Pearson's or Spearman's (average ranks for ties) correlation of accuracy_j with
    sign * metric_j (``Metric.sign`` of ``metrics.CORRELATED``); p comes from
    t = r sqrt((n-2) / (1-r^2)) with
    n - 2 degrees of freedom, as ``scipy.stats.pearsonr`` / ``spearmanr`` compute it (the paper's
    test, which takes the junction points, neighbours of one curve, as independent). A curve
    that is constant in j has r = p = NaN. ``significant`` is the test over instances: r's
    interval lies wholly above or below 0."""
    from scipy import stats as sps

    corr = [
        pl.corr("accuracy", pl.col(m.name) * m.sign, method=method).alias(f"{m.name}|{method}")
        for m in CORRELATED
        for method in METHODS
    ]
    wide = curves.group_by(_CURVE_KEYS).agg(pl.len().alias("n_points"), *corr)
    out = (
        wide.unpivot(index=[*_CURVE_KEYS, "n_points"], variable_name="pair", value_name="r")
        .with_columns(
            pl.col("pair").str.split_exact("|", 1).struct.rename_fields(["metric", "method"])
        )
        .unnest("pair")
    )
    r = out["r"].to_numpy()
    dof = out["n_points"].to_numpy().astype(np.float64) - 2
    with np.errstate(divide="ignore", invalid="ignore"):
        t = r * np.sqrt(dof / (1.0 - r * r))
    p = np.where(np.abs(r) >= 1.0, 0.0, 2.0 * sps.t.sf(np.abs(t), dof))
    out = out.with_columns(pl.Series("p", p))
    apart = (pl.col("low") > 0) | (pl.col("high") < 0)
    return (
        out.join(intervals, on=[*_CURVE_KEYS, "metric", "method"], how="left")
        .with_columns(apart.fill_null(False).alias("significant"))
        .sort([*_CURVE_KEYS, "metric", "method"])
    )


def _row_correlation(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson's r of each row of ``x`` with the same row of ``y``; NaN for a constant row."""
    x = x - x.mean(axis=1, keepdims=True)
    y = y - y.mean(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (x * y).sum(1) / np.sqrt((x * x).sum(1) * (y * y).sum(1))


def _matrix(wide: pl.DataFrame) -> np.ndarray:
    """(instances, junctions) float64 of a frame pivoted by j (its ``instance`` column left out)."""
    return wide.drop("instance").cast(pl.Float64).to_numpy()


def correlation_intervals(junctions: pl.DataFrame) -> pl.DataFrame:
    """Per (estimator, metric, method) of one partition's per-instance scores (``junctions``:
    estimator, instance, j, correct and every metric): the bootstrap 95% interval of the
    correlation of :func:`correlations` (``low``, ``high``), the instances resampled (the mean
    curves of each resample correlated again; never the junction points, which are neighbours
    on one curve), and ``n_units``, the instances. Null below :data:`MIN_INTERVAL_N`."""
    from scipy import stats as sps

    rows = []
    for (estimator,), sub in junctions.group_by("estimator", maintain_order=True):
        wide = {c: sub.pivot("j", index="instance", values=c, sort_columns=True)
                for c in ("correct", *(m.name for m in CORRELATED))}  # fmt: skip
        n = wide["correct"].height
        weights = resample_weights(n) if n >= MIN_INTERVAL_N else None
        accuracy = None if weights is None else weights @ _matrix(wide["correct"]) / n
        for m in CORRELATED:
            signed = None if weights is None else m.sign * weights @ _matrix(wide[m.name]) / n
            for method in METHODS:
                low = high = None
                if accuracy is not None and signed is not None:
                    x, y = accuracy, signed
                    if method == "spearman":
                        x, y = sps.rankdata(x, axis=1), sps.rankdata(y, axis=1)
                    lo, hi = percentile_interval(_row_correlation(x, y))
                    low, high = float(lo), float(hi)
                rows.append((estimator, m.name, method, low, high, n))
    schema = {"estimator": pl.String, "metric": pl.String, "method": pl.String,
              "low": pl.Float64, "high": pl.Float64, "n_units": pl.Int64}  # fmt: skip
    return pl.DataFrame(rows, schema=schema, orient="row").fill_nan(None)


def gain_halves(junctions: pl.DataFrame) -> pl.DataFrame:
    """Per (estimator, instance) of one partition's per-instance scores: the instance's mean
    accuracy gain per component (percentage points) over the first half of the stack,
    (correct_h - correct_1) / (h - 1) with h = floor(L / 2), and over the second,
    (correct_L - correct_h) / (L - h): the gains of ``depth_curves`` (methods §5) telescope, so
    their means over instances are its half means; ``gain_difference`` is first minus second
    (null for L < 4)."""
    n_comp = int(junctions["j"].max() or 0)  # type: ignore[arg-type]
    h = n_comp // 2
    at = {j: 100.0 * pl.col("correct").cast(pl.Float64).filter(pl.col("j") == j).first()
          for j in (1, h, n_comp)}  # fmt: skip
    first = (at[h] - at[1]) / (h - 1) if h >= 2 else pl.lit(None, pl.Float64)
    second = (at[n_comp] - at[h]) / (n_comp - h) if h >= 2 else pl.lit(None, pl.Float64)
    return (
        junctions.group_by("estimator", "instance")
        .agg(first.alias("gain_first"), second.alias("gain_second"))
        .with_columns((pl.col("gain_first") - pl.col("gain_second")).alias("gain_difference"))
        .sort("estimator", "instance")
    )


def fisher_z(r: pl.Expr) -> pl.Expr:
    """Fisher's z = arctanh(r), with r clipped to [-R_CLIP, R_CLIP]."""
    return r.clip(-R_CLIP, R_CLIP).arctanh()


def fisher_z_means(corr: pl.DataFrame, manifests: pl.DataFrame) -> pl.DataFrame:
    """Fisher-z averages of the correlations (methods §4): tanh(mean(arctanh r)).

    Rows with ``task`` null average a model over its tasks (the Avg. column); rows with
    ``model`` null average a task over models; the row with both null averages the per-task
    means over tasks. NaN correlations are left out, and so are, in the averages over tasks, the
    tasks whose instances another task holds (:func:`~layerdiv.analyze.overlap.independent`);
    ``n`` counts the ones averaged."""
    keys = ["estimator", "metric", "method"]
    finite = corr.filter(pl.col("r").is_not_nan()).with_columns(fisher_z(pl.col("r")).alias("z"))
    distinct = independent(finite, manifests)

    def mean(frame: pl.DataFrame, by: list[str]) -> pl.DataFrame:
        return frame.group_by([*by, *keys]).agg(pl.col("z").mean(), pl.len().alias("n"))

    nulls = [pl.lit(None, pl.String).alias(c) for c in KEY]  # one model (revision) per row
    over_tasks = mean(distinct, [*MODEL_KEY]).with_columns(
        n for n in nulls if n.meta.output_name() not in MODEL_KEY
    )
    over_models = mean(finite, ["task"]).with_columns(
        n for n in nulls if n.meta.output_name() != "task"
    )
    overall = mean(mean(distinct, ["task"]), []).with_columns(nulls)
    columns = [*KEY, *keys, "n", "z"]
    return (
        pl.concat([f.select(columns) for f in (over_tasks, over_models, overall)])
        .with_columns(pl.col("z").tanh().alias("r"), pl.col("n").cast(pl.UInt32))
        .drop("z")
        .sort([*KEY, *keys], nulls_last=True)
    )


def depth_curves(
    curves: pl.DataFrame, manifests: pl.DataFrame, min_params: float = 0
) -> pl.DataFrame:
    """Per (model, estimator, j): accuracy and MSE averaged over the model's tasks (those whose
    instances another task holds left out, :func:`~layerdiv.analyze.overlap.independent`), and
    the marginal gains of adding component j (methods §5): accuracy_j - accuracy_{j-1} and
    mse_{j-1} - mse_j (positive = better). Only models with n_params >= ``min_params``."""
    params = manifests.group_by(*MODEL_KEY).agg(pl.col("n_params").first())
    keep = params.filter(pl.col("n_params") >= min_params)
    by = [*MODEL_KEY, "estimator"]
    return (
        independent(curves, manifests)
        .join(keep, on=[*MODEL_KEY])
        .group_by([*by, "j"])
        .agg(
            pl.col("n_params").first(),
            pl.len().alias("n_tasks"),
            pl.col("accuracy", "mse").mean(),
        )
        .sort([*by, "j"])
        .with_columns(
            pl.col("accuracy").diff().over(by).alias("accuracy_gain"),
            (-pl.col("mse").diff()).over(by).alias("mse_gain"),
        )
    )


def _fit_log(j: np.ndarray, acc: np.ndarray) -> dict[str, float]:
    """acc(j) = a + b log j by least squares, with standard errors (scipy.stats.linregress)."""
    if len(j) < 3 or np.ptp(acc) == 0:
        nan = float("nan")
        return {"acc_a": nan, "acc_a_se": nan, "acc_b": nan, "acc_b_se": nan, "acc_r2": nan}
    from scipy import stats as sps

    fit = sps.linregress(np.log(j), acc)
    return {
        "acc_a": float(fit.intercept),
        "acc_a_se": float(fit.intercept_stderr),
        "acc_b": float(fit.slope),
        "acc_b_se": float(fit.stderr),
        "acc_r2": float(fit.rvalue**2),
    }


def degrees(cos: pl.Expr) -> pl.Expr:
    """arccos in degrees, the cosine clipped to [-1, 1] against rounding."""
    return cos.clip(-1.0, 1.0).arccos() * (180.0 / math.pi)


def array_degrees(cos: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`degrees` of an array (NaN stays NaN), into ``out`` when given (it may be ``cos``)."""
    out = np.clip(cos, -1.0, 1.0, out=out)
    np.arccos(out, out=out)
    return np.multiply(out, 180.0 / math.pi, out=out)


def power_law_fit(depth: np.ndarray, size: np.ndarray) -> dict[str, float | None]:
    """size = a * depth^(-beta): the least-squares line log size = log a - beta log depth
    (methods §7, §9; the inverse-depth paper's Fig. 2d) through the points with
    size > 0, beta with its standard error; ``n_fitted`` points, None for the fit below 3."""
    keep = np.isfinite(size) & (size > 0) & (depth > 0)
    fit: dict[str, float | None] = {"a": None, "beta": None, "beta_se": None, "r2": None}
    if keep.sum() >= 3:
        from scipy import stats as sps

        line = sps.linregress(np.log(depth[keep]), np.log(size[keep]))
        fit = {
            "a": math.exp(line.intercept),
            "beta": -float(line.slope),
            "beta_se": float(line.stderr),
            "r2": float(line.rvalue**2),
        }
    return {"n_fitted": int(keep.sum()), **fit}


POWER_FIT_SCHEMA = {
    "n_fitted": pl.Int64,
    "a": pl.Float64,
    "beta": pl.Float64,
    "beta_se": pl.Float64,
    "r2": pl.Float64,
}
"""Columns of :func:`power_law_fit`."""


def inverse_depth(j: np.ndarray, c: float, alpha: float, l0: float) -> np.ndarray:
    """loss(j) = c / j^alpha + L0 (the inverse-depth form of seeds/inverse-depth-scaling.txt)."""
    return c / j**alpha + l0


ALPHA_GRID = np.geomspace(0.01, 10.0, 61)
"""Exponents alpha tried before the fit of :func:`inverse_depth` is refined between neighbours."""


def _fit_inverse(j: np.ndarray, loss: np.ndarray) -> dict[str, float | bool]:
    """Least squares fit of :func:`inverse_depth`, by variable projection: for a given alpha, c
    and L0 enter linearly and are solved exactly, so only alpha is searched (on
    :data:`ALPHA_GRID`, then refined by Brent's method between the grid neighbours of the best
    point). Standard errors come from the Jacobian at the optimum, s^2 (J^T J)^-1 with
    s^2 = RSS / (n - 3), as ``scipy.optimize.curve_fit`` computes them. ``loss_at_bound`` is true
    when the optimum is an end of the grid: the curve is then closer to a logarithm (alpha -> 0)
    or a step (alpha -> inf) than to an inverse power, and the parameters are not meaningful."""
    from scipy import optimize

    names = ["loss_c", "loss_alpha", "loss_l0"]
    out: dict[str, float | bool] = {
        n: float("nan") for n in [*names, *(f"{n}_se" for n in names), "loss_r2"]
    }
    out["loss_at_bound"] = False
    if len(j) < 4 or np.ptp(loss) == 0:
        return out

    def linear(alpha: float) -> tuple[np.ndarray, float]:
        design = np.column_stack([j**-alpha, np.ones_like(j)])
        coef = np.linalg.lstsq(design, loss, rcond=None)[0]
        return coef, float(np.sum((design @ coef - loss) ** 2))

    rss = [linear(a)[1] for a in ALPHA_GRID]
    best = int(np.argmin(rss))
    lo, hi = ALPHA_GRID[max(best - 1, 0)], ALPHA_GRID[min(best + 1, len(ALPHA_GRID) - 1)]
    alpha = float(
        optimize.minimize_scalar(lambda a: linear(a)[1], bounds=(lo, hi), method="bounded").x
    )
    (c, l0), resid = linear(alpha)
    jac = np.column_stack([j**-alpha, -c * np.log(j) * j**-alpha, np.ones_like(j)])
    with np.errstate(divide="ignore", invalid="ignore"):
        cov = resid / (len(j) - 3) * np.linalg.pinv(jac.T @ jac)
    se = np.sqrt(np.diag(cov))
    out.update(dict(zip(names, (float(c), alpha, float(l0)), strict=True)))
    out.update({f"{n}_se": float(v) for n, v in zip(names, se, strict=True)})
    out["loss_r2"] = 1.0 - resid / float(np.sum((loss - loss.mean()) ** 2))
    out["loss_at_bound"] = not ALPHA_GRID[0] * 1.001 < alpha < ALPHA_GRID[-1] * 0.999
    return out


def depth_fits(depth: pl.DataFrame) -> pl.DataFrame:
    """Per (model, estimator): the fits acc(j) = a + b log j (``acc_*``) and
    mse(j) = c / j^alpha + L0 (``loss_*``), each parameter with its standard error (``_se``)
    and the fit's R^2 (methods §5)."""
    rows = []
    for key, group in depth.group_by(*MODEL_KEY, "estimator", maintain_order=True):
        j = group["j"].to_numpy().astype(np.float64)
        rows.append(
            {
                **dict(zip([*MODEL_KEY, "estimator"], key, strict=True)),
                "n_params": group["n_params"][0],
                "n_components": int(j.max()),
                **_fit_log(j, group["accuracy"].to_numpy()),
                **_fit_inverse(j, group["mse"].to_numpy()),
            }
        )
    none = np.array([])
    fitted = {**_fit_log(none, none), **_fit_inverse(none, none)}
    schema = {
        **dict.fromkeys(MODEL_KEY, pl.String),
        "estimator": pl.String,
        "n_params": pl.Int64,
        "n_components": pl.Int64,
        **{k: pl.Boolean if isinstance(v, bool) else pl.Float64 for k, v in fitted.items()},
    }
    return pl.DataFrame(rows, schema=schema)


def _entropy(counts: pl.Expr) -> pl.Expr:
    """Plug-in entropy in bits of a distribution given by counts."""
    p = counts / counts.sum()
    return -(p * p.log(2)).sum()


def mutual_information(counts: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    """Plug-in I(X; Y) in bits per group ``by`` from counts of (pred X, gold Y) pairs:
    I = H(X) + H(Y) - H(X, Y); also n (instances) and the error P(X != Y)."""
    x = counts.group_by([*by, "pred"]).agg(pl.col("count").sum())
    y = counts.group_by([*by, "gold"]).agg(pl.col("count").sum())
    hx = x.group_by(by).agg(_entropy(pl.col("count")).alias("h_x"))
    hy = y.group_by(by).agg(_entropy(pl.col("count")).alias("h_y"))
    hxy = counts.group_by(by).agg(
        _entropy(pl.col("count")).alias("h_xy"),
        pl.col("count").sum().alias("n"),
        (
            pl.col("count").filter(pl.col("pred") != pl.col("gold")).sum() / pl.col("count").sum()
        ).alias("error"),
    )
    return (
        hxy.join(hx, on=by)
        .join(hy, on=by)
        .select(
            *by,
            "n",
            pl.col("h_y").alias("entropy_y"),
            (pl.col("h_x") + pl.col("h_y") - pl.col("h_xy"))
            .clip(lower_bound=0)
            .alias("mutual_info"),
            "error",
        )
    )


def information_curves(prefix_preds: pl.DataFrame, n_options: pl.DataFrame) -> pl.DataFrame:
    """Per (model, task, j): I(prefix_j; Y) of the prefix's argmax prediction, its marginal gain
    over j - 1, the measured error, and the bounds of paper Eq. 12 in bits:
    (H(Y) - I - 1) / log2 K <= error <= (H(Y) - I) / 2, K = number of options."""
    by = [*KEY]
    return (
        mutual_information(prefix_preds, [*by, "j"])
        .join(n_options, on=by)
        .sort([*by, "j"])
        .with_columns(
            pl.col("mutual_info").diff().over(by).alias("gain"),
            ((pl.col("entropy_y") - pl.col("mutual_info") - 1) / pl.col("n_options").log(2)).alias(
                "error_lower"
            ),
            ((pl.col("entropy_y") - pl.col("mutual_info")) / 2).alias("error_upper"),
        )
    )


def information_summary(curves: pl.DataFrame, component_preds: pl.DataFrame) -> pl.DataFrame:
    """Per (model, task): n, H(Y), relevancy sum_c I(argmax u_c; Y) (paper Eq. 13), I of the full
    stack with its Eq. 12 bounds and measured error, and the mean marginal gain of I per component
    in the first and second half of the stack (submodularity shows as a smaller second half)."""
    by = [*KEY]
    relevancy = (
        mutual_information(component_preds, [*by, "component"])
        .group_by(by)
        .agg(pl.col("mutual_info").sum().alias("relevancy"))
    )
    half = (pl.col("j") > pl.col("j").max() / 2).over(by)
    gains = curves.group_by(by).agg(
        pl.col("gain").filter(~half).mean().alias("gain_first_half"),
        pl.col("gain").filter(half).mean().alias("gain_second_half"),
    )
    full = curves.filter(pl.col("j") == pl.col("j").max().over(by)).select(
        *by, "n", "n_options", "entropy_y", "mutual_info", "error", "error_lower", "error_upper"
    )
    return full.join(relevancy, on=by).join(gains, on=by).sort(by)


def module_shares_by_model(
    modules: pl.DataFrame, estimator: str, manifests: pl.DataFrame
) -> pl.DataFrame:
    """Per (model, kind): bias and diversity shares averaged over the model's tasks (paper
    Fig. 4; those whose instances another task holds left out), and the kind's share of the
    components |X| / L."""
    return (
        independent(modules.filter(pl.col("estimator") == estimator), manifests)
        .with_columns(
            (pl.col("n_components") / pl.col("n_components").sum().over(*KEY)).alias(
                "component_share"
            )
        )
        .group_by("model", "kind")
        .agg(pl.col("component_share", "bias_share", "diversity_share").mean())
        .sort("model", "kind")
    )


def majority_baseline(golds: pl.DataFrame) -> pl.DataFrame:
    """Per (model, task): the accuracy of always answering the most frequent gold option, and
    that option, from ``golds`` (model, task, gold, count: the instances with that gold label)."""
    return (
        golds.sort("count", "gold", descending=[True, False])
        .group_by(*KEY, maintain_order=True)
        .agg(
            pl.col("gold").first().alias("majority_option"),
            (pl.col("count").first() / pl.col("count").sum()).alias("majority_accuracy"),
        )
        .sort(*KEY)
    )


def saturation(curves: pl.DataFrame, tolerance: float = 0.01) -> pl.DataFrame:
    """Per (model, task): the depth at which accuracy saturates.

    The saturation depth is the smallest number of components j such that every longer prefix
    j' >= j has accuracy_j' >= accuracy_L - ``tolerance`` (default 1 point), where accuracy_L is
    the full model's accuracy: from j on, adding layers never leaves the final accuracy's
    tolerance band from below. ``saturation_fraction`` = j / L."""
    by = [*KEY]
    acc = curves.filter(pl.col("estimator") == ESTIMATORS[0]).sort([*by, "j"])
    floor = pl.col("accuracy").last().over(by) - tolerance - 1e-12
    suffix_min = pl.col("accuracy").reverse().cum_min().reverse().over(by)
    return (
        acc.with_columns((suffix_min >= floor).alias("_saturated"))
        .group_by(by)
        .agg(
            pl.col("j").max().cast(pl.Int64).alias("n_components"),
            pl.col("accuracy").last().alias("final_accuracy"),
            pl.col("j").filter("_saturated").min().alias("saturation_j"),
        )
        .with_columns(
            (pl.col("saturation_j") / pl.col("n_components")).alias("saturation_fraction")
        )
        .sort(by)
    )


def zscore(column: str, by: list[str]) -> pl.Expr:
    """A curve standardized across j within each group (paper Fig. 5): (x - mean) / std; zero
    for a constant curve."""
    x = pl.col(column)
    std = x.std().over(by)
    return pl.when(std > 0).then((x - x.mean().over(by)) / std).otherwise(0.0).alias(column)


# --- bootstrap over documents ----------------------------------------------------------------

RESAMPLES = 1000
"""Bootstrap resamples of the documents (methods §10, §15, §16)."""
SEED = 0
"""Seed of the bootstrap's generator (one fresh generator per interval: the same data give the
same interval whatever else is analysed)."""
LEVEL = 95.0
"""Percentile interval, in percent."""
MIN_INTERVAL_N = 5
"""Fewest documents a bootstrap interval is given for: resampling one to four documents gives
intervals such as [9.05, 9.05] that say nothing about the spread (the interval is null below)."""


def percentile_interval(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bootstrap :data:`LEVEL` percentile interval of ``samples`` (resamples on the first
    axis; those whose statistic is undefined, NaN, left out): (low, high), each of the shape of
    one sample, NaN where no resample defines it."""
    tail = (100.0 - LEVEL) / 2
    samples = np.asarray(samples, dtype=float)
    defined = np.isfinite(samples).any(axis=0)
    filled = np.where(defined, samples, 0.0)  # no all-NaN slice for nanpercentile to warn about
    low, high = np.nanpercentile(filled, [tail, 100.0 - tail], axis=0)
    return np.where(defined, low, np.nan), np.where(defined, high, np.nan)


def resample_weights(n: int, resamples: int = RESAMPLES) -> np.ndarray:
    """(resamples, n): how often each of ``n`` units (documents) is drawn in each bootstrap
    resample of them (``n`` draws with replacement), from a fresh generator seeded with
    :data:`SEED`. A statistic of weighted sums is then one matrix product for every resample."""
    rng = np.random.default_rng(SEED)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)


Interval = tuple[float | None, float | None]
"""A 95% interval (low, high); None where too few values make one."""


def t_interval(estimate: float | None, se: float | None, dof: float) -> Interval:
    """estimate ± t_(0.975, dof) se; None without a finite standard error or dof < 1."""
    if estimate is None or se is None or not math.isfinite(se) or dof < 1:
        return None, None
    from scipy import stats as sps

    half = float(sps.t.ppf(0.975, dof)) * se
    return estimate - half, estimate + half


def fisher_mean(r: np.ndarray) -> tuple[float, Interval]:
    """The Fisher-z average tanh(mean arctanh r) of the finite correlations ``r`` (one per
    task: the tasks are the units) and its interval tanh(mean z ± t_(0.975, k - 1) sd(z) /
    sqrt(k)); no interval below 2 values."""
    z = np.arctanh(np.clip(r[np.isfinite(r)], -R_CLIP, R_CLIP))
    if len(z) == 0:
        return float("nan"), (None, None)
    mean = float(z.mean())
    low, high = t_interval(mean, float(z.std(ddof=1)) / math.sqrt(len(z)) if len(z) > 1 else None,
                           len(z) - 1)  # fmt: skip
    back = (None if v is None else math.tanh(v) for v in (low, high))
    return math.tanh(mean), tuple(back)  # type: ignore[return-value]


def unit_mean(
    groups: list[np.ndarray], resamples: int = RESAMPLES
) -> tuple[float | None, Interval, int]:
    """The verdicts' statistic over independent units (documents of running text, instances of a
    choice task): the mean over ``groups`` (one per task; one group for one task) of each group's
    mean of its finite values, its bootstrap 95% percentile interval (the units of each group
    resampled with replacement, never blocks, positions or junction points), and n, the units
    counted. No interval below :data:`MIN_INTERVAL_N` units in a group; no value without units."""
    groups = [np.asarray(g, dtype=float) for g in groups]
    groups = [g[np.isfinite(g)] for g in groups]
    groups = [g for g in groups if len(g)]
    n = sum(len(g) for g in groups)
    if not groups:
        return None, (None, None), 0
    value = float(np.mean([g.mean() for g in groups]))
    if min(len(g) for g in groups) < MIN_INTERVAL_N:
        return value, (None, None), n
    rng = np.random.default_rng(SEED)
    means = np.mean([g[rng.integers(0, len(g), (resamples, len(g)))].mean(1) for g in groups], 0)
    low, high = percentile_interval(means)
    return value, (float(low), float(high)), n


def bootstrap_mean(scores: np.ndarray, resamples: int = RESAMPLES) -> tuple[float, float, float]:
    """The mean of ``scores`` and its bootstrap 95% percentile interval over them (NaN below
    :data:`MIN_INTERVAL_N` scores): :func:`unit_mean` of one group."""
    value, (low, high), _ = unit_mean([scores], resamples)
    nan = float("nan")
    return (
        nan if value is None else value,
        nan if low is None else low,
        nan if high is None else high,
    )


def resampled_power_law(
    depth: np.ndarray, totals: np.ndarray, counts: np.ndarray | None = None
) -> tuple[Interval, int]:
    """The bootstrap 95% interval of beta in size = a * depth^(-beta) (:func:`power_law_fit`)
    refitted to the mean profile of each resample of the units (one row per document or
    instance, one column per depth; the rows are resampled, never the depths), and the units
    counted. A unit's row holds its sums ``totals`` over ``counts`` values (tokens of a
    document; one value per instance without ``counts``), so that a resample's mean is its
    total over its count, as the mean of every token. None below :data:`MIN_INTERVAL_N` units
    or 3 depths with a positive mean size."""
    totals = np.asarray(totals, dtype=float)
    counts = np.ones_like(totals) if counts is None else np.asarray(counts, dtype=float)
    whole = np.isfinite(totals).all(axis=1)
    totals, counts = totals[whole], counts[whole]
    n = len(totals)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = totals.sum(axis=0) / counts.sum(axis=0)
    keep = np.isfinite(mean) & (mean > 0) & (depth > 0)
    if n < MIN_INTERVAL_N or keep.sum() < 3:
        return (None, None), n
    weights = resample_weights(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log((weights @ totals[:, keep]) / (weights @ counts[:, keep]))
    fine = np.isfinite(logs).all(axis=1)
    betas = np.full(len(logs), np.nan)
    betas[fine] = -np.polyfit(np.log(depth[keep]), logs[fine].T, 1)[0]
    low, high = percentile_interval(betas)
    return (float(low), float(high)), n
