"""The hooks of ``extract --sinks`` (:mod:`layerdiv.measurements.sinks`, methods §16): per unit,
block and query head, the mean over query positions p = 1..T-1 of the attention weight on key
position 0, from the model's own queries and keys.

The attention modules of the families transformers declares ``_supports_attention_backend``
(Llama, Qwen2, GPT-NeoX, Gemma, ...) call an attention function of transformers'
``AttentionInterface`` with the queries and keys after rotary embedding, the mask (padding,
causality, a sliding window), ``scaling`` and, where the family has them, ``softcap`` and ``s_aux``
(learned sink logits). While a :class:`SinkCapture` is attached, the interface's function of the
model's implementation (``eager``, ``sdpa``) is a dispatcher that calls the original unchanged
and, for the attention modules of a watched model, first computes the softmax's column 0 with its
full normaliser (a log-sum-exp over every key of each query), in slices of queries, in float32 or
wider: nothing of the size of the attention matrix outlives a slice, and the model's output is
the one it computes without the capture."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from layerdiv.errors import DecompositionError
from layerdiv.extract.adapters import UnsupportedModel, get_module
from layerdiv.extract.hooks import Hooks
from layerdiv.measurements import Attachment
from layerdiv.measurements.sinks import QUERY_SLICE

IMPLEMENTATIONS = ("eager", "sdpa")
"""The attention implementations whose mask :func:`bos_weights` reads (an additive or boolean
tensor, or None for plain causal attention)."""

SLICE_ELEMENTS = 2**24
"""The most scores (batch x heads x queries x keys) computed at once."""


Watcher = Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, Any]], None]


def check_sinks(config: Any) -> None:
    """Refuse, in one line before the weights load, a family whose attention does not go through
    transformers' attention interface (``--sinks``'s check of the model)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = getattr(config, "model_type", None)
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        cls = None
    if not getattr(cls, "_supports_attention_backend", False):
        raise UnsupportedModel(
            f"--sinks: the attention of {model_type!r} models does not go through transformers' "
            "attention interface, where --sinks reads its weights; extract without --sinks."
        )


_WATCHERS: dict[Any, Watcher] = {}
"""Attention module -> what its calls are shown to, while its model's capture is attached."""

_INSTALLED: dict[str, Any] = {}
"""Implementation -> the interface's own local entry it replaced (None: it had none)."""

_USERS: dict[str, int] = {}
"""Implementation -> the watches attached through its dispatcher (restored at none)."""


def _original(implementation: str, module: Any) -> Callable[..., Any]:
    """The function the attention interface gives ``implementation`` without the dispatcher:
    its registered function, or the module family's own ``eager_attention_forward``."""
    from transformers.modeling_utils import AttentionInterface

    found: Any = _INSTALLED.get(implementation)
    found = found or AttentionInterface._global_mapping.get(implementation)
    if found is None:  # eager: the family's own function
        found = sys.modules[type(module).__module__].eager_attention_forward
    return cast(Callable[..., Any], found)


def _dispatcher(implementation: str) -> Callable[..., Any]:
    def attention(
        module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
    ) -> Any:
        watcher = _WATCHERS.get(module)
        if watcher is not None:
            watcher(module, query, key, attention_mask, kwargs)
        return _original(implementation, module)(
            module, query, key, value, attention_mask, **kwargs
        )

    return attention


class _Watch:
    """The dispatcher's watch over one model's attention modules (a hook handle)."""

    def __init__(self, implementation: str, modules: Sequence[Any], watcher: Watcher) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.implementation, self.modules = implementation, list(modules)
        if implementation not in _INSTALLED:
            _INSTALLED[implementation] = ALL_ATTENTION_FUNCTIONS._local_mapping.get(implementation)
            ALL_ATTENTION_FUNCTIONS[implementation] = _dispatcher(implementation)
        _USERS[implementation] = _USERS.get(implementation, 0) + 1
        for m in self.modules:
            _WATCHERS[m] = watcher

    def remove(self) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if not self.modules:  # removed already
            return
        for m in self.modules:
            _WATCHERS.pop(m, None)
        self.modules = []
        _USERS[self.implementation] -= 1
        if not _USERS[self.implementation]:
            replaced = _INSTALLED.pop(self.implementation)
            mapping = ALL_ATTENTION_FUNCTIONS._local_mapping
            if replaced is None:
                mapping.pop(self.implementation, None)
            else:
                mapping[self.implementation] = replaced


def allowed_keys(
    mask: torch.Tensor | None, causal: bool, queries: int, keys: int, device: torch.device
) -> torch.Tensor | None:
    """The mask an attention function of :data:`IMPLEMENTATIONS` was given, as an additive
    float mask broadcastable to (B, H, Q, K) (None: every key): a boolean mask (True: attend)
    becomes 0 / -inf, a float one is kept, None is causal where the module is."""
    if mask is None:
        if not causal or queries == 1:
            return None
        q = torch.arange(queries, device=device)[:, None] + (keys - queries)
        allowed = torch.arange(keys, device=device)[None, :] <= q
        return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))
    mask = mask[..., :keys]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask


def bos_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    first: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """(B, H): per row b and query head h, sum over query positions q > first[b] of
    softmax_k(s[b, h, q, k])[first[b]], the scores s = softcap(scaling q . k) + mask as the
    attention functions form them (``query`` (B, H, Q, D) and ``key`` (B, Hkv, K, D) after
    rotary embedding; head h reads key head h // (H / Hkv); ``sinks``: per-head logits that
    join each softmax's normaliser), with a float32 (or wider) log-sum-exp over every key, in
    slices of ``QUERY_SLICE`` queries (fewer where :data:`SLICE_ELEMENTS` says so); a
    ``causal`` attention's slice reads the keys up to its last query only (the later ones are
    masked)."""
    b, heads, n_q, dim = query.shape
    kv, n_k = key.shape[1], key.shape[2]
    dtype = torch.promote_types(query.dtype, torch.float32)
    q = (query.to(dtype) * scaling).reshape(b, kv, heads // kv, n_q, dim)
    k = key.to(dtype)[:, :, None].transpose(-1, -2)  # (B, Hkv, 1, D, K)
    additive = allowed_keys(mask, causal, n_q, n_k, query.device)
    offset = n_k - n_q  # queries are the last n_q positions of the keys
    rows = torch.arange(b, device=query.device)
    total = torch.zeros(b, heads, dtype=dtype, device=query.device)
    step = max(1, min(QUERY_SLICE, SLICE_ELEMENTS // max(1, b * heads * n_k)))
    for start in range(0, n_q, step):
        stop = min(n_q, start + step)
        end = min(n_k, offset + stop) if causal else n_k
        s = (q[:, :, :, start:stop] @ k[..., :end]).reshape(b, heads, stop - start, end)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if additive is not None:
            part = additive[..., start:stop, :end]
            s = s + part.to(dtype)
        lse = torch.logsumexp(s, dim=-1)  # (B, H, q)
        if sinks is not None:
            lse = torch.logaddexp(lse, sinks.to(dtype)[None, :, None])
        # key position first[b] (a row whose first token lies past this slice's keys has no
        # query after it here)
        col = s[rows, :, :, first.clamp(max=end - 1)].reshape(b, heads, stop - start)
        position = torch.arange(start, stop, device=query.device) + offset
        later = (position[None, :] > first[:, None])[:, None, :]  # (B, 1, q): p >= 1
        total += torch.where(later, torch.exp(col - lse), 0).sum(dim=-1)
    return total


class SinkCapture(Hooks):
    """Watches every attention module of the model; after each pass, per batch row, its
    (blocks, heads) mean attention weight on the unit's first token over positions 1..T-1.
    Only the first pass after :meth:`batch` is kept (later passes, as the future effects and
    the skips run them, are not the model's own)."""

    def __init__(self, ctx: Attachment) -> None:
        super().__init__()
        model = ctx.model
        implementation = model.config._attn_implementation
        if implementation not in IMPLEMENTATIONS:
            raise UnsupportedModel(
                f"--sinks: the {implementation!r} attention implementation is not read; load "
                f"the model with one of {', '.join(IMPLEMENTATIONS)}, or extract without --sinks."
            )
        self.n_blocks = len(get_module(model, ctx.adapter.blocks))
        self.add(model.register_forward_pre_hook(self._pass_hook))
        self.add(_Watch(implementation, list(model.modules()), self._watch))
        self.reset()

    def reset(self) -> None:
        self._ids: Sequence[int] | None = None
        self._lengths: Sequence[int] = ()
        self._passes = 0
        self._blocks: list[torch.Tensor] = []  # per attention call of the kept pass: (B, H)

    def batch(self, ids: Sequence[int] | None, lengths: Sequence[int]) -> None:
        self._ids, self._lengths = ids, lengths

    def _pass_hook(self, module: Any, args: tuple) -> None:
        if self._ids is not None:
            self._passes += 1

    def _watch(self, module: Any, query: Any, key: Any, mask: Any, kwargs: dict[str, Any]) -> None:
        if self._ids is None or self._passes != 1 or len(self._blocks) >= self.n_blocks:
            return
        n = torch.as_tensor(self._lengths, device=query.device)
        first = key.shape[2] - n
        scaling = kwargs.get("scaling")
        total = bos_weights(
            query, key, mask, first,
            query.shape[-1] ** -0.5 if scaling is None else float(scaling),
            softcap=kwargs.get("softcap"),
            sinks=kwargs.get("s_aux"),
            causal=bool(getattr(module, "is_causal", True)),
        )  # fmt: skip
        self._blocks.append((total / (n - 1)[:, None]).float())  # T = 1: NaN

    def result(self) -> Sequence[Any]:
        if self._ids is None:
            return [None] * len(self._lengths)
        if len(self._blocks) != self.n_blocks:
            raise DecompositionError(
                f"--sinks: {len(self._blocks)} of the model's {self.n_blocks} blocks called "
                "transformers' attention interface; extract without --sinks."
            )
        values = torch.stack(self._blocks, dim=1).cpu().numpy()  # (B, L, H)
        return [np.asarray(v) for v in values]
