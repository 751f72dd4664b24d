"""Planning: each task's instances (or documents and their tokens), option tokens, data
fingerprint, optional tables and measurement settings, checked (each measurement's own check of
the plan, ``Measurement.plan``) before the weights load so that bad input is refused before
anything is written."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from layerdiv.extract import chunks
from layerdiv.extract.batching import tokenize, tokenize_documents
from layerdiv.extract.config import ExtractConfig
from layerdiv.extract.facts import revision_facts
from layerdiv.extract.models import context_length
from layerdiv.extract.tasks import (
    Instance,
    TaskError,
    TaskSpec,
    data_sha256,
    instances,
    load_task,
    option_token_ids,
)
from layerdiv.measurements import AnswerSpan, Planning, answer_spans, for_kind, registered
from layerdiv.measurements.registry import as_json
from layerdiv.schemas import KINDS
from layerdiv.store.manifest import read_manifest
from layerdiv.store.redo import finish as finish_redo
from layerdiv.store.writer import PartitionWriter, refuse_other_settings


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
    documents: tuple[list[list[int]], list[bool]] | None = None
    """Text tasks: the token ids of every document and whether it was cut (known before the
    weights load, so that a document without tokens is refused before anything is written)."""
    answers: list[AnswerSpan] | None = None
    """Text tasks with an answer: each document's answer span (methods §10,
    ``layerdiv.measurements.answer_spans``), computed once and given to every measurement's
    check of the plan; None without an answer."""
    measures: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The settings of each measurement that this run writes (:func:`_measure_settings`)."""
    planned: dict[str, Any] = field(default_factory=dict)
    """What each measurement's check of the plan gave its hooks (``Measurement.plan``)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about the task (its measurements' checks of the plan)."""
    redo: list[str] = field(default_factory=list)
    """The stored measurements (by name) this run extracts again (``ExtractConfig.redo``)."""


def plan_task(
    name: str, tokenizer: Any, cfg: ExtractConfig, context: int | None = None
) -> TaskPlan:
    """Load a task's instances and option tokens, or a text task's documents and their tokens
    cut to ``max_tokens`` and the model's ``context`` length (task errors surface before the
    weights load), and check the measurements asked for against it. The data fingerprint covers
    the task's first n rows, so a larger ``--limit`` extends the same partition."""
    spec = load_task(name)
    rows = instances(spec, max(spec.n, cfg.limit or 0))
    items = rows[: cfg.limit or spec.n]
    writer = PartitionWriter(cfg.store, cfg.model, spec.name, revision_facts(cfg)["revision"])
    finish_redo(writer.part)  # one a killed run committed
    argument = str(Path(name).resolve()) if Path(name).suffix in (".yaml", ".yml") else name
    sha = data_sha256(rows[: spec.n])
    _refuse_other_kinds(spec, cfg)
    _refuse_redo(writer, cfg, spec, len(items))
    tables = chunks.extra_tables(writer, cfg.measured_tables(spec.kind), cfg.overwrite)
    measures = _measure_settings(writer, cfg, spec, tables)
    if spec.kind == "text":
        limit = context or context_length(None, tokenizer)
        texts = [it.prompt for it in items]
        documents = tokenize_documents(tokenizer, texts, min(spec.max_tokens or limit, limit))
        empty = [i for i, seq in enumerate(documents[0]) if not seq]
        if empty:
            raise TaskError(
                f"task {spec.name}: document {empty[0]} tokenizes to no tokens (empty text); "
                "fix the data or the task's text template, or filter such rows out"
            )
        spans = None if spec.answer is None else answer_spans(tokenizer, items)
        plan = TaskPlan(spec, items, [], sha, writer, tables, argument, documents, spans, measures)
    else:
        ids = option_token_ids(spec, tokenizer, items[0].prompt)
        plan = TaskPlan(spec, items, ids, sha, writer, tables, argument, measures=measures)
    plan.redo = list(cfg.redo)
    sequences = partial(task_sequences, tokenizer=tokenizer, context=context)
    for m in registered():
        if m.name in measures:
            planning = Planning(spec, items, tokenizer, measures[m.name], plan.notes, plan.answers,
                                sequences)  # fmt: skip
            plan.planned[m.name] = m.check_plan(planning)
    return plan


def task_sequences(name: str, count: int, tokenizer: Any, context: int | None) -> list[list[int]]:
    """The token ids of task ``name``'s first ``count`` units (at most) as its extraction takes
    them: a text task's documents cut to its ``max_tokens`` and the ``context`` length, a choice
    task's prompts (``Planning.sequences``)."""
    spec = load_task(name)
    limit = context or context_length(None, tokenizer)
    texts = [it.prompt for it in instances(spec, count)[:count]]
    if spec.kind == "text":
        return tokenize_documents(tokenizer, texts, min(spec.max_tokens or limit, limit))[0]
    return tokenize(tokenizer, texts, limit)[0]


def _refuse_other_kinds(spec: TaskSpec, cfg: ExtractConfig) -> None:
    """Refuse (before anything is written) a measurement asked for whose flag writes nothing
    in the task's kind, and the settings given of one that does not apply to it."""
    for name in cfg.measures:
        m = next(m for m in registered() if m.name == name)
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


def _measure_settings(
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
