"""Tasks that overlap (``layerdiv.analyze.overlap``): a task whose instances another task of the
same model holds is found from the stored prompts, marked in ``manifests`` and left out of every
average over tasks, and its n is said where it is the only data."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from layerdiv.analyze import analyze
from layerdiv.analyze.overlap import independent, lone_subsets
from layerdiv.analyze.report import write_report
from layerdiv.analyze.synthetic import random_partition, write_partition

SIZES = {"big": 40, "other": 30, "part": 15, "relabelled": 15}
"""Instances per task of the one model: ``part``'s prompts and gold options are ``big``'s first
15; ``relabelled`` has those prompts with the other gold option (other instances)."""


def copy_prompts(root: Path, source: str, target: str) -> None:
    """Give ``target``'s instances the prompts of ``source``'s instances of the same index."""
    for path in root.glob(f"instances/**/task={target}/**/*.parquet"):
        table = pq.read_table(path)
        index = table.schema.get_field_index("prompt")
        prompts = pc.replace_substring(table["prompt"], f" of {target}.", f" of {source}.")
        pq.write_table(table.set_column(index, table.schema.field(index), prompts), path)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("overlap") / "store"
    rng = np.random.default_rng(3)
    golds: dict[str, np.ndarray] = {}
    for task, n in SIZES.items():
        logits, gold, rms, kinds = random_partition(rng, n, 3, 2, skill=3 if task == "part" else 1)
        if task in ("part", "relabelled"):
            gold = golds["big"][:n] if task == "part" else 1 - golds["big"][:n]
        golds[task] = gold
        write_partition(root, "org/m", task, logits, gold, kinds, rms)
    copy_prompts(root, "big", "part")
    copy_prompts(root, "big", "relabelled")
    return root


def test_subset_is_marked_from_the_prompts(store: Path) -> None:
    manifests = analyze(store).manifests.sort("task")
    assert manifests["subset_of"].to_list() == [None, None, ["big"], None]


def test_averages_over_tasks_leave_the_subset_out(store: Path, tmp_path: Path) -> None:
    results = analyze(store)
    means = results.correlation_means
    over_tasks = means.filter(pl.col("task").is_null() & pl.col("model").is_not_null())
    assert set(over_tasks["n"]) == {3}  # big, other and relabelled, not part
    assert set(results.depth_curves["n_tasks"]) == {3}
    # Table 1's Avg. leaves part out.
    scores = results.scores.filter(pl.col("estimator") == "paper").sort("task")
    want = 100 * scores.filter(pl.col("task") != "part")["accuracy"].mean()  # type: ignore[operator]
    write_report(results, tmp_path / "r", "paper", str(store), "md")
    text = (tmp_path / "r" / "report.md").read_text()
    row = re.search(r"^\| org/m \|(.+)\|$", text, re.M)
    assert row is not None
    assert float(row.group(1).split("|")[-1]) == pytest.approx(want, abs=0.051)
    assert "part (org/m): its 15 instances are all also in big (same model, same prompts)" in text
    assert "Averages over tasks leave out part: every instance of it is in another task." in text
    provenance = re.search(r"^\| org/m \| part \| 15/15 \|.*$", text, re.M)
    assert provenance is not None and provenance.group(0).endswith("| big |")


def test_a_lone_subset_stays_and_says_its_n(store: Path) -> None:
    manifests = analyze(store).manifests
    frame = pl.DataFrame({"model": ["org--m"] * 2, "revision": ["main"] * 2,
                          "task": ["part", "other"], "v": [1.0, 2.0]})  # fmt: skip
    assert independent(frame, manifests).height == 2  # big is not in the frame
    assert "part alone, n = 15 instances (org--m; a subset of big" in lone_subsets(frame, manifests)
    both = pl.concat([frame, frame.with_columns(pl.lit("big").alias("task"))])
    assert sorted(independent(both, manifests)["task"]) == ["big", "big", "other"]
    assert lone_subsets(both, manifests) == ""
    # a setting averaged apart (e.g. the lens readout): big's rows of another one cover nothing
    lens = both.with_columns(
        lens=pl.when(pl.col("task") == "big").then(pl.lit("b")).otherwise(pl.lit("a"))
    )
    assert independent(lens, manifests, by=["lens"]).height == 4
    assert "part alone" in lone_subsets(lens, manifests, by=["lens"])
