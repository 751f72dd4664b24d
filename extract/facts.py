"""What a partition records about the model itself (methods §12): its revision's
training step and tokens seen, width, depth, vocabulary, parameter counts, and a fingerprint of
the tensors it loaded (two revisions that serve equal weights are one checkpoint)."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from layerdiv.errors import LayerdivError
from layerdiv.extract.adapters import Adapter, get_module
from layerdiv.extract.config import ExtractConfig
from layerdiv.extract.models import WEIGHT_SUFFIXES, LoadedModel, cache_dir
from layerdiv.store.atomic import write_bytes
from layerdiv.store.key import DEFAULT_REVISION
from layerdiv.store.paths import slug

STEP = re.compile(r"^step(\d+)$")
"""A Pythia-style revision name: ``step<N>`` is the checkpoint after N optimizer steps."""


class RevisionError(LayerdivError, ValueError):
    """``--step``, ``--tokens-seen`` and ``--tokens-per-step`` cannot say the tokens seen."""


def revision_facts(cfg: ExtractConfig) -> dict[str, Any]:
    """``revision``, ``step`` and ``tokens_seen`` as the manifest records them: the step from
    ``--step`` or a ``stepN`` revision name, the tokens from ``--tokens-seen`` or step x
    ``--tokens-per-step``; a combination that cannot say them, and a revision that makes no store
    name, are refused."""
    revision = cfg.revision or DEFAULT_REVISION
    slug(revision, "revision")  # one that makes no store name is refused, naming it
    named = STEP.match(revision)
    step = cfg.step if cfg.step is not None else int(named.group(1)) if named else None
    tokens = cfg.tokens_seen
    if cfg.tokens_per_step is not None:
        if cfg.tokens_seen is not None:
            raise RevisionError("give --tokens-seen or --tokens-per-step, not both")
        if step is None:
            raise RevisionError(
                f"--tokens-per-step needs the step of revision {revision!r}: give --step N (or "
                "a revision named stepN)"
            )
        tokens = step * cfg.tokens_per_step
    return {"revision": revision, "step": step, "tokens_seen": tokens}


def weights_hash(model: Any) -> str:
    """xxh3-128 over every tensor of the model's state (each shared tensor once): its name, dtype,
    shape and bytes. Equal for equal weights, whatever files or hub branch they came from."""
    h = xxhash.xxh3_128()
    seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key in seen:  # tied weights
            continue
        seen.add(key)
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        if tensor.device.type != "meta":  # offloaded to disk: its name and shape only
            flat = tensor.detach().reshape(-1).contiguous().cpu()
            h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def weights_stamp(loaded: LoadedModel) -> dict[str, Any] | None:
    """What the loaded tensors' fingerprint follows from, cheap to check again: the weights'
    source (a hub commit, immutable; or a local folder's path with each weight file's name,
    size and modification time, and the sha256 of each file's first and last MiB, which
    ``resolve_source`` computed anyway), the dtype they were loaded in and where (offloaded
    tensors hash by name and shape only). None where the source says nothing of its bytes (a hub
    id of unknown commit)."""
    source = loaded.source
    if source.weights_fingerprint == "hub:unknown":
        return None
    files: list[list[Any]] = []
    folder = Path(source.path)
    if folder.is_dir():
        for f in sorted(folder.iterdir()):
            if f.suffix in WEIGHT_SUFFIXES:
                st = f.stat()
                files.append([f.name, st.st_size, st.st_mtime_ns])
    devices = sorted({t.device.type for t in loaded.model.state_dict().values()})
    return {
        "hash": "xxh3-128 of name, dtype, shape and bytes",
        "source": source.weights_fingerprint,
        "folder": str(folder.resolve()) if folder.is_dir() else source.path,
        "files": files,
        "dtype": str(loaded.dtype),
        "devices": devices,
    }


def cached_weights_hash(loaded: LoadedModel) -> tuple[str, Path | None]:
    """:func:`weights_hash` of the loaded model, kept in the user cache under its
    :func:`weights_stamp`: a later load of the same files (the next task, revision or run) reads
    it back instead of hashing the tensors again. On that reuse the stamp is verified (names,
    sizes, modification times, first and last MiB of the files; the hub commit), not the bytes
    between: a file rewritten in place with its size, time and ends kept would keep its old
    fingerprint (delete ``<cache>/fingerprints`` to hash again). Returns the fingerprint and the
    cache file it was read from (None: computed now)."""
    stamp = weights_stamp(loaded)
    if stamp is None:
        return weights_hash(loaded.model), None
    text = json.dumps(stamp, sort_keys=True)
    entry = cache_dir() / "fingerprints" / f"{xxhash.xxh3_128_hexdigest(text.encode())}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        kept = json.loads(entry.read_text())
        if kept["stamp"] == stamp and isinstance(kept["weights_hash"], str):
            return kept["weights_hash"], entry
    digest = weights_hash(loaded.model)
    with contextlib.suppress(OSError):  # a cache that cannot be written: hash again next time
        write_bytes(entry, json.dumps({"stamp": stamp, "weights_hash": digest}).encode())
    return digest, None


def load_fingerprinted(load: Callable[[], LoadedModel]) -> tuple[LoadedModel, str, str]:
    """Run ``load`` and fingerprint what it loaded (:func:`cached_weights_hash`); returns the
    model, the fingerprint and a line giving its cost beside the load's (CPU seconds) and
    whether it was computed or reused."""
    start = time.process_time()
    loaded = load()
    loading = time.process_time() - start
    start = time.process_time()
    digest, entry = cached_weights_hash(loaded)
    hashing = time.process_time() - start
    how = (
        "hashed from the loaded tensors"
        if entry is None
        else f"reused from {entry} (weight files unchanged: names, sizes, times, first and "
        "last MiB)"
    )
    cost = (
        f"weights fingerprint {digest[:12]} {how}: {hashing:.3f} s CPU, "
        f"{100 * hashing / loading:.1f}% of the model load ({loading:.2f} s CPU)"
    )
    return loaded, digest, cost


def load_with_facts(
    revision: Mapping[str, Any], adapter: Adapter, load: Callable[[], LoadedModel]
) -> tuple[LoadedModel, str]:
    """The loaded model with its :attr:`~LoadedModel.facts` (step and tokens seen of the
    :func:`revision_facts` ``revision``, the model's facts, the fingerprint; the revision is the
    identity's), and the line that gives the fingerprint's cost."""
    loaded, digest, cost = load_fingerprinted(load)
    step = {k: v for k, v in revision.items() if k != "revision"}
    loaded.facts = {**step, **model_facts(loaded, adapter), "weights_hash": digest}
    return loaded, cost


def model_facts(loaded: LoadedModel, adapter: Adapter) -> dict[str, Any]:
    """Depth (decoder blocks) and the non-embedding parameter count: every parameter but those
    of the embedding tables (tokens, positions) and an untied unembedding, each shared parameter
    counted once."""
    model = loaded.model
    blocks = get_module(model, adapter.blocks)
    head = model.get_output_embeddings()
    tables = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    embedding = {
        id(p): p.numel() for m in [*tables, *([head] if head is not None else [])]
        for p in m.parameters(recurse=False)
    }  # fmt: skip
    return {
        "n_layers": len(blocks),
        "n_params_non_embedding": loaded.n_params - sum(embedding.values()),
    }
