"""Models compared on relative depth (``layerdiv.analyze.analyses.compare``): only what every model
has, the findings per model from the sections' own verdicts, and no section for one model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

import layerdiv
from layerdiv.analyze.analyses.compare import MODEL, comparison, findings
from layerdiv.analyze.api import Results
from layerdiv.analyze.markdown import judged, verdict
from layerdiv.analyze.report import write_report
from layerdiv.analyze.synthetic import random_partition, write_partition

KEYS = {"revision": "main"}


def _rows(table: dict[str, list[object]]) -> pl.DataFrame:
    n = len(next(iter(table.values())))
    return pl.DataFrame({**{k: [v] * n for k, v in KEYS.items()}, **table})


def test_comparison_keeps_the_quantities_every_model_has() -> None:
    blocks = _rows(
        {
            "model": ["a", "b", "a", "b"],
            "task": ["text", "text", "quiz", "quiz"],
            "n_blocks": [30, 18, 30, 18],
            "n_done": [8, 8, 120, 120],
        }
    )
    prior = {
        "effective_depth": _rows(
            {
                "model": ["a", "a", "b", "b"],
                "task": ["text"] * 4,
                "measure": ["cos", "kl", "cos", "kl"],
                "n_documents": [8] * 4,
                "ratio": [0.6, None, 0.5, 0.9],
                "ci_low": [0.5, None, 0.4, 0.8],
                "ci_high": [0.7, None, 0.6, 1.0],
            }
        ),
        "decided_depth": _rows(  # model a only: not compared
            {
                "model": ["a"],
                "task": ["text"],
                "group": ["all"],
                "n_documents": [8],
                "mean": [0.9],
                "ci_low": [0.8],
                "ci_high": [1.0],
            }
        ),
        "saturation": _rows(
            {"model": ["a", "b"], "task": ["quiz", "quiz"], "saturation_fraction": [0.8, 1.0]}
        ),
    }
    table = comparison(prior, blocks)
    assert set(table["quantity"]) == {"ed_cos", "ed_kl", "saturation"}
    kl = table.filter(pl.col("quantity") == "ed_kl").sort("model")
    assert kl["value"].to_list() == [None, 0.9]  # a's "no crossing" stays, as null
    assert kl["n_blocks"].to_list() == [30, 18] and kl["n_units"].to_list() == [8, 8]
    saturation = table.filter(pl.col("quantity") == "saturation").sort("model")
    assert saturation["n_units"].to_list() == [120, 120] and saturation["ci_low"].is_null().all()
    one = blocks.filter(pl.col("model") == "a")
    assert comparison(prior, one).height == 0  # one model: nothing to compare
    states = _rows({"model": ["c"], "task": ["maps"], "n_blocks": [15], "n_done": [100]})
    assert comparison(prior, pl.concat([blocks, states])).equals(table)  # c has none of them


def test_judged_collects_each_verdict_as_data() -> None:
    args = ("x holds", "stat", 0.6, (0.5, 0.7), 10, 0.45)
    with judged() as found:
        line = verdict(*args, min_n=3, unit="things")
    assert line.startswith("**Verdict: agrees.**")
    (j,) = found
    assert (j.finding, j.outcome, j.value, j.interval, j.n, j.threshold) == (
        "x holds", "agrees", 0.6, (0.5, 0.7), 10, 0.45,
    )  # fmt: skip
    verdict(*args, min_n=3, unit="things")  # outside the block: not collected
    assert len(found) == 1


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Results]:
    """Two made-up models (30 and 18 blocks, the second less skilled) on three choice tasks,
    and their analysis."""
    root = tmp_path_factory.mktemp("compare") / "store"
    rng = np.random.default_rng(0)
    for model, blocks, skill in (("org/deep", 30, 1.5), ("org/shallow", 18, 0.2)):
        for task, k in (("boolq", 2), ("mnli", 3), ("topics", 5)):
            logits, gold, rms, kinds = random_partition(rng, 40, blocks, k, skill)
            write_partition(root, model, task, logits, gold, kinds, rms)
    return root, layerdiv.run_analysis(root)


def test_the_report_compares_two_models_side_by_side(
    two_models: tuple[Path, Results], tmp_path: Path
) -> None:
    store, results = two_models
    table = results.model_comparison
    assert table.filter(pl.col("quantity") == "saturation").height == 6  # 2 models x 3 tasks
    results.remarks.append("The instances were chosen by hand")  # a paragraph, not a note
    try:
        write_report(results, tmp_path / "report", "paper", str(store), "md")
    finally:
        results.remarks.clear()
    text = (tmp_path / "report" / "report.md").read_text()
    assert "\n\nThe instances were chosen by hand.\n" in text and "> The instances" not in text
    section = text.split("## Models compared on relative depth")[1].split("\n## ")[0]
    assert "### Table 1 side by side" in section and "Accuracy (%), deep" in section
    assert "What confounds the comparison" in section
    # each paper's findings, one row per finding with a cell per model
    rows = [r for r in section.splitlines() if r.startswith("| Diversity of layers")]
    assert len(rows) >= 4 and all(r.count("|") == 6 for r in rows), rows
    assert all(("holds" in r or "cannot tell" in r or "too few" in r) for r in rows)
    figures = {p.name for p in (tmp_path / "report" / "figures").iterdir()}
    assert {"compare_curves.png", "compare_depth.png"} <= figures
    # no data on sinks, attribution or erasure for either model: no empty chart
    assert not {"compare_sinks_igrad.png", "compare_erasure.png", "compare_bos_norm.png"} & figures
    one = layerdiv.run_analysis(store, models="org/deep", tasks="boolq")
    assert one.model_comparison.height == 0
    write_report(one, tmp_path / "one", "paper", str(store), "md")
    assert "Models compared" not in (tmp_path / "one" / "report.md").read_text()


def test_findings_per_model_are_the_sections_verdicts_on_its_rows(
    two_models: tuple[Path, Results],
) -> None:
    from layerdiv.analyze.registry import ReportContext

    _, results = two_models
    ctx = ReportContext(tables=results.by_name, estimator="paper", names={}, figures=Path("."))
    deep, shallow = findings(ctx, "org--deep"), findings(ctx, "org--shallow")
    assert [f.finding for _, f in deep] == [f.finding for _, f in shallow]
    assert not any(MODEL in f.finding for _, f in deep)  # the model's name is not in the row
    rho = [f for p, f in deep if "accuracy rises with Diversity" in f.finding]
    assert len(rho) == 1 and rho[0].n == 3  # three tasks averaged
    assert {p for p, _ in deep} >= {"Diversity of layers (reference paper)", "Inverse-depth paper"}
