"""Residual states (``extract --states``, methods §11): the stored states against a
plain HF forward pass (``output_hidden_states``, and the final norm's input for h_L), the
sampled positions, the stored dtypes, resume settings and the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
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
    key, tokens, states = info.states()
    return key, tokens, states, info.manifest


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return random_texts(7, seed=3)


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-5), ("float16", 1e-3),
                                             ("bfloat16", 8e-3)])  # fmt: skip
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
    from layerdiv.schemas import tables_of

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
    for part in store.glob("tokens/**/*.parquet"):  # version 4's tokens have no loss
        pq.write_table(pq.read_table(part).drop(["loss"]), part, write_page_checksum=True)
    for part in store.glob("token_blocks/**/*.parquet"):  # nor its token_blocks h_embed
        pq.write_table(pq.read_table(part).drop(["h_embed"]), part, write_page_checksum=True)
    assert "states" not in tables_of(4) and "states" in tables_of(5)
    (info,) = Store(store).select()
    assert info.manifest.schema_version == 4 and "states" not in info.manifest.settings
    assert "text_geometry" in layerdiv.run_analysis(store).names()
    with pytest.raises(layerdiv.LayerdivError, match="no selected partition has states"):
        layerdiv.run_analysis(store, maps="all")
