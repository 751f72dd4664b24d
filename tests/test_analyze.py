"""Golden and property tests of the analysis stage (methods §2-6).

The store is built by hand from numpy arrays; every expected number is recomputed here with plain
numpy loops over the definitions, independently of the Polars expressions under test.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import optimize
from scipy import stats as sps

from layerdiv.analyze import analyze, instance_curves
from layerdiv.analyze.stats import inverse_depth
from layerdiv.analyze.synthetic import decoder_kinds, write_partition
from layerdiv.store import Store, StoreError


def close(got: Any, want: Any) -> None:
    """Golden comparison: the analysis equals the independent reference to rounding."""
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


# --- the hand-built store ------------------------------------------------------------------


@dataclass
class Part:
    model: str
    task: str
    logits: np.ndarray  # (N, L, K) float32, as stored
    gold: np.ndarray
    kinds: list[str]
    prefix_rms: np.ndarray  # (N, L) float32
    final_rms: np.ndarray  # (N,) float32
    n_params: int

    def write(self, root: Path, **options: Any) -> None:
        """Store this partition under ``root`` (``synthetic.write_partition`` options)."""
        write_partition(
            root,
            self.model,
            self.task,
            self.logits,
            self.gold,
            self.kinds,
            self.prefix_rms,
            self.final_rms,
            n_params=self.n_params,
            **options,
        )


def make_part(
    rng: np.random.Generator, model: str, task: str, n: int, kinds: list[str], k: int, n_params: int
) -> Part:
    n_comp = len(kinds)
    logits = rng.normal(0.0, 1.5, (n, n_comp, k)).astype(np.float32)
    gold = rng.integers(0, k, n)
    logits[np.arange(n), :, gold] += np.linspace(0.0, 1.0, n_comp, dtype=np.float32)
    prefix_rms = rng.uniform(0.5, 2.0, (n, n_comp)).astype(np.float32)
    final_rms = prefix_rms[:, -1].copy()
    return Part(model, task, logits, gold, kinds, prefix_rms, final_rms, n_params)


@pytest.fixture(scope="module")
def parts() -> list[Part]:
    rng = np.random.default_rng(7)
    alpha, beta = decoder_kinds(3), decoder_kinds(2, bias=True)
    return [
        make_part(rng, "org/alpha", "two", 11, alpha, 2, 2_000_000_000),
        make_part(rng, "org/alpha", "three", 9, alpha, 3, 2_000_000_000),
        make_part(rng, "org/beta", "two", 11, beta, 2, 500_000_000),
        make_part(rng, "org/beta", "three", 9, beta, 3, 500_000_000),
    ]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, parts: list[Part]) -> Path:
    root = tmp_path_factory.mktemp("store")
    shuffle = np.random.default_rng(3)
    for p in parts:
        p.write(root, chunk=4, shuffle=shuffle)
    return root


@pytest.fixture(scope="module", params=["final", "prefix"])
def scale(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def results(store: Path, scale: str):
    return analyze(store, scale=scale)  # type: ignore[arg-type]


# --- the reference: plain loops over the methods page---------------------------------------


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_junction(p: Part, i: int, j: int, scale: str) -> dict[str, float]:
    """Scores of instance i on its first j components (methods §2-3)."""
    k = p.logits.shape[2]
    a = float(p.final_rms[i]) / float(p.prefix_rms[i, j - 1]) if scale == "prefix" else 1.0
    u = [a * p.logits[i, c].astype(np.float64) for c in range(j)]
    y = np.eye(k)[p.gold[i]]
    probs = [softmax(uc) for uc in u]
    ubar, pbar = sum(u) / j, sum(probs) / j
    bias = sum(np.mean((y - pc) ** 2) for pc in probs) / j
    return {
        "correct": float(np.argmax(sum(u)) == p.gold[i]),
        "pred": float(np.argmax(sum(u))),
        "bias": bias,
        "paper_mse": float(np.mean((y - softmax(ubar)) ** 2)),
        "paper_diversity": sum(np.mean((ubar - uc) ** 2) for uc in u) / j,
        "ensemble_mse": float(np.mean((y - pbar) ** 2)),
        "ensemble_diversity": sum(np.mean((pc - pbar) ** 2) for pc in probs) / j,
    }


def reference_curves(p: Part, scale: str) -> dict[str, np.ndarray]:
    """Per metric (estimator_metric or accuracy/bias), the curve over j = 1..L (mean over i)."""
    n, n_comp, _ = p.logits.shape
    rows = [[reference_junction(p, i, j, scale) for i in range(n)] for j in range(1, n_comp + 1)]
    keys = rows[0][0].keys()
    out = {key: np.array([np.mean([r[key] for r in row]) for row in rows]) for key in keys}
    out["accuracy"] = out.pop("correct")
    return out


def slug(model: str) -> str:
    return model.replace("/", "--")


def curve(results, p: Part, estimator: str, metric: str) -> np.ndarray:
    frame = results.curves.filter(
        (pl.col("model") == slug(p.model))
        & (pl.col("task") == p.task)
        & (pl.col("estimator") == estimator)
    ).sort("j")
    return frame[metric].to_numpy()


# --- methods §2 and §3 ----------------------------------------------------------------------


def test_junction_curves_match_reference(results, parts: list[Part], scale: str) -> None:
    for p in parts:
        ref = reference_curves(p, scale)
        for est in ("paper", "ensemble"):
            close(curve(results, p, est, "accuracy"), ref["accuracy"])
            close(curve(results, p, est, "bias"), ref["bias"])
            for metric in ("mse", "diversity"):
                close(curve(results, p, est, metric), ref[f"{est}_{metric}"])
        names = results.curves.filter(
            (pl.col("model") == slug(p.model))
            & (pl.col("task") == p.task)
            & (pl.col("estimator") == "paper")
        ).sort("j")
        assert names["kind"].to_list() == p.kinds
        n_comp = len(p.kinds)
        close(names["relative_depth"], np.arange(1, n_comp + 1) / n_comp)


def test_prefix_scale_changes_mse_not_accuracy(store: Path, parts: list[Part]) -> None:
    final, prefix = analyze(store, scale="final").curves, analyze(store, scale="prefix").curves
    assert final["accuracy"].to_list() == prefix["accuracy"].to_list()
    assert not np.allclose(final["mse"].to_numpy(), prefix["mse"].to_numpy())
    # At j = L the prefix is the whole residual: a_L = final_rms / prefix_rms_L = 1.
    full = [pl.col("j") == pl.col("j").max().over("model", "task")]
    close(final.filter(*full)["mse"].to_numpy(), prefix.filter(*full)["mse"].to_numpy())


def test_instance_scores_match_reference(results, parts: list[Part], scale: str) -> None:
    for p in parts:
        n, n_comp, _ = p.logits.shape
        for est in ("paper", "ensemble"):
            got = results.instance_scores.filter(
                (pl.col("model") == slug(p.model))
                & (pl.col("task") == p.task)
                & (pl.col("estimator") == est)
            ).sort("instance")
            assert got["instance"].to_list() == list(range(n))
            ref = [reference_junction(p, i, n_comp, scale) for i in range(n)]
            assert got["gold"].to_list() == p.gold.tolist()
            assert got["pred"].to_list() == [int(r["pred"]) for r in ref]
            close(got["mse"], [r[f"{est}_mse"] for r in ref])
            close(got["bias"], [r["bias"] for r in ref])
            close(got["diversity"], [r[f"{est}_diversity"] for r in ref])


def test_scores_table(results, parts: list[Part], scale: str) -> None:
    for p in parts:
        n, n_comp, k = p.logits.shape
        ref = [reference_junction(p, i, n_comp, scale) for i in range(n)]
        counts = np.bincount(p.gold, minlength=k)
        for est in ("paper", "ensemble"):
            row = results.scores.filter(
                (pl.col("model") == slug(p.model))
                & (pl.col("task") == p.task)
                & (pl.col("estimator") == est)
            ).row(0, named=True)
            assert (row["n_instances"], row["n_components"], row["n_options"]) == (n, n_comp, k)
            assert row["accuracy"] == pytest.approx(np.mean([r["correct"] for r in ref]))
            assert row["mse"] == pytest.approx(np.mean([r[f"{est}_mse"] for r in ref]), rel=1e-9)
            assert row["majority_accuracy"] == pytest.approx(counts.max() / n)
            assert row["majority_option"] == int(np.argmax(counts))


def test_paper_estimator_is_not_an_identity(results) -> None:
    """methods §2: mse = bias - diversity does not hold for the paper's three numbers."""
    paper = results.instance_scores.filter(pl.col("estimator") == "paper")
    gap = (paper["bias"] - paper["diversity"] - paper["mse"]).abs()
    assert gap.max() > 1e-3


def test_module_split_matches_reference(results, parts: list[Part]) -> None:
    for p in parts:
        n, n_comp, k = p.logits.shape
        for est in ("paper", "ensemble"):
            got = {
                r["kind"]: r
                for r in results.modules.filter(
                    (pl.col("model") == slug(p.model))
                    & (pl.col("task") == p.task)
                    & (pl.col("estimator") == est)
                ).iter_rows(named=True)
            }
            assert set(got) == set(p.kinds)
            terms: dict[str, list[tuple[float, float]]] = {kind: [] for kind in set(p.kinds)}
            for i in range(n):
                y = np.eye(k)[p.gold[i]]
                u = p.logits[i].astype(np.float64)
                probs = np.array([softmax(uc) for uc in u])
                members = u if est == "paper" else probs
                mean = members.mean(axis=0)
                for c, kind in enumerate(p.kinds):
                    terms[kind].append(
                        (np.mean((y - probs[c]) ** 2), np.mean((mean - members[c]) ** 2))
                    )
            total_bias = sum(b for v in terms.values() for b, _ in v)
            total_div = sum(d for v in terms.values() for _, d in v)
            for kind, values in terms.items():
                row = got[kind]
                assert row["n_components"] == p.kinds.count(kind)
                assert row["bias"] == pytest.approx(np.mean([b for b, _ in values]), rel=1e-9)
                assert row["diversity"] == pytest.approx(np.mean([d for _, d in values]), rel=1e-9)
                assert row["bias_share"] == pytest.approx(sum(b for b, _ in values) / total_bias)
                assert row["diversity_share"] == pytest.approx(
                    sum(d for _, d in values) / total_div
                )
            # Eq. 9: bias = sum_X |X| bias_X / L, against the full-stack score.
            full = results.scores.filter(
                (pl.col("model") == slug(p.model))
                & (pl.col("task") == p.task)
                & (pl.col("estimator") == est)
            ).row(0, named=True)
            weighted = sum(r["n_components"] * r["bias"] for r in got.values()) / n_comp
            assert weighted == pytest.approx(full["bias"], rel=1e-9)
            weighted = sum(r["n_components"] * r["diversity"] for r in got.values()) / n_comp
            assert weighted == pytest.approx(full["diversity"], rel=1e-9)


# --- methods §4 -----------------------------------------------------------------------------


SIGNS = {"mse": -1.0, "bias": -1.0, "diversity": 1.0}


def reference_correlations(
    p: Part, scale: str, est: str
) -> dict[tuple[str, str], tuple[float, float]]:
    ref = reference_curves(p, scale)
    out = {}
    for metric, sign in SIGNS.items():
        values = sign * (ref["bias"] if metric == "bias" else ref[f"{est}_{metric}"])
        for method, fn in (("pearson", sps.pearsonr), ("spearman", sps.spearmanr)):
            res = fn(ref["accuracy"], values)
            out[(metric, method)] = (float(res[0]), float(res[1]))
    return out


def test_correlations_match_scipy(results, parts: list[Part], scale: str) -> None:
    for p in parts:
        for est in ("paper", "ensemble"):
            got = results.correlations.filter(
                (pl.col("model") == slug(p.model))
                & (pl.col("task") == p.task)
                & (pl.col("estimator") == est)
            )
            assert got.height == 6
            for metric, method, r, pval, sig, n, low, high, units in got.select(
                "metric", "method", "r", "p", "significant", "n_points", "low", "high", "n_units"
            ).iter_rows():
                ref_r, ref_p = reference_correlations(p, scale, est)[(metric, method)]
                assert n == p.logits.shape[1]
                assert r == pytest.approx(ref_r, rel=1e-9, abs=1e-12)
                assert pval == pytest.approx(ref_p, rel=1e-6, abs=1e-12)
                # the star is the test over instances (resampled), not over junction points
                assert units == p.logits.shape[0]
                assert sig == (low is not None and (low > 0 or high < 0))


def test_fisher_z_means(results) -> None:
    corr, means = results.correlations, results.correlation_means
    key = (
        (pl.col("estimator") == "ensemble")
        & (pl.col("metric") == "mse")
        & (pl.col("method") == "spearman")
    )
    r = {(m, t): v for m, t, v in corr.filter(key).select("model", "task", "r").iter_rows()}
    z = {mt: math.atanh(min(max(v, -1 + 1e-6), 1 - 1e-6)) for mt, v in r.items()}
    got = {(m, t): v for m, t, v in means.filter(key).select("model", "task", "r").iter_rows()}
    models = {m for m, _ in r}
    tasks = {t for _, t in r}
    for m in models:
        assert got[(m, None)] == pytest.approx(math.tanh(np.mean([z[(m, t)] for t in tasks])))
    task_means = {t: np.mean([z[(m, t)] for m in models]) for t in tasks}
    for t in tasks:
        assert got[(None, t)] == pytest.approx(math.tanh(task_means[t]))
    assert got[(None, None)] == pytest.approx(math.tanh(np.mean(list(task_means.values()))))


# --- methods §5 -----------------------------------------------------------------------------


def test_depth_curves_and_fits(store: Path, parts: list[Part]) -> None:
    res = analyze(store, min_params=1e9)
    assert set(res.depth_curves["model"]) == {"org--alpha"}  # beta has 0.5B parameters
    mine = [p for p in parts if p.model == "org/alpha"]
    ref = [reference_curves(p, "final") for p in mine]
    acc = np.mean([r["accuracy"] for r in ref], axis=0)
    mse = np.mean([r["ensemble_mse"] for r in ref], axis=0)
    got = res.depth_curves.filter(pl.col("estimator") == "ensemble").sort("j")
    close(got["accuracy"], acc)
    close(got["mse"], mse)
    close(got["accuracy_gain"].to_numpy()[1:], np.diff(acc))
    close(got["mse_gain"].to_numpy()[1:], -np.diff(mse))

    fit = res.depth_fits.filter(pl.col("estimator") == "ensemble").row(0, named=True)
    j = np.arange(1, len(acc) + 1, dtype=float)
    lin = sps.linregress(np.log(j), acc)
    assert fit["acc_b"] == pytest.approx(lin.slope)
    assert fit["acc_b_se"] == pytest.approx(lin.stderr)
    assert fit["acc_a"] == pytest.approx(lin.intercept)
    params, cov = optimize.curve_fit(
        inverse_depth, j, mse, p0=[fit["loss_c"], 1.0, mse[-1]], maxfev=50000
    )
    got_rss = np.sum(
        (inverse_depth(j, fit["loss_c"], fit["loss_alpha"], fit["loss_l0"]) - mse) ** 2
    )
    ref_rss = np.sum((inverse_depth(j, *params) - mse) ** 2)
    # curve_fit finds the same optimum: the same estimates and errors.
    assert got_rss == pytest.approx(ref_rss, rel=1e-6)
    assert fit["loss_alpha"] == pytest.approx(params[1], rel=1e-3)
    assert fit["loss_alpha_se"] == pytest.approx(np.sqrt(cov[1, 1]), rel=1e-2)


def test_size_filter_can_leave_no_model(store: Path) -> None:
    res = analyze(store, min_params=1e12)
    assert res.depth_curves.height == res.depth_fits.height == 0
    assert "loss_alpha_se" in res.depth_fits.columns and "acc_b_se" in res.depth_fits.columns


def test_inverse_depth_fit_recovers_parameters() -> None:
    from layerdiv.analyze.stats import depth_fits

    j = np.arange(1, 62)
    rng = np.random.default_rng(0)
    mse = inverse_depth(j.astype(float), 0.3, 0.7, 0.12) + rng.normal(0, 1e-4, len(j))
    frame = pl.DataFrame(
        {
            "model": "m",
            "revision": "main",
            "estimator": "paper",
            "j": j,
            "n_params": 1,
            "accuracy": 0.5 + 0.02 * np.log(j),
            "mse": mse,
        }
    )
    fit = depth_fits(frame).row(0, named=True)
    assert fit["loss_alpha"] == pytest.approx(0.7, abs=5 * fit["loss_alpha_se"])
    assert fit["loss_c"] == pytest.approx(0.3, abs=5 * fit["loss_c_se"])
    assert fit["loss_l0"] == pytest.approx(0.12, abs=5 * fit["loss_l0_se"])
    assert fit["acc_b"] == pytest.approx(0.02)
    assert not fit["loss_at_bound"]
    # A logarithmic MSE curve has no interior inverse-power optimum: the fit says so.
    log_curve = frame.with_columns((0.3 - 0.02 * np.log(pl.col("j"))).alias("mse"))
    assert depth_fits(log_curve).row(0, named=True)["loss_at_bound"]


# --- methods §6 and the demo's summaries ----------------------------------------------------


def plugin_mi(xs: list[int], ys: list[int]) -> float:
    n = len(xs)
    pxy, px, py = Counter(zip(xs, ys, strict=True)), Counter(xs), Counter(ys)
    return sum(c / n * math.log2((c / n) / (px[x] / n * py[y] / n)) for (x, y), c in pxy.items())


def test_information_matches_reference(results, parts: list[Part]) -> None:
    for p in parts:
        n, n_comp, k = p.logits.shape
        ys = p.gold.tolist()
        h = -sum(c / n * math.log2(c / n) for c in Counter(ys).values())
        preds = [
            [int(np.argmax(p.logits[i, :j].sum(0))) for i in range(n)] for j in range(1, n_comp + 1)
        ]
        mi = [plugin_mi(pr, ys) for pr in preds]
        got = results.information_curves.filter(
            (pl.col("model") == slug(p.model)) & (pl.col("task") == p.task)
        ).sort("j")
        np.testing.assert_allclose(got["mutual_info"], mi, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(got["gain"].to_numpy()[1:], np.diff(mi), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(
            got["error_lower"], (h - np.array(mi) - 1) / math.log2(k), rtol=1e-9
        )
        np.testing.assert_allclose(got["error_upper"], (h - np.array(mi)) / 2, rtol=1e-9)
        errors = [np.mean([pr[i] != ys[i] for i in range(n)]) for pr in preds]
        np.testing.assert_allclose(got["error"], errors, rtol=1e-12)

        summary = results.information.filter(
            (pl.col("model") == slug(p.model)) & (pl.col("task") == p.task)
        ).row(0, named=True)
        relevancy = sum(
            plugin_mi([int(np.argmax(p.logits[i, c])) for i in range(n)], ys) for c in range(n_comp)
        )
        assert summary["relevancy"] == pytest.approx(relevancy, rel=1e-9)
        assert summary["entropy_y"] == pytest.approx(h)
        assert summary["mutual_info"] == pytest.approx(mi[-1], abs=1e-12)
        assert summary["n"] == n
        gains = np.diff(mi)  # gain of adding component j, for j = 2..L
        j = np.arange(2, n_comp + 1)
        assert summary["gain_first_half"] == pytest.approx(gains[j <= n_comp / 2].mean())
        assert summary["gain_second_half"] == pytest.approx(gains[j > n_comp / 2].mean())


def test_saturation_depth(results, parts: list[Part]) -> None:
    for p in parts:
        acc = reference_curves(p, "final")["accuracy"]
        expected = next(
            j
            for j in range(1, len(acc) + 1)
            if all(a >= acc[-1] - 0.01 - 1e-12 for a in acc[j - 1 :])
        )
        row = results.saturation.filter(
            (pl.col("model") == slug(p.model)) & (pl.col("task") == p.task)
        ).row(0, named=True)
        assert row["saturation_j"] == expected
        assert row["saturation_fraction"] == pytest.approx(expected / len(acc))


def test_saturation_on_a_known_curve() -> None:
    from layerdiv.analyze.stats import saturation

    acc = [0.30, 0.50, 0.71, 0.60, 0.712, 0.72, 0.715, 0.72]
    frame = pl.DataFrame(
        {
            "model": "m",
            "revision": "main",
            "task": "t",
            "estimator": "paper",
            "j": range(1, 9),
            "accuracy": acc,
        }
    )
    row = saturation(frame).row(0, named=True)
    # 0.71 is within 1 point of 0.72, but 0.60 after it is not: saturation starts at j = 5.
    assert row["saturation_j"] == 5


# --- properties (hypothesis) ---------------------------------------------------------------


@st.composite
def partitions(draw: st.DrawFn) -> Part:
    n = draw(st.integers(1, 6))
    blocks = draw(st.integers(1, 3))
    k = draw(st.integers(2, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([0.01, 1.0, 10.0]))
    rng = np.random.default_rng(seed)
    kinds = decoder_kinds(blocks, bias=draw(st.booleans()))
    p = make_part(rng, "prop/model", "task", n, kinds, k, 1)
    p.logits *= np.float32(scale)
    return p


PROPERTY = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@PROPERTY
@given(part=partitions(), scale=st.sampled_from(["final", "prefix"]))
def test_ensemble_identity_per_instance(
    tmp_path_factory: pytest.TempPathFactory, part: Part, scale: str
) -> None:
    root = tmp_path_factory.mktemp("prop")
    part.write(root)
    info = Store(root).partitions[0]
    rows = instance_curves(info, scale).filter(pl.col("estimator") == "ensemble")  # type: ignore[arg-type]
    assert rows.height == part.logits.shape[0] * part.logits.shape[1]
    gap = (rows["mse"] - (rows["bias"] - rows["diversity"])).abs().max()
    assert gap is not None and gap <= 1e-9  # type: ignore[operator]


@PROPERTY
@given(part=partitions())
def test_shares_sum_to_one(tmp_path_factory: pytest.TempPathFactory, part: Part) -> None:
    root = tmp_path_factory.mktemp("prop")
    part.write(root)
    modules = analyze(root).modules
    sums = modules.group_by("estimator").agg(pl.col("bias_share", "diversity_share").sum())
    for bias_share, diversity_share in sums.select("bias_share", "diversity_share").iter_rows():
        assert bias_share == pytest.approx(1.0, abs=1e-12)
        # A single instance of a single component has no diversity: 0/0, no shares.
        assert math.isnan(diversity_share) or diversity_share == pytest.approx(1.0, abs=1e-12)


# --- refusing data that does not add up ----------------------------------------------------


def test_partition_with_missing_rows_is_refused(tmp_path: Path, parts: list[Part]) -> None:
    p = parts[0]
    write_partition(tmp_path, p.model, p.task, p.logits, p.gold, p.kinds)
    part_file = next((tmp_path / "components").rglob("*.parquet"))
    table = pl.read_parquet(part_file)
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(part_file).slice(0, table.height - 1), part_file)
    with pytest.raises(StoreError, match="rows where the chunk needs"):
        analyze(tmp_path)
