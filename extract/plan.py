"""Planning: each task's instances (or documents and their tokens), option tokens, data
fingerprint, optional tables and measurement settings, all checked before the weights load so
that bad input is refused before anything is written."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerdiv.extract import chunks
from layerdiv.extract.batching import tokenize_documents
from layerdiv.extract.config import ExtractConfig
from layerdiv.extract.facts import revision_facts
from layerdiv.extract.future import ANSWER_MARGIN, SPLIT_MARGIN, SPLIT_STEP, SkipSettings
from layerdiv.extract.lens import LENSES
from layerdiv.extract.models import context_length
from layerdiv.extract.tasks import (
    Instance,
    TaskError,
    TaskSpec,
    answer_start,
    data_sha256,
    instances,
    load_task,
    option_token_ids,
)
from layerdiv.measurements import for_kind, registered
from layerdiv.measurements.future import FUTURE
from layerdiv.measurements.lens import LENS
from layerdiv.measurements.registry import as_json
from layerdiv.store.manifest import read_manifest
from layerdiv.store.writer import PartitionWriter


@dataclass
class TaskPlan:
    """A task ready to run: its instances, option tokens, data fingerprint and writer."""

    spec: TaskSpec
    items: list[Instance]
    option_ids: list[int]
    data_sha256: str
    writer: PartitionWriter
    extra_tables: list[str]
    """The optional tables to write (:func:`_extra_tables`)."""
    argument: str = ""
    """The task as ``--task`` takes it: a built-in name, or the absolute path of its YAML."""
    documents: tuple[list[list[int]], list[bool]] | None = None
    """Text tasks: the token ids of every document and whether it was cut (known before the
    weights load, so that a document without tokens is refused before anything is written)."""
    measures: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The settings of each measurement with settings or hooks of its own that this run writes
    (:func:`_measure_settings`)."""
    answers: list[tuple[int, int]] | None = None
    """Text tasks with answer-anchored split points: per document, its answer's start s and
    length A (:func:`_answers`, methods §10)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about the task's documents (answers merged across the
    boundary)."""

    @property
    def lens(self) -> str | None:
        """The logit lens's readout, where this run writes the lens."""
        return self.measures.get(LENS.name, {}).get("lens")

    @property
    def skips(self) -> SkipSettings | None:
        """Text tasks writing the future-effects tables: how."""
        s = self.measures.get(FUTURE.name)
        return (
            None
            if s is None
            else SkipSettings(
                s["skip_split"],
                s["skip_seed"],
                tuple(s["skip_sublayers"]),
                tuple(s.get("skip_modes") or ["total"]),  # absent: recorded before local effects
            )
        )


def plan_task(
    name: str, tokenizer: Any, cfg: ExtractConfig, context: int | None = None
) -> TaskPlan:
    """Load a task's instances and option tokens, or a text task's documents and their tokens
    cut to ``max_tokens`` and the model's ``context`` length (task errors surface before the
    weights load). The data fingerprint covers the task's first n rows, so a larger ``--limit``
    extends the same partition."""
    spec = load_task(name)
    rows = instances(spec, max(spec.n, cfg.limit or 0))
    items = rows[: cfg.limit or spec.n]
    writer = PartitionWriter(cfg.store, cfg.model, spec.name, revision_facts(cfg)["revision"])
    argument = str(Path(name).resolve()) if Path(name).suffix in (".yaml", ".yml") else name
    sha = data_sha256(rows[: spec.n])
    if spec.kind == "text":
        _refuse_text_flags(spec, cfg)
        limit = context or context_length(None, tokenizer)
        texts = [it.prompt for it in items]
        documents = tokenize_documents(tokenizer, texts, min(spec.max_tokens or limit, limit))
        empty = [i for i, seq in enumerate(documents[0]) if not seq]
        if empty:
            raise TaskError(
                f"task {spec.name}: document {empty[0]} tokenizes to no tokens (empty text); "
                "fix the data or the task's text template, or filter such rows out"
            )
        future = list(FUTURE.tables["text"])
        asked = (list(LENS.tables["text"]) if cfg.lens else []) + (future if cfg.skips else [])
        tables = chunks.extra_tables(writer, [*asked, *cfg.measured_tables("text")], cfg.overwrite)
        measures = _measure_settings(writer, cfg, spec, tables)
        plan = TaskPlan(spec, items, [], sha, writer, tables, argument, documents, measures)
        _refuse_no_splits(plan)
        skips = plan.skips
        if skips is not None and skips.anchored is not None:
            plan.answers, plan.notes = _answers(spec, items, tokenizer, skips)
        return plan
    given = _skip_flags(cfg)
    if given:
        raise TaskError(
            f"task {spec.name} is a choice task: {', '.join(given)} applies to text tasks only "
            "(--skips on a choice task skips each block whole at the last prompt token)"
        )
    if cfg.lens is not None and "choice" not in LENSES[cfg.lens].kinds:
        raise TaskError(
            f"task {spec.name} is a choice task: --lens {cfg.lens} applies to text tasks only "
            "(a choice task keeps the last prompt token alone); use --lens"
        )
    ids = option_token_ids(spec, tokenizer, items[0].prompt)
    lens = list(LENS.tables["choice"]) if cfg.lens else []
    asked = [*cfg.extra_tables, *lens, *cfg.measured_tables("choice")]
    tables = chunks.extra_tables(writer, asked, cfg.overwrite)
    measures = _measure_settings(writer, cfg, spec, tables)
    return TaskPlan(spec, items, ids, sha, writer, tables, argument, measures=measures)


def _measure_settings(
    writer: PartitionWriter, cfg: ExtractConfig, spec: TaskSpec, tables: list[str]
) -> dict[str, dict[str, Any]]:
    """The settings of each measurement with settings or hooks of its own that this run writes
    (asked for, or held by the partition): those given, else the partition's own, else the
    defaults. Refuses (before anything is written, whether or not work is left) a measurement
    that does not apply to the task's kind, and settings other than those the partition
    recorded."""
    for name in cfg.measures:
        m = next(m for m in registered() if m.name == name)
        if spec.kind not in m.tables:
            raise TaskError(
                f"task {spec.name} is a {spec.kind} task: {m.flag} applies to "
                f"{', '.join(m.tables)} tasks only; extract it without"
            )
    stored: dict[str, dict[str, Any]] = {}
    if not cfg.overwrite and writer.part.manifest.exists():
        stored = read_manifest(writer.part.manifest).settings
    out = {}
    for m in for_kind(spec.kind):
        hooks = m.attach is not None  # attached by name in the settings (none: {})
        if not (m.settings or hooks) or not set(m.tables[spec.kind]) & set(tables):
            continue
        settings = as_json({**(stored.get(m.name) or m.defaults()), **cfg.given(m)})
        if m.name in stored and settings != stored[m.name]:
            raise TaskError(
                f"{writer.part.manifest}: the stored {m.name} was extracted with "
                f"{m.describe(stored[m.name])}, this run asks for {m.describe(settings)}; drop "
                "these options to keep the stored ones, or use --overwrite"
            )
        out[m.name] = settings
    return out


def _refuse_text_flags(spec: TaskSpec, cfg: ExtractConfig) -> None:
    """Refuse the optional tables a text task cannot have, and ``--skips`` settings without
    ``--skips``."""
    asked = [f"--{t}" for t in cfg.extra_tables if t != "skips"]
    if asked:
        raise TaskError(
            f"task {spec.name} is a text task: {', '.join(asked)} applies to choice tasks only "
            "in this version; extract it without"
        )
    given = _skip_flags(cfg)
    if given and not cfg.skips:
        raise TaskError(f"task {spec.name}: {', '.join(given)} sets up --skips; add --skips")


def _refuse_no_splits(plan: TaskPlan) -> None:
    """Refuse random split points where ``max_tokens`` leaves none, and local effects of a
    sublayer (methods §10 defines them for whole blocks)."""
    spec, skips = plan.spec, plan.skips
    if skips is not None and "total" not in skips.modes:
        raise TaskError(
            "--skip-mode local adds the local effects beside the total ones (their output "
            "change and row counts); give --skip-mode total --skip-mode local"
        )
    if skips is not None and "local" in skips.modes and skips.sublayers != ("block",):
        raise TaskError(
            "--skip-mode local removes the whole block's update (methods §10), not a "
            "sublayer's; drop --skip-sublayer attn/mlp or --skip-mode local"
        )
    short = spec.max_tokens is not None and spec.max_tokens <= SPLIT_STEP + SPLIT_MARGIN
    if skips is not None and skips.split == "random" and short:
        raise TaskError(
            f"task {spec.name}: --skips needs split points 8, 16, ... < T - 4, and max_tokens "
            f"{spec.max_tokens} leaves none; raise max_tokens above 12, use --skip-split all, "
            "or drop --skips"
        )


def _answers(
    spec: TaskSpec, items: list[Instance], tokenizer: Any, skips: SkipSettings
) -> tuple[list[tuple[int, int]], list[str]]:
    """Per document, its answer's start s = T - A and length A (methods §10,
    :func:`~layerdiv.extract.tasks.answer_start`), and a note where a token merges across the
    boundary; refuses a task without an answer, and with ``answer:N:S`` an answer of fewer than
    ``ANSWER_MARGIN + 1`` tokens (no offset below A - 4)."""
    if spec.answer is None:
        raise TaskError(
            f"task {spec.name}: --skip-split {skips.split} anchors the split points at the "
            "answer, and the task names none; add an 'answer' template beside 'text' (the "
            "document is text + answer), or use --skip-split random"
        )
    out, merged = [], []
    for doc, item in enumerate(items):
        assert item.answer is not None  # the task renders one for every document
        start, merges = answer_start(tokenizer, item.prompt, item.answer)
        length = len(tokenizer(item.answer, add_special_tokens=False)["input_ids"])
        if skips.split != "answer" and length <= ANSWER_MARGIN:
            raise TaskError(
                f"task {spec.name}: document {doc}'s answer is {length} tokens, and --skip-split "
                f"{skips.split} draws offsets below A - {ANSWER_MARGIN}, so it needs answers of "
                f"at least {ANSWER_MARGIN + 1}; use --skip-split answer, or filter short answers "
                "out"
            )
        out.append((start, length))
        if merges:
            merged.append(doc)
    notes = (
        [
            f"{len(merged)} of {len(items)} documents have a token that merges across the "
            f"answer's boundary (the first: document {merged[0]}); it counts as the answer's "
            "(methods §10)"
        ]
        if merged
        else []
    )
    return out, notes


def _skip_flags(cfg: ExtractConfig) -> list[str]:
    """The future-effects options given on the command line."""
    given = cfg.given(FUTURE)
    return [s.option.opts[0] for s in FUTURE.settings if s.name in given]


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
