"""The verdict per paper finding (``layerdiv.analyze.markdown.verdict``) and every report section's
use of it: each verdict flips with the numbers it is computed from, and says "too few to tell"
below its minimum n."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from layerdiv.analyze.markdown import verdict
from layerdiv.analyze.registry import ReportContext


def outcome(line: str) -> str:
    """The outcome of each verdict line of ``line``, in order."""
    return ",".join(
        part.split(".**")[0] for part in line.split("**Verdict: ")[1:]
    )  # "agrees", "does not agree", "cannot tell", "too few to tell"


@pytest.mark.parametrize(
    ("value", "interval", "n", "above", "want"),
    [
        (0.8, (0.6, 0.9), 10, True, "agrees"),
        (0.2, (0.1, 0.4), 10, True, "does not agree"),
        (0.5, (0.3, 0.7), 10, True, "cannot tell"),
        (0.8, (0.6, 0.9), 2, True, "too few to tell"),
        (0.2, (0.1, 0.4), 10, False, "agrees"),
        (0.8, (0.6, 0.9), 10, False, "does not agree"),
        (0.8, None, 10, True, "agrees"),
        (0.8, (None, None), 10, True, "cannot tell"),
        (float("nan"), None, 10, True, "cannot tell"),
    ],
)
def test_verdict_outcomes(
    value: float, interval: tuple[float, float] | None, n: int, above: bool, want: str
) -> None:
    line = verdict("x holds", "stat", value, interval, n, 0.45, min_n=3, unit="things", above=above)
    assert outcome(line) == want, line
    count = f"(n = {n} things" + ("; at least 3 needed)" if n < 3 else ")")
    assert "x holds" in line and count in line, line
    if interval is not None and interval[0] is not None:
        assert f"[{interval[0]:.2f}, {interval[1]:.2f}]" in line


def ctx(tables: dict[str, pl.DataFrame]) -> ReportContext:
    return ReportContext(tables=tables, estimator="paper", names={}, figures=Path("."))


def test_paper_verdicts_flip() -> None:
    from layerdiv.analyze.analyses.paper import correlation_verdicts, submodularity_verdicts

    def corr(rs: list[float]) -> pl.DataFrame:
        return pl.DataFrame(
            {"model": "m", "revision": "main", "task": [f"t{i}" for i in range(len(rs))],
             "estimator": "paper", "metric": "diversity", "method": "spearman", "r": rs}
        )  # fmt: skip

    none = pl.DataFrame()  # no manifests' subset_of: every task is independent
    high = corr([0.8, 0.7, 0.9])
    assert outcome(correlation_verdicts(ctx({"correlations": high, "manifests": none}))) == (
        "agrees"
    )
    low = corr([-0.8, -0.7, -0.9])
    assert outcome(correlation_verdicts(ctx({"correlations": low, "manifests": none}))) == (
        "does not agree"
    )
    two = corr([0.8, 0.7])
    assert outcome(correlation_verdicts(ctx({"correlations": two, "manifests": none}))) == (
        "too few to tell"
    )
    subset = pl.DataFrame({"model": ["m"] * 3, "revision": "main", "task": ["t0", "t1", "t2"],
                           "subset_of": [None, None, ["t0"]]})  # fmt: skip
    assert outcome(correlation_verdicts(ctx({"correlations": high, "manifests": subset}))) == (
        "too few to tell"  # t2 is t0's subset: two tasks left
    )

    def gains(difference: np.ndarray, tasks: int = 1) -> dict[str, pl.DataFrame]:
        """Per instance (of each task), its mean gain per component, 1st − 2nd half."""
        n = len(difference)
        frame = pl.DataFrame({"model": "m", "revision": "main", "estimator": "paper",
                              "task": np.repeat([f"t{i}" for i in range(tasks)], n),
                              "instance": np.tile(np.arange(n), tasks),
                              "gain_difference": np.tile(difference, tasks)})  # fmt: skip
        curves = pl.DataFrame({"model": ["m"], "revision": "main", "estimator": "paper", "j": 1})
        return {"gain_halves": frame, "depth_curves": curves, "manifests": none}

    falling = np.array([4.0, 5.5, 3.0, 6.0, 4.5, 5.0, 3.5, 4.0])
    line = submodularity_verdicts(ctx(gains(falling)))
    assert outcome(line) == "agrees" and "n = 8 instances" in line, line
    assert "n = 16 instances" in submodularity_verdicts(ctx(gains(falling, tasks=2)))
    assert outcome(submodularity_verdicts(ctx(gains(-falling)))) == "does not agree"
    spread = falling * np.array([1, -1] * 4)
    assert outcome(submodularity_verdicts(ctx(gains(spread)))) == "cannot tell"
    # four instances are too few, however many junction points each curve has
    assert outcome(submodularity_verdicts(ctx(gains(falling[:4])))) == "too few to tell"


def test_depth_verdicts_flip() -> None:
    from layerdiv.analyze.analyses.depth import decay_verdict, decay_verdicts
    from layerdiv.measurements.skips.analysis import skip_verdicts

    fit = {"n_fitted": 30, "beta": 0.9, "beta_se": 0.05, "r2": 0.9, "beta_low": 0.7,
           "beta_high": 1.1, "n_units": 8}  # fmt: skip
    line = decay_verdict("f", fit, "documents")
    assert outcome(line) == "agrees" and "n = 8 documents" in line and "30 blocks fitted" in line
    poor = {**fit, "beta": 0.22, "r2": 0.2, "beta_low": 0.03, "beta_high": 0.41}
    assert outcome(decay_verdict("f", poor, "documents")) == "does not agree"
    assert "(power law R² 0.20, a poor fit; 30 blocks fitted)" in decay_verdict("f", poor, "x")
    wide = {**fit, "beta": 0.5, "beta_low": 0.2, "beta_high": 0.8}
    assert outcome(decay_verdict("f", wide, "documents")) == "cannot tell"
    assert outcome(decay_verdict("f", {**fit, "n_fitted": 4}, "documents")) == "too few to tell"
    few = {**fit, "n_units": 4, "beta_low": None, "beta_high": None}  # 30 blocks, 4 documents
    assert outcome(decay_verdict("f", few, "documents")) == "too few to tell"

    depth = np.arange(13) / 12
    key = {"model": "m", "revision": "main", "task": "t"}

    def geometry(difference: np.ndarray) -> dict[str, pl.DataFrame]:
        """Per instance, its mean relative contribution, 1st half without block 0 − 2nd."""
        frame = pl.DataFrame({**key, "relative_depth": depth})
        halves = pl.DataFrame({**key, "instance": np.arange(len(difference)),
                               "rel_difference": difference})  # fmt: skip
        return {"geometry": frame, "geometry_halves": halves, "manifests": pl.DataFrame(),
                "depth_decay": pl.DataFrame({**key, **fit}, strict=False)}  # fmt: skip

    difference = np.array([0.4, 0.5, 0.3, 0.6, 0.45, 0.5, 0.35, 0.4])
    line = decay_verdicts(geometry(difference), {})
    assert outcome(line) == "agrees,agrees" and "n = 8 instances" in line, line
    assert outcome(decay_verdicts(geometry(-difference), {})) == "agrees,does not agree"
    assert outcome(decay_verdicts(geometry(difference[:4]), {})) == "agrees,too few to tell"

    def skips(difference: np.ndarray) -> dict[str, pl.DataFrame]:
        """Per instance, its KL of the first half's skips minus the second's."""
        rows = {"instance": np.arange(len(difference)), "kl_difference": difference}
        return {"skip_halves": pl.DataFrame({**key, **rows}), "manifests": pl.DataFrame()}

    # the verdict's unit is the instance: 8 of them, 8 blocks each would not count
    difference = np.array([1.2, 1.5, 0.9, 1.6, 1.1, 1.3, 1.0, 1.4])
    line = skip_verdicts(skips(difference), {})
    assert outcome(line) == "agrees" and "n = 8 instances" in line, line
    assert outcome(skip_verdicts(skips(-difference), {})) == "does not agree"
    spread = np.array([1.2, -1.5, 0.9, -1.6, 1.1, -1.3, 1.0, -1.4])
    assert outcome(skip_verdicts(skips(spread), {})) == "cannot tell"
    assert outcome(skip_verdicts(skips(difference[:4]), {})) == "too few to tell"


def test_law_heads_and_maps_verdicts_flip() -> None:
    from layerdiv.analyze.analyses.depth_law import MIN_POINTS, law_verdict
    from layerdiv.analyze.analyses.maps import MIN_LAYERS, PAIR, maps_verdict, spearman
    from layerdiv.measurements.heads.report import beat_verdicts

    def law(low: float, high: float) -> pl.DataFrame:
        return pl.DataFrame({"parameter": ["alpha_depth"], "estimate": [(low + high) / 2],
                             "ci_low": [low], "ci_high": [high]})  # fmt: skip

    assert outcome(law_verdict(law(0.8, 1.2), MIN_POINTS)) == "agrees"
    assert outcome(law_verdict(law(0.1, 0.3), MIN_POINTS)) == "does not agree"
    assert outcome(law_verdict(law(0.8, 1.2), MIN_POINTS - 1)) == "too few to tell"

    def summary(head: float, n: int = 300) -> pl.DataFrame:
        return pl.DataFrame({"model": "m", "revision": "main", "task": "t", "n_instances": n,
                             "n_heads": 9, "calibrated_accuracy": 0.8,
                             "best_head_calibrated_accuracy": head})  # fmt: skip

    assert outcome(beat_verdicts(summary(0.95), {})) == "agrees"
    assert outcome(beat_verdicts(summary(0.6), {})) == "does not agree"
    assert outcome(beat_verdicts(summary(0.81), {})) == "cannot tell"
    assert outcome(beat_verdicts(summary(0.95, n=20), {})) == "too few to tell"

    def best(target: Sequence[float | None], gated: bool = True) -> pl.DataFrame:
        n = len(target)
        return pl.DataFrame(
            {**{c: "x" for c in PAIR}, "space": "states", "source_layer": range(n),
             "target_layer": [None if t is None else 1 for t in target],
             "clears_gate": [t is not None and gated for t in target],
             "source_depth": np.arange(1, n + 1) / n, "target_depth": target}
        )  # fmt: skip

    def over_documents(low: float, high: float) -> pl.DataFrame:  # the interval over 30 documents
        return pl.DataFrame({**{c: "x" for c in PAIR}, "space": "states", "units": "documents",
                             "low": low, "high": high, "n_units": 30, "gate_changed": 0.0,
                             "defined": 1.0})  # fmt: skip

    rising = [i / 12 for i in range(1, 13)]
    row = spearman(best(rising), over_documents(0.9, 1.0)).row(0, named=True)
    assert row["spearman"] == pytest.approx(1.0) and row["n_units"] == 30
    assert row["n"] == row["n_best"] == row["n_sources"] == 12
    assert row["p_value"] < 0.001 and outcome(maps_verdict(row)) == "agrees"
    row = spearman(best(rising), over_documents(0.3, 1.0)).row(0, named=True)
    assert outcome(maps_verdict(row)) == "cannot tell"  # the documents' interval spans 0.5
    row = spearman(best(rising[::-1]), over_documents(-1.0, -0.9)).row(0, named=True)
    assert row["p_value"] > 0.99
    assert outcome(maps_verdict(row)) == "cannot tell"  # no better than permuted targets
    sparse = spearman(best([*rising[: MIN_LAYERS - 1], *[None] * 8]), over_documents(0.9, 1.0))
    assert sparse["spearman"][0] is None and sparse["n"][0] == MIN_LAYERS - 1
    assert "**No verdict:**" in maps_verdict(sparse.row(0, named=True))
    below = spearman(best(rising, gated=False), over_documents(0.9, 1.0)).row(0, named=True)
    assert below["n"] == 0 and below["n_best"] == 12 and "**No verdict:**" in maps_verdict(below)


def test_overlapping_tasks_get_one_verdict() -> None:
    from layerdiv.measurements.skips.analysis import skip_verdicts

    rng = np.random.default_rng(0)
    frames = [
        pl.DataFrame({"model": "m", "revision": "main", "task": task,
                      "instance": np.arange(n), "kl_difference": 1.0 + rng.random(n)})
        for task, n in (("tweets", 8), ("tweets-erase", 6), ("tweets-skips", 8))
    ]  # fmt: skip
    manifests = pl.DataFrame(
        {"model": "m", "revision": "main", "task": ["tweets", "tweets-erase", "tweets-skips"],
         "kind": "choice", "subset_of": [None, ["tweets"], ["tweets"]]}
    )  # fmt: skip
    line = skip_verdicts({"skip_halves": pl.concat(frames), "manifests": manifests}, {})
    assert outcome(line) == "agrees" and "m, tweets:" in line, line
    assert "m, tweets-erase:" not in line and "m, tweets-skips:" not in line
    assert "No verdict of its own for tweets-erase (its instances are all in tweets)" in line
    assert "tweets-skips (its instances are all in tweets)" in line


def test_power_law_interval_resamples_units_not_depths() -> None:
    from layerdiv.analyze.stats import MIN_INTERVAL_N, resample_weights, resampled_power_law

    rng = np.random.default_rng(3)
    depth = np.arange(1, 31, dtype=float)
    units = depth**-0.9 * np.exp(rng.normal(0, 0.3, (8, 30)))  # 8 documents, 30 blocks
    (low, high), n = resampled_power_law(depth, units)
    assert n == 8
    # by hand: each resample of the 8 rows, its mean profile refitted on log-log axes
    betas = [-np.polyfit(np.log(depth), np.log(w @ units / 8), 1)[0] for w in resample_weights(8)]
    assert low == pytest.approx(np.percentile(betas, 2.5), rel=1e-9)
    assert high == pytest.approx(np.percentile(betas, 97.5), rel=1e-9)
    assert low is not None and high is not None and low < 0.9 < high
    # token-weighted: a document's sums over its tokens, each resample's total over its count
    counts = rng.integers(1, 20, (8, 30)).astype(float)
    (wlow, whigh), _ = resampled_power_law(depth, units * counts, counts)
    wbetas = [-np.polyfit(np.log(depth), np.log(w @ (units * counts) / (w @ counts)), 1)[0]
              for w in resample_weights(8)]  # fmt: skip
    assert (wlow, whigh) == pytest.approx(tuple(np.percentile(wbetas, [2.5, 97.5])), rel=1e-9)
    # 30 blocks are no substitute for documents: 4 give no interval
    assert resampled_power_law(depth, units[: MIN_INTERVAL_N - 1]) == ((None, None), 4)


def test_correlation_stars_and_gain_halves_resample_instances() -> None:
    from layerdiv.analyze.metrics import CORRELATED
    from layerdiv.analyze.stats import correlation_intervals, gain_halves

    rng = np.random.default_rng(5)
    n, junctions = 40, 12
    j = np.arange(1, junctions + 1)
    # accuracy rises with j and so does each metric's signed value: a real relation
    p = np.clip(0.2 + 0.6 * j / junctions, 0, 1)
    correct = rng.random((n, junctions)) < p
    rows = {"estimator": "paper", "instance": np.repeat(np.arange(n), junctions),
            "j": np.tile(j, n), "correct": correct.reshape(-1)}  # fmt: skip
    for m in CORRELATED:
        rows[m.name] = (m.sign * np.tile(j, n) + rng.normal(0, 0.5, n * junctions)).astype(float)
    frame = pl.DataFrame(rows)
    got = correlation_intervals(frame)
    assert set(got["n_units"]) == {n}
    spearman = got.filter(pl.col("method") == "spearman")
    assert (spearman["low"] > 0).all(), spearman
    # four instances: no interval, so no star, however many junction points the curves have
    few = correlation_intervals(frame.filter(pl.col("instance") < 4))
    assert few["low"].null_count() == few.height and set(few["n_units"]) == {4}

    halves = gain_halves(frame)
    h = junctions // 2
    acc = correct.mean(0) * 100
    gains = np.diff(acc)  # gains of j = 2..L: first half j <= h
    want = gains[: h - 1].mean() - gains[h - 1 :].mean()
    assert halves["gain_difference"].mean() == pytest.approx(want, rel=1e-9)
    assert halves.height == n
