"""Heads analysis (methods §8) and component reweighting on synthetic stores.

Every expected number is recomputed here with numpy loops over the definitions, independently of
the Polars expressions under test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from scipy.optimize import approx_fprime

from layerdiv.analyze import analyze
from layerdiv.analyze.registry import ReportContext
from layerdiv.analyze.synthetic import random_heads, random_partition, write_partition
from layerdiv.cli import main
from layerdiv.measurements.heads import reweight as rw
from layerdiv.measurements.heads.analysis import NoHeadsError, head_scores, heads_tables, load_heads
from layerdiv.measurements.heads.report import heads_section
from layerdiv.store import Store, StoreError

N, BLOCKS, HEADS, K = 40, 3, 3, 3


@pytest.fixture(scope="module")
def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    logits, gold, rms, kinds = random_partition(rng, N, BLOCKS, K)
    logits, heads, ids = random_heads(rng, logits, gold, kinds, HEADS, bias=True)
    # Head 0 of the second block is perfect: it beats the whole, alone and calibrated.
    heads[:, 1, 1] = -1.0
    heads[np.arange(N), 1, 1, gold] = 5.0
    attn = [c for c, kind in enumerate(kinds) if kind == "attn"]
    logits[:, attn] = heads.sum(axis=2)
    return {"logits": logits, "gold": gold, "rms": rms, "heads": heads, "ids": np.array(ids)}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, data: dict[str, np.ndarray]) -> Path:
    root = tmp_path_factory.mktemp("heads-store")
    kinds = ["embed"] + ["attn", "mlp"] * BLOCKS
    write_partition(
        root,
        "org/with-heads",
        "task",
        data["logits"],
        data["gold"],
        kinds,
        data["rms"],
        chunk=16,
        shuffle=np.random.default_rng(2),
        optional={"heads": data["heads"]},
        head_ids=data["ids"].tolist(),
    )
    write_partition(root, "org/plain", "task", data["logits"], data["gold"], kinds, data["rms"])
    return root


@pytest.fixture(scope="module")
def tables(store: Path) -> tuple[dict[str, pl.DataFrame], list[str]]:
    notes: list[str] = []
    parts = Store(store).select()
    return {**heads_tables(parts, notes), **rw.reweight_tables(parts, notes)}, notes


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def reference_member(u: np.ndarray, gold: np.ndarray) -> tuple[float, float, float]:
    """Accuracy, calibrated accuracy and mean gold margin of one member's (N, K) logits."""
    acc = np.mean(u.argmax(1) == gold)
    cal = np.mean((u - u.mean(0)).argmax(1) == gold)
    margins = [u[i, g] - max(u[i, k] for k in range(K) if k != g) for i, g in enumerate(gold)]
    return float(acc), float(cal), float(np.mean(margins))


def test_head_scores_match_reference(tables, data) -> None:
    frames, _ = tables
    scores = frames["head_scores"].filter(pl.col("model") == "org--with-heads")
    heads, gold = data["heads"].astype(np.float32).astype(np.float64), data["gold"]
    assert scores.height == 2 * BLOCKS * HEADS  # two estimators, bias terms left out
    for est in ("paper", "ensemble"):
        for b in range(BLOCKS):
            members = heads[:, b, 1:]  # (N, H, K); index 0 is the bias term
            probs = softmax(members)
            bias = ((np.eye(K)[gold][:, None, :] - probs) ** 2).mean(2)  # (N, H)
            m = members if est == "paper" else probs
            div = ((m.mean(1, keepdims=True) - m) ** 2).mean(2)
            for h in range(HEADS):
                row = scores.filter(
                    (pl.col("estimator") == est)
                    & (pl.col("component") == 1 + 2 * b)
                    & (pl.col("head") == h)
                ).row(0, named=True)
                acc, cal, margin = reference_member(members[:, h], gold)
                np.testing.assert_allclose(
                    [row["accuracy"], row["calibrated_accuracy"], row["margin"]],
                    [acc, cal, margin],
                    rtol=1e-9,
                )
                np.testing.assert_allclose(
                    [row["bias"], row["diversity"], row["bias_share"], row["diversity_share"]],
                    [
                        bias[:, h].mean(),
                        div[:, h].mean(),
                        bias[:, h].sum() / bias.sum(),
                        div[:, h].sum() / div.sum(),
                    ],
                    rtol=1e-9,
                )
                assert row["name"] == f"attn.{b}.h{h}" and row["layer"] == b


def test_summary_counts_parts_that_beat_the_whole(tables, data) -> None:
    frames, _ = tables
    gold = data["gold"]
    full = data["logits"].astype(np.float32).astype(np.float64).sum(1)
    whole = float(np.mean(full.argmax(1) == gold))
    heads = data["heads"].astype(np.float32).astype(np.float64)[:, :, 1:]
    per_head = [reference_member(heads[:, b, h], gold) for b in range(BLOCKS) for h in range(HEADS)]
    row = frames["head_summary"].filter(pl.col("model") == "org--with-heads").row(0, named=True)
    whole_cal = reference_member(full, gold)[1]  # like with like: calibrated against calibrated
    assert row["accuracy"] == pytest.approx(whole)
    assert row["calibrated_accuracy"] == pytest.approx(whole_cal)
    assert row["n_heads"] == BLOCKS * HEADS
    assert row["heads_beat"] == sum(a > whole for a, _, _ in per_head)
    assert row["heads_beat_calibrated"] == sum(c > whole_cal for _, c, _ in per_head)
    assert row["heads_beat"] >= 1 and row["best_head"] == "attn.1.h0"
    assert row["best_head_accuracy"] == 1.0
    comps = data["logits"].astype(np.float32).astype(np.float64)
    per_comp = [reference_member(comps[:, c], gold) for c in range(comps.shape[1])]
    assert row["components_beat"] == sum(a > whole for a, _, _ in per_comp)
    assert row["components_beat_calibrated"] == sum(c > whole_cal for _, c, _ in per_comp)


def test_calibrated_parts_are_compared_with_the_calibrated_whole() -> None:
    """A part at 80% calibrated beats a full model at 60% but not its calibrated 85%."""
    from layerdiv.measurements.heads.analysis import summary_row

    parts = pl.DataFrame({"name": ["a", "b"], "kind": ["attn", "mlp"], "accuracy": [0.7, 0.5],
                          "calibrated_accuracy": [0.8, 0.9]})  # fmt: skip
    row = summary_row((0.6, 0.85), parts, parts)
    assert row["heads_beat"] == 1 and row["heads_beat_calibrated"] == 1  # a alone, b calibrated
    row = summary_row((0.6, 0.95), parts, parts)
    assert row["components_beat"] == 1 and row["components_beat_calibrated"] == 0


def test_partition_without_heads_is_noted_and_refused_by_the_api(tables, store) -> None:
    frames, notes = tables
    plain = frames["head_summary"].filter(pl.col("model") == "org--plain").row(0, named=True)
    assert plain["n_heads"] is None and plain["n_components"] == 1 + 2 * BLOCKS
    assert any("org--plain/main/task" in n and "extract --heads" in n for n in notes)
    assert frames["reweight"].filter(pl.col("model") == "org--plain")["members"].item() == "blocks"
    with pytest.raises(
        NoHeadsError,
        match=r"Head scores: not extracted for org--plain/main/task \(`layerdiv extract --heads`",
    ) as err:
        head_scores(store, tasks=["task"])
    assert "\n" not in str(err.value)
    assert head_scores(store, models=["org/with-heads"]).height == 2 * BLOCKS * HEADS


def test_incomplete_heads_are_refused(tmp_path: Path, data) -> None:
    kinds = ["embed"] + ["attn", "mlp"] * BLOCKS
    write_partition(
        tmp_path,
        "m",
        "t",
        data["logits"],
        data["gold"],
        kinds,
        optional={"heads": data["heads"]},
        head_ids=data["ids"].tolist(),
    )
    info = Store(tmp_path).select()[0]
    [part] = info.files("heads")
    pl.read_parquet(part).slice(1).write_parquet(part)  # one (instance, head, option) row lost
    with pytest.raises(StoreError, match="heads rows do not hold"):
        load_heads(info)


def test_reweighting_gradient_and_recorded_split(tables, data) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(9, 5, 3)), rng.integers(0, 3, 9)
    w = rng.uniform(0, 1, 5)
    _, grad = rw.objective(w, x, y, 0.3)
    numeric = approx_fprime(w, lambda v: rw.objective(v, x, y, 0.3)[0], 1e-7)
    np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-6)

    frames, _ = tables
    row = frames["reweight"].filter(pl.col("model") == "org--with-heads").row(0, named=True)
    train, test = rw.split(N, rw.N_TRAIN, rw.SEED)
    assert row["train_instances"] == train.tolist() and row["seed"] == rw.SEED
    assert (row["n_train"], row["n_test"]) == (rw.N_TRAIN, N - rw.N_TRAIN)
    # members: embed + MLPs + every head and bias term
    assert row["n_members"] == 1 + BLOCKS + BLOCKS * (HEADS + 1)
    # the perfect head alone gets every test instance right, and reweighting finds it
    assert row["best_member"] == "attn.1.h0" and row["best_member_accuracy"] == 1.0
    assert row["reweighted_accuracy"] == 1.0 and row["converged"]
    gold = data["gold"]
    full = data["logits"].astype(np.float32).astype(np.float64).sum(1)
    assert row["full_accuracy"] == pytest.approx(np.mean(full[test].argmax(1) == gold[test]))
    weights = frames["reweight_weights"].filter(pl.col("model") == "org--with-heads")
    assert weights.height == row["n_members"] and weights["weight"].is_between(0, 1).all()


def test_reweighting_from_ones_keeps_the_full_model_without_penalty() -> None:
    # With lambda = 0 and every member pushing the gold option, the cross-entropy falls as any
    # weight grows, so every weight stays at its upper bound 1 (the full model).
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 30)
    x = rng.normal(0, 0.1, (30, 4, 2))
    x[np.arange(30), :, y] += 1.0
    fit = rw.fit_weights(x, y, l1=0.0)
    assert np.all(fit.weights > 0.99)
    np.testing.assert_array_equal(rw.combine(x, fit.weights).argmax(1), y)


def test_heads_section_renders_with_figures(tables, tmp_path: Path) -> None:
    frames, _ = tables
    names = {"org--with-heads": "org/with-heads", "org--plain": "org/plain"}
    ctx = ReportContext(frames, "paper", names, tmp_path / "figures")
    text = heads_section(ctx)
    assert (tmp_path / "figures" / "heads_org--with-heads.png").stat().st_size > 1000
    assert "](figures/heads_org--with-heads.png)" in text
    assert "| org/plain | task |" in text and "no heads stored – `extract --heads`" in text
    assert "attn.1.h0" in text
    reweighting = rw.report(ctx)
    assert "| org/with-heads | task | heads | 24 / 16 |" in reweighting


def test_analyze_runs_the_heads_analysis(store: Path) -> None:
    results = analyze(store)
    assert {"head_scores", "head_summary", "reweight"} <= set(results.tables())
    assert results.head_summary.height == 2 and results.reweight.height == 0
    assert any("extract --heads" in note for note in results.notes)
    assert analyze(store, options={"reweight": True}).reweight.height == 2


def test_cli_reweight_option(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "results"
    args = ["analyze", "--store", str(store), "--out", str(out), "--reweight"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "extract --heads" in result.output  # the note about the partition without heads
    assert pl.read_parquet(out / "reweight.parquet").height == 2
    assert pl.read_parquet(out / "head_scores.parquet").height == 2 * BLOCKS * HEADS


def test_query_has_a_heads_view_over_the_partitions_that_hold_heads(store: Path, data) -> None:
    con = Store(store).duckdb()
    per_model = dict(con.sql("SELECT model, count(*) FROM heads GROUP BY model").fetchall())
    assert per_model == {"org--with-heads": data["heads"].size}
    # The heads of every attention component add up to its logits (methods §8).
    ((worst,),) = con.sql(
        "SELECT max(abs(h.logit - c.logit)) FROM (SELECT model, instance, component, option, "
        "sum(logit) AS logit FROM heads GROUP BY ALL) h JOIN components c USING (model, "
        "instance, component, option)"
    ).fetchall()
    assert worst < 1e-4
    assert "heads" not in {
        r[0] for r in Store(store).duckdb(["org/plain"]).sql("SHOW TABLES").fetchall()
    }
