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
    assert "x holds" in line and f"n = {n} things; at least 3 needed" in line
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

    def curves(gains: np.ndarray) -> pl.DataFrame:
        j = np.arange(1, len(gains) + 1)
        return pl.DataFrame({"model": "m", "revision": "main", "estimator": "paper", "j": j,
                             "accuracy_gain": gains})  # fmt: skip

    falling = np.array([0.05, 0.04, 0.05, 0.04, 0.0, 0.001, 0.0, 0.001])
    assert outcome(submodularity_verdicts(ctx({"depth_curves": curves(falling)}))) == "agrees"
    rising = falling[::-1].copy()
    assert outcome(submodularity_verdicts(ctx({"depth_curves": curves(rising)}))) == (
        "does not agree"
    )
    assert outcome(submodularity_verdicts(ctx({"depth_curves": curves(falling[2:6])}))) == (
        "too few to tell"
    )


def test_depth_verdicts_flip() -> None:
    from layerdiv.analyze.analyses.depth import decay_verdict, decay_verdicts
    from layerdiv.measurements.skips.analysis import skip_verdicts

    fit = {"n_fitted": 30, "beta": 0.9, "beta_se": 0.05, "r2": 0.9}
    assert outcome(decay_verdict("f", fit)) == "agrees"
    assert outcome(decay_verdict("f", {**fit, "beta": 0.22, "r2": 0.2})) == "does not agree"
    assert "(power law R² 0.20, a poor fit)" in decay_verdict("f", {**fit, "beta": 0.22, "r2": 0.2})
    assert outcome(decay_verdict("f", {**fit, "beta": 0.5, "beta_se": 0.2})) == "cannot tell"
    assert outcome(decay_verdict("f", {**fit, "n_fitted": 4})) == "too few to tell"

    depth = np.arange(13) / 12
    key = {"model": "m", "revision": "main", "task": "t"}

    def geometry(contribution: np.ndarray) -> dict[str, pl.DataFrame]:
        frame = pl.DataFrame({**key, "relative_depth": depth, "kind": ["embed"] + ["attn"] * 12,
                              "layer": np.arange(13) // 2, "rel_contribution":
                              contribution})  # fmt: skip
        return {"geometry": frame, "depth_decay": pl.DataFrame({**key, **fit}, strict=False)}

    big_first = np.array([0.1, 9.0, 0.5, 0.6, 0.5, 0.55, 0.5, 0.1, 0.12, 0.1, 0.11, 0.1, 0.12])
    assert outcome(decay_verdicts(geometry(big_first), {})) == "agrees,agrees"
    big_second = np.array([0.1, 9.0, 0.1, 0.12, 0.1, 0.11, 0.1, 0.5, 0.6, 0.5, 0.55, 0.5, 0.6])
    assert outcome(decay_verdicts(geometry(big_second), {})) == "agrees,does not agree"

    def skips(difference: np.ndarray) -> dict[str, pl.DataFrame]:
        """Per instance, its KL of the first half's skips minus the second's."""
        rows = {"instance": np.arange(len(difference)), "kl_difference": difference}
        return {"skip_halves": pl.DataFrame({**key, **rows})}

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

    rising = [i / 12 for i in range(1, 13)]
    row = spearman(best(rising)).row(0, named=True)
    assert row["spearman"] == pytest.approx(1.0) and row["low"] > 0.5
    assert row["n"] == row["n_best"] == row["n_sources"] == 12
    assert row["p_value"] < 0.001 and outcome(maps_verdict(row)) == "agrees"
    row = spearman(best(rising[::-1])).row(0, named=True)
    assert row["high"] < 0.5 and row["p_value"] > 0.99
    assert outcome(maps_verdict(row)) == "cannot tell"  # no better than permuted targets
    sparse = spearman(best([*rising[: MIN_LAYERS - 1], *[None] * 8])).row(0, named=True)
    assert sparse["spearman"] is None and sparse["n"] == MIN_LAYERS - 1
    assert "**No verdict:**" in maps_verdict(sparse)
    below = spearman(best(rising, gated=False)).row(0, named=True)  # every R² below the gate
    assert below["n"] == 0 and below["n_best"] == 12 and "**No verdict:**" in maps_verdict(below)
