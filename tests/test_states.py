"""Residual states (``extract --states``, methods §11): the stored states against a
plain HF forward pass (``output_hidden_states``, and the final norm's input for h_L), the
sampled positions, the stored dtypes, resume settings and the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner

from layerdiv.cli import main
from layerdiv.store import Store
from tests.test_text_extract import random_texts, text_task


def extract(*args: str) -> Any:
    return CliRunner().invoke(main, ["extract", *args])


def hf_states(model: Any, ids: list[int]) -> np.ndarray:
    """(T, L + 1, d) float64: h_0..h_(L-1) from ``output_hidden_states``; h_L, which HF returns
    after the final norm, from a pre-hook on the final norm."""
    final: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_pre_hook(lambda m, a: final.append(a[0][0]))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    hs = [h[0] for h in out.hidden_states[:-1]] + final
    return torch.stack(hs, dim=1).double().numpy()


def stored_states(store: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any]:
    info = Store(store).select()[0]
    key, tokens, states, _ = info.states()
    return key, tokens, states, info.manifest


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return random_texts(7, seed=3)


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-5), ("float16", 1e-3),
                                             ("bfloat16", 8e-3)])  # fmt: skip
@pytest.mark.numerical
def test_states_match_hf(
    tmp_path: Path, model_dirs: Any, tokenizer: Any, texts: list[str], dtype: str, tol: float
) -> None:
    from transformers import AutoModelForCausalLM

    folder = model_dirs("llama")
    task = text_task(tmp_path / "task", texts, max_tokens=24)
    store = tmp_path / "store"
    r = extract("--model", str(folder), "--task", str(task), "--store", str(store),
                "--states", "5", "--states-dtype", dtype, "--states-seed", "7")  # fmt: skip
    assert r.exit_code == 0, r.output
    key, tokens, states, manifest = stored_states(store)
    assert manifest.settings["states"] == {"states": 5, "states_seed": 7, "states_dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for doc, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"][:24]
        every = np.arange(1, len(ids))
        want_pos = (
            every
            if len(ids) - 1 <= 5
            else np.sort(np.random.default_rng([7, doc]).choice(every, 5, replace=False))
        )
        rows = key[:, 0] == doc
        assert key[rows, 1].tolist() == want_pos.tolist()
        assert tokens[rows].tolist() == [ids[p] for p in want_pos]
        want = hf_states(model, ids)[want_pos]
        got = states[rows].astype(np.float64)
        scale = np.linalg.norm(want, axis=-1, keepdims=True)
        assert np.abs(got - want).max(initial=0) <= tol * scale.max()
        assert got.shape[1] == len(model.model.layers) + 1


@pytest.mark.numerical
def test_states_all_and_refusals(
    tmp_path: Path, model_dirs: Any, tokenizer: Any, texts: list[str]
) -> None:
    folder = model_dirs("llama")
    task = text_task(tmp_path / "task", texts, max_tokens=16)
    store = tmp_path / "store"
    args = ["--model", str(folder), "--task", str(task), "--store", str(store)]
    r = extract(*args, "--states", "all")
    assert r.exit_code == 0, r.output
    key, _, states, manifest = stored_states(store)
    n = [min(len(tokenizer(t)["input_ids"]), 16) for t in texts]
    assert len(key) == sum(k - 1 for k in n) and 0 not in key[:, 1]
    assert states.dtype == np.float16 and manifest.settings["states"]["states"] == "all"
    # other settings than the stored ones: one line naming both
    r = extract(*args, "--states", "3")
    assert r.exit_code != 0 and "the stored states was extracted with --states all" in r.output
    assert len(r.output.strip().splitlines()) == 1
    r = extract(*args, "--states-seed", "3")
    assert r.exit_code != 0 and "add --states" in r.output
    # a partition without states gets them backfilled
    r = extract(*args.copy()[:4], "--store", str(tmp_path / "s2"))
    assert r.exit_code == 0, r.output
    r = extract(*args.copy()[:4], "--store", str(tmp_path / "s2"), "--states", "all")
    assert r.exit_code == 0 and "added states" in r.output
    assert np.array_equal(stored_states(tmp_path / "s2")[2], states)


def test_float16_overflow_names_bfloat16(
    tmp_path: Path, build_model: Any, tokenizer: Any, texts: list[str]
) -> None:
    model = build_model("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1e8)
    folder = tmp_path / "big"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    task = text_task(tmp_path / "task", texts, max_tokens=16)
    store = tmp_path / "store"
    r = extract("--model", str(folder), "--task", str(task), "--store", str(store), "--states", "2")
    assert r.exit_code != 0
    errors = [line for line in r.output.splitlines() if "Error" in line]
    assert len(errors) == 1 and "does not fit float16; use --states-dtype bfloat16" in errors[0]
    assert not list((store / "states").rglob("*.parquet"))


def test_version_4_text_store_still_reads(
    tmp_path: Path, model_dirs: Any, texts: list[str]
) -> None:
    """A text partition written before states existed (schema version 4) reads, analyses, and
    ``--maps`` says it has no states."""
    import json

    import pyarrow.parquet as pq

    import layerdiv
    from layerdiv.measurements import tables_of

    task = text_task(tmp_path / "task", texts, max_tokens=12)
    store = tmp_path / "store"
    r = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store))
    assert r.exit_code == 0, r.output
    path = next(store.glob("manifests/**/manifest.json"))
    data = json.loads(path.read_text())
    for name in ("settings", "weights"):
        data.pop(name, None)  # fields of version 5
    data["schema_version"] = 4
    path.write_text(json.dumps(data))
    for part in store.glob("tokens/**/*.parquet"):  # version 4's tokens have no loss, no piece
        pq.write_table(pq.read_table(part).drop(["loss", "piece"]), part, write_page_checksum=True)
    for part in store.glob("documents/**/*.parquet"):  # nor its documents answer_start
        pq.write_table(pq.read_table(part).drop(["answer_start"]), part, write_page_checksum=True)
    for part in store.glob("token_blocks/**/*.parquet"):  # nor its token_blocks h_embed
        pq.write_table(pq.read_table(part).drop(["h_embed"]), part, write_page_checksum=True)
    assert "states" not in tables_of(4) and "states" in tables_of(5)
    (info,) = Store(store).select()
    assert info.manifest.schema_version == 4 and "states" not in info.manifest.settings
    assert "text_geometry" in layerdiv.run_analysis(store).names()
    with pytest.raises(
        layerdiv.LayerdivError, match=r"--maps \(the layers' states\): not extracted"
    ):
        layerdiv.run_analysis(store, maps="all")


@pytest.mark.numerical
def test_choice_states_last_prompt_token(
    tmp_path: Path,
    model_dirs: Any,
    tokenizer: Any,
    make_task: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A choice task stores h_0..h_L and the token id at each instance's last prompt token
    (methods §11) as a plain HF forward pass gives them; it resumes (a larger --limit adds the
    new instances' states, saying so first where they will be large), backfills onto a
    partition stored without them, is complete only where every stored chunk has them, and the
    maps run on them."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    import layerdiv

    folder = model_dirs("llama")
    task = make_task(tmp_path / "task", n=12)
    store = tmp_path / "store"
    args = ["--model", str(folder), "--task", str(task), "--store", str(store),
            "--chunk-size", "4"]  # fmt: skip
    r = extract(*args, "--limit", "8", "--states", "all", "--states-dtype", "float32")
    assert r.exit_code == 0, r.output
    # the 4 instances still to do, 3 layers x d 32 x float32: more than a lowered threshold
    monkeypatch.setattr("layerdiv.measurements.states.hooks.LARGE_BYTES", 4 * 3 * 32 * 4 - 1)
    r = extract(*args, "--limit", "12", "--states", "all")  # resumes with the stored settings
    assert r.exit_code == 0, r.output
    assert (
        "Warning: this run will write about 1.5 KiB of states (4 positions x 3 layers" in r.output
    )
    monkeypatch.setattr("layerdiv.measurements.states.hooks.LARGE_BYTES", 4 * 3 * 32 * 4)
    r = extract(*args, "--limit", "12", "--states", "all")
    assert r.exit_code == 0 and "Warning" not in r.output
    key, tokens, states, manifest = stored_states(store)
    assert manifest.settings["states"]["states_dtype"] == "float32"
    info = Store(store).select()[0]
    prompts = info.scan("instances").sort("instance").collect()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert key[:, 0].tolist() == list(range(12)) and states.shape[1] == len(model.model.layers) + 1
    for i, prompt in enumerate(prompts["prompt"]):
        ids = tokenizer(prompt)["input_ids"]
        assert key[i, 1] == len(ids) - 1 == prompts["n_tokens"][i] - 1
        assert tokens[i] == ids[-1]
        want = hf_states(model, ids)[-1]
        assert np.abs(states[i] - want).max() <= 1e-5 * np.linalg.norm(want, axis=-1).max()
    # backfill onto a partition stored without states; one chunk's part removed: incomplete
    other = [*args[:4], "--store", str(tmp_path / "s2"), "--chunk-size", "4", "--limit", "12"]
    assert extract(*other).exit_code == 0
    r = extract(*other, "--states", "all", "--states-dtype", "float32")
    assert r.exit_code == 0 and "added states" in r.output
    assert np.array_equal(stored_states(tmp_path / "s2")[2], states)
    part = sorted((tmp_path / "s2" / "states").rglob("*.parquet"))[1]
    assert pq.read_table(part).column_names == ["doc", "pos", "token", "layer", "char_end", "state"]
    part.unlink()
    (info,) = Store(tmp_path / "s2").select()
    assert "states" not in info.tables and "states left out" in info.incomplete()[0]
    slug = Store(store).select()[0].model
    maps = layerdiv.run_analysis(store, maps=f"{slug}:{slug}").layer_maps
    assert set(maps["n_heldout"]) == {2} and set(maps["n_train"]) == {10}
    assert maps["rel_error"].is_finite().all()
    # every prompt ends in the same token: h_0 is one vector, fitted (W = 0) by its mean
    assert len(set(tokens.tolist())) == 1
    first = maps.filter((pl.col("space") == "states") & (pl.col("source_layer") == 0))
    assert first.filter(pl.col("target_layer") == 0)["rel_error"].item() < 1e-12
