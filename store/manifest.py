"""The provenance manifest of one (model, task) partition."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from layerdiv.measurements import all_optional_tables, for_kind, measurement_of, ruled_tables
from layerdiv.measurements.registry import SETTINGS_KEY, legacy_settings
from layerdiv.schemas import SCHEMA_VERSION, SchemaError, check_version
from layerdiv.schemas.kinds import DEFAULT_KIND, KINDS
from layerdiv.store.atomic import write_bytes
from layerdiv.store.key import DEFAULT_REVISION
from layerdiv.store.location import RemotePath


@dataclass(frozen=True)
class ComponentInfo:
    """One residual component, in execution order (immutable: manifests that list the same
    components share them, :func:`_components`)."""

    name: str
    """Component name (``embed``, ``attn.<i>``, ``mlp.<i>``, ``bias``, ``#<k>`` for repeats)."""
    kind: str
    """``embed``, ``attn``, ``mlp`` or ``bias``."""
    layer: int
    """Decoder block index, -1 for ``embed`` and ``bias``."""


@dataclass(frozen=True)
class Identity:
    """What identifies an extraction: a resumed, sharded or concurrent run may write into a
    partition only when its identity equals the stored one (known before the weights load)."""

    model: str
    """Model id as the user gave it."""
    revision: str | None
    """The revision as ``extract --revision`` gave it (``main`` by default)."""
    weights_fingerprint: str
    """Hub commit for hub weights, else a fingerprint of the local weight files."""
    dtype: str
    """Torch dtype name the model runs in."""
    template_sha256: str
    """Hash of the task definition (``TaskSpec.sha256``)."""
    data_sha256: str | None
    """Hash of the prompts and gold labels of the task's first n rows (its content, not its
    path); None in manifests written before it was recorded."""
    option_token_ids: tuple[int, ...]
    """Token id scored for each option."""
    schema_version: int = SCHEMA_VERSION
    """Schema version of the files."""
    commit: str | None = None
    """Hub commit of the weights, else None."""

    def fields(self) -> dict[str, Any]:
        """The identity as manifest fields (JSON types)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["option_token_ids"] = list(self.option_token_ids)
        return out

    def differences(self, now: Identity, labels: tuple[str, str] = ("stored", "now")) -> list[str]:
        """``name: stored X, now Y`` (or the given labels) for every field where ``now`` differs
        from this one."""
        return [
            f"{f.name}: {labels[0]} {getattr(self, f.name)!r}, {labels[1]} {getattr(now, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(now, f.name)
        ]


RUNS_DIR = "runs"
"""Folder (beside ``manifest.json``) of the run records, one JSON file per extraction run."""

TABLES_DIR = "tables"
"""Folder (beside ``manifest.json``) of one empty marker file per optional table requested."""


@dataclass
class Manifest:
    """What was extracted into a partition and how: enough to trust and reproduce it."""

    model: str
    """Model id as the user gave it (hub id, local folder or alias)."""
    task: str
    """Task name (the partition's ``task=`` value)."""
    revision: str | None
    """The model's revision as ``extract --revision`` gave it (a hub branch, tag or commit; a
    label for a local folder), ``main`` by default; the partition's ``revision=`` folder is its
    slug. Manifests of schema version <= 4 read as ``main`` (their hub commit goes to
    :attr:`commit`)."""
    weights_fingerprint: str
    """sha256 over the weight files' names, sizes and first and last MiB (``hub:<commit>`` for
    hub weights)."""
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
    data_sha256: str | None = None
    """sha256 over the prompts and gold labels of the task's first n rows (``Identity``)."""
    chunk_size: int | None = None
    """Width of the partition's chunk grid, fixed when it is created: chunk j holds instances
    j*chunk_size .. (j+1)*chunk_size-1, possibly in several parts (None in older manifests)."""
    hidden_size: int | None = None
    """Width d of the residual stream (schema version 2; None in older manifests)."""
    vocab_size: int | None = None
    """Rows V of the unembedding (the model config's ``vocab_size``): the lens's uniform
    baseline is log V nats (None in older manifests)."""
    norm_eps: float | None = None
    """Epsilon of the final norm (methods §7 needs it for ||r||; None in older
    manifests)."""
    extra_tables: list[str] = field(default_factory=list)
    """Optional tables (``layerdiv.measurements.all_optional_tables``) requested for this partition
    (filled on read from the markers in ``tables/``); a chunk may still lack one
    (``PartitionWriter.chunks_missing``)."""
    versions: dict[str, str] = field(default_factory=dict)
    """Library versions at extraction time."""
    device: str = "cpu"
    """Device type the model ran on."""
    created_at: str = ""
    """UTC time the partition was first created (ISO 8601)."""
    runs: list[dict[str, Any]] = field(default_factory=list)
    """One entry per extraction run that had work to do (filled on read from ``runs/``, one file
    per run): started_at, host, pid, n_requested, shard, task (as --task gave it), chunk_size,
    device, and when it ended finished_at, seconds, instances."""
    schema_version: int = SCHEMA_VERSION
    """Schema version of the partition's files (``layerdiv.schemas``)."""
    kind: str = DEFAULT_KIND
    """Task kind (``layerdiv.schemas.kinds``): ``choice`` or ``text`` (schema version 4; older
    manifests are choice). Text partitions have no options and the components of a choice
    partition, so the number of blocks L is the number of ``attn`` components."""
    max_tokens: int | None = None
    """Text tasks: documents are cut to their first ``max_tokens`` tokens."""
    commit: str | None = None
    """Hub commit of the weights when known, else None."""
    step: int | None = None
    """Training step of the revision (``--step``, or N of a Pythia-style ``stepN`` revision);
    None where unknown."""
    tokens_seen: int | None = None
    """Training tokens D the revision has seen (``--tokens-seen``, or step x
    ``--tokens-per-step``); None where unknown."""
    weights_hash: str | None = None
    """xxh3-128 over every loaded tensor's name, dtype, shape and bytes (schema version 5;
    ``layerdiv.extract.facts.weights_hash``): two revisions with equal weights have equal ones."""
    n_layers: int | None = None
    """Depth l: the model's decoder blocks (schema version 5)."""
    n_params_non_embedding: int | None = None
    """:attr:`n_params` less the token (and position) embeddings and an untied unembedding: the
    non-embedding count of Kaplan et al., beside the total that Chinchilla fits (version 5)."""
    weights: str | None = None
    """How the weights were made from the files given, when not loaded as they are: e.g. a
    GGUF file's quantization dequantized to float32 (schema version 5; None: loaded as they are,
    or an older manifest)."""
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The settings of each measurement the partition has (``layerdiv.measurements``,
    ``Measurement.settings``), under its name: recorded when a run first writes it, never changed
    but by ``--overwrite``; each of its parts records its own (:meth:`settings_problem`). Schema
    version 5; older manifests' ``lens``, ``skip_split``, ``skip_seed`` and ``skip_sublayers`` are
    read into it (``layerdiv.measurements.registry.legacy_settings``)."""
    generation: int = 0
    """Which extraction of the partition this is: 0 when created, one more at each
    ``--overwrite`` that replaces it. A writer re-reads it before each chunk it commits and stops
    when it changed (another run replaced the partition under it; schema version 5)."""

    def settings_problem(self, table: str, metadata: Mapping[bytes, bytes] | None) -> str | None:
        """What is wrong with the settings that a part of ``table`` records in its Parquet
        key-value ``metadata``: None when they are the manifest's, or when it records none (a
        measurement without settings, or a part written before parts recorded them)."""
        if not metadata or SETTINGS_KEY not in metadata:
            return None
        m = measurement_of(table)
        try:
            found = json.loads(metadata[SETTINGS_KEY])
        except ValueError:
            return f"its {m.name} settings are unreadable"
        want = self.settings.get(m.name)
        if found == want:
            return None
        return f"was written with {m.describe(found)}, the manifest records {m.describe(want)}"

    @property
    def n_blocks(self) -> int:
        """Decoder block calls L (the ``attn`` components)."""
        return sum(c.kind == "attn" for c in self.components)

    def expected_rows(self, count: int, n_tokens: int = 0) -> dict[str, int]:
        """Rows of each table whose size is fixed, in a chunk of ``count`` instances (documents
        holding ``n_tokens`` tokens in all, for text tasks)."""
        facts = {"units": count, "tokens": n_tokens, "blocks": self.n_blocks,
                 "components": len(self.components), "options": len(self.options)}  # fmt: skip
        return KINDS[self.kind].expected_rows(facts)

    def wrong_rows(
        self, count: int, rows: Mapping[str, int], n_tokens: int = 0
    ) -> tuple[str, str] | None:
        """The first table of a chunk of ``count`` instances (documents of ``n_tokens`` tokens)
        whose part's ``rows`` (by table) cannot be right, with what is wrong; None when every
        one can: the fixed sizes (:meth:`expected_rows`) exactly, then what each measurement
        declares (``Measurement.check_rows``, relative to them); a scored kind's other tables
        (of a measurement that declares no rule) need whole rows per instance."""
        expected = self.expected_rows(count, n_tokens)
        for table, found in rows.items():
            if table in expected and found != expected[table]:
                return table, f"{found} rows where the chunk needs {expected[table]}"
        for m in for_kind(self.kind):
            if m.check_rows is not None:
                wrong = m.check_rows(rows, self.n_blocks, self.settings.get(m.name, {}))
                if wrong is not None:
                    return wrong
        ruled = ruled_tables(self.kind)
        for table, found in rows.items():
            if table in expected or table in ruled or not KINDS[self.kind].scored:
                continue
            if found == 0 or found % count:
                return table, f"{found} rows are not whole rows for each of {count} instances"
        return None

    def identity(self) -> Identity:
        """What a resumed or sharded run must match exactly to write into this partition."""
        values = {f.name: getattr(self, f.name) for f in fields(Identity)}
        return Identity(**{**values, "option_token_ids": tuple(self.option_token_ids)})

    def to_json(self) -> str:
        """The manifest file's text (run records and table markers live in their own files)."""
        data = asdict(self)
        data["runs"], data["extra_tables"] = [], []
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> Manifest:
        check_version(data.get("schema_version"), where)
        known, required = _names()
        missing = [name for name in required if name not in data]
        if missing:
            raise SchemaError(f"{where}: manifest lacks {', '.join(missing)}; re-extract it.")
        if data["schema_version"] <= 4:  # the revision was the hub commit, before the key had it
            data = {**data, "commit": data.get("revision"), "revision": DEFAULT_REVISION}
        data = {**data, "settings": {**legacy_settings(data), **data.get("settings", {})}}
        kwargs = {k: v for k, v in data.items() if k in known}
        rows = tuple((c["name"], c["kind"], c["layer"]) for c in data["components"])
        kwargs["components"] = list(_components(rows))
        if kwargs.get("kind", DEFAULT_KIND) not in KINDS:
            raise SchemaError(f"{where}: unknown task kind {kwargs['kind']!r}; re-extract it.")
        return cls(**kwargs)


@functools.lru_cache(maxsize=64)
def _components(rows: tuple[tuple[str, str, int], ...]) -> tuple[ComponentInfo, ...]:
    """The components of ``rows`` (name, kind, layer), made once for all the manifests that list
    them: a checkpoint sweep's thousands of partitions list a few models' components, and
    making (and garbage-collecting) them anew for each was a fifth of ``ls``'s time."""
    return tuple(ComponentInfo(*row) for row in rows)


@functools.cache
def _names() -> tuple[frozenset[str], tuple[str, ...]]:
    """The fields of :class:`Manifest`, and those without a default (a manifest has them)."""
    every = fields(Manifest)
    required = (f.name for f in every if f.default is MISSING and f.default_factory is MISSING)
    return frozenset(f.name for f in every), tuple(required)


def read_manifest(path: Path | RemotePath, listed: Iterable[str] | None = None) -> Manifest:
    """Load and check a manifest (local or on object storage), with its run records and
    optional-table markers (``listed``: the names in its folder, where known, so that absent
    folders are not looked for); a clear error names the file when it cannot be trusted."""
    data = _read_json(path, "manifest", missing="manifest missing")
    manifest = Manifest.from_dict(data, str(path))
    has = (lambda _: True) if listed is None else set(listed).__contains__
    runs_dir, tables_dir = path.parent / RUNS_DIR, path.parent / TABLES_DIR
    records: list[Path | RemotePath] = (
        sorted(runs_dir.glob("*.json"), key=str) if has(RUNS_DIR) else []
    )
    runs = [_read_json(p, "run record") for p in records]
    manifest.runs = sorted([*manifest.runs, *runs], key=lambda r: str(r.get("started_at", "")))
    asked = [r["n_requested"] for r in runs if isinstance(r.get("n_requested"), int)]
    manifest.n_requested = max([manifest.n_requested, *asked])
    markers = {m.name for m in tables_dir.glob("*")} if has(TABLES_DIR) else set()
    markers &= set(all_optional_tables())
    manifest.extra_tables = sorted({*manifest.extra_tables, *markers})
    return manifest


def _read_json(path: Path | RemotePath, what: str, missing: str = "") -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        if missing:
            raise SchemaError(f"{path}: {missing}") from None
        raise
    except (OSError, json.JSONDecodeError) as err:
        raise SchemaError(
            f"{path}: unreadable {what} ({err}); re-extract with --overwrite"
        ) from err
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: {what} is not a JSON object; re-extract with --overwrite")
    return data


def write_manifest(path: Path, manifest: Manifest, exclusive: bool = False) -> bool:
    """Atomically write a manifest (:func:`layerdiv.store.atomic.write_bytes`)."""
    return write_bytes(path, manifest.to_json().encode(), exclusive=exclusive)
