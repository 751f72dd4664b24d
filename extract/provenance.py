"""What a partition records about how it was made: library versions, the extraction's identity
and the manifest."""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from importlib import metadata

import torch

from layerdiv.extract.adapters import Adapter, get_module, norm_eps
from layerdiv.extract.models import LoadedModel, ModelSource
from layerdiv.extract.tasks import TaskSpec
from layerdiv.store.manifest import ComponentInfo, Identity, Manifest


def versions() -> dict[str, str]:
    """Python's and the extraction libraries' versions."""
    out = {"python": platform.python_version()}
    for dist in ("layerdiv", "torch", "transformers", "safetensors", "pyarrow"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out


def identity(
    source: ModelSource,
    dtype: torch.dtype,
    spec: TaskSpec,
    option_ids: list[int],
    data_sha256: str,
    revision: str,
) -> Identity:
    """The identity of an extraction, known before the weights are loaded."""
    return Identity(
        model=source.model_id,
        revision=revision,
        commit=source.revision,
        weights_fingerprint=source.weights_fingerprint,
        dtype=str(dtype).removeprefix("torch."),
        template_sha256=spec.sha256(),
        data_sha256=data_sha256,
        option_token_ids=tuple(option_ids),
    )


def build_manifest(
    loaded: LoadedModel,
    adapter: Adapter,
    spec: TaskSpec,
    ident: Identity,
    components: list[ComponentInfo],
    n_requested: int,
    chunk_size: int,
    tolerance: float,
    approximate: bool,
) -> Manifest:
    """The manifest of a new partition."""
    src, tok = loaded.source, loaded.tokenizer
    return Manifest(
        **ident.fields(),
        task=spec.name,
        model_type=str(src.config.model_type),
        adapter=adapter.family,
        norm=adapter.norm,
        n_params=loaded.n_params,
        **loaded.facts,
        context_length=loaded.context_length,
        hidden_size=int(src.config.hidden_size),
        vocab_size=getattr(src.config, "vocab_size", None),
        norm_eps=norm_eps(get_module(loaded.model, adapter.final_norm)),
        options=list(spec.options),
        option_tokens=[str(t) for t in tok.convert_ids_to_tokens(list(ident.option_token_ids))],
        task_spec=spec.to_dict(),
        kind=spec.kind,
        max_tokens=spec.max_tokens,
        weights=src.weights,
        components=components,
        n_requested=n_requested,
        chunk_size=chunk_size,
        sum_tolerance=tolerance,
        approximate=approximate,
        versions=versions(),
        device=loaded.device.type,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
