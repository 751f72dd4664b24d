"""Per-instance scores and layer-addition curves of one (model, task) partition (methods §2-3).

Everything here is a Polars expression over one *wide* frame: one row per (instance, component c)
in execution order, with the component's option logits ``u0 .. u{K-1}`` (u_c[k], methods
§1) and the instance's ``gold`` option. A junction point j (1-based) is the prefix of the
first j components; all its scores come from running sums over c <= j of per-component "member"
terms, so every junction of every instance costs O(1) after one cumulative sum (``--scale final``).

Both estimators are one computation on different ensemble members (methods §2):

- ``paper``: the members are the logit vectors u_c; the prediction is softmax(ubar) (Eq. 14);
  diversity is the spread of the u_c around ubar in logit units (Eq. 8).
- ``ensemble``: the members are the probability vectors p_c = softmax(u_c); the prediction is their
  mean pbar; diversity is their spread around pbar, so mse = bias - diversity exactly.

The bias term, mean_k (1/j) sum_c (y_k - p_c[k])^2 (Eq. 14), is the same for both.

With ``--scale prefix`` the prefix's components are seen through the logit lens of junction j: every
u_c (c <= j) is multiplied by a_j = final_rms / prefix_rms_j, so that their sum is lens_j of
methods §1. The softmax of a_j u_c depends on j, so the running sums become sums over
all pairs c <= j (O(L^2) per instance); at j = L, a_L = 1 up to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from layerdiv.analyze.options import ESTIMATORS, SCALES, Estimator, Scale
from layerdiv.store import PartitionInfo

# Column names of the running sums over the members c of a prefix (per instance and junction j).
_S, _P = "sum_u", "sum_p"  # sum_u{k} = sum_c u_c[k]; sum_p{k} = sum_c p_c[k]
_Q, _P2, _B = "sum_uu", "sum_pp", "sum_b"  # sum_c sum_k of u_c[k]^2, p_c[k]^2, (y_k - p_c[k])^2


def _u(k: int) -> pl.Expr:
    return pl.col(f"u{k}")


def _y(k: int) -> pl.Expr:
    """One-hot gold y_k (methods §2)."""
    return (pl.col("gold") == k).cast(pl.Float64)


def with_softmax(frame: pl.LazyFrame, logits: list[pl.Expr], prefix: str) -> pl.LazyFrame:
    """Add columns ``{prefix}0 .. {prefix}{K-1}`` = softmax over the K option columns ``logits``
    of each row (max-shifted for stability), computed in stages so nothing is evaluated twice."""
    k_opts = len(logits)
    exps = [pl.col(f"_exp{k}") for k in range(k_opts)]
    return (
        frame.with_columns(pl.max_horizontal(logits).alias("_top"))
        .with_columns((x - pl.col("_top")).exp().alias(f"_exp{k}") for k, x in enumerate(logits))
        .with_columns(pl.sum_horizontal(exps).alias("_total"))
        .with_columns((e / pl.col("_total")).alias(f"{prefix}{k}") for k, e in enumerate(exps))
        .drop("_top", "_total", *(f"_exp{k}" for k in range(k_opts)))
    )


def argmax(logits: list[pl.Expr]) -> pl.Expr:
    """Index of the largest of the K option columns (the first one on ties, as numpy)."""
    top = pl.max_horizontal(logits)
    return pl.coalesce([pl.when(x == top).then(pl.lit(k, pl.Int8)) for k, x in enumerate(logits)])


def with_member_terms(
    frame: pl.LazyFrame, k_opts: int, scale: pl.Expr | None = None
) -> pl.LazyFrame:
    """Add the per-component terms whose sums over a prefix give every score of
    methods §2: u_c[k] (``sum_u{k}``), p_c[k] = softmax(u_c)[k] (Eq. 14, ``sum_p{k}``),
    sum_k u_c[k]^2, sum_k p_c[k]^2 and sum_k (y_k - p_c[k])^2. ``scale`` multiplies each u_c
    first (a_j of the prefix scale)."""
    u = [_u(k) if scale is None else _u(k) * scale for k in range(k_opts)]
    p = [pl.col(f"{_P}{k}") for k in range(k_opts)]
    return with_softmax(frame, u, _P).with_columns(
        *(x.alias(f"{_S}{k}") for k, x in enumerate(u)),
        pl.sum_horizontal([x * x for x in u]).alias(_Q),
        pl.sum_horizontal([x * x for x in p]).alias(_P2),
        pl.sum_horizontal([(_y(k) - p[k]) ** 2 for k in range(k_opts)]).alias(_B),
    )


def _sum_names(k_opts: int) -> list[str]:
    return [*(f"{_S}{k}" for k in range(k_opts)), *(f"{_P}{k}" for k in range(k_opts)), _Q, _P2, _B]


def _prefix_sums_final(terms: pl.DataFrame, k_opts: int) -> pl.DataFrame:
    """Running sums over c <= j of the member terms, per instance (``--scale final``, O(L))."""
    return terms.select(
        "instance",
        "gold",
        (pl.col("component") + 1).alias("j"),
        pl.col(_sum_names(k_opts)).cum_sum().over("instance"),
    )


LENS_CHUNK_ROWS = 1 << 20
"""The prefix scale expands each instance's L components into L(L+1)/2 pairs; instances are
processed in chunks of about this many pairs to bound memory."""


def _prefix_sums_scaled(wide: pl.DataFrame, k_opts: int, n_comp: int) -> pl.DataFrame:
    """Sums over c <= j of the member terms with every u_c scaled by a_j = final_rms /
    prefix_rms_j (``--scale prefix``, methods §1), from one row per pair (j, c <= j)."""
    per_chunk = n_comp * max(1, LENS_CHUNK_ROWS // (n_comp * (n_comp + 1) // 2))
    return pl.concat(
        _scaled_chunk(wide.slice(start, per_chunk), k_opts, n_comp)
        for start in range(0, wide.height, per_chunk)
    )


def _scaled_chunk(wide: pl.DataFrame, k_opts: int, n_comp: int) -> pl.DataFrame:
    # ``wide`` is sorted by (instance, component) with n_comp rows per instance, so the member
    # row of pair (junction row r, component c) is r - component(r) + c.
    pairs = (
        wide.lazy()
        .select(
            pl.int_range(pl.len()).alias("row"),
            (pl.col("final_rms").cast(pl.Float64) / pl.col("prefix_rms")).alias("a"),
            pl.int_ranges(pl.col("component") + 1).alias("c"),
        )
        .explode("c")
        .select("row", "a", (pl.col("row") - pl.col("row") % n_comp + pl.col("c")).alias("member"))
        .collect()
    )
    members = wide.select("gold", *(f"u{k}" for k in range(k_opts)))[pairs["member"]]
    sums = (
        with_member_terms(members.hstack(pairs.select("row", "a")).lazy(), k_opts, pl.col("a"))
        .group_by("row")
        .agg(pl.col(_sum_names(k_opts)).sum())
        .sort("row")
        .collect()
    )
    keys = wide.select("instance", "gold", (pl.col("component") + 1).alias("j"))
    return keys.hstack(sums.drop("row"))


def _with_estimator_scores(frame: pl.LazyFrame, estimator: Estimator, k_opts: int) -> pl.LazyFrame:
    """Add mse and diversity at junction j from the prefix sums (methods §2, L -> j).

    Members m_c are u_c (``paper``) or p_c (``ensemble``); mbar = (1/j) sum_c m_c.
    diversity = mean_k (1/j) sum_c (mbar_k - m_c[k])^2 = (1/(jK)) sum_c sum_k m_c[k]^2
    - mean_k mbar_k^2 (Eq. 8, from running sums); mse = mean_k (y_k - q_k)^2 with the prediction
    q = softmax(ubar) for ``paper`` (Eq. 14) and q = pbar for ``ensemble``."""
    j = pl.col("j").cast(pl.Float64)
    first, second = (_S, _Q) if estimator == "paper" else (_P, _P2)
    frame = frame.with_columns(
        (pl.col(f"{first}{k}") / j).alias(f"_mean{k}") for k in range(k_opts)
    )
    mean = [pl.col(f"_mean{k}") for k in range(k_opts)]
    if estimator == "paper":
        frame = with_softmax(frame, mean, "_q")
    q = [pl.col(f"_q{k}") for k in range(k_opts)] if estimator == "paper" else mean
    return frame.with_columns(
        (pl.sum_horizontal([(_y(k) - x) ** 2 for k, x in enumerate(q)]) / k_opts).alias("mse"),
        (pl.col(second) / (j * k_opts) - pl.sum_horizontal([m * m for m in mean]) / k_opts).alias(
            "diversity"
        ),
    )


def junction_scores(sums: pl.DataFrame, k_opts: int) -> pl.LazyFrame:
    """Per (estimator, instance, junction j): pred, correct, mse, bias, diversity.

    pred_j = argmax_k sum_{c<=j} u_c[k] (methods §3; a_j > 0 cannot change it);
    bias = mean_k (1/j) sum_c (y_k - p_c[k])^2 (Eq. 14)."""
    j = pl.col("j").cast(pl.Float64)
    base = sums.lazy().with_columns(
        argmax([pl.col(f"{_S}{k}") for k in range(k_opts)]).alias("pred"),
        (pl.col(_B) / (j * k_opts)).alias("bias"),
    )
    columns = ["estimator", "instance", "gold", "j", "pred", "correct", "mse", "bias", "diversity"]
    return pl.concat(
        [
            _with_estimator_scores(base, est, k_opts)
            .with_columns(
                pl.lit(est).alias("estimator"), (pl.col("pred") == pl.col("gold")).alias("correct")
            )
            .select(columns)
            for est in ESTIMATORS
        ]
    )


def module_terms(terms: pl.DataFrame, sums: pl.DataFrame, k_opts: int, n_comp: int) -> pl.DataFrame:
    """Full-stack per-component bias and diversity terms by kind (paper Eqs. 9-10).

    Per (estimator, kind X): n = |X|, and the sums over instances i and components c in X of
    b_c = mean_k (y_k - p_c[k])^2 and d_c = mean_k (mbar_k - m_c[k])^2 (members m as in
    :func:`_with_estimator_scores`, mbar over all L components, final scale frozen)."""
    totals = sums.filter(pl.col("j") == n_comp).drop("instance", "gold", "j")[terms["pos"]]
    joined = terms.hstack(totals.select(pl.all().name.prefix("total_"))).lazy()
    frames = []
    for est in ESTIMATORS:
        m = _S if est == "paper" else _P
        mbar = [pl.col(f"total_{m}{k}") / n_comp for k in range(k_opts)]
        d = pl.sum_horizontal([(mbar[k] - pl.col(f"{m}{k}")) ** 2 for k in range(k_opts)])
        frames.append(
            joined.group_by("kind").agg(
                pl.lit(est).alias("estimator"),
                pl.col("component").n_unique().cast(pl.Int64).alias("n_components"),
                (pl.col(_B) / k_opts).sum().alias("bias_sum"),
                (d / k_opts).sum().alias("diversity_sum"),
            )
        )
    return pl.concat(frames).collect()


@dataclass
class PartitionScores:
    """What the analysis keeps of one partition (computed in one pass over its rows)."""

    curves: pl.DataFrame
    """Per (estimator, j): accuracy, mse, bias, diversity averaged over instances."""
    instances: pl.DataFrame
    """Per (estimator, instance), full stack (j = L): gold, pred, correct, mse, bias, diversity."""
    modules: pl.DataFrame
    """Per (estimator, kind): n_components, bias_sum, diversity_sum (sums over instances)."""
    prefix_preds: pl.DataFrame
    """Per (j, pred, gold): number of instances whose prefix j predicts ``pred``."""
    component_preds: pl.DataFrame
    """Per (component, pred, gold): number of instances whose u_c alone predicts ``pred``."""
    junctions: pl.DataFrame
    """Per (estimator, instance, j): correct and the metrics before the average over instances
    (what the verdicts' bootstrap over instances resamples)."""


def load_wide(info: PartitionInfo, scale: Scale = "final") -> pl.DataFrame:
    """The partition's components as one row per (instance, component), sorted, with columns
    instance, component, kind, pos (the instance's position 0..N-1), gold, final_rms,
    u0..u{K-1} (float64) and, for the prefix scale, prefix_rms (rows checked by
    :meth:`PartitionInfo.read`)."""
    manifest = info.manifest
    k_opts, n_comp = len(manifest.options), len(manifest.components)
    extra = ["prefix_rms"] if scale == "prefix" else []
    rows, instances = info.read(["logit", *extra], ["gold", "final_rms"])
    kinds = pl.Series([c.kind for c in manifest.components], dtype=pl.String)
    wide = rows.select(
        pl.col("instance").gather_every(k_opts),
        pl.col("component").gather_every(k_opts),
        *(
            pl.col("logit").gather_every(k_opts, offset=k).cast(pl.Float64).alias(f"u{k}")
            for k in range(k_opts)
        ),
        *(pl.col(c).gather_every(k_opts) for c in extra),
    ).with_columns(
        pl.lit(kinds).gather(pl.col("component")).alias("kind"),
        (pl.int_range(pl.len()) // n_comp).alias("pos"),
    )
    return wide.hstack(instances.select("gold", "final_rms")[wide["pos"]])


@dataclass
class _Prefixes:
    wide: pl.DataFrame
    terms: pl.DataFrame
    """Member terms per (instance, component)."""
    frozen: pl.DataFrame
    """Running sums with the final scale frozen (scale ``final``)."""
    sums: pl.DataFrame
    """Prefix sums of the requested scale."""


def _prefixes(info: PartitionInfo, scale: Scale) -> _Prefixes:
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}: use one of {', '.join(SCALES)}")
    k_opts, n_comp = len(info.manifest.options), len(info.manifest.components)
    wide = load_wide(info, scale)
    terms = with_member_terms(wide.lazy(), k_opts).collect()
    frozen = _prefix_sums_final(terms, k_opts)
    sums = frozen if scale == "final" else _prefix_sums_scaled(wide, k_opts, n_comp)
    return _Prefixes(wide, terms, frozen, sums)


def instance_curves(info: PartitionInfo, scale: Scale = "final") -> pl.DataFrame:
    """Per (estimator, instance, junction j) of one partition: gold, pred, correct, mse, bias,
    diversity (methods §3 before the average over instances)."""
    return junction_scores(_prefixes(info, scale).sums, len(info.manifest.options)).collect()


def partition_scores(info: PartitionInfo, scale: Scale = "final") -> PartitionScores:
    """Methods §2-3 (and the counts §6 needs) for one partition."""
    k_opts, n_comp = len(info.manifest.options), len(info.manifest.components)
    pre = _prefixes(info, scale)
    junctions = junction_scores(pre.sums, k_opts)
    curves, instances, prefix_preds, component_preds, rows = pl.collect_all(
        [
            junctions.group_by("estimator", "j").agg(
                pl.col("correct").mean().alias("accuracy"),
                pl.col("mse", "bias", "diversity").mean(),
            ),
            junctions.filter(pl.col("j") == n_comp).drop("j"),
            junctions.filter(pl.col("estimator") == ESTIMATORS[0])
            .group_by("j", "pred", "gold")
            .agg(pl.len().alias("count")),
            pre.wide.lazy()
            .select("component", "gold", argmax([_u(k) for k in range(k_opts)]).alias("pred"))
            .group_by("component", "pred", "gold")
            .agg(pl.len().alias("count")),
            junctions.drop("gold", "pred").sort("estimator", "instance", "j"),
        ]
    )
    return PartitionScores(
        curves=curves.sort("estimator", "j"),
        instances=instances.sort("estimator", "instance"),
        modules=module_terms(pre.terms, pre.frozen, k_opts, n_comp),
        prefix_preds=prefix_preds,
        component_preds=component_preds,
        junctions=rows,
    )
