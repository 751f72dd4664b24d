"""Linear maps between two models' layers (``--maps``, methods §11): ``layer_maps``
against a reference of its own (states from plain HF ``output_hidden_states``, float64 ridge
least squares by ``numpy.linalg.lstsq`` on the augmented system), a model mapped onto itself,
and the refusals of bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner

import layerdiv
from layerdiv.analyze.analyses.maps import RIDGES
from layerdiv.cli import main
from tests.test_states import hf_states
from tests.test_text_extract import random_texts, text_task

MAX_TOKENS = 20


def run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> dict[str, Any]:
    """A tiny model pair saved with the test tokenizer: llama with 2 blocks of width 32, and
    with 4 blocks of width 48; the texts and their task."""
    import transformers as tf

    root = tmp_path_factory.mktemp("maps")
    folders = {}
    for name, (layers, width) in {"small": (2, 32), "deep": (4, 48)}.items():
        torch.manual_seed(layers)
        config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=width,
                                intermediate_size=2 * width, num_hidden_layers=layers,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=64)  # fmt: skip
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        folders[name] = root / name
        model.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    texts = random_texts(16, seed=5)
    return {"root": root, "folders": folders, "texts": texts,
            "task": text_task(root / "task", texts, max_tokens=MAX_TOKENS)}  # fmt: skip


def extract(pair: dict[str, Any], store: Path, name: str, *flags: str) -> None:
    r = run("extract", "--model", str(pair["folders"][name]), "--task", str(pair["task"]),
            "--store", str(store), *flags)  # fmt: skip
    assert r.exit_code == 0, r.output


def ridge_predict(xt: np.ndarray, yt: np.ndarray, xv: np.ndarray, ridge: float) -> np.ndarray:
    """y_hat of the rows ``xv`` by the ridge map fitted on (xt, yt): float64, W from lstsq on
    [Xc; sqrt(lambda) I] W = [Yc; 0], lambda = ridge trace(Xc'Xc) / d (methods §11)."""
    xb, yb = xt.mean(0), yt.mean(0)
    xc = xt - xb
    lam = ridge * np.sum(xc**2) / xc.shape[1]
    a = np.vstack([xc, np.sqrt(lam) * np.eye(xc.shape[1])])
    b = np.vstack([yt - yb, np.zeros((xc.shape[1], yt.shape[1]))])
    return (xv - xb) @ np.linalg.lstsq(a, b, rcond=None)[0] + yb


def reference(
    x: np.ndarray, y: np.ndarray, docs: np.ndarray, ridge: float | np.ndarray = 1e-3
) -> tuple[np.ndarray, np.ndarray]:
    """rel_error and r2 of every (i, j) by :func:`ridge_predict` (``ridge``: one value, or one
    per (i, j))."""
    held = docs % 5 == 4
    rel = np.empty((x.shape[1], y.shape[1]))
    r2 = np.empty_like(rel)
    ridges = np.broadcast_to(ridge, rel.shape)
    for i in range(x.shape[1]):
        for j in range(y.shape[1]):
            yh = ridge_predict(x[~held, i], y[~held, j], x[held, i], ridges[i, j])
            yy = y[held, j]
            err = np.linalg.norm(yh - yy, axis=1)
            rel[i, j] = np.mean(err / np.maximum(np.linalg.norm(yy, axis=1), 1e-6))
            r2[i, j] = 1 - np.sum(err**2) / np.sum((yy - yy.mean(0)) ** 2)
    return rel, r2


def hf_rows(pair: dict[str, Any], tokenizer: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every position 1..T-1 of every document: (doc per row, states (n, L + 1, d) float64)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pair["folders"][name], dtype=torch.float32)
    docs, states = [], []
    for doc, text in enumerate(pair["texts"]):
        ids = tokenizer(text)["input_ids"][:MAX_TOKENS]
        states.append(hf_states(model.eval(), ids)[1:])
        docs += [doc] * (len(ids) - 1)
    return np.array(docs), np.concatenate(states)


def as_grid(frame: pl.DataFrame, space: str, column: str) -> np.ndarray:
    sub = frame.filter(pl.col("space") == space).sort("source_layer", "target_layer")
    n = sub["target_layer"].n_unique()
    return sub[column].to_numpy().reshape(-1, n)


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-6), ("float16", 3e-3)])
def test_maps_match_reference(
    pair: dict[str, Any], tokenizer: Any, tmp_path: Path, dtype: str, tol: float
) -> None:
    store = tmp_path / "store"
    for name in ("small", "deep"):
        extract(pair, store, name, "--states", "all", "--states-dtype", dtype)
    small, deep = (str(pair["folders"][n]) for n in ("small", "deep"))
    fixed = layerdiv.run_analysis(store, maps=f"{small}:{deep}", options={"maps_ridge": 1e-3})
    results = layerdiv.run_analysis(store, maps=f"{small}:{deep}")  # cross-validated
    docs, x = hf_rows(pair, tokenizer, "small")
    _, y = hf_rows(pair, tokenizer, "deep")
    for maps, ridge in ((fixed.layer_maps, None), (results.layer_maps, "chosen")):
        chosen = {s: as_grid(maps, s, "ridge") for s in ("states", "updates")}
        if ridge is None:
            assert all((g == 1e-3).all() for g in chosen.values())
        else:
            assert set(np.unique(np.concatenate([g.ravel() for g in chosen.values()]))) <= set(
                RIDGES
            )
        rel, r2 = reference(x, y, docs, chosen["states"])
        assert as_grid(maps, "states", "rel_error").shape == (3, 5)
        assert np.abs(as_grid(maps, "states", "rel_error") - rel).max() < tol
        assert np.abs(as_grid(maps, "states", "r2") - r2).max() < tol
        rel_u, r2_u = reference(np.diff(x, axis=1), np.diff(y, axis=1), docs, chosen["updates"])
        assert np.abs(as_grid(maps, "updates", "rel_error") - rel_u).max() < tol
        assert np.abs(as_grid(maps, "updates", "r2") - r2_u).max() < tol
    held = docs % 5 == 4
    mean_rel = np.mean(np.linalg.norm(y[held] - y[~held].mean(0), axis=2)
                       / np.linalg.norm(y[held], axis=2), axis=0)  # fmt: skip
    assert np.abs(as_grid(maps, "states", "mean_rel_error")[0] - mean_rel).max() < tol
    beats = (r2 > 0) & (rel < as_grid(maps, "states", "mean_rel_error"))
    assert (as_grid(maps, "states", "beats_mean") == beats).all()
    assert maps["n_heldout"].unique().to_list() == [int(held.sum())]
    assert maps["n_train"].unique().to_list() == [len(docs) - int(held.sum())]
    assert maps["few_rows"].all()  # far fewer than 10 x 32 training rows
    best = results.layer_map_best.filter(pl.col("space") == "states").sort("source_layer")
    masked = np.where(beats, r2, -np.inf)  # the largest held-out R² among the maps that beat
    want = [int(np.argmax(masked[i, 1:])) + 1 if beats[i, 1:].any() else None for i in (1, 2)]
    assert best["target_layer"].to_list() == want
    assert best["source_depth"].to_list() == [0.5, 1.0]
    assert best["target_depth"].to_list() == [None if j is None else j / 4 for j in want]
    gated = [j is not None and r2[i, j] >= 0.5 for i, j in zip((1, 2), want, strict=True)]
    assert best["clears_gate"].to_list() == gated
    # block updates: l / L too (methods §11), l = 0..L-1 of the small model's 2 blocks
    updates = results.layer_map_best.filter(pl.col("space") == "updates").sort("source_layer")
    assert updates["source_depth"].to_list() == [0.0, 0.5]
    assert set(updates["target_depth"].drop_nulls()) <= {j / 4 for j in range(4)}


def test_identity_and_report(pair: dict[str, Any], tmp_path: Path) -> None:
    store = tmp_path / "store"
    extract(pair, store, "small", "--states", "all", "--states-dtype", "float32")
    slug = layerdiv.Store(store).select()[0].model
    maps = layerdiv.run_analysis(store, maps=f"{slug}:{slug}").layer_maps
    for space in ("states", "updates"):
        grid = as_grid(maps, space, "rel_error")
        diagonal = np.diag(grid)
        assert diagonal.max() < 0.02, diagonal
        assert diagonal.max() < np.min(grid + np.eye(len(grid)) * 9, axis=1).min()
    out = tmp_path / "report"
    r = run("report", "--store", str(store), "--maps", f"{slug}:{slug}", "--out", str(out))
    assert r.exit_code == 0, r.output
    text = (out / "report.md").read_text()
    assert "Warning: " in text and "fewer than 10 x d_A" in text
    # a 2-block model onto itself: 2 source layers, fewer than the 5 a verdict needs
    assert "source layers have a best map with R² >= 0.5" in text
    assert "**No verdict:** fewer than 5 source layers' best maps clear the gate" in text
    assert (out / "figures" / "layer_maps.png").stat().st_size > 10_000


def test_refusals(pair: dict[str, Any], tmp_path: Path) -> None:
    store = tmp_path / "store"
    extract(pair, store, "small")  # no states
    r = run("analyze", "--store", str(store), "--maps", "all", "--out", str(tmp_path / "o"))
    want = "--maps (the layers' states): not extracted for "
    assert (
        r.exit_code == 1 and want in r.output and "`layerdiv extract --states all` adds" in r.output
    )
    extract(pair, store, "small", "--states", "all")
    r = run("analyze", "--store", str(store), "--maps", "all", "--out", str(tmp_path / "o"))
    assert r.exit_code == 1 and "has the states of one model only" in r.output
    extract(pair, store, "deep")  # a partition without states, named
    deep = str(pair["folders"]["deep"])
    small = str(pair["folders"]["small"])
    r = run("analyze", "--store", str(store), "--maps", f"{small}:{deep}", "--out",
            str(tmp_path / "o"))  # fmt: skip
    assert r.exit_code == 1 and f"--maps {deep} (its states): not extracted for " in r.output
    # other tokens: another --states-seed draws other positions
    extract(pair, store, "deep", "--states", "3", "--states-seed", "1", "--overwrite")
    extract(pair, store, "small", "--states", "3", "--overwrite")
    r = run("analyze", "--store", str(store), "--maps", "all", "--out", str(tmp_path / "o"))
    assert r.exit_code == 1 and "stored row 0 is (doc 0, pos" in r.output
    assert "another tokenizer, --states K or --states-seed, or other documents" in r.output
    # two tasks
    other = text_task(pair["root"] / "other", pair["texts"][:6], max_tokens=8, name="other")
    r = run("extract", "--model", deep, "--task", str(other), "--store", str(store),
            "--states", "all")  # fmt: skip
    assert r.exit_code == 0, r.output
    r = run("analyze", "--store", str(store), "--maps", "all", "--out", str(tmp_path / "o"))
    assert r.exit_code == 1 and "states of tasks docs, other; choose one with --task" in r.output
    for out in (r.output,):
        assert len([line for line in out.splitlines() if line.startswith("Error")]) == 1


def test_two_revisions_of_one_model(pair: dict[str, Any], tmp_path: Path) -> None:
    """A map is between two (model, revision) partitions of one task: its key holds both
    revisions, a model with several revisions is named with @REVISION, and the figure spec has
    a heatmap panel (diagonal and best targets drawn over it) and a best-target curve panel."""
    import shutil

    from transformers import AutoModelForCausalLM

    from layerdiv.analyze.analyses.maps import PAIR, maps_figure

    store, folder = tmp_path / "store", tmp_path / "m"
    shutil.copytree(pair["folders"]["small"], folder)
    checkpoints = {"folders": {"m": folder}, "task": pair["task"]}
    extract(checkpoints, store, "m", "--states", "all", "--revision", "early")
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():  # another checkpoint, with the same states (h_L is before the norm)
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(folder)
    extract(checkpoints, store, "m", "--states", "all", "--revision", "late")
    slug = layerdiv.Store(store).select()[0].model
    r = run("analyze", "--store", str(store), "--maps", f"{slug}:{slug}", "--out",
            str(tmp_path / "o"))  # fmt: skip
    assert r.exit_code == 1 and "has revisions early, late on task docs; name one" in r.output
    results = layerdiv.run_analysis(store, maps=f"{slug}@early:{slug}@late")
    maps = results.layer_maps
    assert maps.columns[: len(PAIR)] == list(PAIR)
    assert maps.select(PAIR).unique().rows() == [("docs", slug, "early", slug, "late")]
    assert np.diag(as_grid(maps, "states", "rel_error")).max() < 0.02  # the same weights
    figure = maps_figure(maps, results.layer_map_best, {})
    heat, curve = figure.panels[:2]
    assert len(figure.panels) == 4 and heat.heatmap is not None and curve.heatmap is None
    assert [s.name for s in heat.series] == ["same relative depth", "best target"]
    assert heat.series[0].x == [0, 1, 2] and "@early)" in heat.ylabel and "@late)" in heat.xlabel
    # coloured by what selects the best target: held-out R², on a fixed 0..1 scale
    assert heat.heatmap.colorbar == "held-out R²" and (heat.heatmap.zmin, heat.heatmap.zmax) == (
        0,
        1,
    )
    want = as_grid(maps, heat.title.split(":")[0], "r2")
    assert np.allclose(np.array(heat.heatmap.z, dtype=float), want, equal_nan=True)


@pytest.mark.parametrize("d_b", [40, 2])  # held-out rows solved once (12 <= 4 d_B), or W per pair
def test_fit_maps_against_lstsq(d_b: int) -> None:
    from layerdiv.analyze.layer_maps import ArrayLayers, fit_maps, solve_rows

    rng = np.random.default_rng(0)
    docs = np.repeat(np.arange(10), 6)  # documents 4 and 9 held out: 12 rows
    x = rng.normal(size=(60, 3, 8)) + 5
    y = np.einsum("nld,de->nle", x, rng.normal(size=(8, d_b)))[:, [0, 1, 2, 2]]
    y += rng.normal(size=y.shape) * 0.3
    held = docs % 5 == 4
    order = np.concatenate([np.flatnonzero(~held), np.flatnonzero(held)])
    assert solve_rows(int(held.sum()), d_b, 4) == (d_b == 40)
    got = fit_maps(ArrayLayers(x, order), ArrayLayers(y, order), 48, 12, block_rows=7)
    rel, r2 = reference(x, y, docs)
    assert np.abs(got.rel_error - rel).max() < 1e-10 and np.abs(got.r2 - r2).max() < 1e-10


def test_cross_validated_ridge_against_refits() -> None:
    """Several ridge values: each map's ridge is the one of least squared error summed over the
    folds of training documents (doc % 5 = 0..3), each fold predicted by a map refitted by
    lstsq on the other folds; the scores are the refit's with that ridge; the mean predictor's
    rel_error is the train mean's."""
    from layerdiv.analyze.layer_maps import ArrayLayers, fit_maps

    rng = np.random.default_rng(3)
    docs = np.repeat(np.arange(20), 4)
    x = rng.normal(size=(80, 3, 10)) + 2
    signal = np.einsum("nld,de->nle", x, rng.normal(size=(10, 6)))
    noise = rng.normal(size=signal.shape)
    y = signal * np.array([1.0, 0.05, 0.0])[None, :, None] + noise  # strong, weak, no signal
    held = docs % 5 == 4
    train = np.flatnonzero(~held)
    train = train[np.argsort(docs[train] % 5, kind="stable")]
    order = np.concatenate([train, np.flatnonzero(held)])
    bounds = [0, *np.cumsum(np.bincount(docs[train] % 5)).tolist()]
    ridges = (1e-4, 1e-2, 1.0, 100.0)
    got = fit_maps(ArrayLayers(x, order), ArrayLayers(y, order), len(train), int(held.sum()),
                   ridges, bounds, block_rows=7)  # fmt: skip
    want = np.empty((3, 3))
    for i in range(3):
        for j in range(3):
            err = []
            for ridge in ridges:
                sq = 0.0
                for f in range(4):
                    fit, val = train[docs[train] % 5 != f], train[docs[train] % 5 == f]
                    yh = ridge_predict(x[fit, i], y[fit, j], x[val, i], ridge)
                    sq += float(np.sum((yh - y[val, j]) ** 2))
                err.append(sq)
            want[i, j] = ridges[int(np.argmin(err))]
    assert (got.ridge == want).all(), (got.ridge, want)
    assert len(np.unique(want)) > 1  # the choice depends on the data
    rel, r2 = reference(x, y, docs, want)
    assert np.abs(got.rel_error - rel).max() < 1e-10 and np.abs(got.r2 - r2).max() < 1e-10
    yy = y[held]
    mean_rel = np.mean(np.linalg.norm(yy - y[~held].mean(0), axis=2)
                       / np.linalg.norm(yy, axis=2), axis=0)  # fmt: skip
    assert np.abs(got.mean_rel_error - mean_rel).max() < 1e-12
    assert (got.r2[:, 2] < 0.05).all() and got.r2[0, 0] > 0.5  # y_2 is noise; y_0 is x_0 A


def test_maps_ridge_option() -> None:
    """``--maps-ridge``: cv (or none) cross-validates over the grid, a positive number fixes the
    ridge, anything else is refused in one line."""
    from layerdiv.analyze.analyses.maps import MapsError, ridges

    assert ridges(None) == ridges("cv") == RIDGES and len(RIDGES) > 1
    assert ridges("0.01") == ridges(0.01) == (0.01,)
    for bad in ("0", "-1", "nan", "often"):
        with pytest.raises(MapsError, match=f"--maps-ridge {bad}: give cv or a positive number"):
            ridges(bad)


def planted(
    noise: float, seed: int = 0, order: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A planted correspondence: latent states z_0..z_12 of 120 documents x 4 rows, z_(k+1) =
    tanh(z_k A_k) (no layer a linear function of another), a source of 7 layers
    h_i = z_(2 order[i]) B_i (default order[i] = i: source layer i is target layer 2i) and a
    target of 13 layers z_j C_j plus ``noise`` times Gaussian noise, whose layer 1 is
    100 + 0.05 z_1 C_1 (a large mean, a small spread: the least rel_error of every source
    whatever predicts it). Returns (docs, source (n, 7, 8), target (n, 13, 8))."""
    rng = np.random.default_rng(seed)
    n, d = 480, 8
    z = [rng.normal(size=(n, d))]
    for _ in range(12):
        z.append(np.tanh(z[-1] @ (rng.normal(size=(d, d)) * 1.5 / np.sqrt(d))) * 2)
    order = np.arange(7) if order is None else order
    source = np.stack([z[2 * k] @ rng.normal(size=(d, d)) for k in order], axis=1)
    target = np.stack([z[j] @ rng.normal(size=(d, d)) for j in range(13)], axis=1)
    target[:, 1] = 100 + 0.05 * target[:, 1]
    target += noise * rng.normal(size=target.shape)
    return np.repeat(np.arange(120), 4), source, target


KEY = {"task": "t", "source_model": "a", "source_revision": "main", "target_model": "b",
       "target_revision": "main"}  # fmt: skip


def intervals_frame(sums: Any, updates: bool = False) -> pl.DataFrame:
    """``layer_map_intervals`` of one pair (:data:`KEY`) and space from its documents' sums."""
    from layerdiv.analyze.analyses.maps import INTERVALS_SCHEMA, resampled_rho

    space = "updates" if updates else "states"
    row = {**KEY, "space": space, "units": "documents", **resampled_rho(sums, updates)}
    return pl.DataFrame([row], schema=INTERVALS_SCHEMA)


def planted_fit(docs: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[pl.DataFrame, Any]:
    """``layer_map_best`` of the planted pair's states and their verdict row (:func:`spearman`,
    its interval over the held-out documents), as the analysis fits them."""
    from layerdiv.analyze.analyses.maps import HELD_OUT, best_table, score_rows, spearman
    from layerdiv.analyze.layer_maps import ArrayLayers, fit_maps

    held = docs % HELD_OUT[0] == HELD_OUT[1]
    order = np.concatenate([np.flatnonzero(~held), np.flatnonzero(held)])
    n_train, n_held = int((~held).sum()), int(held.sum())
    scores = fit_maps(ArrayLayers(x, order), ArrayLayers(y, order), n_train, n_held,
                      documents=docs[order[n_train:]])  # fmt: skip
    best = best_table(score_rows(KEY, "states", scores, n_train, n_held, False))
    return best, spearman(best, intervals_frame(scores.documents)).row(0, named=True)


def test_best_target_by_r2_recovers_a_planted_ordering() -> None:
    """Source layer i is target layer 2i: ranked by R², every source layer's best map is its
    own (R² near 1, above the gate), Spearman's rho is 1 and beats permuted targets, and the
    verdict agrees; ranked by rel_error (the former rule) target 1, of a large mean and a small
    spread, would have been every source's best."""
    from layerdiv.analyze.analyses.maps import maps_verdict

    docs, x, y = planted(noise=0.01)
    best, row = planted_fit(docs, x, y)
    best = best.sort("source_layer")
    assert best["target_layer"].to_list() == [2 * i for i in range(1, 7)]
    assert best["clears_gate"].all() and best["r2"].to_numpy().min() > 0.9
    assert row["spearman"] == pytest.approx(1.0) and row["n"] == 6
    assert row["p_value"] == pytest.approx(1 / 720, abs=0.003)  # 1 of 6! orderings
    # the interval over the 24 held-out documents: narrow, around rho; the gate never moves
    assert row["n_units"] == 24 and row["low"] <= row["spearman"] <= row["high"]
    assert row["high"] - row["low"] < 0.05 and row["gate_changed"] == 0 and row["defined"] == 1
    line = maps_verdict(row)
    assert "**Verdict: agrees.**" in line and "6 of 6 source layers" in line, line
    assert "(n = 24 held-out documents, resampled)" in line, line
    # the former rule: the least rel_error among the maps that beat the mean predictor
    from layerdiv.analyze.analyses.maps import HELD_OUT
    from layerdiv.analyze.layer_maps import ArrayLayers, fit_maps

    held = docs % HELD_OUT[0] == HELD_OUT[1]
    order = np.concatenate([np.flatnonzero(~held), np.flatnonzero(held)])
    s = fit_maps(ArrayLayers(x, order), ArrayLayers(y, order), int((~held).sum()),
                 int(held.sum()))  # fmt: skip
    beats = (s.r2 > 0) & (s.rel_error < s.mean_rel_error[None, :])
    by_rel = np.argmin(np.where(beats, s.rel_error, np.inf)[1:, 1:], axis=1) + 1
    assert (by_rel == 1).all()  # the former rule finds no ordering here


def test_maps_below_the_gate_give_no_verdict() -> None:
    """Targets drowned in noise: the best maps' R² stays below the gate, and no verdict is
    given, whatever Spearman's rho of the chosen targets."""
    from layerdiv.analyze.analyses.maps import R2_GATE, maps_verdict

    docs, x, y = planted(noise=6.0)
    best, row = planted_fit(docs, x, y)
    assert np.nanmax(best["r2"].to_numpy()) < R2_GATE
    assert not best["clears_gate"].any()
    assert row["n"] == 0 and row["spearman"] is None
    line = maps_verdict(row)
    assert "**No verdict:**" in line and "Verdict:" not in line.replace("No verdict:", ""), line


def test_a_correspondence_no_better_than_permuted_targets_is_not_a_verdict() -> None:
    """Source layers mapped to targets in a scrambled order: every best map clears the gate,
    the chosen targets follow the scramble, and the permutation test does not let a verdict
    agree."""
    from layerdiv.analyze.analyses.maps import maps_verdict

    scramble = np.array([0, 4, 1, 6, 2, 5, 3])
    docs, x, y = planted(noise=0.01, order=scramble)
    best, row = planted_fit(docs, x, y)
    best = best.sort("source_layer")
    assert best["target_layer"].to_list() == [2 * k for k in scramble[1:]]
    assert best["clears_gate"].all()
    assert row["p_value"] > 0.05
    line = maps_verdict(row)
    assert "**Verdict: cannot tell.**" in line and "n = 24 held-out documents" in line, line


def test_document_sums_give_the_scores_of_any_multiset_of_documents() -> None:
    """The held-out documents' sums (``fit_maps(documents=...)``) give every map's R²,
    rel_error and the mean predictor's rel_error: of the whole held-out set (weights 1: the
    scores ``fit_maps`` returns), and of a multiset of its documents (as ``fit_maps`` scores the
    held-out rows repeated that many times)."""
    from layerdiv.analyze.layer_maps import ArrayLayers, fit_maps
    from tests.tolerance import assert_within

    docs, x, y = planted(noise=0.5)
    held = docs % 5 == 4
    train, rows = np.flatnonzero(~held), np.flatnonzero(held)
    held_docs = np.unique(docs[rows])
    draws = np.random.default_rng(1).integers(0, 3, len(held_docs))  # each drawn 0, 1 or 2 times
    for weights in (np.ones(len(held_docs)), draws.astype(float)):
        picked = np.concatenate([np.tile(rows[docs[rows] == d], int(w))
                                 for d, w in zip(held_docs, weights, strict=True)])  # fmt: skip
        order = np.concatenate([train, picked])
        a, b = ArrayLayers(x, order), ArrayLayers(y, order)
        want = fit_maps(a, b, len(train), len(picked), block_rows=13)
        sums = fit_maps(ArrayLayers(x, np.concatenate([train, rows])),
                        ArrayLayers(y, np.concatenate([train, rows])), len(train), len(rows),
                        documents=docs[rows]).documents  # fmt: skip
        assert sums is not None and len(sums.rows) == len(held_docs) == 24
        r2, rel, mean_rel = (v[0] for v in sums.scores(weights[None, :]))
        # R² = 1 - SSE / SS: float64 sums of 10^3 rows, budget relative to 1 + |R²|
        assert_within(r2, want.r2, 1 + np.abs(want.r2), budget=1e-10, what="r2")
        assert_within(rel, want.rel_error, want.rel_error, budget=1e-12, what="rel_error")
        assert_within(mean_rel, want.mean_rel_error, want.mean_rel_error, budget=1e-12,
                      what="mean_rel_error")  # fmt: skip


def crafted_sums(dominant: float, n_docs: int = 20, layers: int = 6, reversed_: bool = True) -> Any:
    """:class:`DocumentSums` of ``layers`` x ``layers`` update maps over ``n_docs`` documents of
    one row: every document's map i -> i has error 0.1 of its spread 1 (and 0.9 elsewhere), but
    the last one's best is the reversed order i -> L - 1 - i (or, not ``reversed_``, no map
    predicts it), its spread ``dominant``."""
    from layerdiv.analyze.layer_maps import DocumentSums

    sse = np.tile(0.9 - 0.8 * np.eye(layers), (n_docs, 1, 1))
    y_sq = np.ones((n_docs, layers))
    y_sq[-1] = dominant
    sse[-1] = dominant * (1 - np.eye(layers)[::-1] if reversed_ else 1)
    rows = np.ones(n_docs)
    return DocumentSums(rows, sse, np.zeros_like(sse), np.ones((n_docs, layers)),
                        np.zeros((n_docs, layers, 1)), y_sq)  # fmt: skip


def test_one_dominant_document_widens_the_interval() -> None:
    """Resampling documents, not layers: where 20 documents weigh alike and 19 of them say
    i -> i, rho's interval is narrow at 1; where the 20th (its best map reversed) holds most of
    the held-out spread, every resample that draws it reverses the best targets, and the
    interval spans [-1, 1]. Where no map predicts the dominant document, no layer clears the
    gate on the whole held-out set, nor in any resample that draws it: the gated layers change
    (every layer gated, rho defined) in those that do not, 0.95^20 = 36% of them."""
    from layerdiv.analyze.analyses.maps import resampled_rho

    even = resampled_rho(crafted_sums(dominant=1.0), updates=True)
    assert even["n_units"] == 20 and even["low"] == even["high"] == pytest.approx(1.0)
    assert even["gate_changed"] == 0 and even["defined"] == 1
    heavy = resampled_rho(crafted_sums(dominant=1000.0), updates=True)
    assert heavy["low"] == pytest.approx(-1.0) and heavy["high"] == pytest.approx(1.0)
    assert heavy["gate_changed"] == 0 and heavy["defined"] == 1
    noise = resampled_rho(crafted_sums(dominant=1000.0, reversed_=False), updates=True)
    assert noise["gate_changed"] == pytest.approx(0.36, abs=0.05)
    assert noise["defined"] == noise["gate_changed"]
    assert noise["low"] == noise["high"] == pytest.approx(1.0)  # over the resamples without it


def test_too_few_documents_give_no_interval() -> None:
    """Below MIN_INTERVAL_N held-out documents: no interval, and the verdict line says so and
    prints n as documents."""
    from layerdiv.analyze.analyses.maps import MIN_LAYERS, maps_verdict, spearman
    from layerdiv.analyze.stats import MIN_INTERVAL_N

    sums = crafted_sums(dominant=1.0, n_docs=MIN_INTERVAL_N - 1)
    intervals = intervals_frame(sums, updates=True)
    assert intervals["low"][0] is None and intervals["n_units"][0] == MIN_INTERVAL_N - 1
    n = MIN_LAYERS + 3
    depth = np.arange(n) / n
    best = pl.DataFrame({**KEY, "space": "states", "source_layer": range(n),
                         "target_layer": range(n), "clears_gate": True, "source_depth": depth,
                         "target_depth": depth})  # fmt: skip
    row = spearman(best, intervals.with_columns(space=pl.lit("states"))).row(0, named=True)
    line = maps_verdict(row)
    assert "**Verdict: too few to tell.**" in line, line
    assert f"(n = {MIN_INTERVAL_N - 1} held-out documents, resampled; at least" in line, line
    assert f"No interval: fewer than {MIN_INTERVAL_N} held-out documents" in line, line


def test_best_targets_follow_best_tables_rule() -> None:
    """The bootstrap's best targets (:func:`best_targets`, numpy over resamples) are those of
    ``layer_map_best`` (Polars) on the same scores, where the planted noise makes several
    targets compete."""
    from layerdiv.analyze.analyses.maps import best_table, best_targets, score_rows
    from layerdiv.analyze.layer_maps import ArrayLayers, fit_maps

    docs, x, y = planted(noise=2.0)
    held = docs % 5 == 4
    order = np.concatenate([np.flatnonzero(~held), np.flatnonzero(held)])
    n_train, n_held = int((~held).sum()), int(held.sum())
    s = fit_maps(ArrayLayers(x, order), ArrayLayers(y, order), n_train, n_held)
    table = best_table(score_rows(KEY, "states", s, n_train, n_held, False)).sort("source_layer")
    found = best_targets(s.r2[1:, 1:], s.rel_error[1:, 1:], s.mean_rel_error[1:])
    want = table["target_layer"].fill_null(0).to_numpy() - 1  # -1: none beats the mean
    assert found.tolist() == want.tolist()
    assert found.tolist() != [2 * i - 1 for i in range(1, 7)]  # not only the planted ones


def test_an_undefined_rho_shows_no_interval() -> None:
    """Every gated layer's best target the same (the demo's sibling: SmolLM2's state 1): rho is
    undefined on the whole held-out set, and the interval of the resamples that define it is
    not shown as its interval; the share of those resamples is."""
    from layerdiv.analyze.analyses.maps import MIN_LAYERS, maps_verdict, spearman

    n = MIN_LAYERS + 2
    best = pl.DataFrame({**KEY, "space": "states", "source_layer": range(n), "target_layer": 1,
                         "clears_gate": True, "source_depth": np.arange(n) / n,
                         "target_depth": 0.1})  # fmt: skip
    intervals = pl.DataFrame([{**KEY, "space": "states", "units": "documents", "low": 0.58,
                               "high": 0.87, "n_units": 20, "gate_changed": 0.28,
                               "defined": 0.28}])  # fmt: skip
    line = maps_verdict(spearman(best, intervals).row(0, named=True))
    assert "**Verdict: cannot tell.**" in line and "0.58" not in line, line
    assert "n = 20 held-out documents" in line and "rho is defined in 28%" in line, line
