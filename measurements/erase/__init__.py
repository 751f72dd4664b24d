"""``--erase``: residual erasure on a text task that names an answer or on a choice task (methods
§14, ``erasure``): per document (instance), state h_l (l = 0..L) and position t, h_l at t alone is
replaced by the reference mean mu_l and the model runs on; the effect is the largest L2 change of
the whole next-token distribution over the positions that predict an answer token (a choice
task: the L2 change of the option-probability vector at the last prompt token). The reference
means (over positions 1..T-1 of the task's first R documents or prompts, ``--erase-reference R``;
``--erase-reference-positions all``: every position, the authors' mean, which takes in the
attention sink's first token; ``--erase-reference-task NAME``: another task's first R) are
computed once per partition, stored in ``erasure_reference`` beside the manifest and recorded in
the settings with their fingerprint (``erase_reference_sha256``), so that two shards, a resume or
a merge cannot mix two of them. The hooks are
:class:`layerdiv.measurements.erase.hooks.EraseCapture`, bound to the task kind's own capture."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import click
import numpy as np
import pyarrow as pa

from layerdiv.errors import LayerdivError
from layerdiv.measurements.registry import (
    Measurement,
    ModelShape,
    Planning,
    Setting,
    per_token_and_layer,
)
from layerdiv.schemas import DISTANCE, ERASURE, ERASURE_REFERENCE, Rules
from layerdiv.schemas.kinds import KINDS

FINGERPRINT = "erase_reference_sha256"
"""The setting derived from the reference means: the sha256 of their (L + 1, d) float32 bytes."""

POSITIONS = {"after-first": 1, "all": 0}
"""``--erase-reference-positions`` -> the first position t of each reference sequence that the
means take (methods §14: 1..T-1 by default, the attention sink's first token left out; ``all``:
0..T-1, the authors' mean)."""

RECORDED_BEFORE = "all"
"""The positions of a partition whose settings record none (extracted before the setting
existed: every position)."""

COST_ANSWER = 0.25
"""The share of a document's tokens the cost estimate takes as its answer (the estimate is made
from token counts alone; the extraction reads out at the answer's positions only)."""


class EraseError(LayerdivError, ValueError):
    """``--erase`` asked of a task it cannot measure."""


class ErasePlan(NamedTuple):
    """What ``--erase``'s check of a plan gives its hooks."""

    spans: list[tuple[int, int]] | None
    """Per document of a text task, its answer's start s and length A (methods §10); None for
    a choice task (its readout is the last prompt token)."""
    reference: list[list[int]] | None
    """``--erase-reference-task``: the token ids of that task's first R units (None: the
    task's own first R)."""


def reference_start(settings: Mapping[str, Any]) -> int:
    """The first position of each reference sequence its means take (:data:`POSITIONS`; a
    partition recording none: :data:`RECORDED_BEFORE`)."""
    return POSITIONS[settings.get("erase_reference_positions") or RECORDED_BEFORE]


def describe_reference(settings: Mapping[str, Any]) -> str:
    """The reference of ``settings`` in words (``positions 1..T-1 of the task's first 10``)."""
    start = reference_start(settings)
    other = settings.get("erase_reference_task")
    where = f"task {other}'s" if other else "the task's"
    return f"positions {start}..T-1 of {where} first {settings['erase_reference']}"


def plan_erase(plan: Planning) -> ErasePlan:
    """Refuse a text task without an answer and a reference of fewer than 1 or more documents
    (instances) than the run (the reference task) holds; per document of a text task, its
    answer's start s and length A (methods §10), and the reference task's token ids."""
    spec, count = plan.task, int(plan.settings["erase_reference"])
    spans = None
    if not KINDS[spec.kind].scored:
        why = "--erase measures the change of the answer's predictions (methods §14)"
        spans = plan.require_answers(why, "drop --erase")
    other = plan.settings.get("erase_reference_task")
    reference = None if not other else plan.other_task(other, count)
    held = len(plan.items) if reference is None else len(reference)
    if not 1 <= count <= held:
        units = KINDS[spec.kind].units
        which, more, hint = f"task {spec.name}", "this run takes", "or a larger --limit"
        if reference is not None:
            units, which, more = "units", f"the reference task {other}", "it holds"
            hint = "or a larger reference task"
        raise EraseError(
            f"{which}: --erase-reference {count} asks for the reference means of its first "
            f"{count} {units}, and {more} {held}; give a number from 1 to {held} ({hint})"
        )
    return ErasePlan(spans, reference)


def fingerprint(means: np.ndarray) -> str:
    """The sha256 (hex) of the reference means' (L + 1, d) float32 bytes."""
    return hashlib.sha256(np.ascontiguousarray(means, np.float32).tobytes()).hexdigest()


def reference_table(means: np.ndarray) -> pa.Table:
    """The ``erasure_reference`` rows of the (L + 1, d) reference means: one per layer."""
    values = np.asarray(means, np.float32)
    return pa.table(
        {
            "layer": pa.array(np.arange(len(values), dtype=np.int16)),
            "state": pa.array(list(values), pa.list_(pa.float32())),
        },
        schema=ERASURE_REFERENCE,
    )


def reference_means(table: pa.Table) -> np.ndarray:
    """The (L + 1, d) float32 reference means of an ``erasure_reference`` table."""
    order = np.argsort(table["layer"].to_numpy())
    return np.stack(table["state"].to_numpy(zero_copy_only=False))[order].astype(np.float32)


def reference_fingerprint(table: pa.Table) -> str:
    """The :func:`fingerprint` of an ``erasure_reference`` table's means."""
    return fingerprint(reference_means(table))


def erasure_rows(docs: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``erasure`` rows (doc, layer, pos) of documents (instances) ``docs`` from each one's
    (L + 1, T) effects (NaN, stored as null: a document without a measurable answer)."""
    counts = [np.size(v) for v in values]
    shapes = [np.shape(v) for v in values]
    return {
        "erasure": pa.table(
            {
                "doc": pa.array(np.repeat(np.asarray(docs, np.int32), counts)),
                "layer": pa.array(
                    np.concatenate([np.repeat(np.arange(a, dtype=np.int16), t) for a, t in shapes])
                ),
                "pos": pa.array(
                    np.concatenate([np.tile(np.arange(t, dtype=np.int32), a) for a, t in shapes])
                ),
                "effect": pa.array(
                    np.concatenate([np.asarray(v, np.float32).reshape(-1) for v in values]),
                    from_pandas=True,
                ),
            },
            schema=ERASURE,
        )
    }


def erasure_row_counts(
    rows: Mapping[str, int], blocks: int, settings: Mapping[str, Any]
) -> tuple[str, str] | None:
    """A text chunk's ``erasure`` holds a row per token and state 0..L
    (:func:`~layerdiv.measurements.registry.per_token_and_layer`); a choice chunk's, whose prompt
    tokens the chunk does not count, whole rows per state: a positive multiple of L + 1, at
    least L + 1 per instance."""
    text = per_token_and_layer("erasure")(rows, blocks, settings)
    found, count = rows.get("erasure"), rows.get("instances")
    if text is not None or found is None or count is None:
        return text
    if found % (blocks + 1) or found < count * (blocks + 1):
        return "erasure", (
            f"{found} rows are not whole rows for each state 0..{blocks} of the chunk's {count} "
            "instances"
        )
    return None


def erase_flops(shape: ModelShape, tokens: int, first: int, last: int) -> float:
    """FLOPs of the prefix-reusing passes of a sequence of T = ``tokens`` tokens read out at the
    positions ``first``..``last`` (a text task: the answer-predicting positions s - 1..T - 2; a
    choice task: the last prompt token T - 1): per state l and position t <= ``last``, blocks
    l..L-1 at the queries t..T-1 (keys and values of the positions before t read from the clean
    pass) and the readout at the positions max(``first``, t)..``last`` (for h_L, at t alone),
    each over the whole vocabulary; and one clean pass of the blocks that keeps those keys and
    values."""
    L, T = shape.layers, tokens
    t = np.arange(max(last + 1, 0))  # t = 0..last
    # blocks over the queries t..T-1 with keys 0..T-1: a block over T tokens less its first t
    blocks = shape.block(T) - np.array([shape.block(int(u)) for u in t])
    read = np.maximum(last + 1 - np.maximum(first, t), 0)  # positions max(first, t)..last
    states = L * (L + 1) / 2  # blocks l..L-1 for each state l = 0..L
    final = int((t >= first).sum())  # h_L reaches z_t alone: t itself, t = first..last
    return float(
        states * blocks.sum() + shape.readout(L * int(read.sum()) + final) + L * shape.block(T)
    )


def erase_cost(shape: ModelShape, kind: str, tokens: int, settings: Mapping[str, Any]) -> float:
    """FLOPs of residual erasure on a sequence of ``tokens`` tokens (:func:`erase_flops`): a text
    document's answer taken as the last :data:`COST_ANSWER` of them; a choice prompt read out at
    its last token."""
    if KINDS[kind].scored:
        return erase_flops(shape, tokens, tokens - 1, tokens - 1)
    start = tokens - max(1, round(COST_ANSWER * tokens))
    return erase_flops(shape, tokens, max(start - 1, 0), tokens - 2)


ERASE = Measurement(
    name="erase",
    flag="--erase",
    help="Text tasks with an answer, choice tasks: also store the residual erasure map "
    "(methods §14): per state h_l and position, the largest change of the next-token "
    "distribution at the answer's positions (a choice task: of the option probabilities at "
    "the last prompt token) when h_l there is replaced by its reference mean.",
    tables={"text": ("erasure",), "choice": ("erasure",)},
    settings=(
        Setting(
            "erase_reference",
            click.Option(
                ["--erase-reference"],
                type=int,
                default=None,
                help="With --erase: the reference means are taken over the task's first R "
                "documents or prompts (default 10).",
            ),
            10,
        ),
        Setting(
            "erase_reference_positions",
            click.Option(
                ["--erase-reference-positions"],
                type=click.Choice(list(POSITIONS)),
                default=None,
                help="With --erase: the reference means over positions 1..T-1 of each "
                "reference sequence (after-first, the default: the attention sink's first "
                "token left out) or over every position (all: the authors' mean).",
            ),
            "after-first",
        ),
        Setting(
            "erase_reference_task",
            click.Option(
                ["--erase-reference-task"],
                type=str,
                default=None,
                help="With --erase: take the reference means from this task's first R "
                "documents or prompts (a built-in name or a YAML path) rather than the "
                "task's own.",
            ),
            None,
        ),
    ),
    vocab_rows=("text",),
    attach=f"{__name__}.hooks:EraseCapture",
    rows=erasure_rows,
    check_rows=erasure_row_counts,
    flops=erase_cost,
    attribution=True,
    plan_check=plan_erase,
    whole=("erasure_reference",),
    fingerprints={"erasure_reference": (FINGERPRINT, reference_fingerprint)},
    rules={
        "erasure": Rules(grid=(("layer", "states"), ("pos", "tokens")), bounds={"effect": DISTANCE})
    },
    since={"erasure": 7, "erasure_reference": 7},
    order=80,
)
