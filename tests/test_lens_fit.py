"""Learned lenses (methods §17): the sums of ``extract --lens-stats`` against float64 sums of the
model's own states, exact under shards, merges, resumes and backfills; ``fit-lens --kind ls``
against ``numpy.linalg.lstsq`` with the same ridge; ``fit-lens --kind tuned`` resumable, its
settings and refusals; the declared cost."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from layerdiv.cli import main
from layerdiv.extract import lens_fit
from layerdiv.extract.adapters import adapter_for
from layerdiv.extract.lens_fit import TunedSettings, residual_states, train_tuned
from layerdiv.extract.models import LoadedModel
from layerdiv.extract.readout import Readout
from layerdiv.extract.text import TextCapture
from layerdiv.measurements.lens_stats import LensStatsError, LensSums, lens_stats_cost, read_sums
from layerdiv.store import Store
from layerdiv.store.translators import load_translators
from tests.test_text_extract import random_texts, text_task

SOLVE = 1e-6
"""Relative difference of the closed form from lstsq (both float64 over the same states)."""


def run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def loaded_model(folder: str | Path) -> LoadedModel:
    """A model as extraction loads it on the CPU in float32."""
    from layerdiv.extract.models import load_model, load_tokenizer, resolve_source

    source = resolve_source(str(folder), None, None, False)
    tokenizer = load_tokenizer(source)
    return load_model(source, tokenizer, torch.device("cpu"), torch.float32)


def states_of(loaded: LoadedModel, seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """h_l (L, tokens, d) and h_L (tokens, d), float64, of every token of ``seqs``, each
    document run alone."""
    adapter = adapter_for(loaded.model.config)
    capture = TextCapture(loaded.model, adapter, Readout(loaded.model, adapter))
    hs, finals = [], []
    try:
        for s in seqs:
            h, final = residual_states(loaded, capture, [s])
            hs.append(torch.stack(h).double().numpy())
            finals.append(final.double().numpy())
    finally:
        capture.remove()
    return np.concatenate(hs, axis=1), np.concatenate(finals)


def lstsq_lens(h: np.ndarray, y: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """A (L, d, d), b (L, d) minimising mean ||A h + b - y||^2 + lambda ||A - I||^2 per block,
    lambda = ``scale`` x the mean diagonal of h's centred covariance, by ``numpy.linalg.lstsq``
    over the tokens' rows and sqrt(lambda) I ridge rows."""
    n, d = y.shape
    As, bs = [], []
    for x in h:
        centred = x - x.mean(0)
        lam = scale * np.mean(np.sum(centred**2, axis=0) / n)
        rows = np.vstack([np.hstack([x, np.ones((n, 1))]) / np.sqrt(n),
                          np.hstack([np.sqrt(lam) * np.eye(d), np.zeros((d, 1))])])  # fmt: skip
        target = np.vstack([y / np.sqrt(n), np.sqrt(lam) * np.eye(d)])
        coef = np.linalg.lstsq(rows, target, rcond=None)[0]  # (d + 1, d)
        As.append(coef[:d].T)
        bs.append(coef[d])
    return np.stack(As), np.stack(bs)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def sums_of(store: Path) -> LensSums:
    (info,) = Store(store).partitions
    return read_sums(info)


def test_sums_and_the_ls_lens_match_float64_states_and_lstsq(
    tmp_path: Path, model_dirs: Any
) -> None:
    folder = model_dirs("llama")
    texts = random_texts(9, seed=5)
    task = text_task(tmp_path / "task", texts, max_tokens=16)
    store = tmp_path / "s"
    r = run("extract", "--model", str(folder), "--task", str(task), "--store", str(store),
            "--lens-stats", "--batch-size", "1", "--chunk-size", "4")  # fmt: skip
    assert r.exit_code == 0, r.output
    loaded = loaded_model(folder)
    seqs = [loaded.tokenizer(t)["input_ids"][:16] for t in texts]
    h, y = states_of(loaded, seqs)
    got = sums_of(store)
    assert got.n == y.shape[0] == sum(len(s) for s in seqs)
    assert relative(got.h, h.sum(1)) <= 1e-12 and relative(got.final, y.sum(0)) <= 1e-12
    assert relative(got.hh, np.einsum("lni,lnj->lij", h, h)) <= 1e-12
    assert relative(got.hf, np.einsum("lni,nj->lij", h, y)) <= 1e-12
    out = tmp_path / "ls.safetensors"
    r = run("fit-lens", "--store", str(store), "--model", str(folder), "--task", "docs",
            "--kind", "ls", "--out", str(out))  # fmt: skip
    assert r.exit_code == 0, r.output
    t = load_translators(out)
    (info,) = Store(store).partitions
    assert t.kind == "ls" and t.task == "docs"
    assert t.weights_fingerprint == info.manifest.weights_fingerprint
    assert t.settings["ridge"] == 1e-4 and t.settings["tokens"] == got.n
    A, b = lstsq_lens(h, y, 1e-4)
    assert t.A.shape == (2, 32, 32) and t.A.dtype == np.float64
    assert relative(t.A, A) <= SOLVE and relative(t.b, b) <= SOLVE
    # the ridge pulls A towards I: a huge one gives the identity and the mean shift
    r = run("fit-lens", "--store", str(store), "--model", str(folder), "--task", "docs",
            "--kind", "ls", "--out", str(out), "--ridge", "1e9")  # fmt: skip
    assert r.exit_code == 0, r.output
    big = load_translators(out)
    assert np.abs(big.A - np.eye(32)).max() <= 1e-6
    r = run("fit-lens", "--store", str(store), "--model", "other-model", "--task", "docs",
            "--kind", "ls", "--out", str(out))  # fmt: skip
    assert r.exit_code == 1 and "no extracted data matches" in r.output


def test_sums_of_shards_merged_resumed_and_backfilled_equal_one_run_s(
    tmp_path: Path, model_dirs: Any
) -> None:
    folder = str(model_dirs("qwen2"))
    task = text_task(tmp_path / "task", random_texts(11, seed=2), max_tokens=20)
    args = ["--model", folder, "--task", str(task), "--chunk-size", "3"]
    r = run("extract", *args, "--store", str(tmp_path / "whole"), "--lens-stats")
    assert r.exit_code == 0, r.output
    whole = sums_of(tmp_path / "whole")
    for i in range(2):
        r = run("extract", *args, "--store", str(tmp_path / f"s{i}"), "--shard", f"{i}/2",
                "--lens-stats")  # fmt: skip
        assert r.exit_code == 0, r.output
    merged = tmp_path / "m"
    r = run("merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--into", str(merged))
    assert r.exit_code == 0, r.output
    for other in (sums_of(merged),):
        assert other.n == whole.n
        for a, b in zip((other.h, other.final, other.hh, other.hf),
                        (whole.h, whole.final, whole.hh, whole.hf), strict=True):  # fmt: skip
            assert np.array_equal(a, b)
    later = tmp_path / "later"
    assert run("extract", *args, "--store", str(later), "--limit", "5").exit_code == 0
    r = run("extract", *args, "--store", str(later), "--limit", "5", "--lens-stats")
    assert r.exit_code == 0 and "added lens_stats" in r.output, r.output
    (info,) = Store(later).partitions
    assert read_sums(info).n < whole.n
    r = run("extract", *args, "--store", str(later), "--lens-stats")
    assert r.exit_code == 0, r.output
    resumed = sums_of(later)
    assert resumed.n == whole.n
    assert all(relative(a, b) <= 1e-12 for a, b in
               zip((resumed.hh, resumed.hf), (whole.hh, whole.hf), strict=True))  # fmt: skip


def test_a_partition_without_the_sums_is_refused(tmp_path: Path, model_dirs: Any) -> None:
    folder = str(model_dirs("llama"))
    task = text_task(tmp_path / "task", random_texts(3), max_tokens=8)
    r = run("extract", "--model", folder, "--task", str(task), "--store", str(tmp_path / "s"))
    assert r.exit_code == 0, r.output
    r = run("fit-lens", "--store", str(tmp_path / "s"), "--model", folder, "--task", "docs",
            "--kind", "ls", "--out", str(tmp_path / "x"))  # fmt: skip
    assert r.exit_code == 1 and "has no lens statistics; extract it with" in r.output
    assert "--lens-stats" in r.output and not (tmp_path / "x").exists()


def test_the_tuned_lens_resumes_to_the_same_translators(
    tmp_path: Path, model_dirs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = model_dirs("llama")
    loaded = loaded_model(folder)
    adapter = adapter_for(loaded.model.config)
    seqs = [loaded.tokenizer(t)["input_ids"][:16] for t in random_texts(8, seed=1)]
    settings = TunedSettings(steps=12, tokens_per_step=40, seed=3)
    whole = train_tuned(loaded, adapter, seqs, settings, tmp_path / "a.ckpt", progress=False)
    assert np.abs(whole[0] - np.eye(32)).max() > 0  # it moved
    calls = {"n": 0}
    real = lens_fit.residual_states

    def stop_after_eleven(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 13:  # one pass for the shape, then steps 1..11; stop in step 12
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(lens_fit, "residual_states", stop_after_eleven)
    with pytest.raises(KeyboardInterrupt):
        train_tuned(loaded, adapter, seqs, settings, tmp_path / "b.ckpt", progress=False)
    assert torch.load(tmp_path / "b.ckpt", weights_only=True)["step"] == 10
    monkeypatch.setattr(lens_fit, "residual_states", real)
    resumed = train_tuned(loaded, adapter, seqs, settings, tmp_path / "b.ckpt", progress=False)
    assert np.array_equal(resumed[0], whole[0]) and np.array_equal(resumed[1], whole[1])
    with pytest.raises(lens_fit.TunedLensError, match="other settings"):
        train_tuned(loaded, adapter, seqs, TunedSettings(steps=13, tokens_per_step=40, seed=3),
                    tmp_path / "b.ckpt", progress=False)  # fmt: skip


def test_fit_lens_tuned_writes_its_settings_and_refuses_other_weights(
    tmp_path: Path, model_dirs: Any, build_model: Any
) -> None:
    folder = str(tmp_path / "model")
    shutil.copytree(model_dirs("llama"), folder)
    task = text_task(tmp_path / "task", random_texts(6, seed=4), max_tokens=12)
    store = str(tmp_path / "s")
    r = run("extract", "--model", folder, "--task", str(task), "--store", store, "--lens-stats")
    assert r.exit_code == 0, r.output
    out = tmp_path / "tuned.safetensors"
    r = run("fit-lens", "--store", store, "--model", folder, "--task", "docs", "--kind", "tuned",
            "--out", str(out), "--steps", "3", "--tokens-per-step", "30",
            "--init", "ls")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "tuned lens trained on states from the model's own forward pass" in r.output
    t = load_translators(out)
    (info,) = Store(store).partitions
    assert t.kind == "tuned" and t.task == "docs" and t.A.shape == (2, 32, 32)
    assert t.weights_fingerprint == info.manifest.weights_fingerprint
    assert t.settings["init"] == "ls" and t.settings["steps"] == 3
    assert t.settings["tokens_per_step"] == 30 and t.settings["seed"] == 0
    assert not out.with_name(out.name + ".ckpt").exists()
    build_model("llama", seed=1).save_pretrained(folder)  # other weights, the same folder
    r = run("fit-lens", "--store", store, "--model", folder, "--task", "docs", "--kind", "tuned",
            "--out", str(tmp_path / "o"), "--steps", "1")  # fmt: skip
    assert r.exit_code == 1 and "was extracted from weights" in r.output, r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.numerical
def test_smollm2_ls_lens_matches_lstsq(tmp_path: Path) -> None:
    from layerdiv.demo import bbc_articles

    texts = [a["text"] for a in bbc_articles(paragraphs=2)[:3]]
    task = text_task(tmp_path / "task", texts, max_tokens=24)
    store = tmp_path / "s"
    model = "smollm2-135m-instruct"
    r = run("extract", "--model", model, "--task", str(task), "--store", str(store),
            "--lens-stats", "--batch-size", "1")  # fmt: skip
    assert r.exit_code == 0, r.output
    out = tmp_path / "ls.safetensors"
    r = run("fit-lens", "--store", str(store), "--model", model, "--task", "docs", "--kind", "ls",
            "--out", str(out))  # fmt: skip
    assert r.exit_code == 0, r.output
    t = load_translators(out)
    loaded = loaded_model(model)
    seqs = [loaded.tokenizer(x)["input_ids"][:24] for x in texts]
    h, y = states_of(loaded, seqs)
    assert t.A.shape == (30, 576, 576) and t.settings["tokens"] == y.shape[0] == 72
    A, b = lstsq_lens(h, y, 1e-4)
    assert relative(t.A, A) <= SOLVE and relative(t.b, b) <= SOLVE


class _States:
    """A stand-in for the text capture: fixed states of every document, left-padded per batch."""

    def __init__(self, states: dict[int, torch.Tensor]) -> None:
        self.states_of, self.docs = states, [0]

    def states(self) -> list[torch.Tensor]:
        width = max(len(self.states_of[i]) for i in self.docs)
        rows = [torch.cat([torch.zeros(width - len(x), *x.shape[1:]), x])
                for x in (self.states_of[i] for i in self.docs)]  # fmt: skip
        return list(torch.stack(rows).unbind(2))  # L + 1 of (B, width, d)


def test_a_batch_run_again_in_halves_is_counted_once() -> None:
    from layerdiv.measurements import Attachment, RunCapture
    from layerdiv.measurements.lens_stats import lens_stats_rows
    from layerdiv.measurements.lens_stats.hooks import LensStatsCapture

    gen = torch.Generator().manual_seed(0)
    states = {i: torch.randn(2 + i, 3, 4, generator=gen) for i in range(5)}  # (T, L + 1, d)
    text = _States(states)
    hooks = LensStatsCapture(Attachment(None, None, "text", {}, None))
    hooks.bind(text)  # type: ignore[arg-type]
    assert isinstance(hooks, RunCapture)
    values: dict[int, Any] = {}

    def pass_over(docs: list[int]) -> None:
        hooks.reset()
        hooks.batch(docs, [len(states[i]) for i in docs])
        text.docs = docs
        hooks.decomposed(None)  # type: ignore[arg-type]
        values.update(zip(docs, hooks.result(), strict=True))

    hooks.begin([0, 1, 2, 3])
    pass_over([3, 2])
    pass_over([1, 0])  # fails after its pass: run again in halves
    pass_over([1])
    pass_over([0])
    table = lens_stats_rows([0, 1, 2, 3], [values[i] for i in range(4)])["lens_stats"]
    hooks.begin([4])  # the next run: its sums are its own
    pass_over([4])
    alone = lens_stats_rows([4], [values[4]])["lens_stats"]
    x = torch.cat([states[i] for i in range(4)]).double().numpy()
    assert table["tokens"].to_pylist() == [len(x)] * 2 and alone["tokens"][0].as_py() == 6
    hh = np.asarray(table["sum_hh"].to_pylist()).reshape(2, 4, 4)
    assert relative(hh, np.einsum("tli,tlj->lij", x[:, :2], x[:, :2])) <= 1e-12
    hf = np.asarray(table["sum_hfinal"].to_pylist()).reshape(2, 4, 4)
    assert relative(hf, np.einsum("tli,tj->lij", x[:, :2], x[:, 2])) <= 1e-12
    with pytest.raises(LensStatsError, match="are not one run"):
        lens_stats_rows([0, 1, 2, 3, 4], [values[i] for i in range(5)])


def test_the_declared_cost_counts_the_two_products() -> None:
    shape = type("Shape", (), {"layers": 30, "d": 576})()
    assert lens_stats_cost(shape, "text", 100, {}) == 4 * 30 * 576**2 * 100
