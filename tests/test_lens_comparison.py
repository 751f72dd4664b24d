"""The analyses under every lens stored (methods §17): ``lens_comparison``, ``text_lens``,
``decided_depth`` and ``effective_depth`` per lens, from a store holding the logit lens, identity
translators as the ``ls`` lens (whose numbers must be the logit lens's) and other translators as
the ``tuned`` lens; the report's figure, held-out notes and verdict lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from layerdiv.analyze.api import analyze
from layerdiv.analyze.report import write_report
from layerdiv.extract.config import ExtractConfig, measurement_options
from layerdiv.extract.runner import run_extract
from layerdiv.measurements.lens import learned_lens_settings
from layerdiv.store import Store
from layerdiv.store.translators import Translators, save_translators
from tests.test_learned_lens import identity
from tests.test_text_extract import extract, random_texts, text_task
from tests.tolerance import assert_within


def lensed_store(tmp_path: Path, model_dirs: Any, tuned_task: str) -> Path:
    """The logit lens, identity ``ls`` translators (fitted on task ``train``) and random
    near-identity ``tuned`` ones (fitted on ``tuned_task``) of 8 documents of task ``docs``."""
    task = text_task(tmp_path / "task", random_texts(8, seed=11), max_tokens=24)
    store = tmp_path / "store"
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store)]
    assert extract(*args, "--lens").exit_code == 0
    m = Store(store).partitions[0].manifest
    assert m.hidden_size is not None
    ls = identity(m.weights_fingerprint, m.n_blocks, m.hidden_size)
    rng = np.random.default_rng(0)
    noise = 0.3 * rng.standard_normal(ls.A.shape).astype(np.float32)
    tuned = Translators("tuned", ls.A + noise, ls.b, m.weights_fingerprint, tuned_task)
    save_translators(tmp_path / "ls.safetensors", ls)
    save_translators(tmp_path / "tuned.safetensors", tuned)
    # through the Python API, as the demo adds them
    files = {"ls": tmp_path / "ls.safetensors", "tuned": tmp_path / "tuned.safetensors"}
    settings = {**measurement_options({"lens": "final"}), **learned_lens_settings(files)}
    config = ExtractConfig(
        str(model_dirs("llama")), [str(task)], store, measurement_settings=settings
    )
    assert [s.n_added for s in run_extract(config)] == [8]
    return store


def test_every_depth_measure_under_every_lens(tmp_path: Path, model_dirs: Any) -> None:
    store = lensed_store(tmp_path, model_dirs, tuned_task="docs")
    results = analyze(store)

    comparison = results["lens_comparison"]
    assert sorted(comparison["lens"].unique()) == ["logit", "ls", "tuned"]
    blocks = Store(store).partitions[0].manifest.n_blocks
    assert comparison.group_by("lens").len()["len"].to_list() == [blocks + 1] * 3
    held = {r["lens"]: r["held_out"] for r in comparison.unique("lens").iter_rows(named=True)}
    assert held == {"logit": None, "ls": True, "tuned": False}
    by_lens = {lens: sub.sort("layer") for (lens,), sub in comparison.group_by("lens")}
    logit, ls, tuned = by_lens["logit"], by_lens["ls"], by_lens["tuned"]
    scale = float(logit["ce"].max())  # type: ignore[arg-type]
    for column in ("kl", "top5_overlap", "ce", "kl_low", "kl_high", "ce_low", "ce_high"):
        assert_within(ls[column].to_numpy(), logit[column].to_numpy(), scale, what=column)
    assert (logit["kl_low"] <= logit["kl"]).all() and (logit["kl"] <= logit["kl_high"]).all()
    assert logit["kl_low"].lt(logit["kl_high"]).head(blocks).all()  # an interval, not a point
    assert not np.allclose(tuned["kl"].to_numpy()[:blocks], logit["kl"].to_numpy()[:blocks])
    # layer L is the model's output under every lens
    assert tuned["kl"][-1] == 0 and tuned["ce"][-1] == logit["ce"][-1]

    text_lens = results["text_lens"]
    assert sorted(text_lens["lens"].unique()) == ["final", "ls", "tuned"]

    decided = results["decided_depth"]
    assert sorted(decided["lens"].unique()) == ["logit", "ls", "tuned"]
    rows = {r["lens"]: r for r in decided.filter(pl.col("group") == "all").iter_rows(named=True)}
    assert rows["ls"]["mean"] == rows["logit"]["mean"]  # the same ranks, to the token
    assert rows["ls"]["n_tokens"] == rows["tuned"]["n_tokens"] == rows["logit"]["n_tokens"]
    hist = results["decided_depth_hist"]
    assert hist.group_by("lens").len()["len"].to_list() == [blocks + 1] * 3
    # the lens-quality gate and the frequency finding under each lens: the identity lens's are
    # the logit lens's, the tuned lens reads the stream with other cross-entropies
    gate = {r["lens"]: r for r in results["decided_lens"].iter_rows(named=True)}
    assert sorted(gate) == ["logit", "ls", "tuned"]
    for column in ("lens_failed", "lens_limited", "q1_minus_q4", "corpus_tokens"):
        assert gate["ls"][column] == gate["logit"][column], column
    assert_within(gate["ls"]["worst_ce"], gate["logit"]["worst_ce"], scale, what="worst_ce")
    assert gate["tuned"]["worst_ce"] != gate["logit"]["worst_ce"]

    ed = results["effective_depth"]
    lens_rows = ed.filter(pl.col("measure") != "cos")
    assert sorted(lens_rows["lens"].unique()) == ["logit", "ls", "tuned"]
    assert ed.filter(pl.col("measure") == "cos")["lens"].is_null().all()
    assert ed.filter(pl.col("measure") == "cos").height == 1
    for measure in ("kl", "top5"):
        sub = {r["lens"]: r for r in lens_rows.filter(pl.col("measure") == measure).iter_rows(
            named=True)}  # fmt: skip
        assert sub["ls"]["ed"] == sub["logit"]["ed"], measure
        if sub["logit"]["margin"] is None:  # the margin under each lens: none without ED
            assert sub["ls"]["margin"] is None, measure
        else:
            assert_within(sub["ls"]["margin"], sub["logit"]["margin"], 1.0, what=measure)

    out = tmp_path / "report"
    path, _ = write_report(results, out, store=str(store), formats="md")
    text = path.read_text()
    assert (
        "(figures/lens_comparison.png)" in text and (out / "figures/lens_comparison.png").exists()
    )
    assert "**Not held out:** the tuned lens" in text and "fitted on task docs" in text
    assert "the ls lens" not in text.split("Not held out")[1].split("\n")[0]
    lines = [line for line in text.splitlines() if line.startswith("- ")]
    for lens in ("logit", "ls", "tuned"):  # the verdicts of each lens, named
        assert any(f", docs, {lens} lens" in line for line in lines), lens  # decided-at depth
        assert any(f", docs, ED_kl ({lens} lens)" in line for line in lines), lens
    verdicts = [line for line in lines if " · docs, " in line]
    assert any("decided-at depth (all tokens)" in v for v in verdicts), verdicts
    assert any(v.startswith("- ") and "ED_KL" in v for v in verdicts), verdicts
    for line in verdicts:  # the identity lens never differs from the logit lens
        assert "the ls" not in line and "the ls, tuned" not in line, line
        assert any(v in line for v in ("holds under every lens", "under the tuned lens")), line
