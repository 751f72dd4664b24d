"""Residual erasure (``extract --erase``, methods §14) against an independent float64 reference
(the whole model in float64, h_l at position t replaced by a hook, the model run again from
scratch, the full softmax compared at the answer-predicting positions; on a choice task the
softmax over the option logits at the last prompt token), its reference means, partition
identity (resume, shards, merge, another reference refused) and its refusals."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner

import layerdiv.measurements.erase.hooks as erase_hooks
from layerdiv.cli import main
from layerdiv.extract.adapters import adapter_for, get_module, hidden_of, prepare_model
from layerdiv.measurements.erase import reference_means
from layerdiv.store import Store
from tests.test_multihop import SHORT, documents, multihop_task
from tests.test_text_extract import extract, refused, text_task
from tests.tolerance import FLOAT32, FLOAT32_DEEP, assert_within

TOLERANCE = 2e-4
"""An effect (an L2 norm of a change of probabilities, at most sqrt(2)) of the float32 extraction
through SmolLM2's 30 blocks against the float64 reference."""


def blocks_of(model: Any) -> list[Any]:
    return list(get_module(model, adapter_for(prepare_model(model).config).blocks))


def run_states(model: Any, ids: list[int], edit: tuple[int, list[int], torch.Tensor] | None = None):
    """h_0..h_L (L + 1, T, d) and the logits (T, V) of one document through the whole model;
    with ``edit`` = (l, positions, value) the logits (len(positions), T, V) of one copy of the
    document per position, copy b's h_l replaced at positions[b] by value (the states: copy
    0's)."""
    blocks = blocks_of(model)
    states: list[torch.Tensor] = []
    rows = 1 if edit is None else len(edit[1])

    def replace(h: torch.Tensor, layer: int) -> torch.Tensor:
        if edit is not None and edit[0] == layer:
            h = h.clone()
            h[torch.arange(rows), edit[1]] = edit[2]
        states.append(h[0])
        return h

    def before(module: Any, args: tuple, kwargs: dict) -> Any:
        h = replace(hidden_of(args, kwargs), 0)
        return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

    def after(layer: int) -> Any:
        def hook(module: Any, args: tuple, out: Any) -> Any:
            if isinstance(out, tuple):
                return (replace(out[0], layer), *out[1:])
            return replace(out, layer)

        return hook

    handles = [blocks[0].register_forward_pre_hook(before, with_kwargs=True)]
    handles += [b.register_forward_hook(after(i + 1)) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids] * rows)).logits
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(states), logits if edit is not None else logits[0]


def reference_means_of(model: Any, references: list[list[int]], first: int = 1) -> torch.Tensor:
    """The (L + 1, d) mean of h_l over the positions ``first``..T-1 of every sequence of
    ``references`` (methods §14: 1 by default; 0 the authors' mean over every position)."""
    return torch.cat([run_states(model, ids)[0][:, first:] for ids in references], 1).mean(1)


def reference(
    model: Any,
    references: list[list[int]],
    docs: list[list[int]],
    starts: list[int],
    first: int = 1,
):
    """The reference means over positions ``first``..T-1 of the documents ``references`` and
    each of ``docs``'s (L + 1, T) effects (``starts``: each one's answer start s), by the
    definition (methods §14)."""
    means = reference_means_of(model, references, first)  # (L + 1, d)
    effects = []
    for ids, s in zip(docs, starts, strict=True):
        T = len(ids)
        _, clean = run_states(model, ids)
        p = torch.softmax(clean, dim=-1)
        effect = np.zeros((len(means), T))
        for layer in range(len(means)):  # every position's edited copy at once
            _, logits = run_states(model, ids, (layer, list(range(T)), means[layer]))
            change = (torch.softmax(logits, dim=-1) - p).norm(dim=-1)  # (T copies, T)
            effect[layer] = change[:, s - 1 : T - 1].amax(1).numpy()
        effects.append(effect)
    return means.numpy(), effects


def choice_reference(
    model: Any, references: list[list[int]], prompts: list[list[int]], options: list[int]
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The reference means over positions 1..T-1 of the prompts ``references`` and each of
    ``prompts``'s (L + 1, T) effects on the option probabilities at its last token, by the
    definition (methods §14)."""
    means = reference_means_of(model, references)
    effects = []
    for ids in prompts:
        p = torch.softmax(run_states(model, ids)[1][-1, options], dim=-1)
        effect = np.zeros((len(means), len(ids)))
        for layer in range(len(means)):  # every position's edited copy at once
            _, logits = run_states(model, ids, (layer, list(range(len(ids))), means[layer]))
            effect[layer] = (torch.softmax(logits[:, -1, options], dim=-1) - p).norm(dim=-1)
        effects.append(effect)
    return means.numpy(), effects


def stored_effects(store: Path) -> dict[int, np.ndarray]:
    rows = Store(store).scan("erasure").collect().sort("doc", "layer", "pos")
    out = {}
    for (doc,), part in rows.group_by(["doc"], maintain_order=True):
        layers = part["layer"].n_unique()
        out[int(doc)] = part["effect"].to_numpy().reshape(layers, -1)
    return out


def stored_means(store: Path) -> np.ndarray:
    table = Store(store).partitions[0].whole("erasure_reference")
    assert table is not None
    return reference_means(table)


@pytest.mark.numerical
@pytest.mark.parametrize(
    ("family", "batch", "group"), [("llama", "2", 1), ("llama", "2", 16), ("gpt_neox", "1", 1)]
)
def test_erasure_matches_an_independent_float64_reference(
    family: str,
    batch: str,
    group: int,
    tmp_path: Path,
    model_dirs: Any,
    build_model: Any,
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches of 2 documents are left-padded (the clean call's mask is cut to the queries);
    a batch of one has no padding (the attention may have had no mask: a causal one is made).
    Groups of at least one copy (``GROUP_MIN``): these short documents' later groups read the
    clean keys and values of the positions before them; at least 16: one group per state."""
    monkeypatch.setattr(erase_hooks, "GROUP_MIN", group)
    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs(family)), "--task", str(task), "--store",
                  str(store), "--erase", "--erase-reference", "2", "--limit", "4",
                  "--batch-size", batch)  # fmt: skip
    assert out.exit_code == 0, out.output
    docs, starts = [], []
    for document, answer in documents(short=True)[:4]:
        ids = tokenizer(document)["input_ids"]
        docs.append(ids)
        starts.append(len(ids) - len(tokenizer(answer, add_special_tokens=False)["input_ids"]))
    model = build_model(family).to(torch.float64)
    means, effects = reference(model, docs[:2], docs[2:], starts[2:])  # 2, 3: held out
    assert_within(stored_means(store), means, np.abs(means).max(axis=1, keepdims=True))
    got = stored_effects(store)
    assert sorted(got) == list(range(4))
    for doc, want in zip((2, 3), effects, strict=True):
        T = len(docs[doc])
        assert got[doc].shape == (len(means), T)
        assert (got[doc][:, T - 1] == 0).all()  # t > T - 2: exact 0, not computed
        s = starts[doc]  # h_L reaches z_t alone: an exact 0 before s - 1, not at it
        assert (got[doc][-1, : s - 1] == 0).all() and got[doc][-1, s - 1] > 0
        # an L2 norm of a change of probabilities (at most sqrt 2): within FLOAT32 of 1 (the
        # extraction was seen within 2e-9 of the reference), well below the effects' size
        assert_within(got[doc], want, 1.0, what=f"document {doc}")
        assert want.max() > 100 * FLOAT32  # the comparison can fail


@pytest.mark.numerical
@pytest.mark.parametrize(
    ("family", "batch", "group"), [("llama", "4", 1), ("llama", "4", 16), ("gpt_neox", "1", 1)]
)
def test_choice_erasure_matches_an_independent_float64_reference(
    family: str,
    batch: str,
    group: int,
    tmp_path: Path,
    model_dirs: Any,
    build_model: Any,
    tokenizer: Any,
    make_task: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch of 4 prompts of different lengths is left-padded; the last state h_L changes the
    readout only at the last prompt token: every other position of it is an exact 0. Groups
    of at least 1 and 16 copies (``GROUP_MIN``), as in the text test."""
    monkeypatch.setattr(erase_hooks, "GROUP_MIN", group)
    task = make_task(tmp_path / "task", n=4)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs(family)), "--task", str(task), "--store", str(store),
                  "--erase", "--erase-reference", "2", "--batch-size", batch)  # fmt: skip
    assert out.exit_code == 0, out.output
    (info,) = Store(store).select()
    options = list(info.manifest.option_token_ids)
    prompts = [tokenizer(p)["input_ids"] for p in
               info.scan("instances").collect().sort("instance")["prompt"]]  # fmt: skip
    assert len({len(p) for p in prompts}) > 1  # the batch is padded
    model = build_model(family).to(torch.float64)
    means, effects = choice_reference(model, prompts[:2], prompts, options)
    assert_within(stored_means(store), means, np.abs(means).max(axis=1, keepdims=True))
    got = stored_effects(store)
    assert sorted(got) == list(range(4))
    for instance, want in enumerate(effects):
        T = len(prompts[instance])
        assert got[instance].shape == (len(means), T)
        assert (got[instance][-1, : T - 1] == 0).all() and got[instance][-1, T - 1] > 0
        # the readout position itself is measured, and the earlier states reach it
        assert (got[instance][: len(means) - 1, T - 1] > 0).all()
        assert_within(got[instance], want, 1.0, what=f"instance {instance}")
        assert want.max() > 100 * FLOAT32  # the comparison can fail


@pytest.fixture(scope="module")
def sink_model(tmp_path_factory: pytest.TempPathFactory, build_model: Any, tokenizer: Any) -> Any:
    """A tiny model folder (gpt_neox, whose unembedding is not the embedding) whose documents'
    first token ("Q", every multi-hop document's) has an embedding 100 times its own: its
    residual states carry a large norm through every block, as an attention sink's first
    token does (SmolLM2: about 23,800 against 160); and the model itself (float32)."""
    model = build_model("gpt_neox")
    first = tokenizer(documents(short=True)[0][0])["input_ids"][0]
    with torch.no_grad():
        model.get_input_embeddings().weight[first] *= 100.0
    path = tmp_path_factory.mktemp("sink-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


def short_documents(tokenizer: Any, count: int) -> tuple[list[list[int]], list[int]]:
    """The token ids of the first ``count`` short multi-hop documents and their answer starts."""
    docs, starts = [], []
    for document, answer in documents(short=True)[:count]:
        ids = tokenizer(document)["input_ids"]
        docs.append(ids)
        starts.append(len(ids) - len(tokenizer(answer, add_special_tokens=False)["input_ids"]))
    return docs, starts


@pytest.mark.numerical
@pytest.mark.parametrize(("positions", "first"), [("after-first", 1), ("all", 0)])
def test_erasure_reference_positions_against_float64(
    positions: str, first: int, tmp_path: Path, sink_model: Any, tokenizer: Any
) -> None:
    """The reference means over positions 1..T-1 (the default) and over every position
    (``all``, the authors'), each against a float64 reference of its own definition on a model
    whose first token has a large norm; the choice is recorded in the settings."""
    path, model = sink_model
    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    more = [] if positions == "after-first" else ["--erase-reference-positions", positions]
    out = extract("--model", str(path), "--task", str(task), "--store", str(store), "--erase",
                  "--erase-reference", "2", "--limit", "3", *more)  # fmt: skip
    assert out.exit_code == 0, out.output
    settings = Store(store).partitions[0].manifest.settings["erase"]
    assert settings["erase_reference_positions"] == positions
    docs, starts = short_documents(tokenizer, 3)
    model64 = copy.deepcopy(model).to(torch.float64)
    means, effects = reference(model64, docs[:2], docs[2:], starts[2:], first)
    other = reference_means_of(model64, docs[:2], 1 - first).numpy()
    # the first token's large norm: the mean with it is far from the mean without it, so the
    # comparison below tells the two definitions apart
    norms = np.linalg.norm(means, axis=1), np.linalg.norm(other, axis=1)
    assert (np.linalg.norm(means - other, axis=1) > 0.5 * np.minimum(*norms)).all()
    assert_within(stored_means(store), means, np.abs(means).max(axis=1, keepdims=True))
    got = stored_effects(store)[2]
    assert_within(got, effects[0], 1.0, what="document 2")
    assert effects[0].max() > 100 * FLOAT32  # the comparison can fail


def test_erasure_reference_from_another_task(
    tmp_path: Path, sink_model: Any, tokenizer: Any
) -> None:
    """``--erase-reference-task``: the means over positions 1..T-1 of that task's first R
    documents, recorded in the settings; a resume with other reference positions is refused
    before anything is written, as a reference task of fewer units than R."""
    path, model = sink_model
    task = multihop_task(tmp_path / "task", **SHORT)
    texts = ["the cat sat on the mat", "a dog ran by the door of the house", "the end"]
    other = text_task(tmp_path / "other", texts)
    store = tmp_path / "store"
    args = ["--model", str(path), "--task", str(task), "--store", str(store), "--erase",
            "--erase-reference", "2", "--erase-reference-task", str(other)]  # fmt: skip
    out = extract(*args, "--limit", "2")
    assert out.exit_code == 0, out.output
    settings = Store(store).partitions[0].manifest.settings["erase"]
    assert settings["erase_reference_task"] == str(other)
    assert settings["erase_reference_positions"] == "after-first"
    ids = [tokenizer(t)["input_ids"] for t in texts[:2]]
    means = reference_means_of(copy.deepcopy(model).to(torch.float64), ids).numpy()
    own = reference_means_of(copy.deepcopy(model).to(torch.float64),
                             short_documents(tokenizer, 2)[0]).numpy()  # fmt: skip
    scale = np.abs(means).max(axis=1, keepdims=True)
    assert_within(stored_means(store), means, scale)
    assert np.abs(own - means).max() > 100 * FLOAT32 * scale.max()  # the comparison can fail
    before = sorted(p.name for p in store.rglob("*.parquet"))
    out = CliRunner().invoke(main, ["extract", *args, "--limit", "3",
                                    "--erase-reference-positions", "all"])  # fmt: skip
    assert out.exit_code != 0 and "--erase-reference-positions after-first" in out.output
    assert sorted(p.name for p in store.rglob("*.parquet")) == before
    line = refused(tmp_path / "r", str(path), task, "--erase", "--erase-reference", "5",
                   "--erase-reference-task", str(other))  # fmt: skip
    assert f"the reference task {other}" in line and "from 1 to 3" in line


@pytest.mark.numerical
def test_choice_igrad_and_erase_read_one_option_probability_under_a_soft_cap(
    tmp_path: Path, build_model: Any, tokenizer: Any, make_task: Any
) -> None:
    """On a soft-capped family (``--allow-softcap``) choice ``--igrad``'s f(x) and choice
    ``--erase``'s probabilities (its clean and edited readout of the last state) are one
    readout: the softmax over the option logits before the final soft-cap, the logits the
    decomposition splits (methods §1, §13, §14). A cap of 0.1, near the tiny model's logits
    (about 0.1 in size), so that the capped softmax differs well beyond the tolerance."""
    cap = 0.1
    model = build_model("gemma2_softcap")
    model.config.final_logit_softcapping = cap
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    task = make_task(tmp_path / "task", n=3)
    store = tmp_path / "store"
    out = extract("--model", str(tmp_path / "model"), "--task", str(task), "--store", str(store),
                  "--igrad", "--igrad-steps", "2", "--erase", "--erase-reference", "2",
                  "--allow-softcap")  # fmt: skip
    assert out.exit_code == 0, out.output
    (info,) = Store(store).select()
    options = list(info.manifest.option_token_ids)
    instances = info.scan("instances").collect().sort("instance")
    ends = Store(store).scan("igrad_ends").collect()
    effects, last = stored_effects(store), torch.from_numpy(stored_means(store))[-1].double()
    model = model.to(torch.float64)
    norm, head = model.model.norm, model.get_output_embeddings()

    def probs(h: torch.Tensor, capped: bool = False) -> torch.Tensor:
        """The option softmax of final state(s) ``h``: the unembedding at the options, the
        soft-cap left out (or applied: the other rule)."""
        with torch.no_grad():
            z = head(norm(h))[..., options]
        return torch.softmax(cap * torch.tanh(z / cap) if capped else z, dim=-1)

    for instance, (prompt, gold) in enumerate(
        zip(instances["prompt"], instances["gold"], strict=True)
    ):
        ids = tokenizer(prompt)["input_ids"]
        h = run_states(model, ids)[0][-1, -1]  # h_L at the last prompt token
        p, q = probs(h), probs(h, capped=True)
        f_input = ends.filter(pl.col("doc") == instance)["f_input"].to_numpy()
        assert len(f_input) == 2  # block 0 and block 1
        assert_within(f_input, float(p[gold]), 1.0, what=f"igrad f(x), instance {instance}")
        assert abs(float(q[gold] - p[gold])) > 100 * FLOAT32  # the other rule would fail
        # erasing h_L at T - 1: the change from the clean to the edited option probabilities
        effect = effects[instance][-1, len(ids) - 1]
        want = float((probs(last) - p).norm())
        assert_within(effect, want, 1.0, what=f"erase effect of h_L, instance {instance}")
        assert abs(float((probs(last, capped=True) - q).norm()) - want) > 100 * FLOAT32


def test_choice_erasure_leaves_the_other_measurements_alone(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    """The edited passes run with the decomposition paused: every other table of a choice
    partition (the decomposition and the measurements bound to it, or watching every pass) is
    what an extraction without --erase stores."""
    task = make_task(tmp_path / "task", n=3)
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--skips", "--heads",
            "--gram", "--lens", "final", "--sinks"]  # fmt: skip
    for name, more in (("plain", []), ("erased", ["--erase", "--erase-reference", "1"])):
        out = extract(*args, *more, "--store", str(tmp_path / name))
        assert out.exit_code == 0, out.output
    plain, erased = Store(tmp_path / "plain"), Store(tmp_path / "erased")
    tables = ["components", "instances", "skips", "heads", "gram", "lens", "sinks"]
    assert set(tables) <= set(plain.tables) and "erasure" in erased.tables
    for table in tables:
        want, got = plain.scan(table).collect(), erased.scan(table).collect()
        floats = [c for c in want.columns
                  if want[c].dtype.is_float() or want[c].dtype == pl.List(pl.Float32)]  # fmt: skip
        keys = [c for c in want.columns if c not in floats]
        want, got = want.sort(keys), got.sort(keys)
        assert got.select(keys).equals(want.select(keys)), table
        for column in floats:
            a, b = (f[column].explode().cast(pl.Float64).to_numpy() for f in (got, want))
            assert_within(a, b, np.nanmax(np.abs(b)), what=f"{table}.{column}")


def extracted_four_ways(tmp_path: Path, args: list[str]) -> tuple[Path, Path]:
    """``args`` extracted whole (4 units), resumed (2, then 4: the stored reference reused) and
    as 2 shards merged; the resumed and merged stores checked against the whole one (the same
    settings, keys, effects and reference means). Returns (whole, resumed)."""
    whole = tmp_path / "whole"
    assert extract(*args, "--store", str(whole), "--limit", "4").exit_code == 0
    resumed = tmp_path / "resumed"
    for limit in ("2", "4"):
        assert extract(*args, "--store", str(resumed), "--limit", limit).exit_code == 0
    for i in (0, 1):
        out = extract(*args, "--store", str(tmp_path / f"s{i}"), "--shard", f"{i}/2",
                      "--limit", "4")  # fmt: skip
        assert out.exit_code == 0, out.output
    merged = tmp_path / "merged"
    out = CliRunner().invoke(main, ["merge", str(tmp_path / "s0"), str(tmp_path / "s1"),
                                    "--into", str(merged)])  # fmt: skip
    assert out.exit_code == 0, out.output
    keys = ("doc", "layer", "pos")
    want = Store(whole).scan("erasure").collect().sort(*keys)
    settings = Store(whole).partitions[0].manifest.settings["erase"]
    assert set(settings) == {"erase_reference", "erase_reference_positions",
                             "erase_reference_task", "erase_reference_sha256"}  # fmt: skip
    for store in (resumed, merged):
        assert Store(store).partitions[0].manifest.settings["erase"] == settings
        got = Store(store).scan("erasure").collect().sort(*keys)
        assert got.select(keys).equals(want.select(keys))
        assert_within(got["effect"].to_numpy(), want["effect"].to_numpy(), 1.0)
        assert (stored_means(store) == stored_means(whole)).all()
    return whole, resumed


def test_choice_erase_partition_is_resumed_sharded_and_merged(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    task = make_task(tmp_path / "task", n=6)
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--erase",
            "--erase-reference", "2", "--chunk-size", "2"]  # fmt: skip
    whole, _ = extracted_four_ways(tmp_path, args)
    blocks = Store(whole).partitions[0].manifest.n_blocks
    lengths = Store(whole).scan("instances").collect()["n_tokens"].sum()
    rows = Store(whole).scan("erasure").collect().height
    assert rows == (blocks + 1) * lengths  # a row per state and prompt token


def test_erase_partition_is_resumed_sharded_merged_and_keeps_its_reference(
    tmp_path: Path, model_dirs: Any
) -> None:
    task = multihop_task(tmp_path / "task", **SHORT)
    model = str(model_dirs("llama"))
    args = ["--model", model, "--task", str(task), "--erase", "--erase-reference", "2",
            "--chunk-size", "2"]  # fmt: skip
    whole, resumed = extracted_four_ways(tmp_path, args)

    # another reference: a resume is refused before anything is written, so is a merge
    before = sorted(p.name for p in (resumed / "erasure").rglob("*.parquet"))
    out = CliRunner().invoke(main, ["extract", *args[:-4], "--erase-reference", "3",
                                    "--chunk-size", "2", "--store", str(resumed),
                                    "--limit", "6"])  # fmt: skip
    assert out.exit_code != 0 and "--erase-reference 2" in out.output, out.output
    assert sorted(p.name for p in (resumed / "erasure").rglob("*.parquet")) == before
    other = tmp_path / "other"
    third = [*args[:-4], "--erase-reference", "3", "--chunk-size", "2"]
    assert extract(*third, "--store", str(other), "--limit", "4").exit_code == 0
    out = CliRunner().invoke(main, ["merge", str(whole), str(other), "--into",
                                    str(tmp_path / "m2")])  # fmt: skip
    assert out.exit_code != 0 and "erase" in out.output, out.output


def test_erase_refuses_another_reference_of_the_same_size(tmp_path: Path, model_dirs: Any) -> None:
    """A reference that changed (here: its stored file replaced by other means) is another
    extraction: the fingerprint in the settings refuses the resume."""
    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
            "--erase", "--erase-reference", "2", "--chunk-size", "2"]  # fmt: skip
    assert extract(*args, "--limit", "2").exit_code == 0
    info = Store(store).partitions[0]
    info.partition.whole("erasure_reference").unlink()  # computed again: the same means
    assert extract(*args, "--limit", "4").exit_code == 0
    manifest = info.partition.manifest
    text = manifest.read_text()
    digest = Store(store).partitions[0].manifest.settings["erase"]["erase_reference_sha256"]
    manifest.write_text(text.replace(digest, "0" * 64))
    info.partition.whole("erasure_reference").unlink()
    out = CliRunner().invoke(main, ["extract", *args, "--limit", "6"])
    assert out.exit_code != 0 and "erase_reference_sha256" in out.output, out.output


def test_bad_erase_input_is_refused_in_one_line(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    model = str(model_dirs("llama"))
    plain = text_task(tmp_path / "a", ["the cat sat on the warm mat by the door of the house"])
    line = refused(tmp_path, model, plain, "--erase")
    assert "names none; add an 'answer' template" in line and "drop --erase" in line
    task = multihop_task(tmp_path / "b", **SHORT)
    line = refused(tmp_path, model, task, "--erase", "--erase-reference", "5", "--limit", "4")
    assert "--erase-reference 5" in line and "from 1 to 4" in line
    line = refused(tmp_path, model, task, "--erase", "--erase-reference", "0")
    assert "--erase-reference 0" in line
    choice = make_task(tmp_path / "c", n=4)
    line = refused(tmp_path, model, choice, "--erase", "--erase-reference", "5")
    assert "first 5 instances" in line and "from 1 to 4" in line


def test_erasure_rows_are_checked_per_token_and_layer() -> None:
    """A text chunk: a row per token and state; a choice chunk (whose prompt tokens it does not
    count): whole rows per state, at least one position per instance."""
    from layerdiv.measurements.erase import ERASE

    assert ERASE.check_rows is not None
    assert ERASE.check_rows({"erasure": 3 * 10, "tokens": 10}, 2, {}) is None
    wrong = ERASE.check_rows({"erasure": 29, "tokens": 10}, 2, {})
    assert wrong is not None and wrong[0] == "erasure"
    assert ERASE.check_rows({"erasure": 3 * 17, "instances": 2}, 2, {}) is None
    for found in (3 * 17 + 1, 0, 3):  # not whole rows; none; fewer positions than instances
        wrong = ERASE.check_rows({"erasure": found, "instances": 2}, 2, {})
        assert wrong is not None and wrong[0] == "erasure", found


def test_erase_cost_counts_the_prefix_reusing_passes() -> None:
    """The declared cost against a count of the prefix-reusing passes written out per (l, t)."""
    from layerdiv.extract.cost import Shape
    from layerdiv.measurements.erase import erase_flops

    shape = Shape(d=8, layers=3, vocab=50, block_weights=100, attention=16)
    T, s = 9, 6
    # a text task reads s - 1..T - 2 out; a choice task T - 1 alone
    for first, last in ((s - 1, T - 2), (T - 1, T - 1)):
        want = 3 * shape.block(T)  # the clean pass that keeps the keys and values
        for layer in range(4):
            for t in range(last + 1):
                queries = 2 * 100 * (T - t) + 16 * sum(p + 1 for p in range(t, T))
                read = [t] if layer == 3 else range(max(first, t), last + 1)  # h_L: z_t alone
                want += (3 - layer) * queries + 2 * 8 * 50 * sum(first <= j for j in read)
        assert erase_flops(shape, T, first, last) == pytest.approx(want, rel=1e-12)


@pytest.mark.slow
@pytest.mark.numerical
def test_smollm2_erasure_of_one_short_document(tmp_path: Path) -> None:
    from layerdiv.extract.models import load_model, load_tokenizer, resolve_source

    task = text_task(tmp_path / "task", ["The capital of France is"], answer=" Paris")
    store = tmp_path / "store"
    out = extract("--model", "smollm2-135m-instruct", "--task", str(task), "--store", str(store),
                  "--erase", "--erase-reference", "1")  # fmt: skip
    assert out.exit_code == 0, out.output
    source = resolve_source("smollm2-135m-instruct", None, None, False)
    tokenizer = load_tokenizer(source)
    model = load_model(source, tokenizer, torch.device("cpu"), torch.float64).model
    ids = tokenizer("The capital of France is Paris")["input_ids"]
    start = len(ids) - len(tokenizer(" Paris", add_special_tokens=False)["input_ids"])
    means, effects = reference(model, [ids], [ids], [start])
    scale = np.abs(means).max(axis=1, keepdims=True)
    assert_within(stored_means(store), means, scale, FLOAT32_DEEP, rel=1e-3)
    got = stored_effects(store)[0]
    assert_within(got, effects[0], 1.0, TOLERANCE)
    assert effects[0].max() > 100 * TOLERANCE
