"""Per-head logits (methods §8) on tiny random models of every supported family."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from click.testing import CliRunner

from layerdiv.cli import main
from layerdiv.errors import DecompositionError
from layerdiv.extract import adapters, runner
from layerdiv.extract.adapters import UnsupportedModel, adapter_for, get_module
from layerdiv.extract.capture import BatchDecomposition, check_batch
from layerdiv.extract.forward import ModelRunner
from layerdiv.extract.models import (
    LoadedModel,
    ModelSource,
)
from layerdiv.measurements.heads.analysis import head_scores
from layerdiv.measurements.heads.hooks import (
    HeadCapture,
    HeadDecomposition,
    check_head_sums,
    check_heads,
)
from layerdiv.store import Store
from tests.test_models import plain_and_offloaded
from tests.tolerance import assert_within

FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3",
    "phi", "gpt2", "gpt_neox", "gpt_neox_sequential", "gptj", "opt",
)  # fmt: skip
PROMPTS = [[5, 17, 33, 40, 41, 42, 60, 7], [9, 12], [100, 101, 102, 103, 104]]
OPTIONS = [11, 25, 37, 52]


def run_heads(model: Any, tokenizer: Any) -> tuple[BatchDecomposition, HeadDecomposition]:
    """One left-padded batch of :data:`PROMPTS` through ``model`` with both captures."""
    source = ModelSource("tiny", "tiny", None, "test", model.config, False)
    loaded = LoadedModel(source, model, tokenizer, torch.device("cpu"), torch.float32)
    adapter = adapter_for(model.config)
    with ModelRunner(loaded, adapter, OPTIONS, 4096, run_settings={"heads": {}}) as runner:
        batch = runner.run(PROMPTS)
        capture = runner.hooks["heads"]
    assert isinstance(capture, HeadCapture) and capture.heads is not None
    # each instance's values, as the heads table is built from them
    rows = batch.measured["heads"]
    assert [r.logits.shape for r in rows] == [capture.heads.logits.shape[1:]] * len(PROMPTS)
    assert rows[0].layers == [batch.components[c].layer for c in capture.heads.components]
    return batch, capture.heads


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_and_bias_sum_to_the_attention_component(
    family: str, build_model: Any, tokenizer: Any
) -> None:
    model = build_model(family)
    batch, heads = run_heads(model, tokenizer)
    n_heads = model.config.num_attention_heads
    has_bias = family in ("phi", "gpt2", "gpt_neox", "gpt_neox_sequential", "opt")
    assert heads.head_ids == [-1] * has_bias + list(range(n_heads))
    assert [batch.components[c].kind for c in heads.components] == ["attn"] * 2
    assert heads.logits.shape == (len(PROMPTS), 2, n_heads + has_bias, len(OPTIONS))
    error = (heads.logits.sum(2) - batch.logits[:, heads.components]).abs().max()
    assert float(error) < 1e-5
    assert check_head_sums(heads, batch, [0, 1, 2], 1e-4) < 1e-5
    # no head is trivially zero: the split is a real one
    assert bool((heads.logits[:, :, has_bias:].abs().amax(dim=-1) > 0).all())


@pytest.mark.numerical
def test_llama_heads_by_hand(build_model: Any, tokenizer: Any) -> None:
    """u_(b,h)[k] = W_U[k] . (g * W_O[:, h] a_h / rms(x)) from the attention module's own
    input to o_proj and the final norm's input, computed here without layerdiv's code."""
    model = build_model("llama")
    _, heads = run_heads(model, tokenizer)
    prompt = PROMPTS[0]
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        model.model.norm.register_forward_pre_hook(lambda m, a: seen.update(x=a[0][0, -1])),
        *(
            block.self_attn.o_proj.register_forward_pre_hook(
                lambda m, a, i=i: seen.update({f"a{i}": a[0][0, -1]})
            )
            for i, block in enumerate(model.model.layers)
        ),
    ]
    with torch.no_grad():
        model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    x = seen["x"]
    scale = model.model.norm.weight / torch.sqrt(
        x.pow(2).mean() + model.model.norm.variance_epsilon
    )
    w_u = model.lm_head.weight[OPTIONS]
    n_heads, head_dim = model.config.num_attention_heads, model.config.head_dim
    for layer, block in enumerate(model.model.layers):
        w_o = block.self_attn.o_proj.weight
        for h in range(n_heads):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            u = scale * (w_o[:, cols] @ seen[f"a{layer}"][cols])
            # w_u . u within FLOAT32 of ||w_u|| ||u||
            norms = w_u.norm(dim=-1) * u.norm()
            assert_within(heads.logits[0, layer, h], w_u @ u, norms, what=f"{layer}, {h}")


@pytest.mark.numerical
def test_shared_blocks_give_heads_per_call(build_model: Any, tokenizer: Any) -> None:
    model = build_model("llama")
    blocks = model.model.layers
    model.model.layers = torch.nn.ModuleList([blocks[0], blocks[0], blocks[1], blocks[1]])
    model.config.num_hidden_layers = 4
    batch, heads = run_heads(model, tokenizer)
    names = [batch.components[c].name for c in heads.components]
    assert names == ["attn.0", "attn.0#1", "attn.1", "attn.1#1"]
    # the heads add up to their attention component, within FLOAT32 of their magnitudes
    terms = heads.logits.abs().sum(2)
    assert_within(heads.logits.sum(2), batch.logits[:, heads.components], terms)
    # the two calls of one block see different inputs, so their heads differ
    assert not torch.allclose(heads.logits[:, 0], heads.logits[:, 1])


def test_violation_names_the_block(build_model: Any, tokenizer: Any) -> None:
    batch, heads = run_heads(build_model("llama"), tokenizer)
    heads.logits = heads.logits.clone()  # an inference tensor cannot change in place
    heads.logits[1, 1, 2, 0] += 1.0
    with pytest.raises(DecompositionError, match=r"^instance 8: the heads of attn\.1 "):
        check_head_sums(heads, batch, [7, 8, 9], 1e-4)


def test_each_pass_checks_its_heads_unless_the_components_fail_their_own_check(
    build_model: Any, tokenizer: Any
) -> None:
    model = build_model("llama")
    source = ModelSource("tiny", "tiny", None, "test", model.config, False)
    loaded = LoadedModel(source, model, tokenizer, torch.device("cpu"), torch.float32)
    with ModelRunner(
        loaded, adapter_for(model.config), OPTIONS, 4096, run_settings={"heads": {}}
    ) as r:
        batch = r.run(PROMPTS, [7, 8, 9])
        capture = r.hooks["heads"]
        assert isinstance(capture, HeadCapture)
        broken = replace(batch, logits=batch.logits.clone(), sum_error=batch.sum_error.clone())
        broken.logits[1, 1, 0] += 1.0  # attn.0 of instance 8 no longer its heads' sum
        with pytest.raises(DecompositionError, match=r"^instance 8: the heads of attn\.0 "):
            capture.decomposed(broken)
        broken.sum_error[1] = 1.0  # the components do not sum to the model's logits either
        capture.decomposed(broken)  # left to the decomposition's check, which names them
        with pytest.raises(DecompositionError, match=r"task t, instance 8: components sum"):
            check_batch(broken, [7, 8, 9], "t", 1e-4)


def test_unsplittable_attention_is_refused_from_the_config(
    build_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = build_model("llama").config
    assert check_heads(config) == config.num_attention_heads
    patched = tuple(
        replace(a, attn_out=None) if a.family == "llama" else a for a in adapters.ADAPTERS
    )
    monkeypatch.setattr(adapters, "ADAPTERS", patched)
    with pytest.raises(UnsupportedModel, match=r"^--heads: the attention of 'llama' .*--heads\.$"):
        check_heads(config)


def test_projection_paths_exist_for_every_family(build_model: Any) -> None:
    for family in FAMILIES:
        model = build_model(family)
        adapter = adapter_for(model.config)
        assert adapter.attn_out is not None
        block = get_module(model, adapter.blocks)[0]
        proj = get_module(block, adapter.attn_out)
        assert type(proj).__name__ == ("Conv1D" if adapter.attn_out_transposed else "Linear")


def extract(*args: str) -> Any:
    return CliRunner().invoke(main, ["extract", *args], catch_exceptions=False)


def test_extract_heads_end_to_end_and_backfill(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    task = make_task(tmp_path / "task", n=20)
    common = ["--task", str(task), "--chunk-size", "8", "--batch-size", "3"]
    # gpt2: W_O has a bias (head -1) and a Conv1D weight
    store = tmp_path / "gpt2"
    result = extract("--model", str(model_dirs("gpt2")), "--store", str(store), "--heads", *common)
    assert result.exit_code == 0, result.output
    [info] = Store(store).select()
    assert info.manifest.extra_tables == ["heads"]
    heads = pl.read_parquet(info.files("heads"))
    assert heads.height == 20 * 2 * (4 + 1) * 2  # instances x blocks x (heads + bias) x options
    assert sorted(heads["head"].unique()) == [-1, 0, 1, 2, 3]
    comps = pl.read_parquet(info.files("components"))
    sums = heads.group_by("instance", "component", "option").agg(pl.col("logit").sum())
    joined = sums.join(comps, on=["instance", "component", "option"], suffix="_component")
    assert joined.height == 20 * 2 * 2
    assert (joined["logit"] - joined["logit_component"]).abs().max() < 1e-5  # type: ignore[operator]
    assert head_scores(store).height == 2 * 2 * 4  # estimators x blocks x heads

    # llama: extracted without heads, then extended with --heads (backfill, nothing recomputed
    # but the heads)
    store = tmp_path / "llama"
    model = ["--model", str(model_dirs("llama")), "--store", str(store)]
    assert extract(*model, *common).exit_code == 0
    before = {p: p.stat().st_mtime_ns for p in store.rglob("components/**/*.parquet")}
    result = extract(*model, *common, "--heads")
    assert result.exit_code == 0, result.output
    assert "added heads to 20 stored instances (their other tables were kept)" in result.output
    assert "20/20 instances stored (none new; tables added to 20 stored instances)" in result.output
    assert {p: p.stat().st_mtime_ns for p in store.rglob("components/**/*.parquet")} == before
    [info] = Store(store).select()
    assert len(info.files("heads")) == len(info.files("instances")) == 3
    assert head_scores(store).height == 2 * 2 * 4
    again = extract(*model, *common, "--heads")
    assert "nothing to do" in again.output
    # A later run without --heads still gives the chunks it stores heads: the partition has them.
    for table in ("instances", "heads"):
        (part,) = store.glob(f"{table}/**/part-0000016-000004.parquet")
        part.unlink()
    more = extract(*model, *common)
    assert more.exit_code == 0, more.output
    assert "20/20 instances stored (4 new" in more.output
    [info] = Store(store).select()
    assert len(info.files("heads")) == 3 and head_scores(store).height == 2 * 2 * 4


def test_extract_heads_refused_before_weights_load(
    tmp_path: Path, model_dirs: Any, make_task: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    patched = tuple(
        replace(a, attn_out=None) if a.family == "llama" else a for a in adapters.ADAPTERS
    )
    monkeypatch.setattr(adapters, "ADAPTERS", patched)

    def no_weights(*args: Any) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(runner, "load_model", no_weights)
    task = make_task(tmp_path / "task", n=4)
    store = tmp_path / "store"
    result = CliRunner().invoke(
        main,
        ["extract", "--model", str(model_dirs("llama")), "--task", str(task), "--store",
         str(store), "--heads"],
    )  # fmt: skip
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: --heads: the attention of 'llama' models cannot be split into heads exactly (no "
        "per-head output projection in layerdiv/extract/adapters.py); extract without --heads."
    ]
    assert not store.exists()


@pytest.mark.numerical
def test_offloaded_weights_give_identical_heads(model_dirs: Any, tokenizer: Any) -> None:
    """Odd blocks, embedding, final norm and head on disk (accelerate loads them for each
    forward pass): M is formed from the loaded weights and the heads are those of the CPU
    model."""
    plain, offloaded = plain_and_offloaded(model_dirs("gpt2"))
    adapter = adapter_for(plain.config)
    assert get_module(offloaded, adapter.blocks)[1].attn.c_proj.weight.device.type == "meta"
    want = run_heads(plain, tokenizer)[1].logits
    got = run_heads(offloaded, tokenizer)[1].logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
