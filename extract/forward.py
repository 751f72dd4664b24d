"""Running left-padded batches through a model with the capture hooks attached."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from layerdiv.errors import DecompositionError
from layerdiv.extract.adapters import Adapter
from layerdiv.extract.batching import batches
from layerdiv.extract.capture import BatchDecomposition, ComponentCapture
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
    for_kind,
    registered,
)
from layerdiv.measurements.registry import MeasurementError, plugin_errors
from layerdiv.store.tables import (
    components_table,
    documents_table,
    instances_table,
    token_blocks_table,
    tokens_table,
)

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


class ModelRunner:
    """Runs left-padded batches through a model with the capture hooks attached: the task
    ``kind``'s own capture (the last-token decomposition of a choice task, the per-token dot
    products of a text task) and each registered measurement's of ``measures`` (by name: its
    settings; ``planned``, by name: what its check of the plan gave), those derived from the
    kind's capture bound to it; a context manager that always removes its hooks. ``option_ids``
    and ``gold`` (by instance): a choice task's option tokens and gold options."""

    def __init__(
        self,
        loaded: LoadedModel,
        adapter: Adapter,
        option_ids: list[int],
        budget: int,
        kind: str = "choice",
        measures: Mapping[str, Mapping[str, Any]] | None = None,
        gold: Sequence[int] = (),
        planned: Mapping[str, Any] | None = None,
    ) -> None:
        self.loaded = loaded
        self.budget = budget
        """Padded tokens per batch for automatic batching (lowered on out-of-memory)."""
        model = loaded.model
        self.readout = Readout(model, adapter)
        """The model's final norm and unembedding, shared by every capture that reads out."""
        self.capture: ComponentCapture | TextCapture = (
            TextCapture(model, adapter, self.readout)
            if kind == "text"
            else ComponentCapture(model, adapter, self.readout, option_ids)
        )
        """The task kind's own capture: a text task's per-token dot products (methods §9), a
        choice task's last-token decomposition (methods §1)."""
        base = Attachment(model, adapter, kind, {}, self.readout, tuple(option_ids), tuple(gold))
        self.measures = self._attach(base, measures or {}, planned or {})
        """The registered measurements' hooks (``layerdiv.measurements.Measurement.attach``)."""
        self.graded = {m.name for m in registered() if m.needs_grad and m.name in self.measures}
        """The measurements whose hooks take gradients, each run in a pass of its own."""
        self.hooked = [
            (m, self.measures[m.name]) for m in for_kind(kind) if m.name in self.measures
        ]
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
        measures: Mapping[str, Mapping[str, Any]],
        planned: Mapping[str, Any],
    ) -> dict[str, Capture]:
        """The hooks of every measurement of ``base.kind`` in ``measures`` (by name: its
        settings), those built on the kind's own capture bound to :attr:`capture`."""
        attached: dict[str, Capture] = {}
        for m in for_kind(base.kind):
            if m.attach is None or m.name not in measures:
                continue
            ctx = replace(base, settings=measures[m.name], planned=planned.get(m.name))
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
            for capture in (self.capture, *self.measures.values()):
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
        graded = {n: self._graded(self.measures[n], inputs, ids, lengths) for n in self.graded}
        for name, hooks in self.measures.items():
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
        mine = {n: h for n, h in self.measures.items() if n not in graded}
        bound = [n for n, h in mine.items() if isinstance(h, DecompositionCapture)]
        plain = [n for n in mine if n not in bound]
        batch.measured = {**graded, **self._measured(plain)}
        for name in bound:
            self.measures[name].decomposed(batch)  # type: ignore[attr-defined]
        batch.measured.update(self._measured(bound))

    def _measured(self, names: Sequence[str]) -> dict[str, Sequence[Any]]:
        """The values of the measurements ``names`` of the forward pass just run."""
        return {n: self.measures[n].result() for n in names}

    def run_chunk(
        self, seqs: list[list[int]], ids: list[int], batch_size: int | None
    ) -> Iterator[tuple[Any, list[int]]]:
        """Run instances ``ids`` in length-sorted batches; on an out-of-memory error, halve the
        batch (and ``self.budget``, kept for later chunks) and go on."""
        lengths = [len(s) for s in seqs]
        pending = batches(lengths, ids, batch_size, self.budget)
        while pending:
            batch = pending.pop(0)
            try:
                dec = self.run([seqs[i] for i in batch], batch)
            except torch.OutOfMemoryError:
                if len(batch) == 1:
                    raise
                torch.cuda.empty_cache()
                self.budget = max(1, len(batch) * lengths[batch[0]] // 2)
                half = max(1, len(batch) // 2)
                pending = batches(lengths, batch, batch_size and half, self.budget) + pending
                continue
            yield dec, batch


def chunk_tables(
    ids: list[int],
    results: dict[int, tuple[BatchDecomposition, int]],
    gold: list[int],
    seqs: list[list[int]],
    truncated: list[bool],
    prompts: list[str],
) -> dict[str, pa.Table]:
    """The ``components`` and ``instances`` tables of instances ``ids`` (ascending; ``gold``,
    ``seqs``, ``truncated`` and ``prompts`` are indexed by instance), each found
    in ``results`` as (its batch's decomposition, its row there), and the tables of the
    measurements the decompositions hold (:func:`measured_tables`)."""

    def stack(attr: str) -> np.ndarray:
        return np.stack([getattr(results[i][0], attr)[results[i][1]].numpy() for i in ids])

    return {
        **measured_tables("choice", ids, results),
        "components": components_table(
            ids,
            results[ids[0]][0].components,
            stack("logits"),
            stack("out_norm"),
            stack("prefix_rms"),
            stack("cos_residual"),
            stack("cos_prev"),
        ),
        "instances": instances_table(
            ids,
            [gold[i] for i in ids],
            [len(seqs[i]) for i in ids],
            [truncated[i] for i in ids],
            stack("final_rms"),
            stack("model_logits"),
            stack("sum_error"),
            [prompts[i] for i in ids],
        ),
    }


def text_tables(
    ids: list[int],
    results: dict[int, tuple[TextBatch, int]],
    seqs: list[list[int]],
    truncated: list[bool],
    groups: list[str | None],
    answer_starts: list[int] | None = None,
    spell: Callable[[list[int]], list[str]] | None = None,
) -> dict[str, pa.Table]:
    """The ``tokens``, ``token_blocks`` and ``documents`` tables of documents ``ids``
    (ascending; ``seqs``, ``truncated``, ``groups`` and ``answer_starts``, None for a task
    without an answer, are indexed by document; ``spell``: token ids -> the tokens as the
    vocabulary spells them), each found in
    ``results`` as (its batch, its row there), and the tables of the measurements the batches
    hold (:func:`measured_tables`)."""
    n_tokens = [len(seqs[i]) for i in ids]
    dots = np.concatenate([results[i][0].document(results[i][1], len(seqs[i])) for i in ids])
    return {
        **measured_tables("text", ids, results),
        "tokens": tokens_table(
            ids,
            [seqs[i] for i in ids],
            np.concatenate([results[i][0].document_loss(results[i][1], len(seqs[i])) for i in ids]),
            None if spell is None else [spell(seqs[i]) for i in ids],
        ),
        "token_blocks": token_blocks_table(ids, n_tokens, dots),
        "documents": documents_table(
            ids,
            n_tokens,
            [truncated[i] for i in ids],
            [groups[i] for i in ids],
            None if answer_starts is None else [answer_starts[i] for i in ids],
        ),
    }


def measured_tables(
    kind: str, ids: list[int], results: dict[int, tuple[Any, int]]
) -> dict[str, pa.Table]:
    """The tables of the registered measurements (``layerdiv.measurements``) that the run of
    documents or instances ``ids`` (ascending) measured."""
    first = results[ids[0]][0].measured
    tables = {}
    for m in for_kind(kind):
        if m.name not in first or m.rows is None:
            continue
        if any(m.name not in results[i][0].measured for i in ids):
            raise DecompositionError(f"a row ran without the measurement {m.name}")
        values = [results[i][0].measured[m.name][results[i][1]] for i in ids]
        with plugin_errors([(m, None)], "its rows"):
            made = m.rows(ids, values)
        if sorted(made) != sorted(m.tables[kind]):
            raise MeasurementError(
                f"measurement {m.name} ({m.flag}): its rows give the tables {sorted(made)}, it "
                f"declares {sorted(m.tables[kind])} for {kind} tasks; nothing of this chunk was "
                "written"
            )
        tables.update(made)
    return tables
