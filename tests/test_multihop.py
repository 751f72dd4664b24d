"""Answer-anchored split points and local (direct-only) future effects (methods §10) against an
independent float64 reference, on a tiny random model and on SmolLM2, over the handwritten
multi-hop questions of ``tasks/data/multihop``; their bad input refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch

from layerdiv.demo import MULTIHOP_DATA
from layerdiv.extract.adapters import hidden_of
from layerdiv.store import Store
from tests.test_future_effects import reference, rounding, stored
from tests.test_text_extract import extract, refused, text_task


def multihop_task(folder: Path, **overrides: Any) -> Path:
    """The handwritten multi-hop task copied to ``folder`` (``overrides`` replace its keys)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(MULTIHOP_DATA / "questions.jsonl", folder)
    import yaml

    spec = {**yaml.safe_load((MULTIHOP_DATA / "multihop.yaml").read_text()), **overrides}
    (folder / "multihop.yaml").write_text(json.dumps(spec))
    return folder / "multihop.yaml"


SHORT = {"text": "Q: {{ question[-24:] }}\nA:", "answer": " {{ answer[:28] }}"}
"""The tiny model's form of the task (its context is 64 tokens of a 400-token vocabulary)."""


def documents(short: bool = False) -> list[tuple[str, str]]:
    """(document, answer) of every question as the task builds them: text + answer."""
    lines = (MULTIHOP_DATA / "questions.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    if short:
        return [(f"Q: {r['question'][-24:]}\nA: {r['answer'][:28]}", f" {r['answer'][:28]}")
                for r in rows]  # fmt: skip
    return [(f"Question: {r['question']}\nAnswer: {r['answer']}", f" {r['answer']}") for r in rows]


def documented_splits(tokenizer: Any, document: str, answer: str, doc: int, rule: str) -> list[int]:
    """The split points as methods §10 describes them: s = T - A (the answer tokenized alone,
    without special tokens); ``answer``: [s]; ``answer:N:S``: N of s + {0, S, ...} with offsets
    < A - 4, drawn by ``numpy.random.default_rng([0, doc]).choice(..., replace=False)``."""
    a = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
    s = len(tokenizer(document)["input_ids"]) - a
    if rule == "answer":
        return [s]
    _, n, step = rule.split(":")
    candidates = s + np.arange(0, a - 4, int(step))
    rng = np.random.default_rng([0, doc])
    return sorted(rng.choice(candidates, size=min(int(n), len(candidates)), replace=False).tolist())


def local_reference(model: Any, ids: list[int], t: int) -> np.ndarray:
    """rel_change_local (L, L) of one document and split t, float64: for skipped block l, every
    block i >= l has its output at positions 1..t-1 set (a forward hook) to its clean output minus
    block l's clean update d_l; d'_i is what block i computed before that override."""
    layers = model.model.layers
    n = len(layers)
    clean_in: list[torch.Tensor] = []
    clean_out: list[torch.Tensor] = []

    def keep(module: Any, args: tuple, kwargs: dict, out: Any) -> None:
        clean_in.append(hidden_of(args, kwargs)[0])
        clean_out.append((out[0] if isinstance(out, tuple) else out)[0])

    handles = [layer.register_forward_hook(keep, with_kwargs=True) for layer in layers]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for handle in handles:
        handle.remove()
    d = [o - i for i, o in zip(clean_in, clean_out, strict=True)]
    rel = np.zeros((n, n))

    def override(i: int, skipped: int, changes: dict[int, torch.Tensor]) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict, out: Any) -> Any:
            first = out[0] if isinstance(out, tuple) else out
            h = hidden_of(args, kwargs)
            change = ((first - h)[0] - d[i]).norm(dim=-1)
            changes[i] = change / d[i].norm(dim=-1).clamp(min=1e-6)
            new = clean_out[i][None].clone()
            new[:, 1:t] -= d[skipped][1:t]
            return (new, *out[1:]) if isinstance(out, tuple) else new

        return hook

    for skipped in range(n):
        changes: dict[int, torch.Tensor] = {}
        handles = [
            layers[i].register_forward_hook(override(i, skipped, changes), with_kwargs=True)
            for i in range(skipped, n)
        ]
        with torch.no_grad():
            model(torch.tensor([ids]))
        for handle in handles:
            handle.remove()
        for i in range(skipped, n):
            rel[skipped, i] = changes[i][t:].max()
    return rel


def check_answer_splits(
    store: Path,
    model: Any,
    tokenizer: Any,
    rule: str,
    modes: list[str],
    short: bool = True,
    limit: int = 12,
) -> int:
    """Every stored row against the references; returns the (document, split) pairs compared."""
    effects, output = stored(store)
    effects = effects.with_columns(pl.col("mode").cast(pl.String))
    n = len(model.model.layers)
    compared = 0
    for doc, (document, answer) in enumerate(documents(short)[:limit]):
        ids = tokenizer(document)["input_ids"]
        assert not short or len(ids) < 64  # not cut to the tiny model's context
        splits = documented_splits(tokenizer, document, answer, doc, rule)
        mine = effects.filter(pl.col("doc") == doc)
        assert sorted(set(mine["split"].to_list())) == splits, (doc, splits)
        for t in splits:
            # 2e-3 of each value plus the float32 rounding of what it is computed from
            rel_rounding, out_rounding = rounding(model, ids, t)
            for mode in modes:
                rows = mine.filter((pl.col("split") == t) & (pl.col("mode") == mode))
                got = rows.sort("skipped", "block")["rel_change"].to_numpy().reshape(n, n)
                if mode == "total":
                    rel, out = reference(model, ids, t, "block")
                    mine_out = output.filter((pl.col("doc") == doc) & (pl.col("split") == t))
                    o = mine_out.sort("skipped")["out_change"].to_numpy()
                    assert np.all(np.abs(o - out) <= 2e-3 * out + out_rounding), (doc, t, o, out)
                else:
                    rel = local_reference(model, ids, t)
                ok = np.abs(got - rel) <= 2e-3 * rel + rel_rounding
                assert ok.all(), (doc, t, mode, got, rel)
            compared += 1
    return compared


@pytest.mark.numerical
@pytest.mark.parametrize("rule", ["answer", "answer:3:2"])
def test_answer_splits_match_the_float64_reference(
    rule: str, tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any
) -> None:
    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
                  "--skips", "--skip-split", rule, "--batch-size", "3")  # fmt: skip
    assert out.exit_code == 0, out.output
    assert Store(store).partitions[0].manifest.settings["future_effects"]["skip_split"] == rule
    # documents.answer_start: s = T - A (methods §10), the answer's own tokens counted alone
    stored_starts = Store(store).scan("documents").collect().sort("doc")["answer_start"]
    want = [len(tokenizer(d)["input_ids"])
            - len(tokenizer(a, add_special_tokens=False)["input_ids"])
            for d, a in documents(True)[:12]]  # fmt: skip
    assert stored_starts.to_list() == want
    # tokens.piece: each token as the vocabulary spells it
    tokens = Store(store).scan("tokens").filter(pl.col("doc") == 0).collect().sort("pos")
    assert tokens["piece"].to_list() == tokenizer.convert_ids_to_tokens(tokens["token"].to_list())
    model = build_model("llama").to(torch.float64)
    assert check_answer_splits(store, model, tokenizer, rule, ["total"]) >= 12


def test_bad_answer_split_input_is_refused_in_one_line(tmp_path: Path, model_dirs: Any) -> None:
    model = str(model_dirs("llama"))
    plain = text_task(tmp_path / "a", ["the cat sat on the warm mat by the door of the house"])
    line = refused(tmp_path, model, plain, "--skips", "--skip-split", "answer")
    assert "names none; add an 'answer' template" in line
    short = multihop_task(tmp_path / "b", answer=" {{ answer[:2] }}")
    line = refused(tmp_path, model, short, "--skips", "--skip-split", "answer:4:4")
    assert "document 0's answer is" in line and "at least 5" in line


@pytest.mark.numerical
def test_local_effects_match_the_float64_reference(
    tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any
) -> None:
    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
                  "--skips", "--skip-split", "answer:2:3", "--skip-mode", "total",
                  "--skip-mode", "local", "--batch-size", "4")  # fmt: skip
    assert out.exit_code == 0, out.output
    settings = Store(store).partitions[0].manifest.settings["future_effects"]
    assert settings["skip_modes"] == ["total", "local"]
    model = build_model("llama").to(torch.float64)
    assert check_answer_splits(store, model, tokenizer, "answer:2:3", ["total", "local"]) >= 12
    effects, output = stored(store)
    local = effects.filter(pl.col("mode").cast(pl.String) == "local")
    total = effects.filter(pl.col("mode").cast(pl.String) == "total")
    assert local.height == total.height > 0
    assert output.height * total["block"].n_unique() == total.height  # total rows only
    # with two blocks no block lies between l and j to pass the change on: local is total
    keys = ["doc", "split", "skipped", "block"]
    gap = total.sort(keys)["rel_change"].to_numpy() - local.sort(keys)["rel_change"].to_numpy()
    assert np.abs(gap).max() < 1e-6


def test_local_mode_needs_the_whole_block_and_the_total_rows(
    tmp_path: Path, model_dirs: Any
) -> None:
    task = multihop_task(tmp_path / "task", **SHORT)
    model = str(model_dirs("llama"))
    line = refused(tmp_path, model, task, "--skips", "--skip-mode", "total", "--skip-mode",
                   "local", "--skip-sublayer", "attn")  # fmt: skip
    assert "--skip-mode local removes the whole block's update" in line
    line = refused(tmp_path, model, task, "--skips", "--skip-mode", "local")
    assert "give --skip-mode total --skip-mode local" in line


def test_a_version_4_store_reads_mode_as_total_and_proj_as_null(
    tmp_path: Path, model_dirs: Any
) -> None:
    import pyarrow.parquet as pq

    from layerdiv.analyze.api import analyze
    from layerdiv.measurements import tables_of

    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
                  "--skips")  # fmt: skip
    assert out.exit_code == 0, out.output
    want = Store(store).scan("future_effects").collect()
    dropped = {"future_effects": ["mode"], "tokens": ["loss", "piece"], "token_blocks": ["h_embed"],
               "documents": ["answer_start"]}  # fmt: skip
    for table in ("future_effects", "future_output", "tokens", "token_blocks", "documents"):
        for part in store.glob(f"{table}/**/*.parquet"):  # as version 4 wrote them
            old = pq.read_table(part).drop_columns(dropped.get(table, []))
            pq.write_table(old.cast(tables_of(4)[table]), part, write_page_checksum=True)
    path = next(store.glob("manifests/**/manifest.json"))
    data = json.loads(path.read_text())
    data["schema_version"] = 4
    data.pop("weights", None)
    data["settings"]["future_effects"].pop("skip_modes")
    path.write_text(json.dumps(data))
    (info,) = Store(store).partitions
    assert info.manifest.schema_version == 4 and "future_effects" in info.tables
    got = Store(store).scan("future_effects").collect()
    assert got["mode"].cast(pl.String).to_list() == ["total"] * want.height
    assert got.drop("mode").equals(want.drop("mode"))
    result = analyze(store)
    assert result.text_skips.height > 0
    assert result.text_geometry["proj_mean"].is_null().all()
    assert result.text_geometry["angle_final_mean"].is_not_null().all()
    modes = Store(store).duckdb().execute("SELECT DISTINCT mode FROM future_effects").fetchall()
    assert modes == [("total",)]


@pytest.mark.slow
def test_smollm2_answer_splits_and_local_effects(tmp_path: Path) -> None:
    from layerdiv.extract.models import load_model, load_tokenizer, resolve_source

    task = multihop_task(tmp_path / "task")
    store = tmp_path / "store"
    out = extract("--model", "smollm2-135m-instruct", "--task", str(task), "--store", str(store),
                  "--skips", "--skip-split", "answer", "--skip-mode", "total", "--skip-mode",
                  "local", "--limit", "1")  # fmt: skip
    assert out.exit_code == 0, out.output
    source = resolve_source("smollm2-135m-instruct", None, None, False)
    tokenizer = load_tokenizer(source)
    loaded = load_model(source, tokenizer, torch.device("cpu"), torch.float64)
    model, modes = loaded.model, ["total", "local"]
    assert check_answer_splits(store, model, tokenizer, "answer", modes, False, 1) == 1
    effects, _ = stored(store)
    by = effects.with_columns(pl.col("mode").cast(pl.String)).sort(
        "doc", "split", "skipped", "block"
    )
    total = by.filter(pl.col("mode") == "total")["rel_change"].to_numpy()
    local = by.filter(pl.col("mode") == "local")["rel_change"].to_numpy()
    # 30 blocks: the blocks between l and j pass the removed update's change on, so the total
    # effect differs from the direct one
    assert np.abs(total - local).max() > 0.05
