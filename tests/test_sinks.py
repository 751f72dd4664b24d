"""Attention sinks (``extract --sinks``, methods §16): the stored mean attention weight on the first
token against an independent float64 computation (the model in float64, eager attention,
``output_attentions``, one unit at a time), on both task kinds and on families with rotary,
grouped-query, sliding-window and parallel attention; slices of queries; resume, backfill and
merge; the model's output unchanged; the refusal of an unreadable family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner

from layerdiv.cli import main
from layerdiv.extract import runner
from layerdiv.extract.adapters import UnsupportedModel
from layerdiv.measurements.sinks.hooks import check_sinks
from layerdiv.store import Store
from tests.test_text_extract import random_texts, text_task

TOLERANCE = 1e-4
"""Of an attention weight (a probability: its scale is 1)."""


def extract(*args: str) -> Any:
    return CliRunner().invoke(main, ["extract", *args])


def reference(model: Any, ids: list[int]) -> np.ndarray:
    """(L, H) float64: the mean over query positions 1..T-1 of the attention weight on key 0,
    from ``output_attentions`` of one unpadded sequence."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    return np.stack([a[0, :, 1:, 0].double().mean(dim=-1).numpy() for a in out.attentions])


def float64_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="eager"
    ).eval()


def stored_sinks(store: Path) -> np.ndarray:
    """(units, L, H) of the store's one partition, from its rows in key order."""
    frame = Store(store).scan("sinks").collect().sort("doc", "block", "head")
    n, blocks, heads = (frame[c].n_unique() for c in ("doc", "block", "head"))
    assert frame["doc"].to_list() == np.repeat(np.arange(n), blocks * heads).tolist()
    return frame["bos_attention"].to_numpy().reshape(n, blocks, heads)


@pytest.fixture(scope="module")
def sliding_qwen2(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A tiny Qwen2 whose second block attends within a window of 4 positions."""
    import transformers as tf

    config = tf.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_sliding_window=True, sliding_window=4, max_window_layers=1,
    )  # fmt: skip
    assert config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2-sliding")
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def folder_of(family: str, model_dirs: Any, sliding: Path) -> Path:
    return sliding if family == "qwen2_sliding" else model_dirs(family)


FAMILIES = ("llama", "qwen2_sliding", "gpt_neox")


@pytest.mark.numerical
@pytest.mark.parametrize("family", FAMILIES)
def test_text_sinks_match_float64_attention(
    tmp_path: Path, model_dirs: Any, tokenizer: Any, sliding_qwen2: Path, family: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """In slices of 4 queries, each reading the keys up to its last query (the choice test
    below: one slice per prompt)."""
    from layerdiv.measurements.sinks import hooks as sinks

    monkeypatch.setattr(sinks, "QUERY_SLICE", 4)
    folder = folder_of(family, model_dirs, sliding_qwen2)
    texts = random_texts(7, seed=5)
    task = text_task(tmp_path / "task", texts, max_tokens=24)
    store = tmp_path / "store"
    r = extract("--model", str(folder), "--task", str(task), "--store", str(store), "--sinks",
                "--batch-size", "4")  # fmt: skip
    assert r.exit_code == 0, r.output
    got = stored_sinks(store)
    model = float64_model(folder)
    want = np.stack([reference(model, tokenizer(t)["input_ids"][:24]) for t in texts])
    assert got.shape == want.shape == (7, 2, 4)
    assert np.abs(got - want).max() <= TOLERANCE
    if family == "qwen2_sliding":  # the window hides position 0 from the later queries
        long = [d for d, t in enumerate(texts) if len(tokenizer(t)["input_ids"]) > 8]
        assert long and (got[long, 1] < got[long, 0]).any()


@pytest.mark.numerical
@pytest.mark.parametrize("family", FAMILIES)
def test_choice_sinks_match_float64_attention_over_the_prompt(
    tmp_path: Path, model_dirs: Any, tokenizer: Any, make_task: Any, sliding_qwen2: Path,
    family: str,
) -> None:  # fmt: skip
    folder = folder_of(family, model_dirs, sliding_qwen2)
    task = make_task(tmp_path / "task", n=6)
    store = tmp_path / "store"
    r = extract("--model", str(folder), "--task", str(task), "--store", str(store), "--sinks")
    assert r.exit_code == 0, r.output
    got = stored_sinks(store)
    prompts = Store(store).scan("instances").sort("instance").collect()["prompt"]
    model = float64_model(folder)
    want = np.stack([reference(model, tokenizer(p)["input_ids"]) for p in prompts])
    assert got.shape == want.shape and np.abs(got - want).max() <= TOLERANCE


@pytest.mark.numerical
def test_slices_of_queries_and_the_output_unchanged(
    build_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One query per slice gives what one slice gives; the model's logits with the capture
    attached equal those without it (the same kernels), and nothing is left installed in
    transformers' attention interface after it is removed."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from layerdiv.extract.adapters import adapter_for
    from layerdiv.extract.forward import left_padded
    from layerdiv.measurements import Attachment
    from layerdiv.measurements.sinks import hooks as sinks

    model = build_model("llama")
    seqs = [[5, 9, 30, 7], [11, 3, 8, 21, 40, 6, 19]]
    inputs = left_padded(seqs, 0)
    with torch.no_grad():
        plain = model(**inputs).logits

    def run() -> tuple[list[np.ndarray], torch.Tensor]:
        cap = sinks.SinkCapture(Attachment(model, adapter_for(model.config), "text", {}, None))
        cap.reset()
        cap.batch([0, 1], [len(s) for s in seqs])
        with torch.no_grad():
            logits = model(**inputs).logits
        values = list(cap.result())
        cap.remove()
        return values, logits

    whole, logits = run()
    assert torch.equal(logits, plain)
    monkeypatch.setattr(sinks, "SLICE_ELEMENTS", 1)
    sliced, _ = run()
    for a, b in zip(whole, sliced, strict=True):
        assert np.abs(a - b).max() <= 1e-6
    assert model.config._attn_implementation not in ALL_ATTENTION_FUNCTIONS._local_mapping
    # two models of two implementations at once: each restored when its last watch goes
    other = build_model("llama")
    other.config._attn_implementation = "eager"
    caps = [sinks.SinkCapture(Attachment(m, adapter_for(m.config), "text", {}, None))
            for m in (model, other)]  # fmt: skip
    assert {"sdpa", "eager"} <= set(ALL_ATTENTION_FUNCTIONS._local_mapping)
    caps[1].remove()
    assert "eager" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    assert "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
    caps[0].remove()
    caps[0].remove()  # twice: nothing more
    assert not {"sdpa", "eager"} & set(ALL_ATTENTION_FUNCTIONS._local_mapping)


def test_the_declared_cost_counts_the_scores_of_the_slices() -> None:
    """Each slice of 64 queries against the keys up to its last query: T^2 up to one slice,
    about half of T^2 for long sequences; times 2 x heads x head width per block."""
    from layerdiv.extract.cost import SMOLLM2, Shape
    from layerdiv.measurements.sinks import scores, sink_cost

    assert scores(1) == 1 and scores(64) == 64 * 64
    assert scores(130) == 64 * 64 + 64 * 128 + 2 * 130
    assert scores(1024) == sum(64 * (64 * (i + 1)) for i in range(16)) < 0.54 * 1024**2
    config = type("Config", (), SMOLLM2)()
    shape = Shape.from_config(config)
    assert sink_cost(shape, "text", 130, {}) == 30 * 2 * 9 * 64 * scores(130)


def test_resumed_backfilled_and_merged(tmp_path: Path, model_dirs: Any) -> None:
    """Shards with ``--sinks`` merge into the values of one run; a partition stored without
    them gets them added; a larger ``--limit`` extends them."""
    folder = str(model_dirs("llama"))
    task = text_task(tmp_path / "task", random_texts(7, seed=3), max_tokens=16)
    args = ["--model", folder, "--task", str(task), "--chunk-size", "2"]
    r = extract(*args, "--store", str(tmp_path / "whole"), "--sinks")
    assert r.exit_code == 0, r.output
    whole = stored_sinks(tmp_path / "whole")
    for i in range(2):
        r = extract(*args, "--store", str(tmp_path / f"s{i}"), "--shard", f"{i}/2", "--sinks")
        assert r.exit_code == 0, r.output
    merged = tmp_path / "m"
    r = CliRunner().invoke(
        main, ["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--into", str(merged)]
    )
    assert r.exit_code == 0, r.output
    (info,) = Store(merged).partitions
    assert "sinks" in info.tables and not info.incomplete()
    assert np.abs(stored_sinks(merged) - whole).max() <= 1e-6
    other = tmp_path / "later"
    assert extract(*args, "--store", str(other), "--limit", "4").exit_code == 0
    r = extract(*args, "--store", str(other), "--limit", "4", "--sinks")
    assert r.exit_code == 0 and "added sinks" in r.output
    r = extract(*args, "--store", str(other), "--sinks")
    assert r.exit_code == 0, r.output
    assert np.abs(stored_sinks(other) - whole).max() <= 1e-6


def test_a_family_outside_the_attention_interface_is_refused_before_weights_load(
    tmp_path: Path, model_dirs: Any, make_task: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = model_dirs("llama")
    monkeypatch.setattr(LlamaForCausalLM, "_supports_attention_backend", False)
    with pytest.raises(UnsupportedModel, match=r"^--sinks: the attention of 'llama' models"):
        check_sinks(LlamaConfig())

    def no_weights(*args: Any) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(runner, "load_model", no_weights)
    task = make_task(tmp_path / "task", n=4)
    r = extract("--model", str(folder), "--task", str(task), "--store", str(tmp_path / "s"),
                "--sinks")  # fmt: skip
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [
        "Error: --sinks: the attention of 'llama' models does not go through transformers' "
        "attention interface, where --sinks reads its weights; extract without --sinks."
    ]


@pytest.mark.slow
@pytest.mark.numerical
def test_smollm2_sinks_match_float64_attention(tmp_path: Path) -> None:
    from layerdiv.demo import bbc_articles
    from layerdiv.extract.models import load_model, load_tokenizer, resolve_source

    texts = [a["text"] for a in bbc_articles(paragraphs=1)[:2]]
    task = text_task(tmp_path / "task", texts, max_tokens=32)
    out = extract("--model", "smollm2-135m-instruct", "--task", str(task), "--store",
                  str(tmp_path / "s"), "--sinks")  # fmt: skip
    assert out.exit_code == 0, out.output
    got = stored_sinks(tmp_path / "s")
    source = resolve_source("smollm2-135m-instruct", None, None, False)
    tokenizer = load_tokenizer(source)
    model = load_model(source, tokenizer, torch.device("cpu"), torch.float64).model
    model.set_attn_implementation("eager")
    want = np.stack([reference(model, tokenizer(t)["input_ids"][:32]) for t in texts])
    assert got.shape == want.shape == (2, 30, 9)
    assert np.abs(got - want).max() <= TOLERANCE
    assert got.max() > 0.3  # SmolLM2 has sink heads


# --- the analysis ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sink_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """A synthetic choice partition with made-up sinks (12 instances, 3 blocks x 4 heads: some
    heads near the threshold, so that resamples move the rate), and a text partition."""
    from layerdiv.analyze.synthetic import (
        random_partition,
        synthesize_text_store,
        write_partition,
    )

    root = tmp_path_factory.mktemp("sinks") / "store"
    rng = np.random.default_rng(4)
    logits, gold, rms, kinds = random_partition(rng, 12, 3, 2)
    centre = np.array([[0.05, 0.9, 0.3, 0.1], [0.28, 0.32, 0.6, 0.02], [0.4, 0.3, 0.25, 0.8]])
    values = np.clip(centre + rng.normal(0, 0.08, (12, 3, 4)), 0, 1).astype(np.float32)
    write_partition(root, "org/m", "boolq", logits, gold, kinds, rms, chunk=5,
                    optional={"sinks": values})  # fmt: skip
    synthesize_text_store(root, n_models=1, n_docs=6, n_tokens=8, blocks=3, chunk=4,
                          progress=False)  # fmt: skip
    return root, values.astype(np.float64)


def test_sink_analysis_matches_numpy(sink_store: tuple[Path, np.ndarray]) -> None:
    from layerdiv.analyze.api import analyze

    root, values = sink_store
    results = analyze(root)
    means = values.mean(axis=0)  # (L, H): the mean over instances
    heads = results.sink_heads.sort("block", "head")
    assert np.abs(heads["bos_attention"].to_numpy() - means.reshape(-1)).max() <= 1e-6
    assert heads["sink"].to_list() == (means > 0.3).reshape(-1).tolist()
    blocks = results.sink_blocks.sort("block")
    assert blocks["sink_rate"].to_list() == pytest.approx((means > 0.3).mean(axis=1).tolist())
    (rate,) = results.sink_rate.iter_rows(named=True)
    assert (rate["n_units"], rate["n_blocks"], rate["n_heads"]) == (12, 3, 4)
    assert rate["sink_rate"] == pytest.approx((means > 0.3).mean())
    # 1,000 resamples of the instances (seed 0), every head's mean recomputed from each
    draws = np.random.default_rng(0).multinomial(12, np.full(12, 1 / 12), size=1000)
    resampled = np.einsum("rn,nk->rk", draws, values.reshape(12, -1)) / 12
    low, high = np.percentile((resampled > 0.3).mean(axis=1), [2.5, 97.5])
    assert (rate["ci_low"], rate["ci_high"]) == pytest.approx((low, high))
    assert rate["ci_low"] < rate["ci_high"]  # the heads near 0.3 move it


def test_bos_norm_matches_numpy(sink_store: tuple[Path, np.ndarray]) -> None:
    """From the stored h.h of every token: per block, the means over documents of ||h_l|| at
    position 0 and of the mean over positions 1..T-1, on the text partition alone."""
    from layerdiv.analyze.api import analyze

    root, _ = sink_store
    rows = Store(root).scan("token_blocks", task="fineweb").collect().sort("doc", "pos", "block")
    norm = np.sqrt(rows["hh"].to_numpy().astype(np.float64)).reshape(6, 8, 3)  # (doc, pos, block)
    table = analyze(root).bos_norm.sort("block")
    assert table["task"].unique().to_list() == ["fineweb"]
    assert table["n_documents"].to_list() == [6, 6, 6]
    first, rest = norm[:, 0].mean(axis=0), norm[:, 1:].mean(axis=1).mean(axis=0)
    assert np.abs(table["bos_norm"].to_numpy() - first).max() <= 1e-9 * first.max()
    assert np.abs(table["rest_norm"].to_numpy() - rest).max() <= 1e-9 * rest.max()
    assert np.abs(table["ratio"].to_numpy() - first / rest).max() <= 1e-9 * (first / rest).max()


def test_report_sections_and_figures(sink_store: tuple[Path, np.ndarray], tmp_path: Path) -> None:
    from layerdiv.analyze.api import analyze
    from layerdiv.analyze.report import write_report

    root, _ = sink_store
    results = analyze(root)
    out = tmp_path / "report"
    write_report(results, out, "paper", str(root), ("md", "html"))
    text = (out / "report.md").read_text()
    for title, figure in (("Attention sinks", "sinks.png"), ("Attention sinks", "sinks_heads.png"),
                          ("Running text: the first token's norm", "bos_norm.png")):  # fmt: skip
        assert f"## {title}" in text and f"figures/{figure}" in text
        assert (out / "figures" / figure).is_file()
    assert "methods.md#section-16" in text
    page = (out / "report.html").read_text()
    assert "Attention sinks" in page and "sinks_heads.png" in page and "section-16" in page


def test_a_text_part_without_whole_blocks_is_refused(tmp_path: Path) -> None:
    """A ``sinks`` part of a text partition whose rows are not whole blocks (a row removed) is
    refused by readers in one line naming it."""
    import pyarrow.parquet as pq

    from layerdiv.analyze.synthetic import text_chunk, text_manifest, write_text_partition
    from layerdiv.measurements.sinks import sinks_table
    from layerdiv.store import StoreError

    rng = np.random.default_rng(0)
    manifest = text_manifest("org/t", "docs", 4, 3, 8, 2)
    chunks = []
    for start in (0, 2):
        docs = range(start, start + 2)
        tables = text_chunk(rng, docs, 8, 3)
        tables["sinks"] = sinks_table(list(docs), rng.random((2, 3, 4)))
        chunks.append((start, 2, tables))
    write_text_partition(tmp_path, manifest, chunks)
    (info,) = Store(tmp_path).select()
    assert Store(tmp_path).scan("sinks").collect().height == 4 * 3 * 4 and "sinks" in info.tables
    part = sorted(tmp_path.glob("sinks/**/*.parquet"))[1]
    table = pq.read_table(part)
    pq.write_table(table.slice(0, table.num_rows - 1), part, write_page_checksum=True)
    with pytest.raises(StoreError, match=r"sinks.*23 rows are not whole blocks of the model's 3"):
        Store(tmp_path).select()


def test_the_sinks_verdict_reads_long_prompts_alone(
    sink_store: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rate over the units of at least MIN_TOKENS tokens (every unit's length as stored), and
    the verdict: none where fewer than 5 are that long, else over those units alone."""
    from layerdiv.analyze.api import analyze
    from layerdiv.measurements.sinks import analysis
    from layerdiv.measurements.sinks.analysis import MIN_TOKENS, sink_verdicts

    root, values = sink_store
    (rate,) = analyze(root).sink_rate.iter_rows(named=True)
    lengths = Store(root).scan("instances", task="boolq").collect()["n_tokens"]
    assert rate["median_tokens"] == lengths.median() == 100 and rate["n_long"] == 12
    assert rate["long_rate"] == rate["sink_rate"]
    # the first five prompts made shorter than MIN_TOKENS: the rate of the other seven
    short = pl.DataFrame({"doc": range(12), "n_tokens": [MIN_TOKENS - 1] * 5 + [100] * 7})
    monkeypatch.setattr(analysis, "unit_lengths", lambda _: short.lazy())
    (rate,) = analyze(root).sink_rate.filter(pl.col("task") == "boolq").iter_rows(named=True)
    assert rate["n_long"] == 7 and rate["median_tokens"] == 100
    assert rate["long_rate"] == pytest.approx((values[5:].mean(axis=0) > 0.3).mean())

    base = {"model": "m", "revision": "main", "task": "t", "n_units": 12, "median_tokens": 13.0,
            "long_rate": 0.2, "long_low": 0.1, "long_high": 0.3}  # fmt: skip
    few = sink_verdicts(pl.DataFrame([{**base, "n_long": 3}]), pl.DataFrame(), {})
    assert few.startswith("- **No verdict: prompts too short.** m, t: 3 of 12 units")
    enough = sink_verdicts(pl.DataFrame([{**base, "n_long": 9}]), pl.DataFrame(), {})
    assert enough.startswith("- **Verdict: agrees.**") and "n = 9 units" in enough
