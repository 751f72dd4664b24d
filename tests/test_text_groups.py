"""Depth scores per document group (methods §10): the paper's aggregation and ours, against a
small example computed by hand, and end to end from an extracted store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from layerdiv.analyze.api import analyze
from layerdiv.analyze.report import write_report
from layerdiv.analyze.stats import bootstrap_mean
from layerdiv.measurements.future.text_groups import (
    MIN_INTERVAL_N,
    bootstrap_slope,
    group_scores,
)
from layerdiv.store import Store
from tests.test_text_extract import extract, random_texts, text_task

# Three blocks; documents 0 and 1 in group "2", documents 2 and 3 in group "3" (document 3 has
# no effect at all: its score is undefined).
REL = np.array(
    [
        [[0, 2, 4], [0, 0, 1], [0, 0, 0]],
        [[0, 1, 6], [0, 0, 3], [0, 0, 0]],
        [[0, 1, 1], [0, 0, 0], [0, 0, 2]],
        [[0, 0, 0], [0, 0, 0], [0, 0, 0]],
    ],
    dtype=float,
)
OUT = np.array([[1, 1, 0], [0, 1, 1], [2, 0, 0], [0, 0, 0]], dtype=float)
GROUPS = np.array(["2", "2", "3", "3"], dtype=object)


def by(rows: list[dict[str, Any]], effect: str, group: str) -> dict[str, Any]:
    (row,) = [r for r in rows if r["effect"] == effect and r["group"] == group]
    return row


def test_group_scores_match_a_hand_computed_example() -> None:
    rows, slopes = group_scores(REL, OUT, GROUPS)
    # e_doc(l) = sum_j rel(l, j) / max(L - 1 - l, 1), denominators 2, 1, 1:
    # doc 0: (3, 1, 0) -> 1/4; doc 1: (3.5, 3, 0) -> 3/6.5; doc 2: (1, 0, 2) -> 4/3
    # paper, group 2: M = ((0,2,6), (0,0,3), (0,0,0)) -> e = (4, 3, 0) -> 3/7
    layer2 = by(rows, "layer", "2")
    assert layer2["paper_score"] == pytest.approx(3 / 7)
    assert layer2["mean_score"] == pytest.approx((1 / 4 + 3 / 6.5) / 2)
    assert (layer2["n_documents"], layer2["n_scored"]) == (2, 2)
    # o: doc 0 -> 1/2, doc 1 -> 3/2, doc 2 -> 0; paper, group 2: o = (1, 1, 1) -> 1
    logit2 = by(rows, "logit", "2")
    assert logit2["paper_score"] == pytest.approx(1.0)
    assert logit2["mean_score"] == pytest.approx(1.0)
    assert logit2["paper_relative"] == pytest.approx(2 / 3)
    # group 3: document 3 is counted but not scored; the paper's maxima are document 2's
    layer3 = by(rows, "layer", "3")
    assert (layer3["n_documents"], layer3["n_scored"]) == (2, 1)
    assert layer3["paper_score"] == pytest.approx(4 / 3) == layer3["mean_score"]
    # one scored document: no interval (below MIN_INTERVAL_N), not [4/3, 4/3]
    assert np.isnan(layer3["mean_low"]) and np.isnan(layer3["mean_high"])
    assert by(rows, "logit", "3")["paper_score"] == 0.0
    # slope of the logit score on the group: (2, 1/2), (2, 3/2), (3, 0) -> -1
    (logit_slope,) = [s for s in slopes if s["effect"] == "logit"]
    assert logit_slope["slope"] == pytest.approx(-1.0)
    assert (logit_slope["n_scored"], logit_slope["n_groups"]) == (3, 2)
    assert np.isnan(logit_slope["slope_low"]) and np.isnan(logit_slope["slope_high"])


def test_bootstrap_intervals() -> None:
    # resampled means of (0, 1) x 5 are k / 10, k binomial(10, 1/2): the 2.5% and 97.5%
    # percentiles are 0.2 and 0.8 (P(k <= 1) = 0.011, P(k <= 2) = 0.055)
    scores = np.tile([0.0, 1.0], 5)
    mean, low, high = bootstrap_mean(scores)
    assert (
        mean == 0.5 and low == pytest.approx(0.2, abs=0.1) and high == pytest.approx(0.8, abs=0.1)
    )
    assert bootstrap_mean(scores) == (mean, low, high)
    # fewer than MIN_INTERVAL_N scores: the mean, no interval
    few = np.array([0.0, 1.0] * (MIN_INTERVAL_N // 2))[: MIN_INTERVAL_N - 1]
    assert bootstrap_mean(few)[0] == pytest.approx(few.mean())
    assert np.isnan(bootstrap_mean(few)[1:]).all() and np.isnan(bootstrap_slope(few, few)[1:]).all()
    # an exact line: every resample with two distinct x has the same slope
    x = np.repeat([1.0, 2.0, 3.0, 4.0], 10)
    assert bootstrap_slope(x, 3 * x + 1) == pytest.approx((3.0, 3.0, 3.0))
    # noise around a flat line: the interval holds 0 and narrows with more documents
    rng = np.random.default_rng(1)
    widths = []
    for n in (50, 2000):
        xs = rng.integers(2, 5, n).astype(float)
        slope, low, high = bootstrap_slope(xs, rng.normal(size=n))
        assert low < slope < high
        widths.append(high - low)
    assert widths[1] < widths[0] / 3


def test_groups_that_are_not_numbers_have_no_slope() -> None:
    rows, slopes = group_scores(REL, OUT, np.array(["a", "a", None, None], dtype=object))
    assert {r["group"] for r in rows} == {"a", None}
    assert not slopes


def test_group_tables_from_a_store(tmp_path: Path, model_dirs: Any) -> None:
    """``text_group_scores`` from an extracted store equals the scores of the stored rows
    recomputed here, and the report renders its section and figure."""
    task = text_task(tmp_path / "task", random_texts(12, seed=4), max_tokens=30)
    store = tmp_path / "store"
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store)]
    assert extract(*args, "--skips").exit_code == 0
    result = analyze(store)
    scores = result.text_group_scores
    st = Store(store)
    effects = st.scan("future_effects").collect()
    output = st.scan("future_output").collect()
    docs = st.scan("documents").collect().sort("doc")
    with_splits = sorted(set(output["doc"].to_list()))
    blocks = output["skipped"].n_unique()
    rel = np.zeros((len(with_splits), blocks, blocks))
    out = np.zeros((len(with_splits), blocks))
    for i, doc in enumerate(with_splits):
        for row in effects.filter(pl.col("doc") == doc).iter_rows(named=True):
            rel[i, row["skipped"], row["block"]] = max(
                rel[i, row["skipped"], row["block"]], row["rel_change"]
            )
        for row in output.filter(pl.col("doc") == doc).iter_rows(named=True):
            out[i, row["skipped"]] = max(out[i, row["skipped"]], row["out_change"])
    groups = np.array([docs["group"][d] for d in with_splits], dtype=object)
    want, want_slopes = group_scores(rel, out, groups)
    assert scores.height == len(want) == 2 * len(set(groups.tolist()))
    for row in want:
        got = scores.filter((pl.col("group") == row["group"]) & (pl.col("effect") == row["effect"]))
        assert got["n_scored"].item() == row["n_scored"]
        np.testing.assert_allclose(got["paper_score"].item(), row["paper_score"], rtol=1e-6)
        np.testing.assert_allclose(got["mean_score"].item(), row["mean_score"], rtol=1e-6)
    assert result.text_group_slope.height == len(want_slopes) == 2
    report = tmp_path / "report"
    write_report(result, report)
    text = (report / "report.md").read_text()
    assert "Depth score per group" in text and (report / "figures" / "text_groups.png").exists()
