"""Future effects (``extract --skips`` on a text task, methods §9) against an
independent reference: a plain HF forward of the whole model per (document, split point, skipped
block), one document at a time, float64, with the removal done by forward hooks on the block (its
output replaced by its input) or on its attention or MLP (their output zeroed)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner
from polars.testing import assert_frame_equal

from layerdiv.analyze.api import analyze
from layerdiv.cli import main
from layerdiv.extract.adapters import adapter_for, get_module, hidden_of, prepare_model
from layerdiv.store import Store
from tests.test_text_extract import extract, random_texts, refused, text_task
from tests.tolerance import FLOAT32


def documented_splits(n_tokens: int, doc: int, seed: int = 0) -> list[int]:
    """The split points as the docs describe them: up to 4 of 8, 16, ... < T - 4, drawn by
    ``numpy.random.default_rng([seed, doc]).choice(..., replace=False)``."""
    candidates = np.arange(8, n_tokens - 4, 8)
    rng = np.random.default_rng([seed, doc])
    return sorted(rng.choice(candidates, size=min(4, len(candidates)), replace=False).tolist())


def run(
    model: Any, ids: list[int], hook: Any = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Every block's input h_j and update d_j (T, d) and the output logits (T, V) of one
    document, with ``hook`` (module, hook function) attached."""
    inputs: list[torch.Tensor] = []
    updates: list[torch.Tensor] = []

    def keep(module: Any, args: tuple, kwargs: dict, out: Any) -> None:
        h = hidden_of(args, kwargs)
        inputs.append(h[0])
        updates.append(((out[0] if isinstance(out, tuple) else out) - h)[0])

    handles = [layer.register_forward_hook(keep, with_kwargs=True) for layer in layers_of(model)]
    if hook is not None:
        handles.append(hook[0].register_forward_hook(hook[1], with_kwargs=True, prepend=True))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    return inputs, updates, logits


def layers_of(model: Any) -> list[Any]:
    """The model's decoder blocks, found through its family's adapter."""
    return list(get_module(model, adapter_for(prepare_model(model).config).blocks))


def removal(model: Any, block: int, sublayer: str, lo: int, hi: int) -> tuple[Any, Any]:
    """A forward hook removing ``sublayer`` of ``block`` at positions lo..hi-1."""
    layer = layers_of(model)[block]
    adapter = adapter_for(model.config)
    module = layer if sublayer == "block" else get_module(layer, getattr(adapter, sublayer))

    def hook(mod: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        first = out[0] if isinstance(out, tuple) else out
        new = first.clone()
        if sublayer == "block":  # the block's output replaced by its input
            new[:, lo:hi] = hidden_of(args, kwargs)[:, lo:hi]
        else:  # the sublayer adds nothing
            new[:, lo:hi] = 0
        return (new, *out[1:]) if isinstance(out, tuple) else new

    return module, hook


def reference(model: Any, ids: list[int], t: int, sublayer: str) -> tuple[np.ndarray, np.ndarray]:
    """rel_change (L, L) and out_change (L,) of one document and split point t (0: every
    position but the first removed, every position measured)."""
    _, d, z = run(model, ids)
    p = torch.softmax(z, dim=-1)
    n = len(layers_of(model))
    lo, hi, measured = 1, (t if t else len(ids)), t
    rel, out = np.zeros((n, n)), np.zeros(n)
    for block in range(n):
        _, d2, z2 = run(model, ids, removal(model, block, sublayer, lo, hi))
        for j in range(n):
            change = (d2[j] - d[j]).norm(dim=-1) / d[j].norm(dim=-1).clamp(min=1e-6)
            rel[block, j] = change[measured:].max()
        out[block] = (torch.softmax(z2, dim=-1) - p).norm(dim=-1)[measured:].max()
    return rel, out


def rounding(model: Any, ids: list[int], t: int) -> tuple[np.ndarray, float]:
    """The float32 rounding of the stored future effects of one document and split point t, from
    its clean float64 pass (:data:`~tests.tolerance.FLOAT32` of the magnitudes each is computed
    from): per block j, rel_change(l, j) = max ||d'_j - d_j|| / max(||d_j||, 1e-6) holds updates
    that are differences of states of norm ||h_j||, so FLOAT32 * ||h_j|| / max(||d_j||, 1e-6) at
    the measured positions; out_change = max ||softmax(z') - softmax(z)||_2, with d softmax(z) =
    p * (dz - p . dz) for logit errors dz of FLOAT32 * max |z|, so 2 FLOAT32 * max |z| * ||p||_2."""
    h, d, z = run(model, ids)
    rel = [(hj.norm(dim=-1) / dj.norm(dim=-1).clamp(min=1e-6))[t:].max().item()
           for hj, dj in zip(h, d, strict=True)]  # fmt: skip
    p = torch.softmax(z, dim=-1)[t:]
    out = 2 * z[t:].abs().amax(dim=-1) * p.norm(dim=-1)
    return FLOAT32 * np.array(rel), FLOAT32 * out.max().item()


def stored(store: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    st = Store(store)
    effects = st.scan("future_effects").collect().with_columns(pl.col("sublayer").cast(pl.String))
    output = st.scan("future_output").collect().with_columns(pl.col("sublayer").cast(pl.String))
    return effects.sort("doc", "split", "sublayer", "skipped", "block"), output


def check(store: Path, model: Any, tokenizer: Any, texts: list[str], max_tokens: int,
          sublayers: list[str], split_all: bool = False) -> int:  # fmt: skip
    """Compare every stored row with the reference; return the rows compared."""
    effects, output = stored(store)
    n = len(layers_of(model))
    compared = 0
    for doc, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"][:max_tokens]
        splits = [0] if split_all else documented_splits(len(ids), doc)
        mine = effects.filter(pl.col("doc") == doc)
        assert sorted(set(mine["split"].to_list())) == splits
        assert mine.height == len(splits) * len(sublayers) * n * n
        for t in splits:
            rel_rounding, out_rounding = rounding(model, ids, t)
            for sub in sublayers:
                rel, out = reference(model, ids, t, sub)
                rows = mine.filter((pl.col("split") == t) & (pl.col("sublayer") == sub))
                got = rows["rel_change"].to_numpy().reshape(n, n)
                # 2e-3 of the value (the float32 pass against the float64 one) plus the rounding
                # of the magnitudes it is computed from (rel_rounding per affected block j)
                assert np.all(np.abs(got - rel) <= 2e-3 * rel + rel_rounding), (doc, t, sub)
                o = (
                    output.filter(
                        (pl.col("doc") == doc)
                        & (pl.col("split") == t)
                        & (pl.col("sublayer") == sub)
                    )
                    .sort("skipped")["out_change"]
                    .to_numpy()
                )
                assert np.all(np.abs(o - out) <= 2e-3 * out + out_rounding), (doc, t, sub, o, out)
                if t > 0:  # the last block's future effects are 0 by construction, stored as 0
                    assert o[-1] == 0 and not got[-1].any()
                compared += 1
    return compared


@pytest.mark.numerical
def test_future_effects_match_an_independent_float64_reference(
    tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any
) -> None:
    texts = [*random_texts(6, seed=3), "the cat sat"]  # the last has no split point
    task = text_task(tmp_path / "task", texts, max_tokens=40)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
                  "--skips", "--lens", "--skip-sublayer", "block", "--skip-sublayer", "attn",
                  "--skip-sublayer", "mlp", "--batch-size", "3", "--chunk-size", "4")  # fmt: skip
    assert out.exit_code == 0, out.output
    (info,) = Store(store).partitions
    m = info.manifest
    want = {"skip_split": "random", "skip_seed": 0, "skip_sublayers": ["block", "attn", "mlp"],
            "skip_modes": ["total"]}  # fmt: skip
    assert m.settings["future_effects"] == want
    assert {"future_effects", "future_output"} <= set(info.tables)
    model = build_model("llama").to(torch.float64)
    compared = check(store, model, tokenizer, texts, 40, ["block", "attn", "mlp"])
    assert compared >= 20  # documents with several split points were compared
    effects, _ = stored(store)
    assert effects.filter(pl.col("doc") == 6).height == 0
    # blocks before the skipped one are not affected (not run again), nor is the skipped block
    # itself at p >= t: zeros by construction, stored as exact zeros
    assert not effects.filter(pl.col("block") <= pl.col("skipped"))["rel_change"].to_numpy().any()
    assert effects.filter(pl.col("block") > pl.col("skipped"))["rel_change"].to_numpy().min() > 0


@pytest.mark.numerical
def test_skip_split_all_matches_the_reference(
    tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any
) -> None:
    texts = random_texts(3, seed=4)
    task = text_task(tmp_path / "task", texts, max_tokens=8)  # too short for split points
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
                  "--skips", "--skip-split", "all")  # fmt: skip
    assert out.exit_code == 0, out.output
    model = build_model("llama").to(torch.float64)
    assert check(store, model, tokenizer, texts, 8, ["block"], split_all=True) == 3
    _, output = stored(store)  # the removed positions are measured: the last block's is computed
    last = output.filter(pl.col("skipped") == len(layers_of(model)) - 1)["out_change"]
    assert last.to_numpy().min() > 0


def test_skip_split_all_stores_nothing_for_a_document_of_one_token(
    tmp_path: Path, model_dirs: Any, tokenizer: Any
) -> None:
    texts = [*random_texts(2, seed=6), "x"]
    assert len(tokenizer("x")["input_ids"]) == 1  # nothing to remove: no row, not a 0.0
    task = text_task(tmp_path / "task", texts, max_tokens=8)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
                  "--skips", "--skip-split", "all")  # fmt: skip
    assert out.exit_code == 0, out.output
    effects, output = stored(store)
    assert effects.filter(pl.col("doc") == 2).height == 0
    assert output.filter(pl.col("doc") == 2).height == 0
    assert set(output["doc"].to_list()) == {0, 1}


def test_future_effects_resume_backfill_and_settings(tmp_path: Path, model_dirs: Any) -> None:
    texts = random_texts(8, seed=5)
    task = text_task(tmp_path / "task", texts, max_tokens=30)
    store, model = tmp_path / "store", str(model_dirs("llama"))
    base = ["--model", model, "--task", str(task), "--store", str(store), "--chunk-size", "4"]
    assert extract(*base, "--limit", "4").exit_code == 0
    out = extract(*base, "--skips", "--skip-seed", "7")  # backfill 0..3, new 4..7
    assert out.exit_code == 0, out.output
    assert "added future_effects, future_output to 4 stored documents" in out.output
    (info,) = Store(store).partitions
    assert info.manifest.settings["future_effects"]["skip_seed"] == 7 and not info.incomplete()
    _, output = stored(store)
    for doc in range(8):
        n = len(Store(store).scan("tokens").filter(pl.col("doc") == doc).collect())
        got = sorted(set(output.filter(pl.col("doc") == doc)["split"].to_list()))
        assert got == documented_splits(n, doc, seed=7)
    again = extract(*base, "--skips")  # the stored settings are kept: nothing to do
    assert again.exit_code == 0, again.output
    assert Store(store).partitions[0].manifest.settings["future_effects"]["skip_seed"] == 7
    other = CliRunner().invoke(main, ["extract", *base, "--skips", "--skip-split", "all"])
    assert other.exit_code != 0
    assert (
        "the stored future_effects was extracted with --skips --skip-split random" in other.output
    )


def test_bad_skip_input_is_refused_in_one_line(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    model = str(model_dirs("llama"))
    choice = make_task(tmp_path / "a", n=4)
    line = refused(tmp_path, model, choice, "--skips", "--skip-split", "all")
    assert "--skip-split applies to text tasks only" in line
    text = text_task(tmp_path / "b", ["the cat sat on the warm mat"], max_tokens=12)
    assert "leaves none" in refused(tmp_path, model, text, "--skips")
    assert "add --skips" in refused(tmp_path, model, text, "--skip-sublayer", "attn")


@pytest.mark.numerical
@pytest.mark.slow
def test_smollm2_future_effects_on_bbc_news(tmp_path: Path) -> None:
    from layerdiv.demo import bbc_articles
    from layerdiv.extract.models import load_model, load_tokenizer, resolve_source

    texts = [row["text"] for row in bbc_articles(paragraphs=3)[7::300][:1]]
    task = text_task(tmp_path / "task", texts, max_tokens=20)
    store = tmp_path / "store"
    out = extract("--model", "smollm2-135m-instruct", "--task", str(task), "--store", str(store),
                  "--skips")  # fmt: skip
    assert out.exit_code == 0, out.output
    source = resolve_source("smollm2-135m-instruct", None, None, False)
    tokenizer = load_tokenizer(source)
    loaded = load_model(source, tokenizer, torch.device("cpu"), torch.float64)
    assert check(store, loaded.model, tokenizer, texts, 20, ["block"]) == 1


def test_killed_run_shows_its_whole_documents_then_resumes_exactly(
    tmp_path: Path, model_dirs: Any
) -> None:
    """kill -9 during ``extract --skips --lens`` on a text task: ls, query and analyze agree on
    the documents whose chunks are complete (every optional table read, none reported missing),
    and the rerun stores each document once, as an uninterrupted run does."""
    n = 200
    task = text_task(tmp_path / "task", random_texts(n, seed=9), max_tokens=20)
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--chunk-size", "2",
            "--batch-size", "1", "--skips", "--lens"]  # fmt: skip
    whole, store = tmp_path / "whole", tmp_path / "store"
    assert extract(*args, "--store", str(whole)).exit_code == 0
    cmd = [sys.executable, "-m", "layerdiv.cli", "extract", *args, "--store", str(store)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(store.glob("documents/**/part-*.parquet"))) >= 3:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (info,) = Store(store).partitions
    done = info.n_done
    assert 6 <= done < n // 2, "the run must be killed mid-way"
    assert info.tables == ["token_lens", "future_effects", "future_output"]

    listed = CliRunner().invoke(main, ["ls", "--store", str(store)])
    assert (
        listed.exit_code == 0 and f"{done} " in listed.output and "future_output" in listed.output
    )
    sql = ("SELECT (SELECT count(*) FROM documents) AS docs, "
           "(SELECT count(DISTINCT doc) FROM future_output) AS with_splits")  # fmt: skip
    query = CliRunner().invoke(main, ["query", sql, "--store", str(store), "--out",
                                      str(tmp_path / "n.csv")])  # fmt: skip
    assert query.exit_code == 0, query.output
    counts = pl.read_csv(tmp_path / "n.csv").row(0, named=True)
    assert counts["docs"] == done and 0 < counts["with_splits"] <= done
    partial = analyze(store)
    assert {"text_lens", "text_skips", "text_depth_score"} <= set(partial.names())
    assert not [note for note in partial.notes if note.startswith("No ")], partial.notes
    assert partial.text_depth_score["n_documents"].sum() == counts["with_splits"]

    subprocess.run(cmd, check=True, capture_output=True)  # resume
    for table in ("future_effects", "future_output", "token_lens", "documents"):
        got, want = (Store(s).scan(table).collect() for s in (store, whole))
        assert_frame_equal(got.sort(got.columns), want.sort(want.columns))
    assert_frame_equal(analyze(store).text_skips, analyze(whole).text_skips)
