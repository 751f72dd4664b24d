"""Running-text extraction (task kind ``text``): the stored dot products against an independent
reference (plain HF forward with hooks, one document at a time, float64), resume and ``--limit``,
and the refusals of bad input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner

from layerdiv.cli import main
from layerdiv.extract.adapters import adapter_for, get_module, prepare_model
from layerdiv.measurements.lens import readout_of
from layerdiv.store import Store
from tests.tolerance import FLOAT32_DEEP, assert_within

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "warm",
    "mat",
    "while",
    "rain",
    "fell",
    "over",
    "quiet",
    "hills",
    "and",
    "rivers",
    "ran",
    "far",
]


def extract(*args: str) -> Any:
    return CliRunner().invoke(main, ["extract", *args], catch_exceptions=False)


def text_task(folder: Path, texts: list[str], **overrides: Any) -> Path:
    """A local text task over ``texts`` (field ``body``, ``level`` = index mod 3)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"body": t, "level": i % 3} for i, t in enumerate(texts)]
    (folder / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"name": "docs", "kind": "text", "data": "docs.jsonl", "text": "{{ body }}",
            "group_field": "level", "n": len(texts), **overrides}  # fmt: skip
    path = folder / "docs.yaml"
    path.write_text(json.dumps(spec))
    return path


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 30)))) for _ in range(n)]


def reference(model: Any, ids: list[int]) -> np.ndarray:
    """(T, L, 9) of one document from a plain float64 forward pass: h_l from
    ``output_hidden_states``, a and m from forward hooks on each block's attention and MLP (the
    modules the family's adapter names), and h_L = h_(L-1) + a_(L-1) + m_(L-1) (the hidden state
    HF returns last is after the norm)."""
    adapter = adapter_for(prepare_model(model).config)
    layers = get_module(model, adapter.blocks)
    n = len(layers)
    adds: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(layers):
        for kind in ("attn", "mlp"):

            def keep(m: Any, a: Any, out: Any, key: tuple[int, str] = (i, kind)) -> None:
                adds[key] = (out[0] if isinstance(out, tuple) else out)[0]

            module = get_module(layer, getattr(adapter, kind))
            handles.append(module.register_forward_hook(keep))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    a = [adds[i, "attn"] for i in range(n)]
    m = [adds[i, "mlp"] for i in range(n)]
    hs = [out.hidden_states[i][0] for i in range(n)]
    final = hs[-1] + a[-1] + m[-1]
    d = [a[i] + m[i] for i in range(n)]
    rows = []
    for i in range(n):
        x = (hs[i], a[i], m[i])
        dd = (d[i] * d[i + 1]).sum(-1) if i + 1 < n else torch.full_like(hs[i][:, 0], np.nan)
        pairs = [(x[p] * x[q]).sum(-1) for p, q in ((0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2))]
        rows.append(
            torch.stack([*pairs, dd, (hs[i] * final).sum(-1), (hs[i] * hs[0]).sum(-1)], dim=-1)
        )
    return torch.stack(rows, dim=1).numpy()


COLUMNS = ["hh", "aa", "mm", "ha", "hm", "am", "dd_next", "h_final", "h_embed"]


def geometry(v: np.ndarray) -> dict[str, np.ndarray]:
    """methods §9's per-token geometry from the dot products (last axis COLUMNS)."""
    hh, aa, mm, ha, hm, am = (v[..., i] for i in range(6))
    hn = np.sqrt(hh)
    out_sq = hh + aa + mm + 2 * (ha + hm + am)  # |h + a + m|^2
    ham = hh + aa + 2 * ha  # |h + a|^2
    cos_state = (hh + ha + hm) / np.sqrt(hh * out_sq)
    return {
        "attn_rel": np.sqrt(aa) / np.maximum(hn, 1e-6),
        "mlp_rel": np.sqrt(mm) / np.maximum(np.sqrt(ham), 1e-6),
        "cos_attn": ha / np.sqrt(aa * hh),
        "cos_mlp": (hm + am) / np.sqrt(mm * ham),
        "theta_state": np.degrees(np.arccos(np.clip(cos_state, -1, 1))),
    }


def dot_scales(v: np.ndarray) -> np.ndarray:
    """||x|| ||y|| of each dot product x . y of ``v`` (T, L, COLUMNS): h, a, m from the first
    three, d_l = a + m, d_(l+1) of the next block (NaN after the last), h_L = h + a + m of the
    last block, h_0 of the first."""
    hh, aa, mm, ha, hm, am = (v[..., i] for i in range(6))
    h, a, m = np.sqrt(hh), np.sqrt(aa), np.sqrt(mm)
    d = np.sqrt(aa + mm + 2 * am)
    d_next = np.concatenate([d[:, 1:], np.full_like(d[:, :1], np.nan)], axis=1)
    h_last = np.sqrt(hh + aa + mm + 2 * (ha + hm + am))[:, -1:]
    return np.stack([h * h, a * a, m * m, h * a, h * m, a * m, d * d_next, h * h_last,
                     h * h[:, :1]], axis=-1)  # fmt: skip


def stored_values(store: Path) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    st = Store(store)
    blocks = st.scan("token_blocks").collect().sort("doc", "pos", "block")
    return blocks, st.scan("tokens").collect().sort("doc", "pos"), st.scan("documents").collect()


def check_against_reference(
    store: Path, model: Any, tokenizer: Any, texts: list[str], max_tokens: int
) -> None:
    blocks, tokens, docs = stored_values(store)
    n_blocks = model.config.num_hidden_layers
    docs = docs.sort("doc")
    assert docs["doc"].to_list() == list(range(len(texts)))
    got_all, want_all = [], []
    for doc, text in enumerate(texts):
        full = tokenizer(text)["input_ids"]
        ids = full[:max_tokens]
        row = docs.row(doc, named=True)
        assert (row["n_tokens"], row["truncated"]) == (len(ids), len(full) > max_tokens)
        assert tokens.filter(pl.col("doc") == doc)["token"].to_list() == ids
        got = blocks.filter(pl.col("doc") == doc).select(COLUMNS).to_numpy()
        got_all.append(got.reshape(len(ids), n_blocks, len(COLUMNS)))
        want_all.append(reference(model, ids))
    got, want = np.concatenate(got_all), np.concatenate(want_all)
    # Each dot product x . y within FLOAT32_DEEP of ||x|| ||y|| (the reference's norms): the
    # stored value is a float32 sum over d features of states computed in float32 through every
    # block before it, whatever the kernel's order of summation; a tolerance relative to the value
    # itself fails where the terms cancel (dot products of order 1e5 summing to near 0).
    scale = dot_scales(want)
    for i, column in enumerate(COLUMNS):
        assert_within(got[..., i], want[..., i], scale[..., i], FLOAT32_DEEP, what=column)
    # Token-weighted means of the derived geometry, per block, within 1e-3 of the column's mean
    # magnitude (a mean of cosines of either sign may be near 0)
    g, w = geometry(got.astype(np.float64)), geometry(want)
    for name in g:
        scale = np.abs(w[name]).mean()
        assert_within(g[name].mean(axis=0), w[name].mean(axis=0), scale, 1e-3, what=name)


@pytest.mark.numerical
def test_text_extract_matches_an_independent_float64_forward(
    tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any
) -> None:
    texts = random_texts(9)
    task = text_task(tmp_path / "task", texts, max_tokens=20)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store",
                  str(store), "--batch-size", "4", "--chunk-size", "4")  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "docs: 9/9 documents stored" in out.output
    (info,) = Store(store).partitions
    m = info.manifest
    assert (m.kind, m.max_tokens, m.options, m.n_blocks) == ("text", 20, [], 2)
    assert [c.name for c in m.components] == ["embed", "attn.0", "mlp.0", "attn.1", "mlp.1"]
    model = build_model("llama").to(torch.float64)  # the same weights (seed 0), asserted tiny
    check_against_reference(store, model, tokenizer, texts, 20)
    n_tokens = Store(store).scan("documents").collect()["n_tokens"].sum()
    blocks = Store(store).scan("token_blocks").collect()
    assert blocks.height == n_tokens * 2 and blocks["dd_next"].null_count() == n_tokens
    groups = Store(store).scan("documents").collect().sort("doc")["group"].to_list()
    assert groups == [str(i % 3) for i in range(9)]


def test_text_limit_resume_ls_and_query(tmp_path: Path, model_dirs: Any) -> None:
    task = text_task(tmp_path / "task", random_texts(10, seed=1))
    store = tmp_path / "store"
    model = str(model_dirs("llama"))
    args = ["--model", model, "--task", str(task), "--store", str(store), "--chunk-size", "3"]
    first = extract(*args, "--limit", "4")
    assert "docs: 4/4 documents stored (4 new" in first.output, first.output
    before = Store(store).scan("token_blocks").collect().sort("doc", "pos", "block")
    second = extract(*args)
    assert "docs: 10/10 documents stored (6 new" in second.output, second.output
    assert "nothing to do" in extract(*args).output
    after = Store(store).scan("token_blocks").collect().sort("doc", "pos", "block")
    assert after.filter(pl.col("doc") < 4).equals(before.filter(pl.col("doc") < 4))
    assert sorted(Store(store).scan("documents").collect()["doc"].to_list()) == list(range(10))
    ls = CliRunner().invoke(main, ["ls", "--store", str(store)])
    assert ls.exit_code == 0 and "docs" in ls.output
    sql = "SELECT count(DISTINCT doc) AS n FROM token_blocks"
    query = CliRunner().invoke(main, ["query", "--store", str(store), sql])
    assert query.exit_code == 0 and "10" in query.output, query.output


def refused(tmp_path: Path, model: str, task: Path, *flags: str) -> str:
    store = tmp_path / "store"
    out = CliRunner().invoke(
        main, ["extract", "--model", model, "--task", str(task), "--store", str(store), *flags]
    )
    assert out.exit_code != 0
    lines = [line for line in out.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), out.output
    assert not store.exists()  # nothing written
    return lines[0]


def test_bad_text_input_is_refused_in_one_line(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    model = str(model_dirs("llama"))
    no_text = text_task(tmp_path / "a", ["one two"])
    spec = json.loads(no_text.read_text())
    del spec["text"]
    no_text.write_text(json.dumps(spec))
    assert "needs 'text'" in refused(tmp_path, model, no_text)
    empty = text_task(tmp_path / "b", ["the cat", ""])
    assert "document 1 tokenizes to no tokens" in refused(tmp_path, model, empty)
    short = text_task(tmp_path / "c", ["the cat sat"], max_tokens=8)
    assert "leaves none" in refused(tmp_path, model, short, "--skips")
    assert "choice tasks only" in refused(tmp_path, model, short, "--heads")
    choice = make_task(tmp_path / "d", n=4)
    assert "text tasks only" in refused(tmp_path, model, choice, "--lens", "last-block")


@pytest.mark.numerical
@pytest.mark.slow
def test_smollm2_on_bbc_news_matches_an_independent_float64_forward(tmp_path: Path) -> None:
    from layerdiv.demo import bbc_articles
    from layerdiv.extract.models import load_model, load_tokenizer, resolve_source

    texts = [row["text"] for row in bbc_articles(paragraphs=1)[::150][:3]]
    task = text_task(tmp_path / "task", texts, max_tokens=48)
    store = tmp_path / "store"
    out = extract("--model", "smollm2-135m-instruct", "--task", str(task), "--store",
                  str(store), "--batch-size", "3")  # fmt: skip
    assert out.exit_code == 0, out.output
    source = resolve_source("smollm2-135m-instruct", None, None, False)
    tokenizer = load_tokenizer(source)
    loaded = load_model(source, tokenizer, torch.device("cpu"), torch.float64)
    assert Store(store).partitions[0].manifest.n_blocks == 30
    check_against_reference(store, loaded.model, tokenizer, texts, 48)


def reference_lens(
    model: Any, ids: list[int], translate: Callable[[int, torch.Tensor], torch.Tensor] | None = None
) -> np.ndarray:
    """(T, L + 1, 3) kl, top5_overlap, ce of the logit lens of one document, float64: p_l from
    the final norm, unembedding and final soft-cap of ``output_hidden_states`` l < L (each
    ``translate(l, h_l)`` first where given: a learned lens), p_L the model's logits."""
    cap = getattr(model.config, "final_logit_softcapping", None)
    adapter = adapter_for(prepare_model(model).config)
    norm, head = get_module(model, adapter.final_norm), model.get_output_embeddings()

    def readout(h: torch.Tensor) -> torch.Tensor:
        z = head(norm(h))
        return cap * torch.tanh(z / cap) if cap else z

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        n = len(get_module(model, adapter.blocks))
        final = torch.log_softmax(out.logits[0], -1)
        states = [out.hidden_states[i][0] for i in range(n)]
        if translate is not None:
            states = [translate(i, h) for i, h in enumerate(states)]
        layers = [torch.log_softmax(readout(h), -1) for h in states]
    rows = []
    top_final = set_rows(final)
    for logp in [*layers, final]:
        kl = (logp.exp() * (logp - final)).sum(-1).numpy()
        top = set_rows(logp)
        overlap = np.array([len(a & b) / 5 for a, b in zip(top, top_final, strict=True)])
        ce = np.full(len(ids), np.nan)
        ce[:-1] = -logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
        rows.append(np.stack([kl, overlap, ce], axis=-1))
    return np.stack(rows, axis=1)


def set_rows(logp: torch.Tensor) -> list[set[int]]:
    return [set(r) for r in logp.topk(5, dim=-1).indices.tolist()]


def assert_lens_close(got: np.ndarray, want: np.ndarray) -> None:
    """A lens's kl and ce (..., 3: kl, top5_overlap, ce) against the float64 reference: both
    differences of log-probabilities (kl = sum_v p (log p - log p_L), ce = lse(z) - z_next), so
    within FLOAT32 of the log-probabilities' magnitude (the reference's largest ce, about log V)
    and 1e-3 of the value (a float32 pass against a float64 one)."""
    scale = np.nanmax(want[..., 2])
    assert_within(got[..., 0], want[..., 0], scale, rel=1e-3, what="kl")
    assert_within(got[..., 2], want[..., 2], scale, rel=1e-3, what="ce")


def lens_values(store: Path, doc: int) -> np.ndarray:
    lens = Store(store).scan("token_lens").collect().filter(pl.col("doc") == doc)
    frame = lens.sort("pos", "layer").select("kl", "top5_overlap", "ce").to_numpy()
    return frame.reshape(-1, int(lens["layer"].n_unique()), 3)


@pytest.mark.numerical
def test_lens_matches_an_independent_float64_readout(
    tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any
) -> None:
    texts = random_texts(6, seed=2)
    task = text_task(tmp_path / "task", texts, max_tokens=24)
    model_dir = str(model_dirs("llama"))
    for lens in ("final", "last-block"):
        out = extract("--model", model_dir, "--task", str(task), "--store",
                      str(tmp_path / lens), "--batch-size", "3", "--lens", lens)  # fmt: skip
        assert out.exit_code == 0, out.output
        assert readout_of(Store(tmp_path / lens).partitions[0].manifest) == lens
    model = build_model("llama").to(torch.float64)
    got, want = [], []
    for doc, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"][:24]
        got.append(lens_values(tmp_path / "final", doc))
        want.append(reference_lens(model, ids))
        # The last block applied to h_(L-1) is the model itself: its lens is p_L (recomputed:
        # within FLOAT32 of the log-probabilities' magnitude).
        last = lens_values(tmp_path / "last-block", doc)
        scale = np.nanmax(last[..., 2])
        assert_within(last[:, -2, 0], 0.0, scale, what="kl")
        assert np.all(last[:, -2, 1] == 1)
        assert_within(last[:, -2, 2], last[:, -1, 2], scale, what="ce")
        assert not np.allclose(last[:, 0, 0], got[-1][:, 0, 0], atol=1e-6)
    g, w = np.concatenate(got), np.concatenate(want)
    assert_lens_close(g, w)
    assert abs(g[..., 1].mean() - w[..., 1].mean()) <= 5e-3  # top-5 overlap
    assert np.isnan(g[:, :, 2]).sum() == len(texts) * g.shape[1]  # ce null at each last token


@pytest.mark.numerical
def test_lens_of_a_soft_capped_model_caps_every_layer(
    tmp_path: Path, build_model: Any, tokenizer: Any
) -> None:
    """Gemma-2's final logit soft-cap applies to every layer's readout, as to the output's: a
    cap of 0.1, near the tiny model's logits (about 0.1 in size), so that leaving it out shows."""
    model = build_model("gemma2_softcap")
    model.config.final_logit_softcapping = 0.1
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    texts = random_texts(3, seed=4)
    task = text_task(tmp_path / "task", texts, max_tokens=16)
    out = extract("--model", str(tmp_path / "model"), "--task", str(task), "--store",
                  str(tmp_path / "s"), "--lens", "--allow-softcap")  # fmt: skip
    assert out.exit_code == 0, out.output
    model = model.to(torch.float64)
    for doc, text in enumerate(texts):
        got = lens_values(tmp_path / "s", doc)
        want = reference_lens(model, tokenizer(text)["input_ids"][:16])
        assert_lens_close(got, want)


@pytest.mark.numerical
def test_choice_lens_matches_an_independent_float64_readout(
    tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any, make_task: Any
) -> None:
    from layerdiv.extract.tasks import instances, load_task

    task = make_task(tmp_path / "task", n=8)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store",
                  str(store), "--batch-size", "3", "--lens")  # fmt: skip
    assert out.exit_code == 0, out.output
    (info,) = Store(store).partitions
    assert readout_of(info.manifest) == "final" and info.tables == ["lens"]
    lens = Store(store).scan("lens").collect().sort("instance", "layer")
    model = build_model("llama").to(torch.float64)
    option_ids = info.manifest.option_token_ids
    for item_no, item in enumerate(instances(load_task(str(task)))):
        ids = tokenizer(item.prompt)["input_ids"]
        want = reference_lens(model, [*ids, option_ids[item.gold]])[-2]  # at the last prompt token
        got = lens.filter(pl.col("instance") == item_no).select("kl", "top5_overlap", "ce")
        got_np = got.to_numpy()
        assert_lens_close(got_np, want)
        assert np.abs(got_np[:, 1] - want[:, 1]).mean() <= 5e-3


def test_text_shards_merge_into_one_partition(tmp_path: Path, model_dirs: Any) -> None:
    task = text_task(tmp_path / "task", random_texts(7, seed=3))
    model = str(model_dirs("llama"))
    for i in range(2):
        out = extract("--model", model, "--task", str(task), "--store", str(tmp_path / f"s{i}"),
                      "--chunk-size", "2", "--shard", f"{i}/2", "--lens")  # fmt: skip
        assert out.exit_code == 0, out.output
    merged = CliRunner().invoke(
        main, ["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--into", str(tmp_path / "m")]
    )
    assert merged.exit_code == 0, merged.output
    (info,) = Store(tmp_path / "m").partitions
    assert info.n_done == 7 and info.tables == ["token_lens"] and not info.incomplete()
    docs = Store(tmp_path / "m").scan("documents").collect()
    assert sorted(docs["doc"].to_list()) == list(range(7))
    n = int(docs["n_tokens"].sum())
    assert Store(tmp_path / "m").scan("token_blocks").collect().height == n * 2
    assert Store(tmp_path / "m").scan("token_lens").collect().height == n * 3


@pytest.mark.numerical
def test_lens_stats_in_row_slices_match_a_float64_computation(monkeypatch: Any) -> None:
    """Slices of a few rows (a real vocabulary's case; the tiny models fit in one slice), the
    reference broadcast over layers as a choice task uses it, and p_L against itself."""
    from layerdiv.measurements.lens import hooks as readout

    monkeypatch.setattr(readout, "LENS_SLICE", 3 * 50)  # 3 rows of 50 tokens per thread
    gen = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(2, 7, 50, generator=gen)  # (B, layers, V), layer 6 the output
    ids = torch.tensor([3, 17])
    ref = readout.LensReference(logits[:, -1:])
    got = readout.lens_stats(logits.clone(), ref, ids)
    logp = logits.double().log_softmax(-1)
    kl = (logp.exp() * (logp - logp[:, -1:])).sum(-1)
    top = logp.topk(5, -1).indices
    overlap = (top[..., :, None] == top[:, -1:, None, :]).any(-1).sum(-1) / 5
    scale = logp.abs().max()  # kl and log p(v): within FLOAT32 of the log-probabilities' size
    assert_within(got[..., 0], kl, scale, what="kl")
    assert torch.equal(got[..., 1].double(), overlap.double())
    n = len(readout.STATS)
    assert_within(got[..., n:], logp[..., ids], scale, what="log p")
    # p_L against itself: the same operations on the same numbers, exactly 0 and 1
    assert torch.all(got[:, -1, 0] == 0) and torch.all(got[:, -1, 1] == 1)
    # the rank of p_L's top-1 token under each layer, and each layer's own top-1
    own = logp[:, -1:].argmax(-1, keepdim=True)
    rank = (logp > logp.gather(-1, own.expand(*logp.shape[:-1], 1))).sum(-1) + 1
    assert torch.equal(got[..., 2].long(), rank) and torch.all(got[:, -1, 2] == 1)
    assert torch.equal(got[..., 3].long(), logp.argmax(-1))


def test_extract_offers_every_lens_class_and_a_choice_task_those_that_apply() -> None:
    """``--lens NAME`` names exactly the lens classes; a choice task offers those whose kinds
    hold it (``final``), each of them sharing the one readout it was built with."""
    import transformers as tf

    from layerdiv.extract.adapters import adapter_for
    from layerdiv.extract.readout import Readout
    from layerdiv.measurements.lens import LENS
    from layerdiv.measurements.lens.hooks import LENSES, make_lens

    (setting,) = LENS.settings
    option = setting.option
    assert isinstance(option.type, click.Choice)
    assert set(option.type.choices) == set(LENSES)
    assert [name for name, lens in LENSES.items() if "choice" in lens.kinds] == ["final"]
    config = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2)  # fmt: skip
    model = tf.LlamaForCausalLM(config).eval()
    adapter = adapter_for(config)
    readout = Readout(model, adapter)
    for name in LENSES:
        assert make_lens(name, model, adapter, readout).readout is readout


@pytest.mark.parametrize("vocab", [4096, 5000, 300])
def test_top5_finds_what_topk_finds(vocab: int) -> None:
    """Random rows, rows whose five largest share one block, and rows whose largest sit in the
    last, partial block (5000 = 78 x 64 + 8) or in a vocabulary too small for blocks (300)."""
    from layerdiv.measurements.lens import hooks as readout

    gen = torch.Generator().manual_seed(vocab)
    z = torch.randn(40, vocab, generator=gen)
    z[1, 128:133] += 10  # the five largest in one block
    z[2, -3:] += 10  # the largest in the last entries
    z[3, ::64] += 10  # the largest in the first entry of every block
    z[4, 70] += 20  # one outstanding entry, the other four anywhere
    got = readout.top5(z)
    assert torch.equal(got, z.topk(5, dim=-1).indices)
    assert torch.equal(readout.top5(z[::2]), z[::2].topk(5, dim=-1).indices)  # strided rows


@pytest.mark.numerical
@pytest.mark.parametrize("family", ["llama", "phi", "gemma2_softcap"])
def test_readout_into_a_buffer_equals_the_readout(family: str, build_model: Any) -> None:
    """Tied (llama), with an unembedding bias (phi: no buffer, a fresh tensor) and soft-capped
    (gemma2): the logits written into a reused buffer are those of the model's own readout."""
    from layerdiv.extract.adapters import adapter_for
    from layerdiv.extract.readout import Readout

    model = build_model(family)
    readout = Readout(model, adapter_for(model.config))
    x = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    norm = model.model.final_layernorm if family == "phi" else model.model.norm
    with torch.no_grad():
        want = model.lm_head(norm(x))
        cap = getattr(model.config, "final_logit_softcapping", None)
        want = cap * torch.tanh(want / cap) if cap else want
        buffer = torch.full_like(want, float("nan"))
        got = readout.logits(x, out=buffer)
    assert torch.allclose(got, want, atol=1e-6)
    assert (got.data_ptr() == buffer.data_ptr()) == (family != "phi")


@pytest.mark.numerical
@pytest.mark.parametrize("lens", ["final", "last-block"])
def test_lens_read_out_in_stacked_groups_equals_one_layer_at_a_time(
    lens: str, tokenizer: Any
) -> None:
    """A budget of a third of a batch's rows, of one batch (one layer per readout matmul), of
    two (layers stacked two by two: 5 block inputs leave a partial last group) and of every
    layer at once: the same lens as each layer read out alone."""
    import transformers as tf

    from layerdiv.extract.adapters import adapter_for
    from layerdiv.extract.forward import left_padded
    from layerdiv.extract.readout import Readout
    from layerdiv.extract.text import TextCapture
    from layerdiv.measurements import Attachment
    from layerdiv.measurements.lens.hooks import TokenLens

    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                            num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    seqs = [tokenizer(t)["input_ids"][:12] for t in random_texts(3, seed=5)]
    inputs = left_padded(seqs, 0)
    rows = inputs["input_ids"].numel()
    adapter = adapter_for(config)
    readout = Readout(model, adapter)
    capture = TextCapture(model, adapter, readout)
    hooks = TokenLens(Attachment(model, adapter, "text", {"lens": lens}, readout))
    hooks.bind(capture)
    width = inputs["input_ids"].shape[1]
    got = {}
    with torch.inference_mode():
        for budget in (0, rows // 3, rows, 2 * rows, 10 * rows):  # 0: one layer at a time
            capture.reset(inputs["input_ids"])
            hooks.reset()
            hooks.batch(None, [width] * len(seqs))  # every position of every row
            model(**inputs, use_cache=False)
            hooks.decomposed(capture.decompose(budget))
            got[budget] = torch.from_numpy(np.stack(hooks.result()))
    capture.remove()
    want = got.pop(0)
    assert want is not None and want.shape == (3, inputs["input_ids"].shape[1], 6, 5)
    for lens_values_ in got.values():
        assert lens_values_ is not None
        torch.testing.assert_close(lens_values_, want, rtol=1e-5, atol=1e-6, equal_nan=True)
