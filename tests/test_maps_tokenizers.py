"""Maps between models with different tokenizers (``--states words``, methods §11): states at
word ends with the character where each token ends, and maps fitted on the rows of the two
models whose tokens end at the same character of the same document."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch

import layerdiv
from layerdiv.analyze.analyses.maps import MapsError, pair_table
from layerdiv.measurements.states import word_ends
from layerdiv.store.key import PartitionKey
from tests.conftest import WORDS
from tests.test_maps import extract, run
from tests.test_text_extract import random_texts, text_task

MAX_TOKENS = 24


def whitespace_tokenizer() -> Any:
    """A second tokenizer unlike the test one: a WordPiece-free BPE over whitespace-split words
    (no leading-space tokens, another vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[PAD]", "[BOS]", "[UNK]"])
    tok.train_from_iterator(WORDS * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", pad_token="[PAD]", unk_token="[UNK]"
    )


def word_end_chars(text: str) -> set[int]:
    """Where the text's words end (independent of any tokenizer)."""
    return {m.end() for m in re.finditer(r"\S+", text)}


def stored_ends(tok: Any, text: str) -> set[int]:
    """The character ends of the stored word-end tokens of ``text`` under ``tok``: positions
    1..MAX_TOKENS-1 whose token ends a word, the last of the tokens that end there."""
    ends = [e for _, e in tok(text, return_offsets_mapping=True)["offset_mapping"]]
    words = word_end_chars(text)
    return {
        e for p, e in enumerate(ends[:MAX_TOKENS])
        if p >= 1 and e in words and (p + 1 == len(ends) or ends[p + 1] != e)
    }  # fmt: skip


def test_word_ends_by_text() -> None:
    """A token ends a word where a non-space character is followed by a space or the end;
    pieces of one character (same offsets) end it at the last; special tokens never."""
    text = "ab cd  e"
    spans = [(0, 0), (0, 1), (1, 2), (2, 5), (6, 8), (7, 8), (7, 8)]
    got = word_ends(text, spans)
    assert got.char_end.tolist() == [0, 1, 2, 5, 8, 8, 8]
    assert got.word_end.tolist() == [False, False, True, True, False, False, True]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> dict[str, Any]:
    """A tiny llama saved with the test tokenizer, another with a whitespace tokenizer; a text
    task over random texts."""
    import transformers as tf

    root = tmp_path_factory.mktemp("xtok")
    toks = {"bpe": tokenizer, "words": whitespace_tokenizer()}
    folders = {}
    for seed, (name, tok) in enumerate(toks.items()):
        torch.manual_seed(seed)
        config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2 + seed, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
        folders[name] = root / name
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(folders[name])
        tok.save_pretrained(folders[name])
    texts = [t + "." * (i % 2) for i, t in enumerate(random_texts(20, seed=3))]
    task = text_task(root / "task", texts, max_tokens=MAX_TOKENS)
    return {"folders": folders, "toks": toks, "texts": texts, "task": task, "root": root}


def test_maps_across_tokenizers_pair_word_ends(two: dict[str, Any], tmp_path: Path) -> None:
    store = tmp_path / "store"
    for name in ("bpe", "words"):
        extract(two, store, name, "--states", "words")
    parts = {Path(p.manifest.model).name: p for p in layerdiv.Store(store).select()}
    for name, part in parts.items():
        key, _, states, chars = part.states()
        assert (chars >= 0).all() and states.shape[0] == len(key)
        for doc, text in enumerate(two["texts"]):  # the rows are the word ends, by the text
            assert set(chars[key[:, 0] == doc]) == stored_ends(two["toks"][name], text), doc
    shared = sum(
        len(stored_ends(two["toks"]["bpe"], t) & stored_ends(two["toks"]["words"], t))
        for t in two["texts"]
    )
    a, b = (str(two["folders"][n]) for n in ("bpe", "words"))
    maps = layerdiv.run_analysis(store, maps=f"{a}:{b}").layer_maps
    counts = maps.select((pl.col("n_train") + pl.col("n_heldout")).unique())
    assert counts.to_series().to_list() == [shared] and shared > 40
    assert maps.filter(pl.col("space") == "states").height == 3 * 4  # L_A + 1 by L_B + 1


def test_maps_without_word_ends_are_refused(two: dict[str, Any], tmp_path: Path) -> None:
    store = tmp_path / "store"
    for name in ("bpe", "words"):
        extract(two, store, name, "--states", "all")
    for part in layerdiv.Store(store).select():  # every position records where its token ends
        tok = two["toks"][Path(part.manifest.model).name]
        key, _, _, chars = part.states()
        for doc, text in enumerate(two["texts"]):
            ends = [e for _, e in tok(text, return_offsets_mapping=True)["offset_mapping"]]
            assert chars[key[:, 0] == doc].tolist() == ends[1:MAX_TOKENS]
    a, b = (str(two["folders"][n]) for n in ("bpe", "words"))
    r = run("analyze", "--store", str(store), "--maps", f"{a}:{b}", "--out", str(tmp_path / "o"))
    assert r.exit_code == 1 and "both with --states words" in r.output
    with pytest.raises(MapsError, match="both with --states words"):
        layerdiv.run_analysis(store, maps=f"{a}:{b}")


def test_planted_relation_across_tokenizers() -> None:
    """Rows of two 'models' at other positions but shared character ends: a map fitted on the
    pairs recovers a planted linear relation (R² near 1 where it holds, near 0 where the
    target is noise), and rows without a partner are left out."""
    rng = np.random.default_rng(0)
    docs, d = 40, 6
    ka, kb, ca, cb, sa, sb = [], [], [], [], [], []
    m = rng.normal(size=(d, d))
    for doc in range(docs):
        chars = np.sort(rng.choice(np.arange(1, 200), size=12, replace=False))
        x = rng.normal(size=(12, 3, d))
        only_a = rng.random(12) < 0.2  # word ends the other tokenizer does not end a token at
        ka += [(doc, p + 1) for p in range(12)]
        ca += list(chars)
        sa.append(x)
        keep = np.flatnonzero(~only_a)
        kb += [(doc, 2 * p + 1) for p in range(len(keep))]
        cb += list(chars[keep])
        y = np.stack([x[keep, 1] @ m, rng.normal(size=(len(keep), d))], axis=1)
        sb.append(y)

    def part(name: str) -> Any:
        key = PartitionKey(model=name, revision="main", task="docs")
        manifest = SimpleNamespace(model=name, settings={"states": {"states": "words"}})
        return SimpleNamespace(key=key, manifest=manifest, task="docs", where=name,
                               kind=SimpleNamespace(units="documents"))  # fmt: skip

    a, b = part("a"), part("b")
    cache = {
        a.key: (np.array(ka), np.zeros(len(ka)), np.concatenate(sa), np.array(ca, np.int32)),
        b.key: (np.array(kb), np.ones(len(kb)), np.concatenate(sb), np.array(cb, np.int32)),
    }
    maps, intervals = pair_table(a, b, (1e-6,), cache)
    assert intervals["n_units"].to_list() == [docs // 5] * 2  # documents 4, 9, ... held out
    states = maps.filter(pl.col("space") == "states")
    r2 = {(r["source_layer"], r["target_layer"]): r["r2"] for r in states.iter_rows(named=True)}
    assert r2[(1, 0)] == pytest.approx(1.0, abs=1e-6)
    assert max(r2[(i, 1)] for i in range(3)) < 0.2
    assert int(states["n_train"][0] + states["n_heldout"][0]) == len(kb)
