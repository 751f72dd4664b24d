"""The extraction loop: plan every task, load the model once, and for each chunk of the
partition's grid that this process claims, run what is missing and store it (a background
thread writes one chunk while the model runs the next). Resumable, shardable, interruptible."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
from tqdm.auto import tqdm

from layerdiv.extract import chunks, cost
from layerdiv.extract.adapters import Adapter, adapter_for, check_heads, check_softcap
from layerdiv.extract.batching import chunk_runs, tokenize, tokenize_documents
from layerdiv.extract.capture import SUM_TOLERANCE, BatchDecomposition, check_batch
from layerdiv.extract.config import DEFAULT_CHUNK_SIZE, ExtractConfig, TaskSummary
from layerdiv.extract.facts import load_with_facts, revision_facts
from layerdiv.extract.forward import (
    ModelRunner,
    chunk_tables,
    optional_tables,
    text_tables,
    token_budget,
)
from layerdiv.extract.future import SPLIT_MARGIN, SPLIT_STEP, SkipSettings
from layerdiv.extract.heads import check_head_sums
from layerdiv.extract.interrupt import interruptible
from layerdiv.extract.models import (
    LoadedModel,
    context_length,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_source,
)
from layerdiv.extract.provenance import build_manifest, identity
from layerdiv.extract.tasks import (
    Instance,
    TaskError,
    TaskSpec,
    data_sha256,
    instances,
    load_task,
    option_token_ids,
)
from layerdiv.extract.text import check_text_batch
from layerdiv.schemas import KINDS
from layerdiv.store.manifest import Manifest, read_manifest, write_manifest
from layerdiv.store.reader import PartitionInfo
from layerdiv.store.writer import PartitionWriter, Verdict


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
    skips: SkipSettings | None = None
    """Text tasks writing the future-effects tables: how (:func:`_skip_settings`)."""


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
        asked = (["token_lens"] if cfg.lens else []) + (list(FUTURE_TABLES) if cfg.skips else [])
        tables = chunks.extra_tables(writer, asked, cfg.overwrite)
        skips = _skip_settings(writer, cfg) if "future_effects" in tables else None
        return TaskPlan(spec, items, [], sha, writer, tables, argument, documents, skips)
    given = _skip_flags(cfg)
    if given:
        raise TaskError(
            f"task {spec.name} is a choice task: {', '.join(given)} applies to text tasks only "
            "(--skips on a choice task skips each block whole at the last prompt token)"
        )
    if cfg.lens == "last-block":
        raise TaskError(
            f"task {spec.name} is a choice task: --lens last-block applies to text tasks only "
            "(a choice task keeps the last prompt token alone); use --lens"
        )
    ids = option_token_ids(spec, tokenizer, items[0].prompt)
    asked = [*cfg.extra_tables, *(["lens"] if cfg.lens else [])]
    tables = chunks.extra_tables(writer, asked, cfg.overwrite)
    return TaskPlan(spec, items, ids, sha, writer, tables, argument)


def _refuse_other_lens(writer: PartitionWriter, stored: Manifest, manifest: Manifest) -> None:
    """Record the lens of a partition that had none; refuse another lens than the stored one."""
    table = KINDS[stored.kind].lens_table
    if stored.lens is not None and writer.part.parts(table):
        raise TaskError(
            f"{writer.part.manifest}: the stored {table} is --lens {stored.lens}, this run asks "
            f"for --lens {manifest.lens}; use --lens {stored.lens}, or --overwrite"
        )
    stored.lens = manifest.lens
    write_manifest(writer.part.manifest, stored)


FUTURE_TABLES = ("future_effects", "future_output")
"""The tables ``--skips`` writes on a text task."""


def _refuse_text_flags(spec: TaskSpec, cfg: ExtractConfig) -> None:
    """Refuse the optional tables a text task cannot have, and ``--skips`` settings without
    ``--skips``."""
    short = spec.max_tokens is not None and spec.max_tokens <= SPLIT_STEP + SPLIT_MARGIN
    if cfg.skips and cfg.skip_split != "all" and short:
        raise TaskError(
            f"task {spec.name}: --skips needs split points 8, 16, ... < T - 4, and max_tokens "
            f"{spec.max_tokens} leaves none; raise max_tokens above 12, use --skip-split all, "
            "or drop --skips"
        )
    asked = [f"--{t}" for t in cfg.extra_tables if t != "skips"]
    if asked:
        raise TaskError(
            f"task {spec.name} is a text task: {', '.join(asked)} applies to choice tasks only "
            "in this version; extract it without"
        )
    given = _skip_flags(cfg)
    if given and not cfg.skips:
        raise TaskError(f"task {spec.name}: {', '.join(given)} sets up --skips; add --skips")


def _skip_flags(cfg: ExtractConfig) -> list[str]:
    """The future-effects options given on the command line."""
    given = {"--skip-split": cfg.skip_split, "--skip-seed": cfg.skip_seed,
             "--skip-sublayer": cfg.skip_sublayers}  # fmt: skip
    return [flag for flag, value in given.items() if value not in (None, ())]


def _skip_settings(writer: PartitionWriter, cfg: ExtractConfig) -> SkipSettings:
    """The future-effects settings of this run: those given, else the partition's own, else the
    defaults; refuse settings other than those of future effects already stored."""
    stored = None
    if not cfg.overwrite and writer.part.manifest.exists():
        m = read_manifest(writer.part.manifest)
        if m.skip_split is not None:
            stored = SkipSettings(
                m.skip_split, m.skip_seed or 0, tuple(m.skip_sublayers or ["block"])
            )
    base = stored or SkipSettings()
    settings = SkipSettings(
        cfg.skip_split or base.split,
        base.seed if cfg.skip_seed is None else cfg.skip_seed,
        tuple(dict.fromkeys(cfg.skip_sublayers)) or base.sublayers,
    )
    if stored is not None and settings != stored and writer.part.parts("future_effects"):
        raise TaskError(
            f"{writer.part.manifest}: the stored future effects are {_describe(stored)}, this "
            f"run asks for {_describe(settings)}; drop these options to keep the stored ones, or "
            "use --overwrite"
        )
    return settings


def _describe(settings: SkipSettings) -> str:
    sublayers = " ".join(f"--skip-sublayer {s}" for s in settings.sublayers)
    return f"--skip-split {settings.split} --skip-seed {settings.seed} {sublayers}"


def run_extract(cfg: ExtractConfig) -> list[TaskSummary]:
    """Extract every task of ``cfg`` for one model; returns a summary per task."""
    with interruptible():
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        source = resolve_source(cfg.model, cfg.revision, cfg.gguf_file, cfg.trust_remote_code)
        adapter = adapter_for(source.config)
        approximate = check_softcap(source.config, cfg.allow_softcap)
        tokenizer = load_tokenizer(source)
        context = context_length(source.config, tokenizer)
        plans = [plan_task(name, tokenizer, cfg, context) for name in cfg.tasks]
        _refuse_shared_names(plans)
        docs = [p.documents[0] if p.documents else None for p in plans]
        cost.announce(source.config, device.type, [
            cost.job(p.spec.kind, p.extra_tables, cfg.lens, d, [i.prompt for i in p.items],
                     tokenizer) for p, d in zip(plans, docs, strict=True)])  # fmt: skip
        revision = revision_facts(cfg)["revision"]
        idents = [identity(source, dtype, p.spec, p.option_ids, p.data_sha256, revision)
                  for p in plans]  # fmt: skip
        heads = any("heads" in p.extra_tables for p in plans)
        n_heads = check_heads(source.config) if heads else None
        for plan, ident in zip(plans, idents, strict=True):  # all before the weights load
            plan.writer.ensure_writable()
            plan.writer.check(ident, cfg.overwrite, cfg.shard[1])
        loaded: LoadedModel | None = None
        summaries = []
        for plan, ident in zip(plans, idents, strict=True):
            verdict = plan.writer.check(ident, cfg.overwrite, cfg.shard[1])
            todo = partial(chunks.pending, plan.writer, len(plan.items), plan.extra_tables)
            if verdict is Verdict.RESUME and not todo(_chunk_size(cfg), cfg.shard):
                done = len(plan.writer.done_instances())
                notes = _mark_complete(plan.writer, plan.extra_tables)
                summary = TaskSummary(plan.spec.name, len(plan.items), 0, done, 0.0,
                                      kind=plan.spec.kind, notes=notes)  # fmt: skip
            else:
                hashing = None  # the fingerprint's cost, said once
                if loaded is None:
                    load = partial(load_model, source, tokenizer, device, dtype, cfg.device_map)
                    loaded, hashing = load_with_facts(cfg, adapter, load)
                plan.writer.refuse_same_weights(loaded.facts["weights_hash"])
                summary = extract_task(loaded, adapter, plan, cfg, approximate, n_heads)
                summary.notes[:0] = [hashing] if hashing else []
            if cfg.overwrite and verdict is Verdict.RESUME:
                summary.notes.insert(0, f"--overwrite with --shard {cfg.shard[0]}/{cfg.shard[1]}: "
                                     "the partition holds this extraction already (another "
                                     "shard replaced it), so it is resumed")  # fmt: skip
            summaries.append(summary)
        return summaries


def _refuse_shared_names(plans: list[TaskPlan]) -> None:
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


def _mark_complete(writer: PartitionWriter, tables: list[str]) -> list[str]:
    """Mark each of ``tables`` that every complete chunk of the partition now has; return a note
    for each optional table that some stored instances still lack (another shard's chunks, or
    chunks beyond ``--limit``), naming the command that completes it."""
    info = PartitionInfo(writer.part, read_manifest(writer.part.manifest))
    for table in tables:
        if table in info.tables:
            writer.mark_table(table)
    return info.incomplete()


def _chunk_size(cfg: ExtractConfig) -> int:
    return cfg.chunk_size or DEFAULT_CHUNK_SIZE


def _check(dec: BatchDecomposition, ids: list[int], task: str, tol: float) -> None:
    """The invariants of a batch: components sum to the model's logits (methods §1)
    and, with ``--heads``, heads sum to their attention components (methods §8)."""
    check_batch(dec, ids, task, tol)
    if dec.heads is not None:
        check_head_sums(dec.heads, dec, ids, task, tol)


@dataclass(frozen=True)
class _BatchWork:
    """What the task kind changes in the chunk loop: how a batch is checked, which tables a run
    of instances (documents) yields, and what it counts (correct predictions, worst error)."""

    check: Callable[[Any, list[int]], None]
    tables: Callable[[list[int], chunks.Results], dict[str, pa.Table]]
    tally: Callable[[chunks.Results], tuple[int, float]]
    optional: Callable[[list[int], chunks.Results], dict[str, pa.Table]]
    """The optional tables of a run (a backfill writes those a stored chunk lacks)."""


def _batch_work(
    plan: TaskPlan, seqs: list[list[int]], truncated: list[bool], tol: float
) -> _BatchWork:
    spec, items = plan.spec, plan.items
    if spec.kind == "text":
        groups = [it.group for it in items]
        return _BatchWork(
            lambda b, ids: check_text_batch(b, ids, [len(seqs[i]) for i in ids], spec.name),
            lambda r, res: text_tables(r, res, seqs, truncated, groups),
            lambda res: (0, 0.0),
            lambda r, res: text_tables(r, res, seqs, truncated, groups),
        )
    gold, prompts = [it.gold for it in items], [it.prompt for it in items]

    def tally(results: chunks.Results) -> tuple[int, float]:
        correct = sum(int(d.model_logits[r].argmax()) == gold[i] for i, (d, r) in results.items())
        worst = max((float(d.sum_error[r]) for d, r in results.values()), default=0.0)
        return correct, worst

    return _BatchWork(
        partial(_check, task=spec.name, tol=tol),
        lambda r, res: chunk_tables(r, res, gold, seqs, truncated, prompts),
        tally,
        lambda r, res: optional_tables(r, res, gold),
    )


def extract_task(
    loaded: LoadedModel,
    adapter: Adapter,
    plan: TaskPlan,
    cfg: ExtractConfig,
    approximate: bool,
    n_heads: int | None = None,
) -> TaskSummary:
    """Run one task through a loaded model and store every chunk of this shard not stored yet,
    with the optional tables of ``plan.extra_tables`` (``n_heads`` heads per attention block
    for ``heads``), which are also added to stored chunks that lack them."""
    spec, items, writer, tables = plan.spec, plan.items, plan.writer, plan.extra_tables
    if plan.documents is not None:
        seqs, truncated = plan.documents
    else:
        seqs, truncated = tokenize(loaded.tokenizer, [it.prompt for it in items],
                                   loaded.context_length)  # fmt: skip
    readout = bool({"token_lens", "future_effects"} & set(tables))
    budget = token_budget(loaded.device, loaded.model.config, loaded.dtype, readout)
    tol = SUM_TOLERANCE[loaded.dtype]
    work = _batch_work(plan, seqs, truncated, tol)
    unit = KINDS[spec.kind].units
    start_time, notes = time.perf_counter(), []
    with ModelRunner(loaded, adapter, plan.option_ids, budget, tables, n_heads,
                     spec.kind, cfg.lens, plan.skips) as runner:  # fmt: skip
        probe = runner.run([seqs[0]])  # the component list, before anything is written
        work.check(probe, [0])
        ident = identity(loaded.source, loaded.dtype, spec, plan.option_ids, plan.data_sha256,
                         revision_facts(cfg)["revision"])  # fmt: skip
        manifest = build_manifest(loaded, adapter, spec, ident, probe.components, len(items),
                                  _chunk_size(cfg), tol, approximate)  # fmt: skip
        lens_table = KINDS[spec.kind].lens_table
        manifest.lens = cfg.lens if lens_table in tables else None
        if plan.skips is not None:
            manifest.skip_split, manifest.skip_seed = plan.skips.split, plan.skips.seed
            manifest.skip_sublayers = list(plan.skips.sublayers)
        stored = writer.open(manifest, cfg.overwrite, cfg.shard[1])
        settings = ("skip_split", "skip_seed", "skip_sublayers")
        if plan.skips is not None and any(
            getattr(stored, f) != getattr(manifest, f) for f in settings
        ):  # a partition without future effects (or none stored yet) gets this run's
            for f in settings:
                setattr(stored, f, getattr(manifest, f))
            write_manifest(writer.part.manifest, stored)
        if lens_table in tables and stored.lens != manifest.lens:
            _refuse_other_lens(writer, stored, manifest)
        grid = stored.chunk_size or _chunk_size(cfg)
        if cfg.chunk_size and grid != cfg.chunk_size:
            notes.append(f"the partition's chunk grid is {grid} {unit} (--chunk-size "
                         f"{cfg.chunk_size} applies to new partitions only)")  # fmt: skip
        names = [c.name for c in stored.components]
        done = writer.done_instances(stored)
        cells = chunk_runs([i for i in range(len(items)) if i not in done], grid, cfg.shard)
        run = writer.start_run({"n_requested": len(items), "shard": list(cfg.shard),
                                "task": plan.argument,
                                "chunk_size": grid, "device": loaded.device.type})  # fmt: skip
        correct, max_err, n_new = 0, 0.0, 0
        bar = tqdm(total=sum(len(r) for runs in cells.values() for r in runs), desc=spec.name,
                   unit=unit[:3], disable=not cfg.progress, dynamic_ncols=True)  # fmt: skip
        with bar, ThreadPoolExecutor(max_workers=1) as pool:
            writing: Future[None] | None = None
            for j, claim in chunks.claimed(writer, sorted(cells)):
                try:
                    runs, redone = chunks.missing_runs(writer, j, grid, len(items), stored)
                    results = chunks.compute(runner, runs, seqs, cfg.batch_size, names,
                                             work.check, bar.update)  # fmt: skip
                    parts = [(r, work.tables(r, results)) for r in runs]
                except BaseException:
                    claim.release()
                    raise
                notes += redone
                c, e = work.tally(results)
                correct, max_err, n_new = correct + c, max(max_err, e), n_new + len(results)
                if writing is not None:  # at most one chunk in flight
                    writing.result()
                writing = pool.submit(chunks.store, writer, claim, parts)
            if writing is not None:
                writing.result()
        if tables:  # chunks stored before without them: add just these tables
            rerun = partial(chunks.compute, runner, seqs=seqs, batch_size=cfg.batch_size,
                            names=names, check=work.check, progress=lambda n: None)  # fmt: skip
            added = chunks.backfill(writer, tables, grid, cfg.shard, len(items),
                                    lambda run: rerun(runs=[run]), work.optional)  # fmt: skip
            if added:
                notes.append(f"added {', '.join(tables)} to {added} stored {unit} "
                             "(their other tables were kept)")  # fmt: skip
        notes += _mark_complete(writer, tables)
    seconds = time.perf_counter() - start_time
    run.write(finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
              seconds=round(seconds, 3), instances=n_new)  # fmt: skip
    return TaskSummary(
        task=spec.name,
        n_requested=len(items),
        n_new=n_new,
        n_done=len(writer.done_instances()),
        seconds=seconds,
        max_sum_error=max_err,
        n_truncated=sum(truncated),
        accuracy_new=correct / n_new if n_new and spec.kind == "choice" else None,
        kind=spec.kind,
        notes=notes,
    )
