"""The provenance manifest of one (model, task) partition."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from layerdiv.schemas import SCHEMA_VERSION, SchemaError, check_version


@dataclass
class ComponentInfo:
    """One residual component, in execution order."""

    name: str
    """Component name (``embed``, ``attn.<i>``, ``mlp.<i>``, ``bias``, ``#<k>`` for repeats)."""
    kind: str
    """``embed``, ``attn``, ``mlp`` or ``bias``."""
    layer: int
    """Decoder block index, -1 for ``embed`` and ``bias``."""


IDENTITY = (
    "model",
    "revision",
    "weights_fingerprint",
    "dtype",
    "template_sha256",
    "option_token_ids",
    "schema_version",
)
"""Manifest fields that identify an extraction: a run into an existing partition must match them."""


@dataclass
class Manifest:
    """What was extracted into a partition and how: enough to trust and reproduce it."""

    model: str
    """Model id as the user gave it (hub id, local folder or alias)."""
    task: str
    """Task name (the partition's ``task=`` value)."""
    revision: str | None
    """Hub commit of the weights when known, else None."""
    weights_fingerprint: str
    """sha256 over the weight files' names, sizes and first and last MiB."""
    dtype: str
    """Torch dtype the model ran in (``float32``, ``bfloat16``, ``float16``)."""
    model_type: str
    """``config.model_type`` of the model."""
    adapter: str
    """Architecture adapter used (see ``layerdiv.extract.adapters``)."""
    norm: str
    """Final norm kind: ``rms``, ``rms_plus_one`` or ``layer``."""
    n_params: int
    """Parameter count of the model (tied weights counted once)."""
    context_length: int
    """Longest prompt the model accepts; longer prompts are left-truncated."""
    options: list[str]
    """Answer option strings, in option index order."""
    option_token_ids: list[int]
    """Token id scored for each option."""
    option_tokens: list[str]
    """Each option token as the tokenizer decodes it."""
    template_sha256: str
    """sha256 of the task definition (template, options, data source, label rule)."""
    task_spec: dict[str, Any]
    """The task definition as loaded."""
    components: list[ComponentInfo]
    """Every residual component in execution order (the |L| of the paper)."""
    n_requested: int
    """Instances asked for (the task's n or ``--limit``, capped by the data)."""
    sum_tolerance: float
    """Largest relative decomposition error accepted for this dtype."""
    approximate: bool = False
    """True when the decomposition is of pre-soft-cap logits (final logit soft-capping)."""
    hidden_size: int | None = None
    """Width d of the residual stream (schema version 2; None in older manifests)."""
    norm_eps: float | None = None
    """Epsilon of the final norm (METHODS.md section 7 needs it for ||r||; None in older
    manifests)."""
    extra_tables: list[str] = field(default_factory=list)
    """Optional tables (``layerdiv.schemas.OPTIONAL_TABLES``) extracted for every complete chunk
    of this partition (schema version 2; empty in older manifests)."""
    versions: dict[str, str] = field(default_factory=dict)
    """Library versions at extraction time."""
    device: str = "cpu"
    """Device type the model ran on."""
    created_at: str = ""
    """UTC time the partition was first created (ISO 8601)."""
    runs: list[dict[str, Any]] = field(default_factory=list)
    """One entry per extraction run that added instances: finished_at, seconds, instances,
    shard, device (appended when the run ends)."""
    schema_version: int = SCHEMA_VERSION
    """Schema version of the partition's files (``layerdiv.schemas``)."""

    def identity(self) -> dict[str, Any]:
        """The fields a resumed or sharded run must match exactly to write into this partition."""
        return {name: getattr(self, name) for name in IDENTITY}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> Manifest:
        check_version(data.get("schema_version"), where)
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in data and _required(cls, f.name)]
        if missing:
            raise SchemaError(f"{where}: manifest lacks {', '.join(missing)}; re-extract it.")
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["components"] = [ComponentInfo(**c) for c in data["components"]]
        return cls(**kwargs)


def _required(cls: type, name: str) -> bool:
    f = next(f for f in fields(cls) if f.name == name)
    return f.default is MISSING and f.default_factory is MISSING


def read_manifest(path: Path) -> Manifest:
    """Load and check a manifest; a clear error names the file when it cannot be trusted."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SchemaError(f"{path}: manifest missing") from None
    except (OSError, json.JSONDecodeError) as err:
        raise SchemaError(
            f"{path}: unreadable manifest ({err}); re-extract with --overwrite"
        ) from err
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: manifest is not a JSON object; re-extract with --overwrite")
    return Manifest.from_dict(data, str(path))


def atomic_write_bytes(path: Path, data: bytes, exclusive: bool = False) -> bool:
    """Write ``path`` so that readers see the old file or the whole new one, never a part.

    With ``exclusive`` the file is only created if it does not exist yet (returns False then).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        else:
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return True


def write_manifest(path: Path, manifest: Manifest, exclusive: bool = False) -> bool:
    """Atomically write a manifest (see :func:`atomic_write_bytes`)."""
    return atomic_write_bytes(path, manifest.to_json().encode(), exclusive=exclusive)
