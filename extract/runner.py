"""The extraction loop: tokenize, batch by length, run the model once per instance, check the
decomposition, and write complete chunks to the store (resumable, shardable)."""

from __future__ import annotations

import inspect
import platform
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from layerdiv.extract.adapters import (
    Adapter,
    UnsupportedModel,
    adapter_for,
    final_softcap,
    get_module,
    norm_eps,
)
from layerdiv.extract.capture import BatchDecomposition, ComponentCapture, DecompositionError
from layerdiv.extract.models import (
    LoadedModel,
    ModelSource,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_source,
)
from layerdiv.extract.tasks import Instance, TaskSpec, instances, load_task, option_token_ids
from layerdiv.schemas import COMPONENTS, INSTANCES
from layerdiv.store.manifest import ComponentInfo, Manifest
from layerdiv.store.writer import PartitionWriter

SUM_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
"""Largest accepted relative decomposition error per dtype (METHODS.md section 1 invariant)."""

CPU_TOKEN_BUDGET = 1024
"""Padded tokens per batch for ``--batch-size auto`` on the CPU."""

MAX_BATCH_ROWS = 256
"""Upper bound on instances per batch with ``--batch-size auto``."""

MAX_PADDING = 0.2
"""With ``--batch-size auto``, no prompt in a batch is padded by more than this fraction of the
batch's width (length-bucketed batches: padding is wasted compute)."""


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
    """Hub revision (branch, tag or commit) of the model."""
    gguf_file: str | None = None
    """GGUF file inside the model's folder or repo (converted once to safetensors)."""
    limit: int | None = None
    """Instances per task (default: each task's n)."""
    batch_size: int | None = None
    """Instances per batch; None packs length-sorted batches up to a token budget."""
    dtype: str = "auto"
    """auto, fp32, bf16 or fp16."""
    device: str = "auto"
    """auto (cuda, mps, cpu), or a torch device string."""
    shard: tuple[int, int] = (0, 1)
    """(i, N): this process does the chunks whose index is i modulo N."""
    overwrite: bool = False
    """Replace a partition that holds a different extraction."""
    trust_remote_code: bool = False
    """Allow models whose code lives in their hub repo (e.g. MobileLLM)."""
    allow_softcap: bool = False
    """Decompose the pre-soft-cap logits of models with final logit soft-capping (flagged
    ``approximate`` in the manifest) instead of refusing them."""
    chunk_size: int = 1024
    """Instances per stored part; batches are length-sorted within a chunk, and a crash loses
    at most one chunk per process."""
    progress: bool = True
    """Show progress bars."""


@dataclass
class TaskSummary:
    """What one task's extraction did."""

    task: str
    n_requested: int
    n_new: int
    n_done: int
    seconds: float
    max_sum_error: float = 0.0
    n_truncated: int = 0
    accuracy_new: float | None = None


@dataclass
class TaskPlan:
    """A task ready to run: its instances, option tokens and partition writer."""

    spec: TaskSpec
    items: list[Instance]
    option_ids: list[int]
    writer: PartitionWriter


def plan_task(name: str, tokenizer: Any, cfg: ExtractConfig) -> TaskPlan:
    """Load a task's instances and option tokens (task errors surface before the weights load)."""
    spec = load_task(name)
    items = instances(spec, cfg.limit)
    ids = option_token_ids(spec, tokenizer, items[0].prompt)
    return TaskPlan(spec, items, ids, PartitionWriter(cfg.store, cfg.model, spec.name))


def check_softcap(config: Any, allow: bool) -> bool:
    """Refuse final logit soft-capping unless allowed; True when the result is approximate."""
    cap = final_softcap(config)
    if cap and not allow:
        raise UnsupportedModel(
            f"{getattr(config, 'model_type', 'this model')} soft-caps its final logits (cap "
            f"{cap}), which is not linear: the components cannot sum to its logits. Pass "
            "--allow-softcap to decompose the pre-cap logits instead (the manifest marks the "
            "partition approximate)."
        )
    return bool(cap)


def run_extract(cfg: ExtractConfig) -> list[TaskSummary]:
    """Extract every task of ``cfg`` for one model; returns a summary per task."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    source = resolve_source(cfg.model, cfg.revision, cfg.gguf_file, cfg.trust_remote_code)
    adapter = adapter_for(source.config)
    approximate = check_softcap(source.config, cfg.allow_softcap)
    tokenizer = load_tokenizer(source)
    plans = [plan_task(name, tokenizer, cfg) for name in cfg.tasks]
    for plan in plans:  # refuse a conflicting partition before the weights are loaded
        plan.writer.check(_identity(source, dtype, plan), cfg.overwrite)
    loaded: LoadedModel | None = None
    summaries = []
    for plan in plans:
        done = plan.writer.done_instances()
        if not cfg.overwrite and not _pending(plan, done, cfg):
            summaries.append(TaskSummary(plan.spec.name, len(plan.items), 0, len(done), 0.0))
            continue
        loaded = loaded or load_model(source, tokenizer, device, dtype)
        summaries.append(extract_task(loaded, adapter, plan, cfg, approximate))
    return summaries


def _pending(plan: TaskPlan, done: set[int], cfg: ExtractConfig) -> bool:
    """Whether this shard has instances of ``plan`` left to extract."""
    todo = [i for i in range(len(plan.items)) if i not in done]
    return next(_chunks(todo, cfg.chunk_size, cfg.shard), None) is not None


def _identity(source: ModelSource, dtype: torch.dtype, plan: TaskPlan) -> dict[str, Any]:
    """The manifest fields that identify an extraction (``Manifest.identity``), known before
    the weights are loaded."""
    return {
        "model": source.model_id,
        "revision": source.revision,
        "weights_fingerprint": source.weights_fingerprint,
        "dtype": str(dtype).removeprefix("torch."),
        "template_sha256": plan.spec.sha256(),
        "option_token_ids": plan.option_ids,
    }


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("layerdiv", "torch", "transformers", "safetensors", "pyarrow"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out


def tokenize(loaded: LoadedModel, items: list[Instance]) -> tuple[list[list[int]], list[bool]]:
    """Token ids of every prompt; prompts longer than the context keep their last tokens (and a
    leading BOS) and are flagged as truncated."""
    ids = loaded.tokenizer([it.prompt for it in items], add_special_tokens=True)["input_ids"]
    ctx = loaded.context_length
    bos = loaded.tokenizer.bos_token_id
    out, truncated = [], []
    for seq in ids:
        if len(seq) <= ctx:
            out.append(list(seq))
            truncated.append(False)
            continue
        keep = [seq[0], *seq[len(seq) - ctx + 1 :]] if seq[0] == bos else list(seq[-ctx:])
        out.append(keep)
        truncated.append(True)
    return out, truncated


def _chunks(todo: list[int], chunk_size: int, shard: tuple[int, int]) -> Iterator[list[int]]:
    """Contiguous runs of ``todo`` within each grid cell of ``chunk_size``, for this shard."""
    run: list[int] = []
    for i in todo:
        if run and (i != run[-1] + 1 or i // chunk_size != run[0] // chunk_size):
            if (run[0] // chunk_size) % shard[1] == shard[0]:
                yield run
            run = []
        run.append(i)
    if run and (run[0] // chunk_size) % shard[1] == shard[0]:
        yield run


def batches(
    lengths: list[int], ids: list[int], batch_size: int | None, budget: int
) -> list[list[int]]:
    """Group ``ids`` longest first; a fixed ``batch_size``, or as many as fit ``budget`` padded
    tokens (at most :data:`MAX_BATCH_ROWS`, none padded beyond :data:`MAX_PADDING`)."""
    order = sorted(ids, key=lambda i: (-lengths[i], i))
    if batch_size:
        return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]
    out: list[list[int]] = []
    for i in order:
        # Longest first: a batch's padded width is the length of its first member.
        if (
            out
            and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget
            and len(out[-1]) < MAX_BATCH_ROWS
            and lengths[i] >= (1 - MAX_PADDING) * lengths[out[-1][0]]
        ):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def token_budget(device: torch.device, config: Any, dtype: torch.dtype) -> int:
    """Padded tokens per batch for ``--batch-size auto``: a fixed budget on the CPU; on a GPU,
    half the free memory over an estimate of one token's transient activations in one block
    (residual, normed copy, q/k/v/o and three MLP-width tensors). Halved on out-of-memory."""
    if device.type != "cuda":
        return CPU_TOKEN_BUDGET
    free, _ = torch.cuda.mem_get_info(device)
    d = config.hidden_size
    width = 4 * d + 3 * (getattr(config, "intermediate_size", None) or 4 * d)
    per_token = width * torch.finfo(dtype).bits // 8
    return max(256, int(free // 2 // per_token))


class ModelRunner:
    """Runs left-padded batches through a model with the capture hooks attached."""

    def __init__(
        self, loaded: LoadedModel, adapter: Adapter, option_ids: list[int], budget: int
    ) -> None:
        self.loaded = loaded
        self.budget = budget
        """Padded tokens per batch for automatic batching (lowered on out-of-memory)."""
        self.capture = ComponentCapture(loaded.model, adapter, option_ids)
        params = inspect.signature(loaded.model.forward).parameters
        self.extra: dict[str, Any] = {"use_cache": False}
        if "logits_to_keep" in params:
            self.extra["logits_to_keep"] = 1
        self.pad_id = loaded.tokenizer.pad_token_id or 0

    def run(self, seqs: list[list[int]]) -> BatchDecomposition:
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):
            input_ids[row, width - len(s) :] = torch.tensor(s)
            mask[row, width - len(s) :] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        device = self.loaded.device
        self.capture.reset()
        with torch.inference_mode():
            self.loaded.model(
                input_ids=input_ids.to(device),
                attention_mask=mask.to(device),
                position_ids=position_ids.to(device),
                **self.extra,
            )
        return self.capture.decompose()

    def run_chunk(
        self, seqs: list[list[int]], chunk: list[int], batch_size: int | None
    ) -> Iterator[tuple[BatchDecomposition, list[int]]]:
        """Run ``chunk`` in length-sorted batches; on a GPU out-of-memory error, halve the batch
        (and ``self.budget``, kept for later chunks) and go on."""
        lengths = [len(s) for s in seqs]
        pending = batches(lengths, chunk, batch_size, self.budget)
        while pending:
            batch = pending.pop(0)
            try:
                dec = self.run([seqs[i] for i in batch])
            except torch.OutOfMemoryError:
                if len(batch) == 1:
                    raise
                torch.cuda.empty_cache()
                self.budget = max(1, len(batch) * lengths[batch[0]] // 2)
                half = max(1, len(batch) // 2)
                pending = batches(lengths, batch, batch_size and half, self.budget) + pending
                continue
            yield dec, batch

    def close(self) -> None:
        self.capture.remove()


def _check(dec: BatchDecomposition, ids: list[int], task: str, tol: float) -> None:
    """Stop on NaN/Inf or a decomposition error above ``tol``, naming instance and component."""
    # A NaN in one component output spreads to every logit through the norm scale: name the
    # first component whose output is not finite, else the first with a non-finite logit.
    real = torch.tensor([c.kind != "bias" for c in dec.components])
    bad_z = ~torch.isfinite(dec.out_norm) & real
    bad_u = ~torch.isfinite(dec.logits).all(dim=-1)
    if (bad_z | bad_u).any():
        row = int((bad_z | bad_u).any(dim=1).nonzero()[0])
        comp = int((bad_z[row] if bad_z[row].any() else bad_u[row]).nonzero()[0])
        raise DecompositionError(
            f"task {task}, instance {ids[row]}: component {dec.components[comp].name} has a "
            "NaN or Inf logit (try --dtype fp32)"
        )
    worst = int(dec.sum_error.argmax())
    if not float(dec.sum_error[worst]) <= tol:
        raise DecompositionError(
            f"task {task}, instance {ids[worst]}: components sum to the model's option logits "
            f"only within {float(dec.sum_error[worst]):.2e} (relative), above the tolerance "
            f"{tol:.0e}; the architecture adapter does not decompose this model exactly"
        )


def extract_task(
    loaded: LoadedModel, adapter: Adapter, plan: TaskPlan, cfg: ExtractConfig, approximate: bool
) -> TaskSummary:
    """Run one task through a loaded model and store every chunk not stored yet."""
    spec, items = plan.spec, plan.items
    seqs, truncated = tokenize(loaded, items)
    budget = token_budget(loaded.device, loaded.model.config, loaded.dtype)
    runner = ModelRunner(loaded, adapter, plan.option_ids, budget)
    tol = SUM_TOLERANCE[loaded.dtype]
    start_time = time.perf_counter()
    try:
        probe = runner.run([seqs[0]])  # the component list, before anything is written
        _check(probe, [0], spec.name, tol)
        manifest = _manifest(loaded, adapter, plan, probe.components, tol, approximate)
        plan.writer.open(manifest, cfg.overwrite)  # refuses a different stored extraction
        done = plan.writer.done_instances()
        todo = [i for i in range(len(items)) if i not in done]
        chunks = list(_chunks(todo, cfg.chunk_size, cfg.shard))
        names = [c.name for c in manifest.components]
        max_err, correct, n_new = 0.0, 0, 0
        bar = tqdm(
            total=sum(len(c) for c in chunks),
            desc=f"{spec.name}",
            unit="inst",
            disable=not cfg.progress,
            dynamic_ncols=True,
        )
        # Chunks are written by a background thread while the model runs the next one.
        with bar, ThreadPoolExecutor(max_workers=1) as pool:
            writing: Future[tuple[int, float]] | None = None
            for chunk in chunks:
                results: dict[int, tuple[BatchDecomposition, int]] = {}
                for dec, ids in runner.run_chunk(seqs, chunk, cfg.batch_size):
                    _check(dec, ids, spec.name, tol)
                    if [c.name for c in dec.components] != names:
                        raise DecompositionError(
                            f"task {spec.name}: instance {ids[0]} ran a different component "
                            "sequence than the first instance"
                        )
                    for row, i in enumerate(ids):
                        results[i] = (dec, row)
                    bar.update(len(ids))
                if writing is not None:  # at most one chunk in flight
                    correct, max_err = _add(writing.result(), correct, max_err)
                writing = pool.submit(_store_chunk, plan, chunk, results, seqs, truncated)
                n_new += len(chunk)
            if writing is not None:
                correct, max_err = _add(writing.result(), correct, max_err)
    finally:
        runner.close()
    seconds = time.perf_counter() - start_time
    if n_new:
        plan.writer.record_run(
            {
                "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "seconds": round(seconds, 3),
                "instances": n_new,
                "shard": list(cfg.shard),
                "device": loaded.device.type,
            }
        )
    return TaskSummary(
        task=spec.name,
        n_requested=len(items),
        n_new=n_new,
        n_done=len(plan.writer.done_instances()),
        seconds=seconds,
        max_sum_error=max_err,
        n_truncated=sum(truncated),
        accuracy_new=correct / n_new if n_new else None,
    )


def _add(stats: tuple[int, float], correct: int, max_err: float) -> tuple[int, float]:
    return correct + stats[0], max(max_err, stats[1])


def _store_chunk(
    plan: TaskPlan,
    chunk: list[int],
    results: dict[int, tuple[BatchDecomposition, int]],
    seqs: list[list[int]],
    truncated: list[bool],
) -> tuple[int, float]:
    """Write one chunk; returns its correct-prediction count and worst decomposition error."""
    comp_table, inst_table = _tables(chunk, results, plan.items, seqs, truncated)
    plan.writer.write_chunk(chunk[0], len(chunk), comp_table, inst_table)
    gold = np.array([plan.items[i].gold for i in chunk])
    pred = np.array([int(results[i][0].model_logits[results[i][1]].argmax()) for i in chunk])
    return int((gold == pred).sum()), float(inst_table["sum_error"].to_numpy().max())


def _manifest(
    loaded: LoadedModel,
    adapter: Adapter,
    plan: TaskPlan,
    components: list[ComponentInfo],
    tol: float,
    approximate: bool,
) -> Manifest:
    src, tok = loaded.source, loaded.tokenizer
    return Manifest(
        **_identity(src, loaded.dtype, plan),
        task=plan.spec.name,
        model_type=str(src.config.model_type),
        adapter=adapter.family,
        norm=adapter.norm,
        n_params=loaded.n_params,
        context_length=loaded.context_length,
        hidden_size=int(src.config.hidden_size),
        norm_eps=norm_eps(get_module(loaded.model, adapter.final_norm)),
        options=list(plan.spec.options),
        option_tokens=[str(t) for t in tok.convert_ids_to_tokens(plan.option_ids)],
        task_spec=plan.spec.to_dict(),
        components=components,
        n_requested=len(plan.items),
        sum_tolerance=tol,
        approximate=approximate,
        versions=_versions(),
        device=loaded.device.type,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def _tables(
    chunk: list[int],
    results: dict[int, tuple[BatchDecomposition, int]],
    items: list[Instance],
    seqs: list[list[int]],
    truncated: list[bool],
) -> tuple[pa.Table, pa.Table]:
    """Long component rows and instance rows of one chunk, in instance order."""
    first = results[chunk[0]][0]
    infos = first.components
    n_comp, n_opt = first.logits.shape[1], first.logits.shape[2]

    def stack(attr: str) -> np.ndarray:
        return np.stack([getattr(results[i][0], attr)[results[i][1]].numpy() for i in chunk])

    logits = stack("logits")  # (B, L, K)
    per_comp = {
        a: np.repeat(stack(a).reshape(-1), n_opt)
        for a in ("out_norm", "prefix_rms", "cos_residual", "cos_prev")
    }
    b = len(chunk)
    comp_index = np.tile(np.repeat(np.arange(n_comp, dtype=np.int16), n_opt), b)
    names = pa.array([c.name for c in infos], pa.string())
    kinds = [c.kind for c in infos]
    kind_values = pa.array(sorted(set(kinds), key=kinds.index), pa.string())
    kind_index = np.array([kind_values.to_pylist().index(k) for k in kinds], dtype=np.int8)
    layers = np.array([c.layer for c in infos], dtype=np.int16)
    components = pa.table(
        {
            "instance": pa.array(np.repeat(np.array(chunk, dtype=np.int32), n_comp * n_opt)),
            "component": pa.array(comp_index),
            "name": pa.DictionaryArray.from_arrays(pa.array(comp_index), names),
            "kind": pa.DictionaryArray.from_arrays(pa.array(kind_index[comp_index]), kind_values),
            "layer": pa.array(layers[comp_index]),
            "option": pa.array(np.tile(np.arange(n_opt, dtype=np.int8), b * n_comp)),
            "logit": pa.array(logits.reshape(-1).astype(np.float32)),
            "out_norm": pa.array(per_comp["out_norm"], from_pandas=True),
            "prefix_rms": pa.array(per_comp["prefix_rms"]),
            "cos_residual": pa.array(per_comp["cos_residual"], from_pandas=True),
            "cos_prev": pa.array(per_comp["cos_prev"], from_pandas=True),
        },
        schema=COMPONENTS,
    )
    instances_table = pa.table(
        {
            "instance": pa.array(chunk, pa.int32()),
            "gold": pa.array([items[i].gold for i in chunk], pa.int8()),
            "n_tokens": pa.array([len(seqs[i]) for i in chunk], pa.int32()),
            "truncated": pa.array([truncated[i] for i in chunk], pa.bool_()),
            "final_rms": pa.array(stack("final_rms"), pa.float32()),
            "model_logits": pa.array(list(stack("model_logits")), pa.list_(pa.float32())),
            "sum_error": pa.array(stack("sum_error"), pa.float32()),
        },
        schema=INSTANCES,
    )
    return components, instances_table
