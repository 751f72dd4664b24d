"""The depth loss law (methods §12): L_hat = c_w w^-a_w + c_l l^-a_l + c_D D^-a_D + E
over points (width, depth, tokens, loss), fitted as the inverse-depth paper does, and the
within-model version delta_ce(l) = c l^-a.

numpy and scipy only: :func:`fit_law` takes a frame of points and returns a :class:`LawFit`
(estimates, standard errors, bootstrap intervals, held-out error, the objective at the optimum).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from scipy.optimize import least_squares

from layerdiv.errors import LayerdivError
from layerdiv.measurements import tables_of
from layerdiv.schemas.kinds import KINDS
from layerdiv.store.key import KEY, MODEL_KEY
from layerdiv.store.reader import Names, PartitionInfo, Store, StoreError

KINDS_WITH_LOSS = tuple(k.name for k in KINDS.values() if "tokens" in k.required)
"""The task kinds whose partitions store the model's own loss per token (``tokens.loss``)."""
VARIABLES = ("width", "depth", "tokens")
"""The law's variables, as the input columns name them (w, l, D)."""
COLUMNS = (*VARIABLES, "loss")
"""The columns a table of points must have."""
PARAMETERS = ("c_width", "alpha_width", "c_depth", "alpha_depth", "c_tokens", "alpha_tokens", "E")
"""The 7 parameters, in the order of every parameter vector here."""
N_PARAMS = len(PARAMETERS)
EXPONENT_STARTS = (0.2, 0.6, 1.2)
"""Initial exponents: every combination over the three terms is one start of the solver."""
FLOOR_STARTS = (0.3, 0.8)
"""Initial E as fractions of the lowest loss: each is combined with every exponent start."""
HELDOUT_FRACTION = 0.2
"""Share of the points held out in each split (methods §12)."""
POINT_MARGIN = 3
"""Points beyond the 7 parameters a fit needs: sigma^2 = sum residual^2 / (n - 7) then rests on at
least this many residual degrees of freedom."""
MIN_POINTS = N_PARAMS + POINT_MARGIN
"""The fewest points a fit (and each held-out split's fit) takes."""
RANK_RTOL = 1e-8
"""A Jacobian whose smallest singular value is below this fraction of its largest is taken as
rank-deficient: (J'J)^-1 then squares its condition past 1e16, and no digit of the standard errors
is right (nor does the solver repeat its steps there)."""


class LawError(LayerdivError, ValueError):
    """Points the law cannot be fitted to (a missing column, a non-positive value, too few, or
    points that do not identify the 7 parameters)."""


@dataclass
class LawFit:
    """The fitted law: estimates in the units of the input columns, with their uncertainty."""

    table: pl.DataFrame
    """One row per parameter (:data:`PARAMETERS`): estimate, se, ci_low, ci_high."""
    objective: float
    """Mean over the fitted points of (log L - log L_hat)^2 at the optimum."""
    gradient_norm: float
    """Infinity norm of the objective's gradient at the optimum (scaled units): ~0 = optimum."""
    n_points: int
    n_fitted: int
    """Points kept after ``exclude_highest``."""
    n_bootstrap: int
    """Resamples whose refit is identified (:func:`_identified_fit`): the intervals' draws."""
    heldout_error: float | None
    """Mean absolute relative error |L - L_hat| / L on the held-out points (None: no splits)."""
    n_heldout: int
    """Held-out splits whose fit is identified: those the error averages."""
    points: pl.DataFrame = field(repr=False)
    """The fitted points, with the column ``fitted`` (L_hat)."""

    def summary(self) -> pl.DataFrame:
        """One row: how the fit was made and how well it fits."""
        return pl.DataFrame(
            {
                "n_points": [self.n_points],
                "n_fitted": [self.n_fitted],
                "objective": [self.objective],
                "gradient_norm": [self.gradient_norm],
                "n_bootstrap": [self.n_bootstrap],
                "n_heldout_splits": [self.n_heldout],
                "heldout_mean_abs_rel_error": [self.heldout_error],
            }
        )


def check_points(points: pl.DataFrame, where: str) -> pl.DataFrame:
    """The columns :data:`COLUMNS` of ``points`` as float64, refused in one line (``LawError``)
    when one is missing, not numeric, null or not positive."""
    missing = [c for c in COLUMNS if c not in points.columns]
    if missing:
        raise LawError(
            f"{where} lacks the column(s) {', '.join(missing)}: give a table with the columns "
            f"{', '.join(COLUMNS)}"
        )
    try:
        frame = points.select(pl.col(c).cast(pl.Float64, strict=True) for c in COLUMNS)
    except pl.exceptions.PolarsError:
        raise LawError(f"{where}: the columns {', '.join(COLUMNS)} must be numbers") from None
    for column in COLUMNS:
        values = frame[column]
        bad = values.is_null() | ~values.is_finite() | (values <= 0)
        if bad.any():
            row = int(bad.arg_max() or 0)
            raise LawError(
                f"{where}: {column} must be a positive number on every row, row {row + 1} has "
                f"{values[row]}; remove or correct that point"
            )
    return frame


def read_points(path: str | Path) -> pl.DataFrame:
    """Points from a CSV or Parquet file with the columns width, depth, tokens, loss (checked:
    :func:`check_points`)."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            frame = pl.read_parquet(path)
        elif suffix == ".csv":
            frame = pl.read_csv(path)
        else:
            raise LawError(f"{path}: unknown file type; give a .csv or .parquet file")
    except (OSError, pl.exceptions.PolarsError) as err:
        raise LawError(f"{path}: cannot be read ({str(err).splitlines()[0]})") from None
    return check_points(frame, str(path))


# --- the model, in scaled units -------------------------------------------------------------
# Internally each variable is divided by its geometric mean s and every c and E is fitted as its
# log: theta = (log c'_w, a_w, log c'_l, a_l, log c'_D, a_D, log E), with c = c' s^a.


def _terms(theta: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(n, 3): c'_k x'_k^-a_k for each term k (x: the scaled variables, n x 3)."""
    logc, alpha = theta[0:6:2], theta[1:6:2]
    return np.exp(logc - alpha * np.log(x))


def _log_residuals(theta: np.ndarray, x: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """log L - log L_hat (methods §12: the objective is the mean of their squares)."""
    return np.log(loss) - np.log(_terms(theta, x).sum(axis=1) + np.exp(theta[6]))


def _log_jacobian(theta: np.ndarray, x: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """d(log L - log L_hat)/d theta = -(d L_hat / d theta) / L_hat."""
    terms = _terms(theta, x)
    floor = np.exp(theta[6])
    fitted = terms.sum(axis=1) + floor
    jac = np.empty((len(loss), N_PARAMS))
    jac[:, 0:6:2] = terms
    jac[:, 1:6:2] = -terms * np.log(x)
    jac[:, 6] = floor
    return -jac / fitted[:, None]


def _solve(theta0: np.ndarray, x: np.ndarray, loss: np.ndarray) -> Any:
    return least_squares(
        _log_residuals, theta0, jac=_log_jacobian, args=(x, loss), method="lm", xtol=1e-12,
        ftol=1e-12, gtol=1e-12, max_nfev=2000,
    )  # fmt: skip


def _starts(loss: np.ndarray) -> list[np.ndarray]:
    """Initial points: every combination of :data:`EXPONENT_STARTS` and :data:`FLOOR_STARTS`,
    the rest of the mean loss above E split evenly between the three terms at the scaled
    variables' geometric mean (x' = 1)."""
    starts = []
    for floor, alphas in product(FLOOR_STARTS, product(EXPONENT_STARTS, repeat=3)):
        e0 = floor * loss.min()
        c0 = np.log(max(loss.mean() - e0, 1e-3 * loss.mean()) / 3)
        starts.append(np.array([c0, alphas[0], c0, alphas[1], c0, alphas[2], np.log(e0)]))
    return starts


def _best(starts: list[np.ndarray], x: np.ndarray, loss: np.ndarray) -> Any:
    """The solution of lowest objective over ``starts`` (the solver's failures skipped)."""
    best = None
    for theta0 in starts:
        with np.errstate(all="ignore"):
            res = _solve(theta0, x, loss)
        finite = np.all(np.isfinite(res.x)) and np.isfinite(res.cost)
        if finite and (best is None or res.cost < best.cost):
            best = res
    if best is None:
        raise LawError("the law could not be fitted from any start: check the points")
    return best


def _single_value(raw: np.ndarray) -> str | None:
    """Why the points (n x 3, :data:`VARIABLES`) cannot identify the law before any fit: a
    variable with one value, whose term c x^-a is then a constant beside E; None if each varies."""
    for k, variable in enumerate(VARIABLES):
        values = np.unique(raw[:, k])
        if len(values) < 2:
            return (
                f"every point has {variable} {values[0]:g}, so c_{variable} and alpha_{variable} "
                f"cannot be told from E; give points of at least two values of {variable}"
            )
    return None


def _rank_deficiency(theta: np.ndarray, x: np.ndarray, loss: np.ndarray) -> str | None:
    """Why the fit at ``theta`` does not identify the 7 parameters: the Jacobian of the log
    residuals without full rank (:data:`RANK_RTOL`), naming the parameters that its null space
    moves; None at an identified optimum."""
    with np.errstate(all="ignore"):
        jac = _log_jacobian(theta, x, loss)
    if not np.all(np.isfinite(jac)):
        return "the Jacobian at the optimum is not finite"
    _, sv, vt = np.linalg.svd(jac, full_matrices=False)
    rank = int(np.sum(sv > RANK_RTOL * sv[0])) if sv[0] > 0 else 0
    if rank == N_PARAMS:
        return None
    weak = (vt[rank:] ** 2).sum(axis=0)  # each parameter's share of the unconstrained directions
    names = [PARAMETERS[i] for i in np.argsort(-weak) if weak[i] > 0.1]
    return (
        f"the Jacobian at the optimum has rank {rank} of {N_PARAMS} (the points leave "
        f"{', '.join(names)} undetermined)"
    )


def _identified_fit(starts: list[np.ndarray], x: np.ndarray, loss: np.ndarray) -> Any | None:
    """:func:`_best` over ``starts`` of a resample or split, or None where its points cannot
    identify the law (one value of a variable, no start converging, or a rank-deficient Jacobian
    at its optimum): such a fit is left out, as its solution is arbitrary (and the solver does
    not even repeat it from the same start)."""
    if _single_value(x) is not None:
        return None
    try:
        res = _best(starts, x, loss)
    except LawError:
        return None
    return None if _rank_deficiency(res.x, x, loss) else res


def _to_input_units(theta: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(c_w, a_w, c_l, a_l, c_D, a_D, E) in the units of the input columns: c = c' s^a."""
    alpha = theta[1:6:2]
    out = np.empty(N_PARAMS)
    out[0:6:2] = np.exp(theta[0:6:2] + alpha * np.log(scale))
    out[1:6:2] = alpha
    out[6] = np.exp(theta[6])
    return out


def _unit_jacobian(theta: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """d(parameters in input units) / d theta (for the delta method, exact for Gauss-Newton
    covariances: they transform with the parameterisation)."""
    params = _to_input_units(theta, scale)
    t = np.zeros((N_PARAMS, N_PARAMS))
    for k in range(3):
        c, a = 2 * k, 2 * k + 1
        t[c, c] = params[c]
        t[c, a] = params[c] * np.log(scale[k])
        t[a, a] = 1.0
    t[6, 6] = params[6]
    return t


def standard_errors(
    theta: np.ndarray, x: np.ndarray, loss: np.ndarray, scale: np.ndarray
) -> np.ndarray:
    """Standard errors of the parameters in input units: sigma^2 (J'J)^-1 with J the Jacobian of
    the residuals L - L_hat and sigma^2 = sum residual^2 / (n - 7) (methods §12), computed in
    the scaled parameters and carried to input units by the chain rule."""
    terms = _terms(theta, x)
    fitted = terms.sum(axis=1) + np.exp(theta[6])
    residual = loss - fitted
    jac = np.empty((len(loss), N_PARAMS))  # d(L - L_hat)/d theta
    jac[:, 0:6:2] = -terms
    jac[:, 1:6:2] = terms * np.log(x)
    jac[:, 6] = -np.exp(theta[6])
    sigma2 = float(residual @ residual) / (len(loss) - N_PARAMS)
    cov = sigma2 * np.linalg.pinv(jac.T @ jac)
    t = _unit_jacobian(theta, scale)
    return np.sqrt(np.clip(np.diag(t @ cov @ t.T), 0, None))


def fit_law(
    points: pl.DataFrame,
    exclude_highest: int = 0,
    bootstrap: int = 200,
    heldout: int = 0,
    seed: int = 0,
) -> LawFit:
    """Fit L_hat = c_w w^-a_w + c_l l^-a_l + c_D D^-a_D + E to ``points`` (columns width, depth,
    tokens, loss) by least squares on log loss from several starts (methods §12).

    ``exclude_highest`` N keeps the points whose loss is strictly below the N-th highest;
    ``bootstrap`` B resamples refitted from the optimum give 2.5/97.5 percentile intervals;
    ``heldout`` K random 20% splits give the mean absolute relative error on the held-out
    points (each split fitted from every start). ``seed`` fixes both. Points that cannot
    identify the 7 parameters are refused (``LawError``): fewer than :data:`MIN_POINTS`, a
    variable with one value, or a Jacobian without full rank at the optimum; a resample or
    split that cannot is left out of the intervals or the error."""
    frame = check_points(points, "the points")
    n_points = frame.height
    if exclude_highest < 0:
        raise LawError(f"--exclude-highest must be 0 or more, not {exclude_highest}")
    if exclude_highest:
        if exclude_highest >= n_points:
            raise LawError(
                f"--exclude-highest {exclude_highest} leaves no point of {n_points}: give a "
                "number below the number of points"
            )
        cut = np.sort(frame["loss"].to_numpy())[::-1][exclude_highest - 1]
        frame = frame.filter(pl.col("loss") < cut)  # methods §12: strictly below
    if frame.height < MIN_POINTS:
        raise LawError(
            f"{frame.height} point(s) to fit (of {n_points}) but the law has {N_PARAMS} "
            f"parameters: give at least {MIN_POINTS} points (the parameters plus {POINT_MARGIN} "
            "for the residual variance)"
        )
    raw = frame.select(VARIABLES).to_numpy()
    loss = frame["loss"].to_numpy()
    if problem := _single_value(raw):
        raise LawError(f"the law cannot be identified from these points: {problem}")
    scale = np.exp(np.log(raw).mean(axis=0))
    x = raw / scale
    best = _best(_starts(loss), x, loss)
    theta = best.x
    if problem := _rank_deficiency(theta, x, loss):
        raise LawError(
            f"the law cannot be identified from these points: {problem}; give points that vary "
            "width, depth and tokens more widely (or more of them)"
        )
    estimate = _to_input_units(theta, scale)
    se = standard_errors(theta, x, loss, scale)
    rng = np.random.default_rng(seed)
    n = len(loss)
    draws = []
    for _ in range(bootstrap):
        idx = rng.integers(0, n, n)
        res = _identified_fit([theta], x[idx], loss[idx])
        if res is not None:
            draws.append(_to_input_units(res.x, scale))
    low = high = np.full(N_PARAMS, np.nan)
    if draws:
        low, high = np.percentile(np.array(draws), [2.5, 97.5], axis=0)
    errors = []
    n_out = max(1, round(HELDOUT_FRACTION * n))
    if heldout and n - n_out < MIN_POINTS:
        raise LawError(
            f"{n} points are too few for held-out splits of 20% (each split fits at least "
            f"{MIN_POINTS}): omit --heldout"
        )
    for _ in range(heldout):
        order = rng.permutation(n)
        out, keep = order[:n_out], order[n_out:]
        split = _identified_fit(_starts(loss[keep]), x[keep], loss[keep])
        if split is not None:
            predicted = _terms(split.x, x[out]).sum(axis=1) + np.exp(split.x[6])
            errors.append(np.abs(loss[out] - predicted) / loss[out])
    fitted = _terms(theta, x).sum(axis=1) + np.exp(theta[6])
    table = pl.DataFrame(
        {
            "parameter": list(PARAMETERS),
            "estimate": estimate,
            "se": se,
            "ci_low": low,
            "ci_high": high,
        }
    )
    return LawFit(
        table=table,
        objective=float(2 * best.cost / n),  # least_squares' cost is sum(r^2) / 2
        gradient_norm=float(best.optimality),
        n_points=n_points,
        n_fitted=n,
        n_bootstrap=len(draws),
        heldout_error=float(np.mean(np.concatenate(errors))) if errors else None,
        n_heldout=len(errors),
        points=frame.with_columns(pl.Series("fitted", fitted)),
    )


def term(table: pl.DataFrame, variable: str, values: np.ndarray) -> np.ndarray:
    """c_k x^-a_k of the term of ``variable`` at ``values`` (input units), with the estimates
    of ``table`` (:attr:`LawFit.table`)."""
    k = VARIABLES.index(variable)
    est = table["estimate"].to_numpy()
    return np.asarray(est[2 * k] * values ** -est[2 * k + 1])


def partial_residuals(table: pl.DataFrame, points: pl.DataFrame, variable: str) -> np.ndarray:
    """L - (L_hat - term_k) of the fitted ``points`` (:attr:`LawFit.points`): the loss with
    every other term and E removed, the term of ``variable`` plus the residual (the paper's
    Fig. 2f)."""
    values = points[variable].to_numpy()
    return np.asarray(
        points["loss"].to_numpy() - points["fitted"].to_numpy() + term(table, variable, values)
    )


EXAMPLE = {"c_width": 40.0, "alpha_width": 0.5, "c_depth": 1.5, "alpha_depth": 1.0,
           "c_tokens": 300.0, "alpha_tokens": 0.3, "E": 1.7}  # fmt: skip
"""Made-up parameters of :func:`synthetic_points` (exponents near the paper's)."""


def synthetic_points(
    seed: int, n: int = 245, noise: float = 0.01, params: dict[str, float] = EXAMPLE
) -> pl.DataFrame:
    """``n`` points of the law with ``params``: width log-uniform in [256, 8192], depth uniform
    in 4..63, tokens log-uniform in [1e9, 1e12], loss times log-normal noise of sd ``noise``
    (for tests and benchmarks)."""
    rng = np.random.default_rng(seed)
    width = np.exp(rng.uniform(np.log(256), np.log(8192), n))
    depth = rng.integers(4, 64, n).astype(float)
    tokens = np.exp(rng.uniform(np.log(1e9), np.log(1e12), n))
    loss = (
        params["c_width"] * width ** -params["alpha_width"]
        + params["c_depth"] * depth ** -params["alpha_depth"]
        + params["c_tokens"] * tokens ** -params["alpha_tokens"]
        + params["E"]
    ) * np.exp(rng.normal(0, noise, n))
    return pl.DataFrame({"width": width, "depth": depth, "tokens": tokens, "loss": loss})


# --- within one model ---------------------------------------------------------------------------


def power_fit(layer: np.ndarray, delta: np.ndarray) -> tuple[float, float, float]:
    """(c, a, r^2) of delta = c l^-a by least squares on log-log axes over the positive deltas
    (methods §12, within one model); nan where fewer than two are positive."""
    keep = (layer > 0) & (delta > 0)
    if keep.sum() < 2:
        return float("nan"), float("nan"), float("nan")
    lx, ly = np.log(layer[keep]), np.log(delta[keep])
    slope, intercept = np.polyfit(lx, ly, 1)
    resid = ly - (intercept + slope * lx)
    total = float(((ly - ly.mean()) ** 2).sum())
    r2 = 1 - float((resid**2).sum()) / total if total > 0 else float("nan")
    return float(np.exp(intercept)), float(-slope), r2


def law_spec(table: pl.DataFrame, points: pl.DataFrame, title: str = "") -> Any:
    """The figure (:class:`layerdiv.analyze.plots.Figure`) of a fit's ``table`` and fitted
    ``points``: one panel per variable, the partial residuals L - (L_hat - term) against the
    variable with the fitted term c x^-a (the paper's Fig. 2f), log-log axes (points whose
    partial residual is not positive cannot be drawn: the panel counts them)."""
    from layerdiv.analyze import plots

    est = dict(zip(PARAMETERS, table["estimate"], strict=True))
    panels = []
    for variable in VARIABLES:
        values = points[variable].to_numpy()
        partial = partial_residuals(table, points, variable)
        shown = partial > 0
        grid = np.geomspace(values.min(), values.max(), 100)
        alpha = est[f"alpha_{variable}"]
        hidden = int((~shown).sum())
        panels.append(
            plots.Panel(
                f"{variable} term",
                [
                    plots.Series(
                        "points",
                        values[shown].tolist(),
                        partial[shown].tolist(),
                        color="#1f77b4",
                        line=False,
                    ),
                    plots.Series(
                        f"fit, alpha_{variable} = {alpha:.3g}",
                        grid.tolist(),
                        term(table, variable, grid).tolist(),
                        color="black",
                        marker=None,
                    ),
                ],
                xlabel=variable,
                ylabel="partial residual L - (L_hat - term)",
                xscale="log",
                yscale="log",
                notes=[f"{hidden} points <= 0 not shown"] if hidden else [],
            )
        )
    return plots.Figure(
        title or "Depth loss law (methods §12): each term's partial residuals and the fitted term",
        panels,
        cols=len(VARIABLES),
        panel_size=(4.2, 3.4),
    )


def law_figure(fit: LawFit, path: Path) -> Path:
    """:func:`law_spec` of ``fit`` drawn as a PNG at ``path``."""
    from layerdiv.analyze import plots

    return plots.to_matplotlib(law_spec(fit.table, fit.points), path)


# --- points from a store ------------------------------------------------------------------------


LAW_COLUMNS = pl.Schema(
    {
        **dict.fromkeys(KEY, pl.String),
        "width": pl.Int64,
        "depth": pl.Int64,
        "tokens_seen": pl.Int64,
        "loss": pl.Float64,
        "n_tokens": pl.Int64,
    }
)
"""The columns of :func:`law_points`."""


def law_points(store: Store | str | Path, tasks: Names = (), models: Names = ()) -> pl.DataFrame:
    """The points of the depth law (methods §12) the store holds: per (model,
    revision, text task) the width w, depth l, training tokens D of the revision (null where not
    recorded: give ``extract --step/--tokens-seen``) and the mean of the model's own next-token
    cross-entropy ``tokens.loss`` over every token that has one (``n_tokens`` of them; a
    partition extracted before the loss was stored has none, and is refused)."""
    st = store if isinstance(store, Store) else Store(store)
    parts = [p for p in st.select(models, tasks) if p.kind.name in KINDS_WITH_LOSS]
    if not parts:
        raise StoreError("no running-text partition selected: the law needs a text task's loss")
    old = [
        p.key.label
        for p in parts
        if "loss" not in tables_of(p.manifest.schema_version)["tokens"].names
    ]
    if old:
        raise StoreError(
            f"{', '.join(old)}: extracted before the model's loss was stored (schema version "
            "<= 4); re-extract them with --overwrite"
        )
    frame = mean_loss(st, parts)
    facts = st.models(models, tasks).select(*MODEL_KEY, "width", "depth", "tokens_seen")
    return (
        frame.join(facts, on=[*MODEL_KEY], how="left")
        .select(LAW_COLUMNS.names())
        .cast(LAW_COLUMNS)
        .sort(*KEY)
    )


def mean_loss(store: Store, parts: Sequence[PartitionInfo[Any]]) -> pl.DataFrame:
    """Per text partition of ``parts`` (key columns): ``loss``, the mean of ``tokens.loss`` over
    the ``n_tokens`` tokens that have one (null and 0 for partitions of schema version <= 4)."""
    schema = {**dict.fromkeys(KEY, pl.String), "loss": pl.Float64, "n_tokens": pl.Int64}
    text = [p for p in parts if p.kind.name in KINDS_WITH_LOSS]
    if not text:
        return pl.DataFrame(schema=schema)
    return (
        store.scan("tokens", [p.model for p in text], [p.task for p in text])
        .join(pl.LazyFrame([dict(p.key.items()) for p in text]), on=[*KEY], how="semi")
        .group_by(*KEY)
        .agg(pl.col("loss").mean(), pl.col("loss").count().alias("n_tokens"))
        .collect()
        .cast(schema)  # type: ignore[arg-type]
        .sort(*KEY)
    )


def model_losses(store: Store, task: str, models: Sequence[str] = ()) -> pl.DataFrame:
    """Per (model, revision) of ``store`` on ``task``: width, depth, tokens (tokens seen in
    training) and loss (the mean of the model's own per-token cross-entropy): the one place the
    law reads a store (:func:`law_points`). A revision without its tokens seen is refused,
    naming it."""
    points = law_points(store, tasks=task, models=models).rename({"tokens_seen": "tokens"})
    unknown = points.filter(pl.col("tokens").is_null())
    if unknown.height:
        names = ", ".join(f"{m}@{r}" for m, r in unknown.select("model", "revision").rows())
        raise LawError(
            f"{names}: no training tokens recorded on task {task}; re-extract with "
            "--tokens-seen D (or --step N --tokens-per-step T), or fit a table of points "
            "(--points FILE)"
        )
    checked = check_points(points, f"{store.root}, task {task}")
    return pl.concat([points.select("model", "revision"), checked], how="horizontal")


def store_points(store: Store, task: str, models: Sequence[str] = ()) -> pl.DataFrame:
    """The law's points of ``task`` in ``store`` (:func:`model_losses`; of ``models`` only, when
    given), refused in one line when they come from fewer than two models (a law across models
    needs several)."""
    points = model_losses(store, task, models)
    found = points["model"].n_unique() if points.height else 0
    if found < 2:
        raise LawError(
            f"{store.root} holds {found} model(s) with a loss on task {task}: the law needs "
            "points of several models (extract more models, or give --points FILE)"
        )
    return points
