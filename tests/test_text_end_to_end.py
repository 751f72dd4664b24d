"""Running text from extraction to report: ``extract --lens`` on a tiny random Llama, then the
analyses' tables against a direct float64 computation from the model's own hidden states, and the
report's running-text sections (Markdown and HTML)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from layerdiv.analyze.api import analyze
from layerdiv.cli import main
from tests.test_text_analysis import reference_geometry
from tests.test_text_extract import assert_lens_close, random_texts, reference_lens, text_task
from tests.tolerance import assert_within

TEXT_SECTIONS = (
    "Running text: geometry of the residual stream",
    "Running text: logit lens",
    "Running text: update profiles and depth scores",
)


def vectors(model: Any, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(h0 (T, d), attn and mlp (T, L, d)) of one document, float64: h0 from
    ``output_hidden_states``, what each block's attention and MLP add from forward hooks."""
    adds: list[torch.Tensor] = []
    handles = [
        module.register_forward_hook(
            lambda m, a, out: adds.append((out[0] if isinstance(out, tuple) else out)[0])
        )
        for layer in model.model.layers
        for module in (layer.self_attn, layer.mlp)
    ]
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    attn, mlp = (torch.stack(adds[i::2], dim=1).numpy() for i in (0, 1))
    h = [s[0].numpy() for s in out.hidden_states]
    # The hooked updates rebuild every block input HF returns (its last state is after the norm).
    rebuilt = h[0][:, None] + np.cumsum(attn + mlp, axis=1)
    np.testing.assert_allclose(rebuilt[:, :-1], np.stack(h[1:-1], axis=1), rtol=1e-9, atol=1e-9)
    return h[0], attn, mlp


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory, model_dirs: Any) -> tuple[Path, list[str]]:
    """A text store of 7 short documents (cut to 16 tokens) extracted with ``--lens``."""
    root = tmp_path_factory.mktemp("text-e2e")
    texts = random_texts(7, seed=3)
    task = text_task(root / "task", texts, max_tokens=16)
    store = root / "store"
    out = CliRunner().invoke(
        main,
        ["extract", "--model", str(model_dirs("llama")), "--task", str(task), "--store",
         str(store), "--batch-size", "3", "--chunk-size", "3", "--lens"],
        catch_exceptions=False,
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    return store, texts


@pytest.mark.numerical
def test_analysis_of_an_extracted_store_matches_float64_numpy(
    extracted: tuple[Path, list[str]], build_model: Any, tokenizer: Any
) -> None:
    store, texts = extracted
    model = build_model("llama").to(torch.float64)  # the same weights (seed 0), asserted tiny
    docs = [tokenizer(t)["input_ids"][:16] for t in texts]
    parts = [vectors(model, ids) for ids in docs]
    h0, attn, mlp = (np.concatenate([p[i] for p in parts]) for i in range(3))
    want = reference_geometry(h0, attn, mlp)
    results = analyze(store)
    geo = results.text_geometry.sort("block")
    assert geo["n_tokens"].to_list() == [len(h0)] * attn.shape[1]
    for column, values in want.items():
        with warnings.catch_warnings():  # theta_update: no next block at the last one
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, scale = np.nanmean(values, axis=0), np.nanmean(np.abs(values))
        got = geo[f"{column}_mean"].fill_null(np.nan).to_numpy()
        # within 1e-3 of the column's mean magnitude (a mean of cosines of either sign may be
        # near 0; proj is 0 at the embedding by construction, stored as 0)
        assert_within(got, mean, scale, 1e-3, what=column)
    # Lens: mean over the positions of a document, then over documents (ce: positions with a
    # next token).
    per_doc = np.stack([np.nanmean(reference_lens(model, ids), axis=0) for ids in docs])
    lens = results.text_lens.sort("layer")
    assert lens["n_documents"].to_list() == [len(docs)] * per_doc.shape[1]
    want_lens = per_doc.mean(axis=0)  # (layers, 3)
    assert_lens_close(np.stack([lens[c] for c in ("kl", "top5_overlap", "ce")], -1), want_lens)
    np.testing.assert_allclose(lens["top5_overlap"], want_lens[:, 1], atol=5e-3)  # a count / 5


def test_report_draws_the_running_text_sections(
    extracted: tuple[Path, list[str]], tmp_path: Path
) -> None:
    pytest.importorskip("plotly")
    store, _ = extracted
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main, ["report", "--store", str(store), "--out", str(out), "--format", "md,html"]
    )
    assert result.exit_code == 0, result.output
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    for title in TEXT_SECTIONS:
        assert title in md and title in html, title
    for figure in ("text_geometry.png", "text_lens.png", "text_profiles.png"):
        assert (out / "figures" / figure).is_file() and f"figures/{figure}" in md


def test_an_analysis_without_rows_is_left_out_and_the_others_run(
    tmp_path: Path, model_dirs: Any
) -> None:
    texts = ["the cat sat", "a movie was good", "x"]  # all <= 12 tokens: no split point
    task = text_task(tmp_path / "task", texts, max_tokens=40)
    store = tmp_path / "store"
    model = str(model_dirs("llama"))
    args = ["extract", "--model", model, "--task", str(task), "--store", str(store), "--skips"]
    out = CliRunner().invoke(main, [*args, "--lens"])
    assert out.exit_code == 0, out.output
    with pytest.warns(UserWarning, match="'text_skips' left out: .* has no future_effects rows"):
        results = analyze(store)
    assert "text_skips" not in results.analyses
    assert {"text_geometry", "text_lens", "text_profiles"} <= set(results.analyses)
    assert "text_depth_score" not in results.by_name and "text_profile_pca" in results.by_name
    report = CliRunner().invoke(main, ["report", "--store", str(store), "--out",
                                       str(tmp_path / "report")])  # fmt: skip
    assert report.exit_code == 0, report.output
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Running text: geometry of the residual stream" in md
    assert "'text_skips' left out" in md


@pytest.mark.numerical
def test_choice_lens_curves_beside_text_and_readouts_never_averaged(
    tmp_path: Path, model_dirs: Any, make_task: Any, tokenizer: Any
) -> None:
    """A choice task extracted with ``--lens`` gives ``lens_curves`` (the means over instances
    of its ``lens`` table, with log V), drawn dashed beside running text; two text tasks of one
    model extracted with ``final`` and ``last-block`` stay apart (a ``lens`` column; one curve
    each in the figure)."""
    import polars as pl

    from layerdiv.store import Store

    model, store = str(model_dirs("llama")), tmp_path / "store"
    texts = random_texts(4, seed=5)
    tasks = [
        ([str(make_task(tmp_path / "choice", n=6))], ["--lens"]),
        ([str(text_task(tmp_path / "a", texts, max_tokens=12, name="final-docs"))], ["--lens"]),
        ([str(text_task(tmp_path / "b", texts, max_tokens=12, name="block-docs"))],
         ["--lens", "last-block"]),
    ]  # fmt: skip
    for task, flags in tasks:
        args = ["extract", "--model", model, "--task", *task, "--store", str(store), *flags]
        out = CliRunner().invoke(main, args, catch_exceptions=False)
        assert out.exit_code == 0, out.output
    results = analyze(store)
    curves = results.lens_curves.sort("layer")
    stored = Store(store).scan("lens").collect()
    want = stored.group_by("layer").agg(pl.col("kl", "top5_overlap", "ce").mean()).sort("layer")
    assert curves["lens"].unique().to_list() == ["final"]
    for column in ("kl", "top5_overlap", "ce"):
        np.testing.assert_allclose(curves[column], want[column], rtol=1e-6, err_msg=column)
    assert curves["n_instances"].to_list() == [6] * curves.height
    np.testing.assert_allclose(curves["uniform_ce"], np.log(len(tokenizer)), rtol=1e-12)
    text = results.text_lens
    assert sorted(text.select("task", "lens").unique().iter_rows()) == [
        ("block-docs", "last-block"),
        ("final-docs", "final"),
    ]
    report = tmp_path / "report"
    result = CliRunner().invoke(
        main, ["report", "--store", str(store), "--out", str(report), "--format", "md,html"]
    )
    assert result.exit_code == 0, result.output
    html = (report / "report.html").read_text()
    lens_figure = re.search(r'"text_lens.png":(\{"data":\[.*?\]),"layout"', html)
    assert lens_figure is not None
    names = set(re.findall(r'"name":"([^"]+)"', lens_figure.group(1)))
    assert {n.split(" ", 1)[1] for n in names} == {
        "(final) text",
        "(last-block) text",
        "(final) last prompt token",
    }
