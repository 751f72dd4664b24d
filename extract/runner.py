"""The extraction loop: plan every task (:mod:`layerdiv.extract.plan`), load the model once, and
for each task open its partition, run each chunk of the partition's grid that this process
claims and lacks (a background thread writes one chunk while the model runs the next), backfill
the optional tables of chunks stored without them, and summarise. Resumable, shardable,
interruptible."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from typing import Any

import pyarrow as pa
from tqdm.auto import tqdm

from layerdiv.extract import chunks, cost
from layerdiv.extract.adapters import Adapter, adapter_for, check_softcap
from layerdiv.extract.batching import chunk_runs, token_budget
from layerdiv.extract.capture import SUM_TOLERANCE
from layerdiv.extract.config import DEFAULT_CHUNK_SIZE, ExtractConfig, TaskSummary
from layerdiv.extract.facts import load_with_facts, revision_facts
from layerdiv.extract.forward import ModelRunner, time_forward
from layerdiv.extract.interrupt import interruptible
from layerdiv.extract.kinds import BatchWork, task_kind
from layerdiv.extract.models import (
    LoadedModel,
    context_length,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_source,
)
from layerdiv.extract.plan import TaskPlan, plan_task, refuse_shared_names
from layerdiv.extract.provenance import build_manifest
from layerdiv.measurements import MEASUREMENTS, Measurement, for_kind, registered
from layerdiv.schemas.kinds import KINDS
from layerdiv.store.manifest import Identity, Manifest, read_manifest
from layerdiv.store.reader import PartitionInfo
from layerdiv.store.redo import MeasurementRedo
from layerdiv.store.writer import PartitionWriter, Verdict


def _measurements_of(kind: str, tables: list[str]) -> list[Measurement]:
    """The measurements that write some of ``tables`` in ``kind``'s partitions."""
    return [m for m in for_kind(kind) if set(m.tables[kind]) & set(tables)]


def run_extract(cfg: ExtractConfig) -> list[TaskSummary]:
    """Extract every task of ``cfg`` for one model; returns a summary per task."""
    with interruptible():
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        facts = revision_facts(cfg)  # once per run, passed on
        revision = facts["revision"]
        source = resolve_source(cfg.model, cfg.revision, cfg.gguf_file, cfg.trust_remote_code)
        adapter = adapter_for(source.config)
        approximate = check_softcap(source.config, cfg.allow_softcap)
        tokenizer = load_tokenizer(source)
        context = context_length(source.config, tokenizer)
        plans = [plan_task(name, tokenizer, cfg, context, revision) for name in cfg.tasks]
        refuse_shared_names(plans)
        docs = [p.documents[0] if p.documents else None for p in plans]
        jobs = [cost.job(p.spec.kind, _costed(p), d, [i.prompt for i in p.items], tokenizer)
                for p, d in zip(plans, docs, strict=True)]  # fmt: skip
        cost.announce(source.config, device.type, jobs)
        idents = [p.identity(source, dtype) for p in plans]  # once per plan, passed on
        for m in registered():  # each measurement's check of the model, before the weights load
            if any(m.name in p.run_settings for p in plans):
                m.check_model(source.config)
        for plan, ident in zip(plans, idents, strict=True):  # all before the weights load
            plan.writer.ensure_writable()
            plan.writer.check(ident, cfg.overwrite, cfg.shard[1])
        loaded: LoadedModel | None = None
        summaries = []
        for plan, ident in zip(plans, idents, strict=True):
            verdict = plan.writer.check(ident, cfg.overwrite, cfg.shard[1])
            todo = partial(chunks.pending, plan.writer, len(plan.items), plan.extra_tables)
            if (
                verdict is Verdict.RESUME
                and not plan.redo
                and not todo(_chunk_size(cfg), cfg.shard)
            ):
                done = len(plan.writer.done_instances())
                notes = _mark_complete(plan.writer, plan.extra_tables)
                summary = TaskSummary(plan.spec.name, len(plan.items), 0, done, 0.0,
                                      kind=plan.spec.kind, notes=notes)  # fmt: skip
            else:
                hashing = None  # the fingerprint's cost, said once
                if loaded is None:
                    load = partial(load_model, source, tokenizer, device, dtype, cfg.device_map)
                    loaded, hashing = load_with_facts(facts, adapter, load)
                    _announce_measured(loaded, source.config, jobs)
                plan.writer.refuse_same_weights(loaded.facts["weights_hash"])
                summary = extract_task(loaded, adapter, plan, cfg, approximate, ident)
                summary.notes[:0] = [hashing] if hashing else []
            if cfg.overwrite and verdict is Verdict.RESUME:
                summary.notes.insert(0, f"--overwrite with --shard {cfg.shard[0]}/{cfg.shard[1]}: "
                                     "the partition holds this extraction already (another "
                                     "shard replaced it), so it is resumed")  # fmt: skip
            summaries.append(summary)
        return summaries


def _costed(plan: TaskPlan) -> dict[str, dict[str, Any]]:
    """The measurements whose cost a task's run has: those redone (``--redo``), else all."""
    return {n: plan.run_settings[n] for n in plan.redo} if plan.redo else plan.run_settings


def _announce_measured(loaded: LoadedModel, config: Any, jobs: list[cost.Job]) -> None:
    """Time a short probe of plain forward passes on the loaded model and print the run's
    estimate at the FLOP rate it measured (``cost.announce_measured``)."""
    tokens = min(cost.probe_tokens(jobs), loaded.context_length, 512)
    timed = time_forward(loaded, tokens, cost.PROBE_SEQUENCES)
    rate = cost.probe_rate(config, tokens, timed)
    cost.announce_measured(config, loaded.device.type, jobs, rate)


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


@dataclass
class _Task:
    """One task's extraction under way: its plan, tokens, batch work and opened partition."""

    plan: TaskPlan
    cfg: ExtractConfig
    seqs: list[list[int]]
    truncated: list[bool]
    work: BatchWork
    stored: Manifest | None = None
    """The partition's manifest once opened (:func:`open_partition`)."""
    grid: int = 0
    """The partition's chunk width."""
    notes: list[str] = field(default_factory=list)
    correct: int = 0
    max_err: float = 0.0
    n_new: int = 0
    n_added: int = 0

    @property
    def names(self) -> list[str]:
        """The partition's component names, that every batch must run."""
        assert self.stored is not None
        return [c.name for c in self.stored.components]


def extract_task(
    loaded: LoadedModel,
    adapter: Adapter,
    plan: TaskPlan,
    cfg: ExtractConfig,
    approximate: bool,
    ident: Identity | None = None,
) -> TaskSummary:
    """Run one task through a loaded model and store every chunk of this shard not stored yet,
    with the optional tables of ``plan.extra_tables``, which are also added to stored chunks
    that lack them: open the partition, run the chunks, backfill, summarise. ``ident``: the
    extraction's identity where known (``TaskPlan.identity``)."""
    kind = task_kind(plan.spec.kind)
    seqs, truncated = plan.documents or kind.sequences(
        loaded.tokenizer, [it.prompt for it in plan.items], plan.spec, loaded.context_length
    )
    tol = SUM_TOLERANCE[loaded.dtype]
    work = kind.work(plan, seqs, truncated, tol, loaded.tokenizer.convert_ids_to_tokens)
    task = _Task(plan, cfg, seqs, truncated, work,
                 notes=list(plan.notes))  # fmt: skip
    name, tables = plan.spec.kind, plan.extra_tables
    vocab_rows = any(name in m.vocab_rows for m in _measurements_of(name, tables))
    budget = token_budget(loaded.device, loaded.model.config, loaded.dtype, vocab_rows)
    start_time = time.perf_counter()
    for measurement in plan.redo:
        redo(task, measurement, partial(ModelRunner, loaded, adapter, plan.option_ids, budget,
                                        name), loaded.device.type)  # fmt: skip
    if plan.redo and not chunks.pending(plan.writer, len(plan.items), tables, _chunk_size(cfg),
                                        cfg.shard):  # fmt: skip
        task.notes += _mark_complete(plan.writer, tables)  # nothing else to do
        return summary(task, time.perf_counter() - start_time)
    with ModelRunner(loaded, adapter, plan.option_ids, budget, name, plan.run_settings,
                     [it.gold for it in plan.items], plan.planned) as runner:  # fmt: skip
        ident = ident or plan.identity(loaded.source, loaded.dtype)
        open_partition(task, runner, loaded, adapter, tol, approximate, ident)
        for m in _measurements_of(name, tables):
            _warn_size(task, m)
        run = plan.writer.start_run({"n_requested": len(plan.items), "shard": list(cfg.shard),
                                     "task": plan.argument, "chunk_size": task.grid,
                                     "device": loaded.device.type})  # fmt: skip
        run_chunks(task, runner)
        backfill(task, runner)
        task.notes += _mark_complete(plan.writer, tables)
    seconds = time.perf_counter() - start_time
    run.write(finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
              seconds=round(seconds, 3), instances=task.n_new)  # fmt: skip
    return summary(task, seconds)


def open_partition(
    task: _Task,
    runner: ModelRunner,
    loaded: LoadedModel,
    adapter: Adapter,
    tol: float,
    approximate: bool,
    ident: Identity,
) -> None:
    """Run the first instance (the component list, before anything is written), build the
    manifest and open (create, resume or replace) the partition with it, recording the settings
    of measurements new to it; sets ``task.stored`` and ``task.grid``."""
    plan, cfg = task.plan, task.cfg
    spec, writer = plan.spec, plan.writer
    probe = runner.run([task.seqs[0]])
    task.work.check(probe, [0])
    manifest = build_manifest(loaded, adapter, spec, ident, probe.components, len(plan.items),
                              _chunk_size(cfg), tol, approximate)  # fmt: skip
    derived, whole = runner.prepare(task.seqs, _stored_whole(plan, cfg.overwrite))
    for name, values in derived.items():  # settings derived once per partition (fingerprints)
        plan.run_settings[name].update(values)
    manifest.settings = dict(plan.run_settings)
    stored = writer.open(manifest, cfg.overwrite, cfg.shard[1])  # records them, or refuses others
    for table, data in whole.items():  # before the first chunk
        writer.write_whole(table, data)
    task.stored, task.grid = stored, stored.chunk_size or _chunk_size(cfg)
    if cfg.chunk_size and task.grid != cfg.chunk_size:
        unit = KINDS[spec.kind].units
        task.notes.append(f"the partition's chunk grid is {task.grid} {unit} (--chunk-size "
                          f"{cfg.chunk_size} applies to new partitions only)")  # fmt: skip


def redo(task: _Task, name: str, runner: Callable[..., ModelRunner], device: str) -> None:
    """Extract measurement ``name`` again over every stored chunk of the partition, with the
    settings of ``task.plan.run_settings``, and swap its tables and settings in
    (``layerdiv.store.redo``: nothing changes unless every chunk is done), its run recorded;
    ``runner`` makes a ``ModelRunner`` from the run's settings (by name) and the gold options."""
    plan, cfg, kind = task.plan, task.cfg, task.plan.spec.kind
    writer, m = plan.writer, MEASUREMENTS[name]
    task.stored = read_manifest(writer.part.manifest)
    parts = writer.part.done_parts()
    record = writer.start_run({"redo": name, "settings": plan.run_settings[name],
                               "task": plan.argument, "device": device})  # fmt: skip
    start = time.perf_counter()
    bar = _bar(sum(c for _, c in parts), f"{plan.spec.name} --redo {name}", task)
    with runner({name: plan.run_settings[name]}, [it.gold for it in plan.items],
                plan.planned) as hooked, bar:  # fmt: skip
        derived, whole = hooked.prepare(task.seqs, {})
        plan.run_settings[name].update(derived.get(name, {}))
        staged = MeasurementRedo(writer, name, list(m.tables[kind]), plan.run_settings[name])
        try:
            for table, data in whole.items():
                staged.write_whole(table, data)
            for s, c in parts:
                run = list(range(s, s + c))
                results = chunks.compute(hooked, [run], task.seqs, cfg.batch_size, task.names,
                                         task.work.check, bar.update)  # fmt: skip
                made = task.work.optional(run, results)
                for table in m.tables[kind]:
                    staged.write_part(table, s, c, made[table])
            staged.commit()
        except BaseException:
            staged.discard()
            raise
    seconds = time.perf_counter() - start
    record.write(finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 seconds=round(seconds, 3), instances=sum(c for _, c in parts))  # fmt: skip
    units = KINDS[kind].units
    task.notes.append(f"{name} redone over {sum(c for _, c in parts)} stored {units} with "
                      f"{m.describe(plan.run_settings[name])} in {seconds:.1f} s (its other tables "
                      "and settings kept)")  # fmt: skip


def _stored_whole(plan: TaskPlan, overwrite: bool) -> dict[str, pa.Table]:
    """The tables stored once per partition that the measurements of ``plan`` write and the
    partition holds (none with ``overwrite``: it is replaced)."""
    tables = [t for m in registered() if m.name in plan.run_settings for t in m.whole]
    found = {} if overwrite else {t: plan.writer.stored_whole(t) for t in tables}
    return {t: data for t, data in found.items() if data is not None}


def _warn_size(task: _Task, m: Measurement) -> None:
    """Print measurement ``m``'s line (``Measurement.size_warning``) before a run whose tables
    of it (of units not stored yet, and of stored chunks that lack them) will be large."""
    plan, stored, kind = task.plan, task.stored, task.plan.spec.kind
    if m.size_warning is None:
        return
    assert stored is not None and stored.hidden_size is not None  # written by this release
    done = plan.writer.done_instances(stored)
    lacking = {i for t in m.tables[kind] for s, n in plan.writer.part.lacking(t)
               for i in range(s, s + n)}  # fmt: skip
    todo = [i for i in range(len(plan.items)) if i not in done or i in lacking]
    lengths = [len(s) for s in task.seqs]
    line = m.size_warning_of(
        lengths, todo, kind, plan.run_settings[m.name], stored.n_blocks, stored.hidden_size
    )
    if line is not None:
        print(line, file=sys.stderr, flush=True)


def _bar(total: int, desc: str, task: _Task) -> tqdm:
    """The progress bar of ``total`` units (instances, documents) of ``task``, which moves by
    shares of a unit within a batch (``ModelRunner.run_chunk``)."""
    shown = "{l_bar}{bar}| {n:.1f}/{total} {unit} [{elapsed}<{remaining}]"
    unit = KINDS[task.plan.spec.kind].units[:3]
    off = not task.cfg.progress
    return tqdm(total=total, desc=desc, unit=unit, disable=off, bar_format=shown)


def run_chunks(task: _Task, runner: ModelRunner) -> None:
    """Claim each chunk of this shard that has instances not stored, compute them and store
    them (one chunk written in the background while the next one runs)."""
    plan, cfg, stored = task.plan, task.cfg, task.stored
    assert stored is not None
    writer, n = plan.writer, len(plan.items)
    done = writer.done_instances(stored)
    cells = chunk_runs([i for i in range(n) if i not in done], task.grid, cfg.shard)
    bar = _bar(sum(len(r) for runs in cells.values() for r in runs), plan.spec.name, task)
    with bar, ThreadPoolExecutor(max_workers=1) as pool:
        writing: Future[None] | None = None
        for j, claim in chunks.claimed(writer, sorted(cells)):
            try:
                runs, redone = chunks.missing_runs(writer, j, task.grid, n, stored)
                results = chunks.compute(runner, runs, task.seqs, cfg.batch_size, task.names,
                                         task.work.check, bar.update)  # fmt: skip
                parts = [(r, task.work.tables(r, results)) for r in runs]
            except BaseException:
                claim.release()
                raise
            task.notes += redone
            c, e = task.work.tally(results)
            task.correct, task.max_err = task.correct + c, max(task.max_err, e)
            task.n_new += len(results)
            if writing is not None:  # at most one chunk in flight
                writing.result()
            writing = pool.submit(chunks.store, writer, claim, parts)
        if writing is not None:
            writing.result()


def backfill(task: _Task, runner: ModelRunner) -> None:
    """Add the optional tables to this shard's chunks stored before without them (their other
    tables kept)."""
    plan, cfg, tables = task.plan, task.cfg, task.plan.extra_tables
    if not tables:
        return
    rerun = partial(chunks.compute, runner, seqs=task.seqs, batch_size=cfg.batch_size,
                    names=task.names, check=task.work.check, progress=lambda n: None)  # fmt: skip
    added = chunks.backfill(plan.writer, tables, task.grid, cfg.shard, len(plan.items),
                            lambda run: rerun(runs=[run]), task.work.optional)  # fmt: skip
    task.n_added = added
    if added:
        unit = KINDS[plan.spec.kind].units
        task.notes.append(f"added {', '.join(tables)} to {added} stored {unit} "
                          "(their other tables were kept)")  # fmt: skip


def summary(task: _Task, seconds: float) -> TaskSummary:
    """What the task's extraction did."""
    plan, n_new = task.plan, task.n_new
    return TaskSummary(
        task=plan.spec.name,
        n_requested=len(plan.items),
        n_new=n_new,
        n_done=len(plan.writer.done_instances()),
        seconds=seconds,
        max_sum_error=task.max_err,
        n_truncated=sum(task.truncated),
        n_added=task.n_added,
        accuracy_new=task_kind(plan.spec.kind).accuracy(task.correct, n_new),
        kind=plan.spec.kind,
        notes=task.notes,
    )
