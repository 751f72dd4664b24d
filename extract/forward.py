"""Running left-padded batches through a model with the capture hooks attached."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from types import TracebackType
from typing import Any

import pyarrow as pa
import torch

from layerdiv.extract.adapters import Adapter
from layerdiv.extract.batching import batches
from layerdiv.extract.capture import BatchDecomposition
from layerdiv.extract.kinds import task_kind
from layerdiv.extract.models import LoadedModel
from layerdiv.extract.readout import Readout
from layerdiv.extract.text import TextBatch, TextCapture
from layerdiv.measurements import (
    Attachment,
    Capture,
    DecompositionCapture,
    GradientCapture,
    PartitionCapture,
    RowsCapture,
    RunCapture,
    for_kind,
    registered,
)
from layerdiv.measurements.registry import plugin_errors

Batch = BatchDecomposition | TextBatch
"""What one forward pass gives: a choice task's decomposition, or a text task's dot products."""


def left_padded(seqs: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` of ``seqs`` left-padded to the
    longest, so that the last position of every row is its last prompt token."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        input_ids[row, width - len(s) :] = torch.tensor(s)
        mask[row, width - len(s) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}


def time_forward(loaded: LoadedModel, tokens: int, sequences: int) -> float:
    """Seconds of one plain forward pass (no hooks attached) over a batch of ``sequences``
    sequences of ``tokens`` tokens, after one pass that warms the model up: the probe of
    ``layerdiv.extract.cost.probe_rate``."""
    vocab = int(loaded.model.config.vocab_size)
    ids = (torch.arange(sequences * tokens) % vocab).reshape(sequences, tokens)
    ids = ids.to(loaded.device)
    sync = torch.cuda.synchronize if loaded.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        loaded.model(input_ids=ids, use_cache=False)
        sync()
        start = time.perf_counter()
        loaded.model(input_ids=ids, use_cache=False)
        sync()
    return time.perf_counter() - start


class ModelRunner:
    """Runs left-padded batches through a model with the capture hooks attached: the task
    ``kind``'s own capture (``layerdiv.extract.kinds.TaskKind.capture``: the last-token
    decomposition of a choice task, the per-token dot products of a text task) and each
    registered measurement's of ``run_settings`` (by name: its settings; ``planned``, by name: what
    its check of the plan gave), those derived from the kind's capture bound to it; a context
    manager that always removes its hooks. ``option_ids`` and ``gold`` (by instance): a choice
    task's option tokens and gold options."""

    def __init__(
        self,
        loaded: LoadedModel,
        adapter: Adapter,
        option_ids: list[int],
        budget: int,
        kind: str = "choice",
        run_settings: Mapping[str, Mapping[str, Any]] | None = None,
        gold: Sequence[int] = (),
        planned: Mapping[str, Any] | None = None,
    ) -> None:
        self.loaded = loaded
        self.budget = budget
        """Padded tokens per batch for automatic batching (lowered on out-of-memory)."""
        model = loaded.model
        self.readout = Readout(model, adapter)
        """The model's final norm and unembedding, shared by every capture that reads out."""
        self.capture = task_kind(kind).capture(model, adapter, self.readout, option_ids)
        """The task kind's own capture: a text task's per-token dot products (methods §9), a
        choice task's last-token decomposition (methods §1)."""
        base = Attachment(model, adapter, kind, {}, self.readout, tuple(option_ids), tuple(gold),
                          weights_fingerprint=loaded.source.weights_fingerprint)  # fmt: skip
        self._shares: dict[str, float] = {}
        """The share of the batch under way that each measurement reporting progress has done."""
        self._progress: Callable[[float], object] = lambda units: None
        self._units, self._shown = 0, 0.0
        """The units of the batch under way and how many of them the bar shows done."""
        self.hooks = self._attach(base, run_settings or {}, planned or {})
        """The registered measurements' hooks by name (``Measurement.attach``)."""
        self.graded = {m.name for m in registered() if m.needs_grad and m.name in self.hooks}
        """The measurements whose hooks take gradients, each run in a pass of its own."""
        self.hooked = [(m, self.hooks[m.name]) for m in for_kind(kind) if m.name in self.hooks]
        """Each measurement with its hooks: an exception in a plug-in's names it
        (``layerdiv.measurements.registry.plugin_errors``)."""
        params = inspect.signature(model.forward).parameters
        self.extra: dict[str, Any] = {"use_cache": False}
        if "logits_to_keep" in params:
            self.extra["logits_to_keep"] = 1
        self.pad_id = loaded.tokenizer.pad_token_id or 0

    def _attach(
        self,
        base: Attachment,
        run_settings: Mapping[str, Mapping[str, Any]],
        planned: Mapping[str, Any],
    ) -> dict[str, Capture]:
        """The hooks of every measurement of ``base.kind`` in ``run_settings`` (by name: its
        settings), those built on the kind's own capture bound to :attr:`capture`."""
        attached: dict[str, Capture] = {}
        for m in for_kind(base.kind):
            if m.attach is None or m.name not in run_settings:
                continue
            ctx = replace(base, settings=run_settings[m.name], planned=planned.get(m.name),
                          progress=partial(self._advance, m.name))  # fmt: skip
            with plugin_errors([(m, None)], "attaching its hooks"):
                hooks = m.attach_to(ctx)
                if hooks is None:
                    continue
                attached[m.name] = hooks
                if isinstance(hooks, DecompositionCapture):
                    hooks.bind(self.capture)
        return attached

    def __enter__(self) -> ModelRunner:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with plugin_errors(self.hooked, "removing its hooks"):
            for capture in (self.capture, *self.hooks.values()):
                capture.remove()

    def prepare(
        self, seqs: Sequence[Sequence[int]], stored: Mapping[str, pa.Table]
    ) -> tuple[dict[str, dict[str, Any]], dict[str, pa.Table]]:
        """What the measurements computed once per partition give before its first chunk
        (``PartitionCapture.prepare``; ``seqs``: every unit's token ids, ``stored``: the whole
        tables the partition holds): the settings each derives (by name) and their tables."""
        derived: dict[str, dict[str, Any]] = {}
        whole: dict[str, pa.Table] = {}
        for m, hooks in self.hooked:
            if isinstance(hooks, PartitionCapture):
                with plugin_errors([(m, hooks)], "preparing the partition"):
                    derived[m.name], tables = hooks.prepare(
                        seqs, lambda batch: self.run(batch), stored
                    )
                whole.update(tables)
        return derived, whole

    def run(self, seqs: list[list[int]], ids: list[int] | None = None) -> Any:
        """One forward pass over ``seqs`` (left-padded) and its :data:`Batch`
        (``BatchDecomposition`` for a choice task, ``TextBatch`` for a text task), with the
        values of the measurements (of instances or documents ``ids``; None: a probe pass, whose
        values are not stored)."""
        with plugin_errors(self.hooked, "its hooks"):
            return self._run(seqs, ids)

    def _run(self, seqs: list[list[int]], ids: list[int] | None) -> Any:
        device = self.loaded.device
        inputs = {k: v.to(device) for k, v in left_padded(seqs, self.pad_id).items()}
        inputs.update(self.extra)
        lengths = [len(s) for s in seqs]
        graded = {n: self._graded(self.hooks[n], inputs, ids, lengths) for n in self.graded}
        for name, hooks in self.hooks.items():
            if name not in graded:
                hooks.reset()
                if isinstance(hooks, RowsCapture):
                    hooks.batch(ids, lengths)
        capture = self.capture
        with torch.inference_mode():
            if isinstance(capture, TextCapture):
                capture.reset(inputs["input_ids"])
                self.loaded.model(**inputs)
                text = capture.decompose(self.budget)
                self._measure(text, graded)
                if text.loss is None:  # no bound measurement read h_L out
                    text.loss = capture.loss()
                return text
            capture.reset()
            self.loaded.model(**inputs)
            dec = capture.decompose()
            self._measure(dec, graded)
            return dec

    def _graded(
        self, hooks: Capture, inputs: dict[str, Any], ids: list[int] | None, lengths: list[int]
    ) -> Sequence[Any]:
        """The values of a measurement declared with ``needs_grad`` (a ``GradientCapture``):
        the batch run again for it alone, out of inference mode with gradients on and the
        kind's own capture paused."""
        hooks.reset()
        if isinstance(hooks, RowsCapture):
            hooks.batch(ids, lengths)
        assert isinstance(hooks, GradientCapture)  # declared with needs_grad
        with self.capture.pausing(), torch.inference_mode(False), torch.enable_grad():
            hooks.backward(self.loaded.model(**inputs))
        return hooks.result()

    def _measure(self, batch: Batch, graded: dict[str, Sequence[Any]]) -> None:
        """The measurements' values of the pass just run into ``batch.measured``: those of the
        hooks not bound to the kind's capture taken before the bound ones run (a bound capture
        may run passes of its own, the skips', with the kind's capture paused)."""
        mine = {n: h for n, h in self.hooks.items() if n not in graded}
        bound = [n for n, h in mine.items() if isinstance(h, DecompositionCapture)]
        plain = [n for n in mine if n not in bound]
        batch.measured = {**graded, **self._measured(plain)}
        for name in bound:
            self.hooks[name].decomposed(batch)  # type: ignore[attr-defined]
        batch.measured.update(self._measured(bound))

    def _measured(self, names: Sequence[str]) -> dict[str, Sequence[Any]]:
        """The values of the measurements ``names`` of the forward pass just run."""
        return {n: self.hooks[n].result() for n in names}

    def _advance(self, name: str, share: float) -> None:
        """Measurement ``name`` has done ``share`` of the batch under way: the bar moves to the
        mean share of the measurements that report progress, in the batch's units."""
        self._shares[name] = min(max(share, 0.0), 1.0)
        done = self._units * sum(self._shares.values()) / len(self._shares)
        if done > self._shown:
            self._progress(done - self._shown)
            self._shown = done

    def run_chunk(
        self,
        seqs: list[list[int]],
        ids: list[int],
        batch_size: int | None,
        progress: Callable[[float], object] = lambda units: None,
    ) -> Iterator[tuple[Any, list[int]]]:
        """Run instances ``ids`` (a contiguous run, stored as one part: the measurements' hooks
        that sum over a run are told first, ``RunCapture.begin``) in length-sorted batches,
        telling ``progress`` how many units (instances or documents, a share of one within a
        batch) are done since it was last told; on an out-of-memory error, halve the batch (and
        ``self.budget``, kept for later chunks) and go on."""
        for hooks in self.hooks.values():
            if isinstance(hooks, RunCapture):
                hooks.begin(ids)
        lengths = [len(s) for s in seqs]
        pending = batches(lengths, ids, batch_size, self.budget)
        self._progress = progress
        while pending:
            batch = pending.pop(0)
            self._units, self._shown = len(batch), 0.0
            self._shares = dict.fromkeys(self._shares, 0.0)
            try:
                dec = self.run([seqs[i] for i in batch], batch)
                progress(len(batch) - self._shown)
            except torch.OutOfMemoryError:
                progress(-self._shown)  # the halves count again
                if len(batch) == 1:
                    raise
                torch.cuda.empty_cache()
                self.budget = max(1, len(batch) * lengths[batch[0]] // 2)
                half = max(1, len(batch) // 2)
                pending = batches(lengths, batch, batch_size and half, self.budget) + pending
                continue
            yield dec, batch
