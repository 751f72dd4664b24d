"""Learned lenses at extraction (``extract --lens-ls FILE``, ``--lens-tuned FILE``, methods §17):
identity translators give the logit lens's numbers, a least-squares lens fitted here with numpy
matches an independent float64 readout, and translators of other weights or a resume with other
translators are refused before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner

from layerdiv.cli import main
from layerdiv.extract.adapters import adapter_for, get_module, prepare_model
from layerdiv.store import Store
from layerdiv.store.translators import Translators, save_translators
from tests.test_text_extract import (
    assert_lens_close,
    extract,
    random_texts,
    reference_lens,
    text_task,
)
from tests.tolerance import assert_within

VALUES = ["kl", "top5_overlap", "ce"]


def identity(fingerprint: str, blocks: int, d: int, kind: str = "ls", task: str = "train") -> Any:
    A = np.broadcast_to(np.eye(d, dtype=np.float32), (blocks, d, d)).copy()
    return Translators(kind, A, np.zeros((blocks, d), np.float32), fingerprint, task)


def lens_rows(store: Path, table: str) -> pl.DataFrame:
    return Store(store).scan(table).collect().sort("doc", "pos", "layer")


def written(store: Path) -> list[Path]:
    """The files under ``store`` (a refusal after the weights load may leave its empty folder)."""
    return [p for p in store.rglob("*") if p.is_file()]


def one_line_error(args: list[str]) -> str:
    out = CliRunner().invoke(main, ["extract", *args])
    assert out.exit_code != 0
    # the model's loading bar may come first (a check against its weights follows it)
    lines = [line for line in out.output.splitlines() if line.strip() and "Loading" not in line]
    assert len(lines) == 1 and lines[0].startswith("Error:"), out.output
    return lines[0]


def test_identity_translators_give_the_logit_lens_and_others_are_refused(
    tmp_path: Path, model_dirs: Any
) -> None:
    task = text_task(tmp_path / "task", random_texts(6, seed=3), max_tokens=20)
    store = tmp_path / "store"
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
            "--chunk-size", "3"]  # fmt: skip
    assert extract(*args, "--lens", "--limit", "3").exit_code == 0
    manifest = Store(store).partitions[0].manifest
    fingerprint, blocks, d = manifest.weights_fingerprint, manifest.n_blocks, manifest.hidden_size
    assert d is not None
    file = tmp_path / "ls.safetensors"
    t = identity(fingerprint, blocks, d)
    save_translators(file, t)

    # added to the stored chunks (a backfill), beside the logit lens, which stays as it was
    logit = lens_rows(store, "token_lens")
    out = extract(*args, "--lens-ls", str(file), "--limit", "3")
    assert out.exit_code == 0 and "tables added to 3 stored" in out.output, out.output
    assert lens_rows(store, "token_lens").equals(logit)
    recorded = Store(store).partitions[0].manifest.settings["lens_ls"]
    assert recorded == {"lens_ls": str(file), "kind": "ls", "fingerprint": t.fingerprint,
                        "task": "train"}  # fmt: skip

    # a resume with other translators (another file at the same path, or the same at another
    # path) is refused before anything is written
    before = lens_rows(store, "token_lens_ls")
    save_translators(file, Translators("ls", t.A, t.b + 1.0, fingerprint, "train"))
    assert "fingerprint" in one_line_error([*args, "--lens", "--lens-ls", str(file)])
    moved = tmp_path / "moved.safetensors"
    save_translators(moved, t)
    assert "--overwrite" in one_line_error([*args, "--lens", "--lens-ls", str(moved)])
    assert lens_rows(store, "token_lens_ls").equals(before)
    assert Store(store).partitions[0].manifest.settings["lens_ls"] == recorded

    # the rest of the documents with the same translators: identity gives the logit lens
    save_translators(file, t)
    assert extract(*args, "--lens", "--lens-ls", str(file)).exit_code == 0
    logit, learned = lens_rows(store, "token_lens"), lens_rows(store, "token_lens_ls")
    assert learned.height == logit.height and logit["doc"].n_unique() == 6
    for column in ("doc", "pos", "layer", "final_rank", "top1"):
        assert learned[column].to_list() == logit[column].to_list(), column
    scale = float(np.nanmax(logit["ce"].to_numpy()))  # log-probabilities' size, about log V
    for column in VALUES:
        assert_within(learned[column].to_numpy(), logit[column].to_numpy(), scale, what=column)

    # other weights, another shape, another kind, a damaged file: refused, nothing written
    fresh = tmp_path / "fresh"
    cases = {
        "other-weights": (identity("0" * 64, blocks, d), "--lens-ls", "fitted on weights"),
        "other-shape": (identity(fingerprint, blocks + 1, d), "--lens-ls", "translators for"),
        "other-kind": (identity(fingerprint, blocks, d, "tuned"), "--lens-ls", "--lens-tuned"),
    }
    for name, (translators, flag, message) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_translators(path, translators)
        new = ["--model", args[1], "--task", str(task), "--store", str(fresh), flag, str(path)]
        assert message in one_line_error(new), name
        assert not written(fresh), name
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(file.read_bytes()[:-7])
    new = ["--model", args[1], "--task", str(task), "--store", str(fresh), "--lens-ls"]
    assert "not a readable translators file" in one_line_error([*new, str(damaged)])
    assert not written(fresh)


@pytest.mark.numerical
def test_a_least_squares_lens_matches_an_independent_float64_readout(
    tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any
) -> None:
    model = build_model("llama").to(torch.float64)
    adapter = adapter_for(prepare_model(model).config)
    blocks = len(get_module(model, adapter.blocks))
    # fitted on one set of documents (numpy, float64: [h_l, 1] -> h_L by least squares) ...
    train = [tokenizer(t)["input_ids"][:24] for t in random_texts(20, seed=7)]
    with torch.no_grad():
        hidden = [model(torch.tensor([ids]), output_hidden_states=True).hidden_states
                  for ids in train]  # fmt: skip
    # h_L: the last residual state, the final norm's input (hidden_states[L] is its output)
    captured: list[np.ndarray] = []
    norm = get_module(model, adapter.final_norm)
    handle = norm.register_forward_hook(lambda m, i, o: captured.append(i[0][0].numpy()))
    with torch.no_grad():
        for ids in train:
            model(torch.tensor([ids]))
    handle.remove()
    target = np.concatenate(captured)
    A, b = [], []
    for layer in range(blocks):
        h = np.concatenate([x[layer][0].numpy() for x in hidden])
        coef = np.linalg.lstsq(np.hstack([h, np.ones((len(h), 1))]), target, rcond=None)[0]
        A.append(coef[:-1].T)
        b.append(coef[-1])
    task = text_task(tmp_path / "task", random_texts(5, seed=8), max_tokens=24)
    store = tmp_path / "store"
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store)]
    assert extract(*args, "--lens").exit_code == 0
    fingerprint = Store(store).partitions[0].manifest.weights_fingerprint
    t = Translators("ls", np.stack(A), np.stack(b), fingerprint, "train", {"lambda": 0.0})
    save_translators(tmp_path / "ls.safetensors", t)
    out = extract(*args, "--lens-ls", str(tmp_path / "ls.safetensors"))
    assert out.exit_code == 0, out.output

    # ... scored on others, against p_l^T = softmax(W_U norm(A_l h_l + b_l)) in float64
    def translate(layer: int, h: torch.Tensor) -> torch.Tensor:
        return h @ torch.from_numpy(t.A[layer]).T + torch.from_numpy(t.b[layer])

    rows = lens_rows(store, "token_lens_ls")
    logit = lens_rows(store, "token_lens")
    layers = blocks + 1
    for doc, text in enumerate(random_texts(5, seed=8)):
        ids = tokenizer(text)["input_ids"][:24]
        mine = rows.filter(pl.col("doc") == doc).select(VALUES).to_numpy()
        want = reference_lens(model, ids, translate)
        assert_lens_close(mine.reshape(-1, layers, 3), want)
    # a fitted lens is closer to the output than the logit lens at the first block input
    first = pl.col("layer") == 0
    assert rows.filter(first)["kl"].mean() < logit.filter(first)["kl"].mean()  # type: ignore[operator]


def test_shards_merge_with_the_same_translators_only(tmp_path: Path, model_dirs: Any) -> None:
    task = text_task(tmp_path / "task", random_texts(4, seed=4), max_tokens=12)
    model = str(model_dirs("llama"))
    file = tmp_path / "ls.safetensors"

    def shard(i: int, store: str, t: Translators) -> None:
        save_translators(file, t)
        out = extract("--model", model, "--task", str(task), "--store", str(tmp_path / store),
                      "--chunk-size", "2", "--shard", f"{i}/2", "--lens-ls", str(file))  # fmt: skip
        assert out.exit_code == 0, out.output

    probe = ["--model", model, "--task", str(task), "--store", str(tmp_path / "probe")]
    assert extract(*probe, "--limit", "1").exit_code == 0
    m = Store(tmp_path / "probe").partitions[0].manifest
    assert m.hidden_size is not None
    t = identity(m.weights_fingerprint, m.n_blocks, m.hidden_size)
    fingerprint = m.weights_fingerprint
    other = Translators("ls", t.A, t.b + 0.5, fingerprint, "train")
    shard(0, "a", t)
    shard(1, "b", t)
    shard(1, "c", other)

    def merge(*stores: str) -> Any:
        paths = [str(tmp_path / s) for s in stores]
        into = str(tmp_path / f"m-{''.join(stores)}")
        return CliRunner().invoke(main, ["merge", *paths, "--into", into])

    assert merge("a", "b").exit_code == 0
    (info,) = Store(tmp_path / "m-ab").partitions
    assert info.n_done == 4 and info.tables == ["token_lens_ls"] and not info.incomplete()
    refused = merge("a", "c")
    assert refused.exit_code != 0 and "lens_ls" in refused.output, refused.output
