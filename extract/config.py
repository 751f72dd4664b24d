"""What one ``layerdiv extract`` run is asked to do, and what it reports back (no torch here:
the command line reads its options from this module, each declared once, by the field it sets
or by the measurement it asks for)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import click

from layerdiv.errors import LayerdivError
from layerdiv.extract.launchers import Shard, parse_shard
from layerdiv.measurements import Measurement, for_kind, registered
from layerdiv.schemas.kinds import KINDS

DEFAULT_STORE = "layerdiv-store"
"""The store folder when ``--store`` is not given."""

DEFAULT_CHUNK_SIZE = 1024
"""Instances per chunk of a new partition when ``--chunk-size`` is not given."""

DTYPES = {"auto": "", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``--dtype`` values and the torch dtype each names; ``auto`` picks per device
(``layerdiv.extract.models.resolve_dtype``)."""


def _option(*decls: str, **attrs: Any) -> dict[str, click.Option]:
    """A field's ``extract`` option (the field's metadata): ``decls`` and ``attrs`` as
    ``click.Option`` takes them, the parameter named after the field."""
    return {"option": click.Option(list(decls), **attrs)}


def _parse_batch_size(ctx: click.Context, param: click.Parameter, value: str) -> int | None:
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter("a positive integer or 'auto'")
    return int(value)


def _parse_shard(ctx: click.Context, param: click.Parameter, value: str) -> Shard:
    from_env = ctx.get_parameter_source("shard") is click.core.ParameterSource.ENVIRONMENT
    return parse_shard(value, os.environ, "LAYERDIV_SHARD" if from_env else "--shard")


def _local_store(ctx: click.Context, param: click.Parameter, value: str) -> Path:
    from layerdiv.store.location import local_root

    local_root(value)
    return Path(value)


@dataclass
class ExtractConfig:
    """Everything one ``layerdiv extract`` run needs; each field the command line sets carries
    its option (:meth:`options`)."""

    model: str = field(
        metadata=_option(
            "--model",
            required=True,
            help="Hub id, local folder, or an offline alias: smollm2-135m-instruct, gemma3-270m.",
        )
    )
    """Hub id, local folder, or an offline alias (``smollm2-135m-instruct``, ``gemma3-270m``)."""
    tasks: list[str] = field(
        metadata=_option(
            "--task",
            "tasks",
            multiple=True,
            required=True,
            callback=lambda ctx, param, value: list(value),
            help="Built-in task name or task YAML path (repeatable).",
        )
    )
    """Built-in task names or task YAML paths."""
    store: Path = field(
        default=Path(DEFAULT_STORE),
        metadata=_option(
            "--store",
            default=DEFAULT_STORE,
            show_default=True,
            type=click.Path(file_okay=False),
            callback=_local_store,
            help="Store (cache) folder, local: publish a finished store to object storage by a "
            "sync.",
        ),
    )
    """Store directory."""
    revision: str | None = field(
        default=None,
        metadata=_option(
            "--revision",
            help="Hub revision (branch, tag or commit); for a local folder, a label. A key of the "
            "store: each revision is its own partition (default main).",
        ),
    )
    """Hub revision (branch, tag or commit) of the model; for a local folder, a label. The
    partition's ``revision=`` key (``main`` when None)."""
    step: int | None = field(
        default=None,
        metadata=_option(
            "--step",
            type=click.IntRange(min=0),
            help="Training step of the revision (default: N of a revision named stepN).",
        ),
    )
    """Training step of the revision (None: N of a Pythia-style ``stepN`` revision, or unknown)."""
    tokens_seen: int | None = field(
        default=None,
        metadata=_option(
            "--tokens-seen",
            type=click.IntRange(min=0),
            help="Training tokens the revision has seen (default: step x --tokens-per-step).",
        ),
    )
    """Training tokens the revision has seen (None: step x ``tokens_per_step`` where given)."""
    tokens_per_step: int | None = field(
        default=None,
        metadata=_option(
            "--tokens-per-step",
            type=click.IntRange(min=1),
            help="Training tokens per step (Pythia: 2,097,152), to record the tokens seen of a "
            "step.",
        ),
    )
    """Training tokens per optimizer step, to derive ``tokens_seen`` from the step."""
    gguf_file: str | None = field(
        default=None, metadata=_option("--gguf-file", help="GGUF file in the model folder or repo.")
    )
    """GGUF file inside the model's folder or repo (converted once to safetensors)."""
    limit: int | None = field(
        default=None,
        metadata=_option("--limit", type=click.IntRange(min=1), help="Instances per task."),
    )
    """Instances per task (default: each task's n)."""
    batch_size: int | None = field(
        default=None,
        metadata=_option(
            "--batch-size",
            default="auto",
            show_default=True,
            callback=_parse_batch_size,
            help="Instances per batch, or auto (length-sorted batches up to a token budget).",
        ),
    )
    """Instances per batch; None packs length-sorted batches up to a token budget."""
    dtype: str = field(
        default="auto",
        metadata=_option(
            "--dtype", type=click.Choice(list(DTYPES)), default="auto", show_default=True
        ),
    )
    """One of :data:`DTYPES`."""
    device: str = field(
        default="auto",
        metadata=_option(
            "--device", default="auto", show_default=True, help="auto, cuda, cuda:1, mps, cpu."
        ),
    )
    """auto (cuda, mps, cpu), or a torch device string."""
    device_map: str | None = field(
        default=None,
        metadata=_option(
            "--device-map",
            type=click.Choice(["auto"]),
            help="auto: spread a model larger than one GPU over the GPUs, CPU and disk "
            "(accelerate).",
        ),
    )
    """None: the whole model on ``device``; ``auto``: spread over the GPUs, then CPU and disk
    offload, by accelerate (models larger than one GPU)."""
    shard: tuple[int, int] = field(
        default=(0, 1),
        metadata=_option(
            "--shard",
            default="0/1",
            show_default=True,
            envvar="LAYERDIV_SHARD",
            callback=_parse_shard,
            help="Do chunk share i of N; auto: i and N from a SLURM job array, torchrun or "
            "(auto/N) a Kubernetes indexed job. Also read from $LAYERDIV_SHARD.",
        ),
    )
    """(i, N): this process does the chunks whose index is i modulo N (the command line's
    option gives a ``layerdiv.extract.launchers.Shard``)."""
    overwrite: bool = field(
        default=False,
        metadata=_option(
            "--overwrite",
            is_flag=True,
            help="Replace a partition holding another extraction (with --shard i/N, N > 1: only "
            "one holding another extraction; one holding this extraction is resumed).",
        ),
    )
    """Replace a partition that holds a different extraction (with N > 1 shards, a partition
    that holds this extraction is resumed instead: see ``PartitionWriter.check``)."""
    redo: tuple[str, ...] = field(
        default=(),
        metadata=_option(
            "--redo",
            multiple=True,
            metavar="MEASUREMENT",
            callback=lambda ctx, param, value: tuple(dict.fromkeys(value)),
            help="Extract the stored measurement MEASUREMENT (e.g. igrad) of each partition "
            "again with the settings given (else its defaults), replacing its tables and "
            "settings and keeping every other table (repeatable).",
        ),
    )
    """Measurements (by name) whose stored tables and settings this run replaces in each
    partition (``layerdiv.store.redo``), their other tables and settings kept."""
    trust_remote_code: bool = field(
        default=False,
        metadata=_option(
            "--trust-remote-code", is_flag=True, help="Run model code from its hub repo."
        ),
    )
    """Allow models whose code lives in their hub repo (e.g. MobileLLM)."""
    allow_softcap: bool = field(
        default=False,
        metadata=_option(
            "--allow-softcap",
            is_flag=True,
            help="Decompose pre-soft-cap logits (flagged approximate).",
        ),
    )
    """Decompose the pre-soft-cap logits of models with final logit soft-capping (flagged
    ``approximate`` in the manifest) instead of refusing them."""
    chunk_size: int | None = field(
        default=None,
        metadata=_option(
            "--chunk-size",
            type=click.IntRange(min=1),
            help=f"Instances per chunk of a new partition (default {DEFAULT_CHUNK_SIZE}; the unit "
            "of resumption and sharding); an existing partition keeps its own.",
        ),
    )
    """Instances per chunk of a new partition's grid (None: :data:`DEFAULT_CHUNK_SIZE`; an
    existing partition keeps its own): the unit of resumption, of sharding and of claiming; a
    crash loses at most one chunk per process."""
    measurement_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The registered measurements (``layerdiv.measurements``) this run asks for, by name: the
    settings given (a setting left out, None or empty: not given, the partition's own or the
    default). :func:`measurement_options` makes it from ``extract``'s options."""
    progress: bool = True
    """Show progress bars."""

    @classmethod
    def field_options(cls) -> list[click.Option]:
        """The ``extract`` options of the fields that carry one."""
        return [f.metadata["option"] for f in fields(cls) if "option" in f.metadata]

    @classmethod
    def options(cls) -> list[click.Option]:
        """``extract``'s options: the fields' (:meth:`field_options`), then every registered
        measurement's (``Measurement.click_options``)."""
        return [*cls.field_options(), *(o for m in registered() for o in m.click_options())]

    @classmethod
    def from_options(cls, values: Mapping[str, Any], **given: Any) -> ExtractConfig:
        """The run that ``extract``'s option ``values`` (by parameter name) ask for, the fields
        in ``given`` replaced; the measurements' by :func:`measurement_options`."""
        own = {f.name: values[f.name] for f in fields(cls) if "option" in f.metadata}
        return cls(
            **{**own, **given},
            measurement_settings=measurement_options(values, own.get("redo", ())),
        )

    def given(self, m: Measurement) -> dict[str, Any]:
        """The settings of measurement ``m`` given (under :attr:`measurement_settings`); a
        setting not given is left out, a repeated option's values once each."""
        values = self.measurement_settings.get(m.name, {})
        given = {k: v for k, v in values.items() if v not in (None, ())}
        return {k: tuple(dict.fromkeys(v)) if isinstance(v, tuple) else v for k, v in given.items()}

    def asked_tables(self, kind: str) -> list[str]:
        """The tables of the measurements this run asks for (:attr:`measurement_settings`) in
        task ``kind``'s partitions."""
        asked = self.measurement_settings
        return [t for m in for_kind(kind) if m.name in asked for t in m.tables[kind]]


class OptionError(LayerdivError, ValueError):
    """A measurement's setting given without the measurement."""


def measurement_options(
    values: Mapping[str, Any], redo: tuple[str, ...] = ()
) -> dict[str, dict[str, Any]]:
    """:attr:`ExtractConfig.measurement_settings` from the values of the measurements'
    ``extract`` options (by parameter name: a flag's, a setting's; ``{"skips": True, "lens":
    "final"}``): every measurement whose flag is given or that is to be redone (``redo``, by
    name), with its settings. Refuses a setting given without its measurement's flag, and a
    ``redo`` that names no measurement (a core table: not one measurement's)."""
    names = [m.name for m in registered()]
    for name in redo:
        if name in names:
            continue
        core = sorted({t for k in KINDS.values() for t in k.required})
        what = "a core table of every partition" if name in core else "not a measurement"
        raise OptionError(
            f"--redo {name}: {what}; --redo takes a measurement ({', '.join(names)}); "
            "re-extract the whole partition with --overwrite"
        )
    asked: dict[str, dict[str, Any]] = {}
    for m in registered():
        settings = {s.name: values.get(s.name) for s in m.settings}
        if values.get(m.dest) or m.name in redo:
            asked[m.name] = settings
        elif any(v not in (None, ()) for v in settings.values()):
            given = [s.option.opts[0] for s in m.settings if values.get(s.name) not in (None, ())]
            raise OptionError(f"{', '.join(given)} sets up {m.flag}; add {m.flag}")
    return asked


@dataclass
class TaskSummary:
    """What one task's extraction did."""

    task: str
    """Task name."""
    n_requested: int
    """Instances this run asked for."""
    n_new: int
    """Instances this run computed and stored."""
    n_done: int
    """Instances stored in the partition after the run."""
    seconds: float
    """Wall time of the task's extraction."""
    max_sum_error: float = 0.0
    """Largest relative decomposition error of the new instances."""
    n_truncated: int = 0
    """Prompts left-truncated to the model's context."""
    n_added: int = 0
    """Stored instances this run gave the optional tables they lacked (a backfill)."""
    accuracy_new: float | None = None
    """Fraction of new instances whose top option logit is the gold one."""
    kind: str = "choice"
    """The task kind (``text``: documents, cut to ``max_tokens`` rather than left-truncated)."""
    notes: list[str] = field(default_factory=list)
    """Things the user should know (a stored chunk grid used, a damaged chunk redone, ...)."""
