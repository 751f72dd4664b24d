"""Planning: each task's instances (or documents and their tokens), option tokens, data
fingerprint, optional tables and measurement settings, checked (each measurement's own check of
the plan, ``Measurement.plan_check``) before the weights load so that bad input is refused before
anything is written."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerdiv.extract import chunks
from layerdiv.extract.config import ExtractConfig
from layerdiv.extract.facts import revision_facts
from layerdiv.extract.kinds import task_kind
from layerdiv.extract.models import ModelSource, context_length
from layerdiv.extract.provenance import identity
from layerdiv.extract.tasks import (
    Instance,
    TaskError,
    TaskSpec,
    data_sha256,
    instances,
    load_task,
)
from layerdiv.measurements import MEASUREMENTS, AnswerSpan, Planning, for_kind, registered
from layerdiv.measurements.registry import as_json
from layerdiv.schemas.kinds import KINDS
from layerdiv.store.key import DEFAULT_REVISION
from layerdiv.store.manifest import Identity, read_manifest
from layerdiv.store.redo import finish as finish_redo
from layerdiv.store.writer import PartitionWriter, refuse_other_settings

if TYPE_CHECKING:
    import torch


@dataclass
class TaskPlan:
    """A task ready to run: its instances, option tokens, data fingerprint and writer."""

    spec: TaskSpec
    items: list[Instance]
    option_ids: list[int]
    data_sha256: str
    writer: PartitionWriter
    extra_tables: list[str]
    """The optional tables to write (``chunks.extra_tables``)."""
    argument: str = ""
    """The task as ``--task`` takes it: a built-in name, or the absolute path of its YAML."""
    revision: str = DEFAULT_REVISION
    """The model's revision as given (``facts.revision_facts``)."""
    documents: tuple[list[list[int]], list[bool]] | None = None
    """Text tasks: the token ids of every document and whether it was cut (known before the
    weights load, so that a document without tokens is refused before anything is written)."""
    answers: list[AnswerSpan] | None = None
    """Text tasks with an answer: each document's answer span (methods §10,
    ``layerdiv.measurements.answer_spans``), computed once and given to every measurement's
    check of the plan; None without an answer."""
    run_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The settings of each measurement that this run writes (:func:`_run_settings`)."""
    planned: dict[str, Any] = field(default_factory=dict)
    """What each measurement's check of the plan gave its hooks (``Measurement.plan_check``)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about the task (its measurements' checks of the plan)."""
    redo: list[str] = field(default_factory=list)
    """The stored measurements (by name) this run extracts again (``ExtractConfig.redo``)."""

    def identity(self, source: ModelSource, dtype: torch.dtype) -> Identity:
        """The identity of its extraction with the model ``source`` in ``dtype``, known before
        the weights load (``provenance.identity``)."""
        return identity(source, dtype, self.spec, self.option_ids, self.data_sha256, self.revision)


def plan_task(
    name: str,
    tokenizer: Any,
    cfg: ExtractConfig,
    context: int | None = None,
    revision: str | None = None,
) -> TaskPlan:
    """Load a task's instances and option tokens, or a text task's documents and their tokens
    cut to ``max_tokens`` and the model's ``context`` length (task errors surface before the
    weights load), and check the measurements asked for against it. The data fingerprint covers
    the task's first n rows, so a larger ``--limit`` extends the same partition. ``revision``:
    the run's (``facts.revision_facts``), found from ``cfg`` where not given."""
    spec = load_task(name)
    revision = revision or revision_facts(cfg)["revision"]
    rows = instances(spec, max(spec.n, cfg.limit or 0))
    items = rows[: cfg.limit or spec.n]
    writer = PartitionWriter(cfg.store, cfg.model, spec.name, revision)
    finish_redo(writer.part)  # one a killed run committed
    argument = str(Path(name).resolve()) if Path(name).suffix in (".yaml", ".yml") else name
    sha = data_sha256(rows[: spec.n])
    _refuse_other_kinds(spec, cfg)
    _refuse_redo(writer, cfg, spec, len(items))
    tables = chunks.extra_tables(writer, cfg.asked_tables(spec.kind), cfg.overwrite)
    run_settings = _run_settings(writer, cfg, spec, tables)
    limit = context or context_length(None, tokenizer)
    prepared = task_kind(spec.kind).prepare(spec, items, tokenizer, limit)
    plan = TaskPlan(spec=spec, items=items, data_sha256=sha, writer=writer, extra_tables=tables,
                    argument=argument, revision=revision, run_settings=run_settings,
                    **prepared)  # fmt: skip
    plan.redo = list(cfg.redo)
    sequences = partial(task_sequences, tokenizer=tokenizer, context=context)
    for m in registered():
        if m.name in run_settings:
            planning = Planning(spec, items, tokenizer, run_settings[m.name], plan.notes,
                                plan.answers, sequences)  # fmt: skip
            plan.planned[m.name] = m.check_plan(planning)
    return plan


def task_sequences(name: str, count: int, tokenizer: Any, context: int | None) -> list[list[int]]:
    """The token ids of task ``name``'s first ``count`` units (at most) as its extraction takes
    them: a text task's documents cut to its ``max_tokens`` and the ``context`` length, a choice
    task's prompts (``Planning.sequences``)."""
    spec = load_task(name)
    texts = [it.prompt for it in instances(spec, count)[:count]]
    limit = context or context_length(None, tokenizer)
    return task_kind(spec.kind).sequences(tokenizer, texts, spec, limit)[0]


def _refuse_other_kinds(spec: TaskSpec, cfg: ExtractConfig) -> None:
    """Refuse (before anything is written) a measurement asked for whose flag writes nothing
    in the task's kind, and the settings given of one that does not apply to it."""
    for name in cfg.measurement_settings:
        m = MEASUREMENTS[name]
        if spec.kind in m.tables:
            continue
        given = [s.option.opts[0] for s in m.settings if s.name in cfg.given(m)]
        if given or not any(o.flag == m.flag for o in for_kind(spec.kind)):
            raise TaskError(
                f"task {spec.name} is a {spec.kind} task: {', '.join(given) or m.flag} applies "
                f"to {', '.join(m.tables)} tasks only; extract it without"
            )


def _refuse_redo(writer: PartitionWriter, cfg: ExtractConfig, spec: TaskSpec, n: int) -> None:
    """Refuse (before anything is written) a ``--redo`` that cannot replace the stored
    measurement: with ``--overwrite`` or ``--shard``, of a partition not stored, of a
    measurement the partition does not hold, or covering fewer units than it stores."""
    if not cfg.redo:
        return
    where = writer.part.manifest.parent
    if cfg.overwrite or cfg.shard[1] > 1:
        option = "--overwrite (it replaces the whole partition)" if cfg.overwrite else "--shard"
        raise TaskError(f"--redo runs alone over a stored partition: drop {option}")
    if not writer.part.manifest.exists():
        raise TaskError(
            f"--redo {' '.join(cfg.redo)}: {where} is not stored; extract task {spec.name} "
            "first (without --redo)"
        )
    held = chunks.extra_tables(writer, [], False)
    for name in cfg.redo:
        m = next(m for m in registered() if m.name == name)
        if not set(m.tables[spec.kind]) & set(held):
            raise TaskError(
                f"--redo {name}: {where} holds no {name} to redo; extract it with {m.flag} "
                "(without --redo)"
            )
    stored = max((s + c for s, c in writer.part.done_parts()), default=0)
    if stored > n:
        raise TaskError(
            f"--redo {' '.join(cfg.redo)}: {where} stores {stored} {KINDS[spec.kind].units}, "
            f"this run covers {n}: give --limit {stored} so that every stored one is redone"
        )


def _run_settings(
    writer: PartitionWriter, cfg: ExtractConfig, spec: TaskSpec, tables: list[str]
) -> dict[str, dict[str, Any]]:
    """The settings of each measurement that this run writes (asked for, or held by the
    partition): those given, else the partition's own, else the defaults. Refuses (before
    anything is written, whether or not work is left) settings other than those the partition
    recorded."""
    stored: dict[str, dict[str, Any]] = {}
    if not cfg.overwrite and writer.part.manifest.exists():
        stored = read_manifest(writer.part.manifest).settings
    out = {}
    for m in for_kind(spec.kind):
        if not set(m.tables[spec.kind]) & set(tables):
            continue
        redo = m.name in cfg.redo  # the partition's own replaced: not refused
        own = (None if redo else stored.get(m.name)) or m.defaults()
        given = cfg.given(m)
        for s in m.settings:  # a set given in another order: the recorded order
            if s.unordered and s.name in given and set(given[s.name]) == set(own.get(s.name, ())):
                given[s.name] = own[s.name]
        out[m.name] = as_json({**own, **given})
        if not redo:
            refuse_other_settings(writer.part.manifest, stored, {m.name: out[m.name]})
    return out


def refuse_shared_names(plans: list[TaskPlan]) -> None:
    """Refuse (before anything is written) two tasks of one name: they would be one partition."""
    first: dict[str, TaskPlan] = {}
    for plan in plans:
        other = first.setdefault(plan.spec.name, plan)
        if other is not plan:
            raise TaskError(
                f"--task {other.argument} and --task {plan.argument} are both named "
                f"{plan.spec.name!r}, and a task's name is its partition: give one of them "
                "another `name:` (or drop the repeated --task)"
            )
