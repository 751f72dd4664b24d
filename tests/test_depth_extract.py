"""Layer skips and the Gram matrix at extraction (METHODS.md section 7), on tiny random models,
checked against the model run by hand (no layerdiv hooks)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from layerdiv.extract.adapters import adapter_for, get_module
from layerdiv.extract.skips import BlockSkipper

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


def without_block(model: Any, module: int) -> torch.Tensor:
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
        logits = clone(**batch(PROMPTS), use_cache=False).logits
    return logits[:, -1, OPTIONS]


def plain_logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch(PROMPTS), use_cache=False).logits[:, -1, OPTIONS]


def skip_logits(model: Any) -> torch.Tensor:
    skipper = BlockSkipper(model, adapter_for(model.config), OPTIONS)
    inputs = batch(PROMPTS)
    with torch.inference_mode():
        with skipper.recording():
            model(**inputs, use_cache=False)
        return skipper.skip_logits(lambda: model(**inputs, use_cache=False))


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "phi", "gpt2", "gpt_neox"])
def test_skip_logits_equal_model_without_the_block(family: str, build_model: Any) -> None:
    model = build_model(family)
    before = plain_logits(model)
    got = skip_logits(model)
    n_blocks = len(get_module(model, adapter_for(model.config).blocks))
    assert got.shape == (len(PROMPTS), n_blocks, len(OPTIONS))
    for b in range(n_blocks):
        torch.testing.assert_close(got[:, b], without_block(model, b), rtol=1e-4, atol=1e-5)
        assert (got[:, b] - before).abs().max() > 1e-4  # skipping a block changes the logits
    # the forwards are restored: a plain run gives the model's own logits again
    torch.testing.assert_close(plain_logits(model), before, rtol=0, atol=0)
    assert not any(
        "forward" in m.__dict__ for m in get_module(model, adapter_for(model.config).blocks)
    )


def test_skips_of_a_shared_block_cover_every_call(build_model: Any) -> None:
    model = build_model("llama")
    blocks = model.model.layers
    model.model.layers = torch.nn.ModuleList([blocks[0], blocks[1], blocks[0], blocks[1]])
    model.config.num_hidden_layers = 4
    got = skip_logits(model)
    assert got.shape[1] == 2
    for b in range(2):
        torch.testing.assert_close(got[:, b], without_block(model, b), rtol=1e-4, atol=1e-5)
