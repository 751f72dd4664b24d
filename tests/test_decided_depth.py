"""Decided-at depth (methods §16): the lens's ``final_rank`` and ``top1`` and the analysis's
decided depth against a float64 computation from hooks on the blocks' inputs (a tiny Llama, and
SmolLM2 on one short document); stores of schema version 5 (without them) still read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch

from layerdiv.analyze.api import analyze
from layerdiv.extract.adapters import adapter_for, get_module, hidden_of, prepare_model
from layerdiv.measurements.lens import decided_depth
from layerdiv.store import Store
from tests.test_text_extract import extract, random_texts, text_task

TOLERANCE = 1e-4
"""Logits closer than this (relative to the largest logit of the row) may be ordered either way
by a float32 forward pass: a rank is checked to lie within the ranks such ties allow."""


def decided_of(rank: np.ndarray) -> np.ndarray:
    """decided(p) of ranks (tokens, L) the plain way: the smallest l with every rank from l on
    equal to 1, L when there is none (methods §16)."""
    blocks = rank.shape[1]
    out = []
    for row in rank:
        d = blocks
        for block in range(blocks - 1, -1, -1):
            if row[block] != 1:
                break
            d = block
        out.append(d)
    return np.array(out)


def test_decided_on_hand_made_ranks() -> None:
    rank = np.array([[5, 1, 1, 1], [1, 1, 1, 2], [1, 1, 1, 1], [1, 3, 1, 1], [2, 2, 2, 2]])
    assert decided_depth.decided(rank).tolist() == [1, 4, 0, 2, 4]
    assert decided_of(rank).tolist() == [1, 4, 0, 2, 4]


def float64_ranks(model: Any, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of one document in float64: the model's own top-1 token y (T,) (the first largest
    logit), and per block input l = 0..L-1 the lowest and highest rank (T, L) that y can have
    under the lens when logits within :data:`TOLERANCE` of y's may be ordered either way. The
    block inputs are taken by forward pre-hooks on the blocks; p_l = softmax(head(norm(h_l)))."""
    adapter = adapter_for(prepare_model(model).config)
    blocks = get_module(model, adapter.blocks)
    norm, head = get_module(model, adapter.final_norm), model.get_output_embeddings()
    inputs: list[torch.Tensor] = []

    def keep(module: Any, args: Any, kwargs: Any) -> None:
        inputs.append(hidden_of(args, kwargs)[0])

    handles = [b.register_forward_pre_hook(keep, with_kwargs=True) for b in blocks]
    try:
        with torch.no_grad():
            final = model(torch.tensor([ids])).logits[0]
            layers = [head(norm(h)) for h in inputs]
    finally:
        for h in handles:
            h.remove()
    y = final.argmax(-1)
    low, high = [], []
    for z in layers:
        own = z.gather(-1, y[:, None])
        tol = TOLERANCE * z.abs().amax(-1, keepdim=True).clamp(min=1.0)
        low.append((z > own + tol).sum(-1) + 1)
        high.append((z >= own - tol).sum(-1))
    return y.numpy(), torch.stack(low, 1).numpy(), torch.stack(high, 1).numpy()


def check_ranks(store: Path, model: Any, docs: list[list[int]]) -> None:
    """The stored ``final_rank`` and ``top1`` of every document, and the analysis's decided
    depth of every token, against :func:`float64_ranks`."""
    st = Store(store)
    lens = st.scan("token_lens").collect().sort("doc", "pos", "layer")
    (info,) = st.partitions
    blocks = info.manifest.n_blocks
    predicted = decided_depth.predictions(info).sort("doc", "pos")
    earliest, latest = [], []
    for doc, ids in enumerate(docs):
        y, low, high = float64_ranks(model, ids)
        rows = lens.filter(pl.col("doc") == doc)
        rank = rows["final_rank"].to_numpy().reshape(len(ids), blocks + 1)
        top1 = rows["top1"].to_numpy().reshape(len(ids), blocks + 1)
        assert (rank[:, -1] == 1).all() and (top1[:, -1] == y).all()
        assert ((low <= rank[:, :-1]) & (rank[:, :-1] <= high)).all()
        # decided(p) falls as ranks fall: the near ties allow decided(low) .. decided(high),
        # one value where no layer's first place is in doubt (p < T - 1)
        earliest.append(decided_of(low)[:-1])
        latest.append(decided_of(high)[:-1])
        got = predicted.filter(pl.col("doc") == doc)
        assert got["pos"].to_list() == list(range(len(ids) - 1))
        decided = got["decided"].to_numpy()
        assert ((earliest[-1] <= decided) & (decided <= latest[-1])).all()
        assert got["top1"].to_list() == y[:-1].tolist()
    first, last = np.concatenate(earliest), np.concatenate(latest)
    assert (first == last).mean() >= 0.9  # near ties at the top are rare
    mean = analyze(store).decided_depth.filter(pl.col("group") == "all")["mean"][0]
    assert ((first + 1) / blocks).mean() - 1e-4 <= mean <= ((last + 1) / blocks).mean() + 1e-4


def test_final_rank_matches_a_float64_hook_computation(
    tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any
) -> None:
    texts = random_texts(5, seed=7)
    task = text_task(tmp_path / "task", texts, max_tokens=20)
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store",
                  str(tmp_path / "s"), "--batch-size", "2", "--lens")  # fmt: skip
    assert out.exit_code == 0, out.output
    model = build_model("llama").to(torch.float64)
    check_ranks(tmp_path / "s", model, [tokenizer(t)["input_ids"][:20] for t in texts])


def test_choice_lens_final_rank_matches_float64(
    tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any, make_task: Any
) -> None:
    from layerdiv.extract.tasks import instances, load_task

    task = make_task(tmp_path / "task", n=6)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store",
                  str(store), "--batch-size", "3", "--lens")  # fmt: skip
    assert out.exit_code == 0, out.output
    lens = Store(store).scan("lens").collect().sort("instance", "layer")
    model = build_model("llama").to(torch.float64)
    for item_no, item in enumerate(instances(load_task(str(task)))):
        y, low, high = float64_ranks(model, tokenizer(item.prompt)["input_ids"])
        rows = lens.filter(pl.col("instance") == item_no)
        rank, top1 = rows["final_rank"].to_numpy(), rows["top1"].to_numpy()
        assert rank[-1] == 1 and top1[-1] == y[-1]  # at the last prompt token
        assert ((low[-1] <= rank[:-1]) & (rank[:-1] <= high[-1])).all()


@pytest.mark.slow
def test_smollm2_final_rank_matches_a_float64_hook_computation(tmp_path: Path) -> None:
    from layerdiv.demo import bbc_articles
    from layerdiv.extract.models import load_model, load_tokenizer, resolve_source

    text = bbc_articles(paragraphs=1)[0]["text"]
    task = text_task(tmp_path / "task", [text], max_tokens=24)
    out = extract("--model", "smollm2-135m-instruct", "--task", str(task), "--store",
                  str(tmp_path / "s"), "--lens")  # fmt: skip
    assert out.exit_code == 0, out.output
    source = resolve_source("smollm2-135m-instruct", None, None, False)
    tokenizer = load_tokenizer(source)
    model = load_model(source, tokenizer, torch.device("cpu"), torch.float64).model
    check_ranks(tmp_path / "s", model, [tokenizer(text)["input_ids"][:24]])


def as_version_5(store: Path) -> None:
    """Rewrite ``store`` as schema version 5 wrote it: the lens parts without ``final_rank`` and
    ``top1``, the tokens without ``piece``, the documents without ``answer_start`` (version 7),
    no table version 5 did not have, the manifests at version 5."""
    from layerdiv.measurements import tables_of

    later = {"token_lens": ["final_rank", "top1"], "tokens": ["piece"],
             "documents": ["answer_start"]}  # fmt: skip
    for table, columns in later.items():
        for part in store.glob(f"{table}/**/*.parquet"):
            pq.write_table(pq.read_table(part).drop_columns(columns), part)
    for folder in store.iterdir():
        if folder.name != "manifests" and folder.name not in tables_of(5):
            shutil.rmtree(folder)
    for path in store.glob("manifests/**/manifest.json"):
        data = json.loads(path.read_text())
        data["schema_version"] = 5
        path.write_text(json.dumps(data))


def test_a_version_5_store_reads_with_the_ranks_null(tmp_path: Path) -> None:
    from layerdiv.analyze.synthetic import synthesize_text_store

    store = tmp_path / "store"
    synthesize_text_store(store, n_models=1, n_docs=4, n_tokens=8, blocks=3, chunk=2, lens=True,
                          progress=False)  # fmt: skip
    assert analyze(store).decided_depth.height == len(decided_depth.GROUPS)
    as_version_5(store)
    st = Store(store)
    (info,) = st.partitions
    assert info.manifest.schema_version == 5
    lens = st.scan("token_lens").collect()
    assert lens.height == 4 * 8 * 4 and lens["final_rank"].null_count() == lens.height
    assert lens["top1"].null_count() == lens.height and lens["kl"].null_count() == 0
    batch = next(info.batches("token_lens", ["doc", "final_rank"], 10))
    assert batch.column("final_rank").null_count == 10
    results = analyze(store)
    assert "decided_depth" not in results.by_name and "effective_depth" in results.by_name
    assert any("No decided-at depth for" in n and info.key.label in n for n in results.notes)


def test_ranks_by_counts_equal_the_fused_expression() -> None:
    """The processor's counting path of ``ranks`` and the one expression a GPU compiles give the
    same ranks and top-1 tokens, on logits with planted ties: at y's logit (before and after y)
    and at the maximum (two-way, and all of a row, more than the five largest hold)."""
    from layerdiv.measurements.lens import hooks as readout

    gen = torch.Generator().manual_seed(3)
    z = torch.randn(9, 300, generator=gen).round(decimals=1)  # many exact ties
    z[7] = 0.0  # every entry ties
    z[8, [4, 40]] = z[8].max() + 1  # a two-way tie at the top
    first = torch.tensor([[0], [5], [17], [299], [100], [3], [250], [123], [40]])
    top = readout.top5(z)
    want_rank, want_top1 = readout.ranks_fused(z, first, top)
    rank, top1 = readout.ranks(z, first, top, torch.empty_like(z))
    assert torch.equal(rank.long(), want_rank) and torch.equal(top1.long(), want_top1)
    own = z.gather(-1, first)
    pairs = zip(z, own[:, 0].tolist(), first[:, 0].tolist(), strict=True)
    plain = [1 + sum(int(v > o or (v == o and i < f)) for i, v in enumerate(row.tolist()))
             for row, o, f in pairs]  # fmt: skip
    assert rank.long().tolist() == plain
    assert top1.long().tolist() == [int(np.flatnonzero(row == row.max())[0]) for row in z.numpy()]
    assert top1[7] == 0 and top1[8] == 4 and rank[7] == 124


def test_the_lens_gate_and_the_frequency_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``decided_lens`` against the stored rows (the blocks whose mean lens cross-entropy exceeds
    log V, the tokens whose decided depth follows one), and the verdict: over documents, with the
    gate's caveat, and none where the lens sets most tokens' depth."""
    from layerdiv.analyze.synthetic import synthesize_text_store

    root = tmp_path / "store"
    synthesize_text_store(root, 1, 8, 12, 6, chunk=4, lens=True, progress=False)
    path = next(root.glob("manifests/**/manifest.json"))
    path.write_text(json.dumps({**json.loads(path.read_text()), "vocab_size": 50_000}))
    (info,) = Store(root).partitions
    lens = Store(root).scan("token_lens").filter(pl.col("layer") < 6).collect()
    ce = lens.group_by("layer").agg(pl.col("ce").mean()).sort("layer")["ce"].to_numpy()
    np.testing.assert_allclose(decided_depth.lens_ce(info), ce, rtol=1e-6)
    # the made-up lens is better than uniform (log V = 10.8 nats): made 5 nats worse, it is not
    # at its first three blocks (7.3, 7.1, 6.2 nats)
    worse = decided_depth.lens_ce(info) + 5.0
    monkeypatch.setattr(decided_depth, "lens_ce", lambda *_: worse)
    results = analyze(root)
    (row,) = results["decided_lens"].iter_rows(named=True)
    failed = worse > np.log(50_000)
    assert row["lens_failed"] == failed.sum() == 3 and row["n_documents"] == 8
    d = decided_depth.predictions(info)["decided"].to_numpy()
    want = np.mean([x > 0 and failed[x - 1] for x in d])
    assert row["lens_limited"] == pytest.approx(want)
    # the quartiles count in the store's tokens of the model, stated
    tokens = Store(root).scan("tokens").collect()
    assert (row["corpus_tokens"], row["corpus_tasks"]) == (tokens.height, "fineweb")
    counts = decided_depth.corpus_counts([info], {info.model})[info.model][0]
    want_counts = tokens.group_by("token").agg(pl.len().alias("count"))
    assert counts.sort("token").equals(want_counts.sort("token"))
    # a count from elsewhere moves the quartiles: every prediction's token made the rarest but one
    top1 = decided_depth.token_groups(info)["top1"]
    other = pl.DataFrame({"token": top1.unique().sort(), "count": 1}).with_columns(
        pl.when(pl.col("token") == top1[0]).then(1000).otherwise(1).alias("count")
    )
    moved = decided_depth.token_groups(info, counts=other)
    assert moved.filter(pl.col("top1") == top1[0])["quartile"].unique().to_list() == [4]
    groups = results["decided_depth"].filter(pl.col("group").is_in(["q1", "q4"])).sort("group")
    assert row["q1_minus_q4"] == pytest.approx(groups["mean"][0] - groups["mean"][1])

    base = {"model": "m", "revision": "main", "task": "t", "lens": "logit", "n_blocks": 30,
            "uniform_ce": 10.8, "worst_ce": 26.4, "q1_minus_q4": 0.1, "ci_low": 0.05,
            "ci_high": 0.15, "n_documents": 8}  # fmt: skip
    none = pl.DataFrame()
    fine = decided_depth.decided_verdicts(
        pl.DataFrame([{**base, "lens_failed": 0, "lens_limited": 0.0}]), none, {}
    )
    assert fine.startswith("- **Verdict: agrees.**") and "n = 8 documents" in fine
    assert "Caveat" not in fine
    some = decided_depth.decided_verdicts(
        pl.DataFrame([{**base, "lens_failed": 12, "lens_limited": 0.2}]), none, {}
    )
    assert some.startswith("- **Verdict: agrees.**")
    assert "Caveat: the lens's cross-entropy exceeds log V = 10.8 nats at 12 of 30 blocks" in some
    most = decided_depth.decided_verdicts(
        pl.DataFrame([{**base, "lens_failed": 20, "lens_limited": 0.55}]), none, {}
    )
    assert most.startswith("- **No verdict: the lens decides.** m, t, logit lens:")
    assert "55%" in most
