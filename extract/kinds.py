"""The extraction's side of each task kind (:mod:`layerdiv.schemas.kinds` declares what its
partitions store): how its units are tokenized and planned, its own capture, the check of each
batch, the tables of a run of units (its core tables and the measurements'), what a chunk counts
and the summary line of a run. The runner, the planner and the model runner ask the kind
(:func:`task_kind`) rather than compare its name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from layerdiv.extract.adapters import Adapter
from layerdiv.extract.batching import tokenize, tokenize_documents
from layerdiv.extract.capture import (
    BatchDecomposition,
    ComponentCapture,
    DecompositionError,
    check_batch,
)
from layerdiv.extract.readout import Readout
from layerdiv.extract.tasks import Instance, TaskError, TaskSpec, option_token_ids
from layerdiv.extract.text import TextBatch, TextCapture, check_text_batch
from layerdiv.measurements import answer_spans, for_kind
from layerdiv.measurements.registry import MeasurementError, plugin_errors
from layerdiv.schemas.kinds import CHOICE, TEXT, Kind
from layerdiv.store.tables import (
    components_table,
    documents_table,
    instances_table,
    token_blocks_table,
    tokens_table,
)

if TYPE_CHECKING:
    from layerdiv.extract.config import TaskSummary
    from layerdiv.extract.plan import TaskPlan

Results = dict[int, tuple[Any, int]]
"""Instance (document) -> (its batch's result, ``layerdiv.extract.forward.Batch``, and its row
there)."""


@dataclass(frozen=True)
class BatchWork:
    """What the task kind does in the chunk loop: how a batch is checked, which tables a run
    of units yields, and what it counts (correct predictions, worst error)."""

    check: Callable[[Any, list[int]], None]
    tables: Callable[[list[int], Results], dict[str, pa.Table]]
    tally: Callable[[Results], tuple[int, float]]
    optional: Callable[[list[int], Results], dict[str, pa.Table]]
    """The optional tables of a run (a backfill writes those a stored chunk lacks)."""


class TaskKind(ABC):
    """One task kind's extraction: :attr:`decl` is its declaration."""

    decl: Kind

    @abstractmethod
    def sequences(
        self, tokenizer: Any, texts: list[str], spec: TaskSpec, context: int
    ) -> tuple[list[list[int]], list[bool]]:
        """The token ids of the units ``texts`` of task ``spec`` as its extraction takes them,
        and whether each was cut (``context``: the model's context length)."""

    @abstractmethod
    def prepare(
        self, spec: TaskSpec, items: list[Instance], tokenizer: Any, context: int
    ) -> dict[str, Any]:
        """What the plan of task ``spec`` holds of this kind before the weights load (fields of
        ``layerdiv.extract.plan.TaskPlan`` by name), refusing bad input."""

    @abstractmethod
    def capture(
        self, model: Any, adapter: Adapter, readout: Readout, option_ids: list[int]
    ) -> ComponentCapture | TextCapture:
        """The kind's own capture, attached to ``model``."""

    @abstractmethod
    def work(
        self, plan: TaskPlan, seqs: list[list[int]], truncated: list[bool], tol: float, spell: Any
    ) -> BatchWork:
        """The chunk loop's work for ``plan``'s units ``seqs`` (``spell``: token ids -> the
        tokens as the vocabulary spells them)."""

    @abstractmethod
    def summary(self, s: TaskSummary) -> str:
        """What a run that stored new units did, for its summary line."""

    def accuracy(self, correct: int, n_new: int) -> float | None:
        """The fraction of the ``n_new`` units computed that the model got right (None: the
        kind scores none)."""
        return correct / n_new if n_new and self.decl.scored else None

    def measurement_tables(self, ids: list[int], results: Results) -> dict[str, pa.Table]:
        """The tables of the registered measurements (``layerdiv.measurements``) that the run of
        units ``ids`` (ascending) measured."""
        name, first = self.decl.name, results[ids[0]][0].measured
        tables = {}
        for m in for_kind(name):
            if m.name not in first or m.rows is None:
                continue
            if any(m.name not in results[i][0].measured for i in ids):
                raise DecompositionError(f"a row ran without the measurement {m.name}")
            values = [results[i][0].measured[m.name][results[i][1]] for i in ids]
            with plugin_errors([(m, None)], "its rows"):
                made = m.rows(ids, values)
            if sorted(made) != sorted(m.tables[name]):
                raise MeasurementError(
                    f"measurement {m.name} ({m.flag}): its rows give the tables {sorted(made)}, "
                    f"it declares {sorted(m.tables[name])} for {name} tasks; nothing of this "
                    "chunk was written"
                )
            tables.update(made)
        return tables


class ChoiceKind(TaskKind):
    """Prompts whose options are scored at the last prompt token (methods §1)."""

    decl = CHOICE

    def sequences(
        self, tokenizer: Any, texts: list[str], spec: TaskSpec, context: int
    ) -> tuple[list[list[int]], list[bool]]:
        """Prompts longer than the context keep their last tokens (``batching.tokenize``)."""
        return tokenize(tokenizer, texts, context)

    def prepare(
        self, spec: TaskSpec, items: list[Instance], tokenizer: Any, context: int
    ) -> dict[str, Any]:
        """The options' token ids (``tasks.option_token_ids``)."""
        return {"option_ids": option_token_ids(spec, tokenizer, items[0].prompt)}

    def capture(
        self, model: Any, adapter: Adapter, readout: Readout, option_ids: list[int]
    ) -> ComponentCapture:
        """The last-token decomposition over the options (methods §1)."""
        return ComponentCapture(model, adapter, readout, option_ids)

    def work(
        self, plan: TaskPlan, seqs: list[list[int]], truncated: list[bool], tol: float, spell: Any
    ) -> BatchWork:
        """Decompositions checked to ``tol``; the correct predictions and worst error counted."""
        gold, prompts = [it.gold for it in plan.items], [it.prompt for it in plan.items]

        def tally(results: Results) -> tuple[int, float]:
            correct = sum(
                int(d.model_logits[r].argmax()) == gold[i] for i, (d, r) in results.items()
            )
            worst = max((float(d.sum_error[r]) for d, r in results.values()), default=0.0)
            return correct, worst

        return BatchWork(
            partial(check_batch, task=plan.spec.name, tol=tol),
            lambda r, res: self.tables(r, res, gold, seqs, truncated, prompts, spell),
            tally,
            self.measurement_tables,
        )

    def tables(
        self,
        ids: list[int],
        results: dict[int, tuple[BatchDecomposition, int]],
        gold: list[int],
        seqs: list[list[int]],
        truncated: list[bool],
        prompts: list[str],
        spell: Callable[[list[int]], list[str]] | None = None,
    ) -> dict[str, pa.Table]:
        """The ``components`` and ``instances`` tables of instances ``ids`` (ascending;
        ``gold``, ``seqs``, ``truncated`` and ``prompts`` are indexed by instance; ``spell``:
        token ids -> the tokens as the vocabulary spells them), each found in ``results`` as
        (its batch's decomposition, its row there), and the tables of the measurements the
        decompositions hold (:meth:`measured`)."""

        def stack(attr: str) -> np.ndarray:
            return np.stack([getattr(results[i][0], attr)[results[i][1]].numpy() for i in ids])

        return {
            **self.measurement_tables(ids, results),
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
                None if spell is None else [spell(seqs[i]) for i in ids],
            ),
        }

    def summary(self, s: TaskSummary) -> str:
        """Time, accuracy, the worst decomposition error and the prompts truncated."""
        acc = "" if s.accuracy_new is None else f", accuracy {100 * s.accuracy_new:.1f}%"
        cut = f"; {s.n_truncated} prompts left-truncated to the context" if s.n_truncated else ""
        return (
            f"{s.n_new} new in {s.seconds:.1f} s{acc}; max decomposition error "
            f"{s.max_sum_error:.1e}{cut}"
        )


class TextKind(TaskKind):
    """Running text read at every token (methods §9)."""

    decl = TEXT

    def sequences(
        self, tokenizer: Any, texts: list[str], spec: TaskSpec, context: int
    ) -> tuple[list[list[int]], list[bool]]:
        """Documents cut to the task's ``max_tokens`` and the context
        (``batching.tokenize_documents``)."""
        return tokenize_documents(tokenizer, texts, min(spec.max_tokens or context, context))

    def prepare(
        self, spec: TaskSpec, items: list[Instance], tokenizer: Any, context: int
    ) -> dict[str, Any]:
        """The documents' tokens (a document without any refused) and, for a task with an
        answer, each document's answer span (methods §10)."""
        documents = self.sequences(tokenizer, [it.prompt for it in items], spec, context)
        empty = [i for i, seq in enumerate(documents[0]) if not seq]
        if empty:
            raise TaskError(
                f"task {spec.name}: document {empty[0]} tokenizes to no tokens (empty text); "
                "fix the data or the task's text template, or filter such rows out"
            )
        spans = None if spec.answer is None else answer_spans(tokenizer, items)
        return {"option_ids": [], "documents": documents, "answers": spans}

    def capture(
        self, model: Any, adapter: Adapter, readout: Readout, option_ids: list[int]
    ) -> TextCapture:
        """The per-token dot products and the model's own loss (methods §9)."""
        return TextCapture(model, adapter, readout)

    def work(
        self, plan: TaskPlan, seqs: list[list[int]], truncated: list[bool], tol: float, spell: Any
    ) -> BatchWork:
        """Batches checked for their tokens' values; nothing counted."""
        groups = [it.group for it in plan.items]
        starts = None if plan.answers is None else [a.start for a in plan.answers]
        name = plan.spec.name
        tables = partial(
            self.tables, seqs=seqs, truncated=truncated, groups=groups, answer_starts=starts,
            spell=spell,
        )  # fmt: skip
        return BatchWork(
            lambda b, ids: check_text_batch(b, ids, [len(seqs[i]) for i in ids], name),
            tables,
            lambda res: (0, 0.0),
            tables,
        )

    def tables(
        self,
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
        vocabulary spells them), each found in ``results`` as (its batch, its row there), and the
        tables of the measurements the batches hold (:meth:`measured`)."""
        n_tokens = [len(seqs[i]) for i in ids]
        dots = np.concatenate([results[i][0].document(results[i][1], len(seqs[i])) for i in ids])
        loss = [results[i][0].document_loss(results[i][1], len(seqs[i])) for i in ids]
        return {
            **self.measurement_tables(ids, results),
            "tokens": tokens_table(
                ids,
                [seqs[i] for i in ids],
                np.concatenate(loss),
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

    def summary(self, s: TaskSummary) -> str:
        """Time and the documents cut to ``max_tokens``."""
        cut = f"; {s.n_truncated} cut to max_tokens" if s.n_truncated else ""
        return f"{s.n_new} new in {s.seconds:.1f} s{cut}"


TASK_KINDS: dict[str, TaskKind] = {k.decl.name: k for k in (ChoiceKind(), TextKind())}
"""The extraction's side of every task kind (``layerdiv.schemas.kinds.KINDS``) by name."""


def task_kind(name: str) -> TaskKind:
    """The extraction's side of the task kind ``name``."""
    return TASK_KINDS[name]
