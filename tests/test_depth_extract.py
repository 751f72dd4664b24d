"""Layer skips and the Gram matrix at extraction (methods §7), on tiny random models,
checked against the model run by hand (no layerdiv hooks)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from layerdiv.extract.adapters import adapter_for, get_module
from layerdiv.extract.capture import ComponentCapture
from layerdiv.extract.readout import Readout
from layerdiv.measurements import Attachment
from layerdiv.measurements.gram.hooks import GramCapture
from layerdiv.measurements.skips.hooks import SkipCapture
from layerdiv.schemas import gram_index
from tests.tolerance import assert_within

PROMPTS = [[5, 17, 33, 40, 41, 42, 60, 7], [9, 12], [100, 101, 102, 103, 104]]
OPTIONS = [11, 25, 37]


def batch(prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Left-padded inputs as extraction forms them."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }


def without_block(
    model: Any,
    module: int,
    inputs: dict[str, torch.Tensor] | None = None,
    options: list[int] = OPTIONS,
) -> torch.Tensor:
    """The option logits of a deep copy of ``model`` whose block ``module`` is deleted from the
    block list (every call of it), run by plain HF code."""
    adapter = adapter_for(model.config)
    clone = copy.deepcopy(model)
    parent_path, _, name = adapter.blocks.rpartition(".")
    blocks = get_module(clone, adapter.blocks)
    target = list({id(b): b for b in blocks}.values())[module]
    setattr(
        get_module(clone, parent_path),
        name,
        torch.nn.ModuleList([b for b in blocks if b is not target]),
    )
    with torch.no_grad():
        logits = clone(**(inputs or batch(PROMPTS)), use_cache=False).logits
    return logits[:, -1, options]


def plain_logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch(PROMPTS), use_cache=False).logits[:, -1, OPTIONS]


def attachment(model: Any, capture: ComponentCapture) -> Attachment:
    """What an extraction attaches a measurement's hooks with, on a choice task of
    :data:`OPTIONS` whose every instance's gold option is the first."""
    return Attachment(model, capture.adapter, "choice", {}, capture.readout, OPTIONS, [0] * 3)


def bound_values(model: Any, hooks: Any) -> tuple[Any, torch.Tensor]:
    """The decomposition of :data:`PROMPTS` and the values (stacked by row) of the capture class
    ``hooks`` bound to it as an extraction binds it (``--skips``' or ``--gram``'s)."""
    adapter = adapter_for(model.config)
    capture = ComponentCapture(model, adapter, Readout(model, adapter), OPTIONS)
    bound = hooks(attachment(model, capture))
    bound.bind(capture)
    try:
        with torch.inference_mode():
            model(**batch(PROMPTS), use_cache=False)
            dec = capture.decompose()
            bound.decomposed(dec)
        return dec, torch.stack(list(bound.result()))
    finally:
        capture.remove()
        bound.remove()


@pytest.mark.numerical
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "phi", "gpt2", "gpt_neox"])
def test_skip_logits_equal_model_without_the_block(family: str, build_model: Any) -> None:
    model = build_model(family)
    before = plain_logits(model)
    got = bound_values(model, SkipCapture)[1]
    n_blocks = len(get_module(model, adapter_for(model.config).blocks))
    assert got.shape == (len(PROMPTS), n_blocks, len(OPTIONS))
    for b in range(n_blocks):
        want = without_block(model, b)  # within FLOAT32 of the logits' scale
        assert_within(got[:, b], want, want.abs().max(), what=f"block {b}")
        assert (got[:, b] - before).abs().max() > 1e-4  # skipping a block changes the logits
    # the forwards are restored: a plain run gives the model's own logits again (the same
    # computation on the same kernels: exact)
    torch.testing.assert_close(plain_logits(model), before, rtol=0, atol=0)
    assert not any(
        "forward" in m.__dict__ for m in get_module(model, adapter_for(model.config).blocks)
    )


@pytest.mark.numerical
def test_skips_of_a_shared_block_cover_every_call(build_model: Any) -> None:
    model = build_model("llama")
    blocks = model.model.layers
    model.model.layers = torch.nn.ModuleList([blocks[0], blocks[1], blocks[0], blocks[1]])
    model.config.num_hidden_layers = 4
    got = bound_values(model, SkipCapture)[1]
    assert got.shape[1] == 2
    for b in range(2):
        want = without_block(model, b)  # within FLOAT32 of the logits' scale
        assert_within(got[:, b], want, want.abs().max(), what=f"block {b}")


def hooked_outputs(
    model: Any, inputs: dict[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Component outputs z (B, C, d) at the last position from plain torch hooks on the
    attention and MLP modules and HF's own hidden states (embedding), and those hidden states."""
    adapter = adapter_for(model.config)
    outs: list[torch.Tensor] = []

    def keep(module: Any, args: Any, output: Any) -> None:
        outs.append((output[0] if isinstance(output, tuple) else output)[:, -1].float())

    handles = [
        get_module(block, getattr(adapter, kind)).register_forward_hook(keep)
        for block in get_module(model, adapter.blocks)
        for kind in ("attn", "mlp")
    ]
    with torch.no_grad():
        out = model(**(inputs or batch(PROMPTS)), use_cache=False, output_hidden_states=True)
    for handle in handles:
        handle.remove()
    hidden = [h[:, -1].float() for h in out.hidden_states]
    return torch.stack([hidden[0], *outs], dim=1), hidden


@pytest.mark.numerical
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_neox"])
def test_cos_prev_and_gram_equal_direct_computation(family: str, build_model: Any) -> None:
    model = build_model(family)
    dec, rows = bound_values(model, GramCapture)
    z, hidden = hooked_outputs(model)
    n = z.shape[1]
    cos_prev = torch.nn.functional.cosine_similarity(z[:, 1:], z[:, :-1], dim=-1)
    assert_within(dec.cos_prev[:, 1:n], cos_prev, 1.0)  # a cosine: of scale 1
    assert torch.isnan(dec.cos_prev[:, 0]).all()
    gram = z @ z.transpose(1, 2)
    a, b = torch.triu_indices(n, n)
    assert rows.shape == (len(PROMPTS), n * (n + 1) // 2)
    for i, j in [(0, 0), (0, n - 1), (1, 2), (n - 2, n - 1)]:
        k = gram_index(i, j, n)
        assert (int(a[k]), int(b[k])) == (i, j)
        # z_i . z_j within FLOAT32 of ||z_i|| ||z_j||
        scale = (gram[:, i, i] * gram[:, j, j]).sqrt()
        assert_within(rows[:, k], gram[:, i, j], scale, what=f"gram {i}, {j}")
    # the state after block l (HF hidden_states[l], before the final norm) from the Gram matrix
    for layer in range(1, len(hidden) - 1):
        c = 2 * layer + 1  # embedding + attention and MLP of blocks 0..layer-1
        norm2 = rows.new_zeros(len(PROMPTS))
        for i in range(c):
            for j in range(i, c):
                norm2 += (1 if i == j else 2) * rows[:, gram_index(i, j, n)]
        # ||h||^2 sums terms of up to (sum_i ||z_i||)^2: its square root is off by FLOAT32 of
        # (sum_i ||z_i||)^2 / (2 ||h||)
        want = hidden[layer].norm(dim=-1)
        terms = sum(rows[:, gram_index(i, i, n)].sqrt() for i in range(c))
        assert_within(norm2.sqrt(), want, terms**2 / (2 * want), what=f"||h_{layer}||")


# --- end to end: extract --skips --gram, then the depth tables ---------------------------------


def extract(*args: str) -> Any:
    from click.testing import CliRunner

    from layerdiv.cli import main

    result = CliRunner().invoke(main, ["extract", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def direct_z(model_dir: Path, task: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per instance, run alone through plain HF code: component outputs z (N, C, d) at the last
    token from plain hooks, the option logits (N, K), and the logits with each block removed
    by hand (N, blocks, K)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layerdiv.extract.tasks import instances, load_task, option_token_ids

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    spec = load_task(str(task))
    items = instances(spec, spec.n)
    options = option_token_ids(spec, tok, items[0].prompt)
    zs, logits, skipped = [], [], []
    for item in items:
        ids = tok(item.prompt, return_tensors="pt").input_ids
        z, _ = hooked_outputs(model, {"input_ids": ids})
        zs.append(z[0])
        with torch.no_grad():
            logits.append(model(ids).logits[0, -1, options])
        skipped.append(torch.stack([without_block(model, b, {"input_ids": ids}, options)[0]
                                    for b in range(len(model.model.layers))]))  # fmt: skip
    return torch.stack(zs), torch.stack(logits), torch.stack(skipped)


@pytest.mark.numerical
def test_extract_skips_and_gram_backfill_and_analysis(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    import numpy as np
    import polars as pl

    from layerdiv.analyze.analyses import depth
    from layerdiv.measurements.gram import analysis as gram
    from layerdiv.measurements.skips import analysis as skips
    from layerdiv.store import Store

    model_dir, task = model_dirs("llama"), make_task(tmp_path / "task", n=9)
    store = tmp_path / "store"
    common = ["--model", str(model_dir), "--task", str(task), "--store", str(store)]
    extract(*common, "--chunk-size", "4")
    with pytest.raises(skips.SkipsError, match="no complete skips table"):
        skips.skip_effects(store)
    parts = sorted((store / "components").rglob("*.parquet"))
    before = [p.read_bytes() for p in parts]
    result = extract(*common, "--skips", "--gram")
    assert "added skips, gram to 9 stored instances" in result.output
    assert [p.read_bytes() for p in sorted((store / "components").rglob("*.parquet"))] == before
    assert "nothing to do" in extract(*common, "--skips").output

    z, logits, skipped = direct_z(model_dir, task)
    st = Store(store)
    stored_skips = st.scan("skips").collect().sort("instance", "layer", "option")
    stored_logits = stored_skips["logit"].to_numpy().reshape(skipped.shape)
    assert_within(stored_logits, skipped, skipped.abs().max(), what="skip logits")
    tables = depth.geometry(store)
    # geometry: means over instances of the direct per-instance values (methods §7)
    r = z.cumsum(1)
    rel = (z[:, 1:].norm(dim=-1) / r[:, :-1].norm(dim=-1)).mean(0)
    cos_prev = torch.nn.functional.cosine_similarity(z[:, 1:], z[:, :-1], dim=-1).mean(0)
    geo = tables["geometry"].sort("component")
    np.testing.assert_allclose(geo["rel_contribution"], rel.numpy(), rtol=1e-4)
    assert_within(geo["cos_prev"], cos_prev, 1.0, what="cos_prev")  # a mean of cosines
    # gram: the angle of the state after block 1 to the final state
    h1, final = z[:, :3].sum(1), z.sum(1)
    to_end = torch.rad2deg(torch.arccos(torch.nn.functional.cosine_similarity(h1, final, -1)))
    angles = gram.gram_tables(st.select())["gram_blocks"].sort("block")
    np.testing.assert_allclose(angles["angle_to_end_deg"][0], to_end.mean().item(), rtol=1e-3)
    assert angles["angle_to_end_deg"][-1] == pytest.approx(0.0, abs=0.1)
    # skip effects: TE = logits - skip logits, DE = the block's own logits, IE = TE - DE
    comps = st.scan("components").collect()
    de = (
        comps.filter(pl.col("layer") >= 0)
        .group_by("instance", "layer", "option")
        .agg(pl.col("logit").sum())
        .sort("instance", "layer", "option")["logit"]
        .to_numpy()
        .reshape(skipped.shape)
    )
    te = (logits[:, None, :] - skipped).numpy()
    gold = st.scan("instances").collect().sort("instance")["gold"].to_numpy()
    effects = skips.skip_effects(store).sort("layer")
    # each a mean of differences of logits: within FLOAT32 of the logits' mean magnitude
    scale = (np.abs(logits.numpy())[:, None, :] + np.abs(skipped.numpy()) + np.abs(de)).mean((0, 2))
    assert_within(effects["total_effect"], np.abs(te).mean((0, 2)), scale, what="TE")
    assert_within(effects["direct_effect"], np.abs(de).mean((0, 2)), scale, what="DE")
    assert_within(effects["indirect_effect"], np.abs(te - de).mean((0, 2)), scale, what="IE")
    without = (skipped.argmax(-1).numpy() == gold[:, None]).mean(0)
    np.testing.assert_allclose(effects["accuracy_without"], without)
    log_p = torch.log_softmax(logits, -1)[:, None, :]
    log_q = torch.log_softmax(skipped, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean(0)
    # a small difference of log-probabilities: within FLOAT32 of sum_k p_k (|log p_k| + |log q_k|)
    scale = (log_p.exp() * (log_p.abs() + log_q.abs())).sum(-1).mean(0)
    assert_within(effects["kl"], kl, scale, what="kl")
    # per instance: the mean KL of the first half's skips ((b + 1) / L <= 0.5) minus the
    # second's, the unit the verdict resamples
    per = (log_p.exp() * (log_p - log_q)).sum(-1).numpy()  # (instances, blocks)
    first = (np.arange(per.shape[1]) + 1) / per.shape[1] <= 0.5
    halves = skips.skip_tables(st.select())["skip_halves"].sort("instance")
    assert halves["instance"].to_list() == list(range(len(per)))
    each = (log_p.exp() * (log_p.abs() + log_q.abs())).sum(-1).numpy().mean(1)
    want = per[:, first].mean(1) - per[:, ~first].mean(1)
    assert_within(halves["kl_difference"].to_numpy(), want, each, what="kl_difference")
