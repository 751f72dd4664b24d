"""Running left-padded batches through a model with the capture hooks attached."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from layerdiv.extract.adapters import Adapter
from layerdiv.extract.batching import batches
from layerdiv.extract.capture import BatchDecomposition, ComponentCapture, DecompositionError
from layerdiv.extract.future import FutureEffects, SkipSettings
from layerdiv.extract.lens import make_lens
from layerdiv.extract.models import LoadedModel
from layerdiv.extract.readout import Readout
from layerdiv.extract.text import TextBatch, TextCapture
from layerdiv.measurements import (
    Attachment,
    Capture,
    DecompositionCapture,
    RowsCapture,
    for_kind,
)
from layerdiv.measurements.future import future_rows
from layerdiv.measurements.lens import LENS
from layerdiv.measurements.registry import MeasurementError, plugin_errors
from layerdiv.store.tables import (
    components_table,
    documents_table,
    instances_table,
    token_blocks_table,
    token_lens_table,
    tokens_table,
)

Batch = BatchDecomposition | TextBatch
"""What one forward pass gives: a choice task's decomposition, or a text task's dot products."""

CPU_TOKEN_BUDGET = 1024
"""Padded tokens per batch for ``--batch-size auto`` on the CPU."""


def token_budget(
    device: torch.device, config: Any, dtype: torch.dtype, readout: bool = False
) -> int:
    """Padded tokens per batch for ``--batch-size auto``: a fixed budget on the CPU; on a GPU,
    half the free memory over an estimate of one token's transient activations in one block
    (residual, normed copy, q/k/v/o and three MLP-width tensors), and with ``readout`` (the
    logit lens, future effects) three float32 rows over the vocabulary. Halved on
    out-of-memory."""
    if device.type != "cuda":
        return CPU_TOKEN_BUDGET
    free, _ = torch.cuda.mem_get_info(device)
    d = config.hidden_size
    width = 4 * d + 3 * (getattr(config, "intermediate_size", None) or 4 * d)
    per_token = width * torch.finfo(dtype).bits // 8
    if readout:
        per_token += 3 * 4 * getattr(config, "vocab_size", 0)
    return max(256, int(free // 2 // per_token))


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
    """Runs left-padded batches through a model with the capture hooks attached (those of the
    task ``kind``: the last-token decomposition of a choice task, the per-token dot products of a
    text task, with its lens and future effects, and each registered measurement's of
    ``measures``, by name: its settings); a context manager that always removes its hooks.
    ``option_ids`` and ``gold`` (by instance): a choice task's option tokens and gold options."""

    def __init__(
        self,
        loaded: LoadedModel,
        adapter: Adapter,
        option_ids: list[int],
        budget: int,
        kind: str = "choice",
        skips: SkipSettings | None = None,
        measures: Mapping[str, Mapping[str, Any]] | None = None,
        answers: Sequence[tuple[int, int]] | None = None,
        gold: Sequence[int] = (),
    ) -> None:
        self.loaded = loaded
        self.budget = budget
        """Padded tokens per batch for automatic batching (lowered on out-of-memory)."""
        model, measures = loaded.model, measures or {}
        self.readout = Readout(model, adapter)
        """The model's final norm and unembedding, shared by every capture that reads out."""
        lens = measures.get(LENS.name) if kind == "text" else None  # a choice task's: attached
        text_lens = None if lens is None else make_lens(lens["lens"], model, adapter, self.readout)
        self.text = TextCapture(model, adapter, self.readout, text_lens) if kind == "text" else None
        """Text tasks: the per-token capture, with ``--lens`` its logit lens (methods §9); the
        choice captures are not attached."""
        self.future = (
            FutureEffects(model, adapter, self.readout, skips, answers)
            if self.text is not None and skips is not None
            else None
        )
        """Text tasks with ``--skips``: the future effects (methods §9; ``answers``, per
        document its answer's start and length, for answer-anchored split points, §10)."""
        self.capture = (
            ComponentCapture(model, adapter, self.readout, option_ids)
            if self.text is None
            else None
        )
        """Choice tasks: the last-token decomposition (methods §1)."""
        base = Attachment(model, adapter, kind, {}, self.readout, tuple(option_ids), tuple(gold))
        self.measures = self._attach(base, measures)
        """The registered measurements' hooks (``layerdiv.measurements.Measurement.attach``)."""
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
        self, base: Attachment, measures: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, Capture]:
        """The hooks of every measurement of ``base.kind`` in ``measures`` (by name: its
        settings) that has hooks of its own for that kind, those built on the decomposition
        bound to :attr:`capture`."""
        attached: dict[str, Capture] = {}
        for m in for_kind(base.kind):
            if m.attach is None or m.name not in measures:
                continue
            with plugin_errors([(m, None)], "attaching its hooks"):
                hooks = m.attach_to(replace(base, settings=measures[m.name]))
                if hooks is None:  # computed by the task kind's own capture (a text task's lens)
                    continue
                attached[m.name] = hooks
                if isinstance(hooks, DecompositionCapture):
                    assert self.capture is not None  # declared for choice tasks only
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
            for capture in (self.capture, self.text, *self.measures.values()):
                if capture is not None:
                    capture.remove()

    def run(self, seqs: list[list[int]], ids: list[int] | None = None) -> Any:
        """One forward pass over ``seqs`` (left-padded) and its :data:`Batch`
        (``BatchDecomposition`` for a choice task, ``TextBatch`` for a text task; with
        ``--skips``, the future effects of documents ``ids`` when given)."""
        with plugin_errors(self.hooked, "its hooks"):
            return self._run(seqs, ids)

    def _run(self, seqs: list[list[int]], ids: list[int] | None) -> Any:
        device = self.loaded.device
        inputs = {k: v.to(device) for k, v in left_padded(seqs, self.pad_id).items()}
        inputs.update(self.extra)
        for hooks in self.measures.values():
            hooks.reset()
            if isinstance(hooks, RowsCapture):
                hooks.batch(ids, [len(s) for s in seqs])
        if self.text is not None:
            self.text.reset(inputs["input_ids"])
            with torch.inference_mode():
                return self._run_text(self.text, inputs, [len(s) for s in seqs], ids)
        if self.capture is not None:
            self.capture.reset()
        with torch.inference_mode():
            return self._run_choice(inputs)

    def _run_text(
        self,
        text: TextCapture,
        inputs: dict[str, Any],
        lengths: list[int],
        ids: list[int] | None,
    ) -> TextBatch:
        """A text task's pass: the per-token values, the measurements' and (documents ``ids``
        given) the future effects."""
        self.loaded.model(**inputs)
        batch = text.decompose(self.budget)
        batch.measured = self._measured()
        if self.future is not None and ids is not None:
            with text.pausing():
                batch.future = self.future.run(
                    text.states(),
                    text.block_args,
                    text.dtype,
                    lengths,
                    ids,
                    max(1, self.budget // inputs["input_ids"].shape[1]),
                )
        return batch

    def _run_choice(self, inputs: dict[str, Any]) -> BatchDecomposition:
        """A choice task's pass: the decomposition and the measurements' values, those of the
        hooks not bound to the decomposition taken before the bound ones run (a bound capture
        may run passes of its own, the skips', with the decomposition paused)."""
        capture = self.capture
        assert capture is not None  # a choice runner
        self.loaded.model(**inputs)
        dec = capture.decompose()
        bound = {n: h for n, h in self.measures.items() if isinstance(h, DecompositionCapture)}
        dec.measured = self._measured([n for n in self.measures if n not in bound])
        for hooks in bound.values():
            hooks.decomposed(dec)
        dec.measured.update(self._measured(list(bound)))
        return dec

    def _measured(self, names: Sequence[str] | None = None) -> dict[str, Sequence[Any]]:
        """The registered measurements' values (those of ``names``; None: all) of the forward
        pass just run."""
        return {n: self.measures[n].result() for n in (self.measures if names is None else names)}

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
) -> dict[str, pa.Table]:
    """The ``tokens``, ``token_blocks`` and ``documents`` tables (and ``token_lens`` where the run
    computed it) of documents ``ids``
    (ascending; ``seqs``, ``truncated`` and ``groups`` are indexed by document), each found in
    ``results`` as (its batch, its row there)."""
    n_tokens = [len(seqs[i]) for i in ids]
    dots = np.concatenate([results[i][0].document(results[i][1], len(seqs[i])) for i in ids])
    optional = future_tables(ids, results)
    if results[ids[0]][0].lens is not None:
        if any(results[i][0].lens is None for i in ids):
            raise DecompositionError("a document ran without the lens")
        v = np.concatenate([results[i][0].document_lens(results[i][1], len(seqs[i])) for i in ids])
        optional["token_lens"] = token_lens_table(ids, n_tokens, v)
    return {
        **optional,
        **measured_tables("text", ids, results),
        "tokens": tokens_table(
            ids,
            [seqs[i] for i in ids],
            np.concatenate([results[i][0].document_loss(results[i][1], len(seqs[i])) for i in ids]),
        ),
        "token_blocks": token_blocks_table(ids, n_tokens, dots),
        "documents": documents_table(
            ids, n_tokens, [truncated[i] for i in ids], [groups[i] for i in ids]
        ),
    }


def future_tables(ids: list[int], results: dict[int, tuple[TextBatch, int]]) -> dict[str, pa.Table]:
    """The future-effects tables (:mod:`layerdiv.measurements.future`) of documents ``ids``
    (ascending) where the run computed them."""
    if results[ids[0]][0].future is None:
        return {}
    values = []
    for i in ids:
        batch, row = results[i]
        if batch.future is None:
            raise DecompositionError("a document ran without the future effects")
        values.append(batch.future[row])
    return future_rows(ids, values)


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
