"""Every supported architecture decomposes exactly: tiny random models of each family."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from layerdiv.extract.adapters import (
    UnsupportedModel,
    adapter_for,
    get_module,
    supported_model_types,
)
from layerdiv.extract.capture import BatchDecomposition
from layerdiv.extract.forward import ModelRunner
from layerdiv.extract.models import LoadedModel, ModelSource
from tests.tolerance import FLOAT32, assert_within

FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3",
    "phi", "gpt2", "gpt_neox", "gpt_neox_sequential", "gptj", "opt",
)  # fmt: skip

# The component-name contract: changing these names breaks users' SQL.
PINNED_NAMES = {
    "llama": ["embed", "attn.0", "mlp.0", "attn.1", "mlp.1"],
    "gpt2": ["embed", "attn.0", "mlp.0", "attn.1", "mlp.1", "bias"],
    "phi": ["embed", "attn.0", "mlp.0", "attn.1", "mlp.1", "bias"],
    "gpt_neox": ["embed", "attn.0", "mlp.0", "attn.1", "mlp.1", "bias"],
}
PROMPTS = [[5, 17, 33, 40, 41, 42, 60, 7], [9, 12], [100, 101, 102, 103, 104]]
OPTIONS = [11, 25, 37, 52]


def loaded(model: Any, tokenizer: Any) -> LoadedModel:
    source = ModelSource("tiny", "tiny", None, "test", model.config, False)
    return LoadedModel(source, model, tokenizer, torch.device("cpu"), torch.float32)


def decompose(model: Any, tokenizer: Any, prompts: list[list[int]]) -> BatchDecomposition:
    with ModelRunner(loaded(model, tokenizer), adapter_for(model.config), OPTIONS, 4096) as runner:
        return runner.run(prompts)


def reference(
    model: Any, prompt: list[int]
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Hidden states at the last position, the final norm's input, and the model's logits, from
    plain HF outputs (no layerdiv code)."""
    adapter = adapter_for(model.config)
    seen: dict[str, torch.Tensor] = {}
    norm = get_module(model, adapter.final_norm)
    handle = norm.register_forward_pre_hook(lambda m, a: seen.update(x=a[0][0, -1].clone()))
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    handle.remove()
    hidden = [h[0, -1] for h in out.hidden_states[:-1]] + [seen["x"]]
    return hidden, seen["x"], out.logits[0, -1]


@pytest.mark.numerical
@pytest.mark.parametrize("family", FAMILIES)
def test_components_sum_to_model_logits_and_match_hidden_states(
    family: str, build_model: Any, tokenizer: Any
) -> None:
    model = build_model(family)
    dec = decompose(model, tokenizer, PROMPTS)
    n_layers = model.config.num_hidden_layers
    names = [c.name for c in dec.components]
    assert names[0] == "embed" and len(names) in (1 + 2 * n_layers, 2 + 2 * n_layers)
    adapter = adapter_for(model.config)
    norm = get_module(model, adapter.final_norm)
    gain = norm.weight.detach().float() + (1.0 if adapter.norm == "rms_plus_one" else 0.0)
    w = model.get_output_embeddings().weight.detach()[OPTIONS].float()
    for row, prompt in enumerate(PROMPTS):
        hidden, x, logits = reference(model, prompt)
        # The components add up to the model's own (unpadded, unbatched) option logits, within
        # FLOAT32 of the sum of their magnitudes (the padded batch runs other kernels).
        terms = dec.logits[row].abs().sum(0)
        assert_within(dec.logits[row].sum(0), logits[OPTIONS], terms, what=family)
        assert float(dec.sum_error[row]) <= FLOAT32 * float(terms.max())

        def projected(got: torch.Tensor, v: torch.Tensor, x: torch.Tensor = x) -> None:
            """``got`` = w . u, u = v through the final norm of x's scale, within FLOAT32 of
            ||w|| ||u||."""
            if adapter.norm == "layer":
                u = gain * (v - v.mean()) / torch.sqrt(x.var(unbiased=False) + norm.eps)
            else:
                u = gain * v / torch.sqrt(x.pow(2).mean() + adapter_eps(norm))
            assert_within(got, w @ u, w.norm(dim=-1) * u.norm(), what=family)

        # Embedding component = the projected input of the first block.
        projected(dec.logits[row, 0], hidden[0])
        # attention + MLP of each layer = projected difference of consecutive hidden states.
        for layer in range(n_layers):
            pair = [i for i, c in enumerate(dec.components) if c.layer == layer]
            projected(dec.logits[row, pair].sum(0), hidden[layer + 1] - hidden[layer])


def adapter_eps(norm: Any) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)))


@pytest.mark.parametrize("family", sorted(PINNED_NAMES))
def test_component_names_are_pinned(family: str, build_model: Any, tokenizer: Any) -> None:
    dec = decompose(build_model(family), tokenizer, PROMPTS[:1])
    assert [c.name for c in dec.components] == PINNED_NAMES[family]
    assert [c.kind for c in dec.components] == [n.split(".")[0] for n in PINNED_NAMES[family]]


def test_shared_layers_give_one_component_per_call(build_model: Any, tokenizer: Any) -> None:
    """A block that runs twice (MobileLLM layer-share) yields two components, with no code of
    its own: here every block of a 2-layer Llama is listed twice."""
    model = build_model("llama")
    blocks = model.model.layers
    model.model.layers = torch.nn.ModuleList([blocks[0], blocks[0], blocks[1], blocks[1]])
    model.config.num_hidden_layers = 4
    dec = decompose(model, tokenizer, PROMPTS)
    assert [c.name for c in dec.components] == [
        "embed", "attn.0", "mlp.0", "attn.0#1", "mlp.0#1",
        "attn.1", "mlp.1", "attn.1#1", "mlp.1#1",
    ]  # fmt: skip
    assert float(dec.sum_error.max()) < 1e-5


@pytest.mark.numerical
def test_geometry_columns(build_model: Any, tokenizer: Any) -> None:
    model = build_model("llama")
    dec = decompose(model, tokenizer, PROMPTS[:1])
    hidden, x, _ = reference(model, PROMPTS[0])
    eps = adapter_eps(model.model.norm)
    # The last prefix is the full residual: its rms is the final rms.
    assert torch.allclose(dec.prefix_rms[0, -1], dec.final_rms[0], rtol=1e-5)
    assert torch.allclose(dec.final_rms[0], torch.sqrt(x.pow(2).mean() + eps), rtol=1e-5)
    assert torch.isnan(dec.cos_residual[0, 0]) and torch.isfinite(dec.cos_residual[0, 1:]).all()
    assert torch.allclose(dec.out_norm[0, 0], hidden[0].norm(), rtol=1e-5)


def test_unknown_architecture_lists_supported(build_model: Any) -> None:
    with pytest.raises(UnsupportedModel, match=r"supported model types: .*llama"):
        adapter_for(build_model("bert").config)
    assert "gpt_neox" in supported_model_types()


@pytest.mark.numerical
def test_capture_buffer_grows_with_calls_and_rows(build_model: Any, tokenizer: Any) -> None:
    """More component calls than preallocated slots (a block run 40 times) and a larger batch
    after a smaller one: the reused buffer grows and the numbers stay exact."""
    model = build_model("llama")
    blocks = model.model.layers
    model.model.layers = torch.nn.ModuleList([blocks[0], blocks[1]] * 20)
    model.config.num_hidden_layers = 40
    with ModelRunner(loaded(model, tokenizer), adapter_for(model.config), OPTIONS, 4096) as runner:
        small = runner.run(PROMPTS[1:2])
        large = runner.run(PROMPTS)
    assert len(large.components) == 1 + 2 * 40
    assert [c.name for c in large.components][-2:] == ["attn.1#19", "mlp.1#19"]
    terms = large.logits.abs().sum(1)  # (rows, options): the magnitudes of each sum
    assert float(large.sum_error.max()) <= FLOAT32 * float(terms.max())
    assert_within(small.logits[0], large.logits[1], terms[1].max())
