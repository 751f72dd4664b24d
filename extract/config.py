"""What one ``layerdiv extract`` run is asked to do, and what it reports back (no torch here:
the command line reads its choices and defaults from this module)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from layerdiv.errors import LayerdivError
from layerdiv.measurements import Measurement, for_kind, registered

DEFAULT_CHUNK_SIZE = 1024
"""Instances per chunk of a new partition when ``--chunk-size`` is not given."""

DTYPES = {"auto": "", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``--dtype`` values and the torch dtype each names; ``auto`` picks per device
(``layerdiv.extract.models.resolve_dtype``)."""


@dataclass
class ExtractConfig:
    """Everything one ``layerdiv extract`` run needs."""

    model: str
    """Hub id, local folder, or the alias ``smollm2-135m-instruct``."""
    tasks: list[str]
    """Built-in task names or task YAML paths."""
    store: Path = Path("layerdiv-store")
    """Store directory."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of the model; for a local folder, a label. The
    partition's ``revision=`` key (``main`` when None)."""
    step: int | None = None
    """Training step of the revision (None: N of a Pythia-style ``stepN`` revision, or unknown)."""
    tokens_seen: int | None = None
    """Training tokens the revision has seen (None: step x ``tokens_per_step`` where given)."""
    tokens_per_step: int | None = None
    """Training tokens per optimizer step, to derive ``tokens_seen`` from the step."""
    gguf_file: str | None = None
    """GGUF file inside the model's folder or repo (converted once to safetensors)."""
    limit: int | None = None
    """Instances per task (default: each task's n)."""
    batch_size: int | None = None
    """Instances per batch; None packs length-sorted batches up to a token budget."""
    dtype: str = "auto"
    """One of :data:`DTYPES`."""
    device: str = "auto"
    """auto (cuda, mps, cpu), or a torch device string."""
    device_map: str | None = None
    """None: the whole model on ``device``; ``auto``: spread over the GPUs, then CPU and disk
    offload, by accelerate (models larger than one GPU)."""
    shard: tuple[int, int] = (0, 1)
    """(i, N): this process does the chunks whose index is i modulo N."""
    overwrite: bool = False
    """Replace a partition that holds a different extraction (with N > 1 shards, a partition
    that holds this extraction is resumed instead: see ``PartitionWriter.check``)."""
    trust_remote_code: bool = False
    """Allow models whose code lives in their hub repo (e.g. MobileLLM)."""
    allow_softcap: bool = False
    """Decompose the pre-soft-cap logits of models with final logit soft-capping (flagged
    ``approximate`` in the manifest) instead of refusing them."""
    chunk_size: int | None = None
    """Instances per chunk of a new partition's grid (None: :data:`DEFAULT_CHUNK_SIZE`; an
    existing partition keeps its own): the unit of resumption, of sharding and of claiming; a
    crash loses at most one chunk per process."""
    heads: bool = False
    """Also store every attention head's option logits (the ``heads`` table, methods
    §8); a partition stored without them is extended (backfilled)."""
    skips: bool = False
    """Also store the option logits with each block skipped (``skips`` table, methods §7); on
    a text task, the future effects (``layerdiv.measurements.future``, methods §9)."""
    skip_split: str | None = None
    """Text tasks with ``skips``: ``random`` (4 seeded split points per document, the default)
    or ``all`` (every position but the first); None keeps the partition's own."""
    skip_sublayers: tuple[str, ...] = ()
    """Text tasks with ``skips``: what is removed, of ``block``, ``attn``, ``mlp`` (empty: the
    partition's own, or ``block``)."""
    skip_seed: int | None = None
    """Text tasks with ``skips``: the seed of the random split points (None: the partition's
    own, or 0)."""
    skip_modes: tuple[str, ...] = ()
    """Text tasks with ``skips``: how each skip runs on, of ``total`` and ``local`` (methods §10;
    empty: the partition's own, or ``total``)."""
    gram: bool = False
    """Also store each instance's Gram matrix of the component outputs (``gram`` table)."""
    lens: str | None = None
    """Text tasks: also store the logit lens of every block input (``token_lens`` table,
    methods §9): ``final`` (final norm and unembedding) or ``last-block`` (the last
    block applied first)."""
    measures: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The registered measurements with hooks of their own that this run asks for
    (``layerdiv.measurements``), by name: the settings given (None: not given, the partition's
    own or the default)."""
    progress: bool = True
    """Show progress bars."""

    @property
    def extra_tables(self) -> list[str]:
        """The optional choice-task tables this run writes (and backfills for chunks stored
        without them), but the lens (whose flag has a value)."""
        flags = (("heads", self.heads), ("skips", self.skips), ("gram", self.gram))
        return [t for t, on in flags if on]

    def given(self, m: Measurement) -> dict[str, Any]:
        """The settings of measurement ``m`` given on the command line (a built-in one's by its
        fields, another's under :attr:`measures`); a setting not given is left out, a repeated
        option's values once each."""
        own = {f.name for f in fields(self)}
        values = (
            {s.name: getattr(self, s.name) for s in m.settings}
            if m.dest in own
            else self.measures.get(m.name, {})
        )
        given = {k: v for k, v in values.items() if v not in (None, ())}
        return {k: tuple(dict.fromkeys(v)) if isinstance(v, tuple) else v for k, v in given.items()}

    def measured_tables(self, kind: str) -> list[str]:
        """The tables of :attr:`measures` for task ``kind``."""
        return [t for m in for_kind(kind) if m.name in self.measures for t in m.tables[kind]]


class OptionError(LayerdivError, ValueError):
    """A measurement's setting given without the measurement."""


def measurement_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """``ExtractConfig``'s keyword arguments from the values of the measurements' ``extract``
    options: the built-in ones by their field, the others under ``measures``."""
    own = {f.name for f in fields(ExtractConfig)}
    out: dict[str, Any] = {k: v for k, v in values.items() if k in own}
    measures: dict[str, dict[str, Any]] = {}
    for m in registered():
        if m.dest in own:
            continue
        settings = {s.name: values.get(s.name) for s in m.settings}
        if values.get(m.dest):
            measures[m.name] = settings
        elif any(v not in (None, ()) for v in settings.values()):
            given = [s.option.opts[0] for s in m.settings if values.get(s.name) not in (None, ())]
            raise OptionError(f"{', '.join(given)} sets up {m.flag}; add {m.flag}")
    return {**out, "measures": measures}


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
