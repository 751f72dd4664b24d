"""Architecture adapters: where each model family keeps the modules whose outputs are added to the
residual stream, and how its final norm scales the residual. The only architecture-specific code
in layerdiv lives here.

A component is the output of a module that is added to the residual stream (methods §1).
The embedding component is taken as the input of the first decoder block, so position embeddings
(GPT-2) and embedding scaling (Gemma) are part of it. Components are recorded in the order their
modules run, so parallel attention/MLP blocks and shared layers that run twice need no special code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from layerdiv.errors import LayerdivError

NormKind = Literal["rms", "rms_plus_one", "layer"]


class UnsupportedModel(LayerdivError, ValueError):
    """The model's architecture has no adapter, or cannot be decomposed exactly."""


@dataclass(frozen=True)
class Adapter:
    """Where one architecture family keeps its residual-stream modules."""

    family: str
    """Short family name recorded in the manifest."""
    model_types: tuple[str, ...]
    """``config.model_type`` values this adapter serves."""
    blocks: str
    """Dotted path from the causal-LM object to the list of decoder blocks."""
    attn: str
    """Dotted path inside a block to the module whose output is the attention component."""
    mlp: str
    """Dotted path inside a block to the module whose output is the MLP component."""
    final_norm: str
    """Dotted path from the causal-LM object to the final norm."""
    norm: NormKind
    """``rms``: g * x / rms(x); ``rms_plus_one``: (1 + g) * x / rms(x); ``layer``: LayerNorm."""
    attn_out: str | None = None
    """Dotted path inside a block to the attention output projection W_O (methods
    §8): its input at a position is the concatenation of the heads' outputs a_h, head-major, each
    of width in_features / num_attention_heads. None: the attention cannot be split into heads
    exactly (``--heads`` is refused)."""
    attn_out_transposed: bool = False
    """W_O's weight is stored (in, out), as GPT-2's ``Conv1D``, instead of ``nn.Linear``'s
    (out, in)."""
    attn_post_norm: bool = False
    """The attention component (``attn``) is a norm of W_O's output (Gemma-2/3 sandwich norms):
    the heads go through it with its scale frozen at the block's own value."""
    refuse: Callable[[Any], str | None] | None = None
    """Of a config of this family: why it cannot be decomposed (one line), or None."""
    prepare: Callable[[Any], None] | None = None
    """Gives a loaded model of this family the modules the paths above name (idempotent)."""


def _opt_tokens_view(model: Any) -> None:
    """OPT's MLP has no module of its own and runs on the tokens flattened to rows: its fc2 is
    wrapped so that its output passes through an identity module ``fc2.tokens`` shaped (batch,
    positions, d), what the MLP adds to the residual stream (hooks there see and may replace it)."""
    import torch

    class TokensView(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner, self.tokens, self.shape = inner, torch.nn.Identity(), (0, 0)

        def forward(self, x: Any) -> Any:
            y = self.inner(x)
            return self.tokens(y.view(*self.shape, y.shape[-1])).reshape(y.shape)

    for layer in model.model.decoder.layers:
        if type(layer.fc2).__name__ == "TokensView":
            continue
        view = TokensView(layer.fc2)
        layer.fc2 = view

        def keep_shape(module: Any, args: Any, kwargs: Any, view: Any = view) -> None:
            view.shape = tuple(hidden_of(args, kwargs).shape[:-1])

        layer.register_forward_pre_hook(keep_shape, with_kwargs=True)


def _opt_refusal(config: Any) -> str | None:
    """OPT variants whose residual stream is not the sum of the blocks' additions."""
    if not getattr(config, "do_layer_norm_before", True):
        return (
            "is a post-norm OPT (do_layer_norm_before=False, as OPT-350m): each block layer-norms "
            "the residual stream after adding to it, so the stream is not a sum of components"
        )
    if getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
        return (
            "projects its embeddings and final states (word_embed_proj_dim != hidden_size), "
            "which the readout does not model"
        )
    if getattr(config, "_remove_final_layer_norm", False):
        return "has no final layer norm (_remove_final_layer_norm=True)"
    return None


_LLAMA_LIKE: dict[str, Any] = dict(
    blocks="model.layers",
    attn="self_attn",
    mlp="mlp",
    final_norm="model.norm",
    attn_out="self_attn.o_proj",
)
_SANDWICH: dict[str, Any] = dict(
    blocks="model.layers",
    attn="post_attention_layernorm",
    mlp="post_feedforward_layernorm",
    final_norm="model.norm",
    attn_out="self_attn.o_proj",
    attn_post_norm=True,
)

ADAPTERS: tuple[Adapter, ...] = (
    Adapter("llama", ("llama", "mobilellm"), norm="rms", **_LLAMA_LIKE),
    Adapter("mistral", ("mistral",), norm="rms", **_LLAMA_LIKE),
    Adapter("qwen2", ("qwen2",), norm="rms", **_LLAMA_LIKE),
    Adapter("qwen3", ("qwen3",), norm="rms", **_LLAMA_LIKE),
    Adapter("phi3", ("phi3",), norm="rms", **_LLAMA_LIKE),
    Adapter("gemma", ("gemma",), norm="rms_plus_one", **_LLAMA_LIKE),
    Adapter("gemma2", ("gemma2",), norm="rms_plus_one", **_SANDWICH),
    Adapter("gemma3", ("gemma3_text",), norm="rms_plus_one", **_SANDWICH),
    Adapter(
        "phi",
        ("phi",),
        blocks="model.layers",
        attn="self_attn",
        mlp="mlp",
        final_norm="model.final_layernorm",
        norm="layer",
        attn_out="self_attn.dense",
    ),
    Adapter(
        "gpt2",
        ("gpt2",),
        blocks="transformer.h",
        attn="attn",
        mlp="mlp",
        final_norm="transformer.ln_f",
        norm="layer",
        attn_out="attn.c_proj",
        attn_out_transposed=True,
    ),
    Adapter(
        "gpt_neox",
        ("gpt_neox",),
        blocks="gpt_neox.layers",
        attn="attention",
        mlp="mlp",
        final_norm="gpt_neox.final_layer_norm",
        norm="layer",
        attn_out="attention.dense",
    ),
    Adapter(
        "gptj",
        ("gptj",),
        blocks="transformer.h",
        attn="attn",
        mlp="mlp",
        final_norm="transformer.ln_f",
        norm="layer",
        attn_out="attn.out_proj",
    ),
    Adapter(
        "opt",
        ("opt",),
        blocks="model.decoder.layers",
        attn="self_attn",
        mlp="fc2.tokens",
        final_norm="model.decoder.final_layer_norm",
        norm="layer",
        attn_out="self_attn.out_proj",
        refuse=_opt_refusal,
        prepare=_opt_tokens_view,
    ),
)


def supported_model_types() -> list[str]:
    return sorted(t for a in ADAPTERS for t in a.model_types)


def adapter_for(config: Any) -> Adapter:
    """The adapter of a HuggingFace config, or an error listing the supported architectures."""
    model_type = getattr(config, "model_type", None)
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            reason = adapter.refuse(config) if adapter.refuse else None
            if reason:
                raise UnsupportedModel(f"this {model_type!r} model {reason}; it is not supported.")
            return adapter
    raise UnsupportedModel(
        f"architecture {model_type!r} is not supported; supported model types: "
        f"{', '.join(supported_model_types())}. Adding one is a new entry in "
        "layerdiv/extract/adapters.py."
    )


def final_softcap(config: Any) -> float | None:
    """The final logit soft-cap of a config (Gemma-2 style), or None when there is none."""
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def check_softcap(config: Any, allow: bool) -> bool:
    """Refuse final logit soft-capping unless allowed; True when the result is approximate."""
    cap = final_softcap(config)
    if cap and not allow:
        raise UnsupportedModel(
            f"{getattr(config, 'model_type', 'this model')} soft-caps its final logits (cap "
            f"{cap}), which is not linear: the components cannot sum to its logits. Pass "
            "--allow-softcap to decompose the pre-cap logits instead (the manifest marks the "
            "partition approximate)."
        )
    return bool(cap)


def prepare_model(model: Any) -> Any:
    """``model`` with the modules its adapter names (:attr:`Adapter.prepare`; idempotent)."""
    model_type = getattr(model.config, "model_type", None)
    for adapter in ADAPTERS:
        if model_type in adapter.model_types and adapter.prepare is not None:
            adapter.prepare(model)
    return model


def get_module(root: Any, path: str) -> Any:
    """Follow a dotted attribute path (``model.layers``) from ``root``."""
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def hidden_of(args: tuple, kwargs: dict) -> Any:
    """The hidden states a decoder block call reads (its first positional argument, else its
    ``hidden_states`` keyword), from a forward pre-hook's ``args`` and ``kwargs``."""
    return args[0] if args else kwargs["hidden_states"]


def norm_eps(norm: Any) -> float:
    """The epsilon a norm module adds inside its square root."""
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, int | float):
            return float(value)
    raise UnsupportedModel(f"cannot find the epsilon of final norm {type(norm).__name__}")
