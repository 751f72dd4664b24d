"""``--skips`` on a text task: the future effects of removing each block's update at the
positions before a split point (methods §9; ``future_effects`` and ``future_output``),
with the settings ``--skip-split``, ``--skip-sublayer``, ``--skip-mode`` and ``--skip-seed``
(recorded in the manifest, compared on a rerun). Its check of the plan (:func:`plan_future`)
refuses settings a task cannot follow and finds each document's answer for the answer-anchored
split points; its hooks are :class:`layerdiv.measurements.future.hooks.FutureCapture`, bound to the
text task's per-token capture."""

from collections.abc import Mapping, Sequence
from typing import Any

import click
import numpy as np
import pyarrow as pa
from numpy.typing import ArrayLike

from layerdiv.errors import LayerdivError
from layerdiv.measurements.registry import Measurement, ModelShape, Planning, Setting
from layerdiv.schemas import (
    DISTANCE,
    FUTURE_EFFECTS,
    FUTURE_OUTPUT,
    MODES,
    NONNEGATIVE,
    SUBLAYERS,
    Rules,
)

SPLIT_STEP = 8
"""Random split points are multiples of this."""
SPLIT_MARGIN = 4
"""A random split point t is below T - SPLIT_MARGIN."""
SPLITS = 4
"""Random split points drawn per document."""
ANSWER_MARGIN = 4
"""``answer:N:S`` draws offsets below A - ANSWER_MARGIN of an answer of A tokens (methods §10)."""


class SplitError(LayerdivError, ValueError):
    """A ``--skip-split`` value that names no split rule, or one the task cannot follow."""


def parse_split(value: str) -> tuple[int, int] | None:
    """The (N, S) of an answer-anchored split rule (methods §10; ``answer``: (1, 0)), None for
    ``random`` and ``all``; :class:`SplitError` naming the accepted forms for anything else."""
    if value in ("random", "all"):
        return None
    if value == "answer":
        return (1, 0)
    parts = value.split(":")
    if (
        len(parts) == 3
        and parts[0] == "answer"
        and all(p.isdigit() and int(p) > 0 for p in parts[1:])
    ):
        return (int(parts[1]), int(parts[2]))
    raise SplitError(
        f"--skip-split {value!r}: use random, all, answer, or answer:N:S with N split points "
        "and a step S, both positive integers (e.g. answer:4:4)"
    )


class SplitRule(click.ParamType):
    """``--skip-split``: ``random``, ``all``, ``answer`` or ``answer:N:S`` (:func:`parse_split`)."""

    name = "random|all|answer|answer:N:S"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            parse_split(str(value))
        except SplitError as err:
            self.fail(str(err), param, ctx)
        return str(value)


def _skip_key(
    doc: ArrayLike, split: ArrayLike, sublayer: Sequence[str], skipped: ArrayLike, each: int
) -> dict[str, pa.Array]:
    """The key columns of the future-effects tables, each row repeated ``each`` times."""
    codes = np.array([SUBLAYERS.index(s) for s in sublayer], np.int8)
    return {
        "doc": pa.array(np.repeat(np.asarray(doc, np.int32), each)),
        "split": pa.array(np.repeat(np.asarray(split, np.int32), each)),
        "sublayer": pa.DictionaryArray.from_arrays(
            pa.array(np.repeat(codes, each)), pa.array(SUBLAYERS, pa.string())
        ),
        "skipped": pa.array(np.repeat(np.asarray(skipped, np.int16), each)),
    }


def future_tables(
    doc: ArrayLike,
    split: ArrayLike,
    sublayer: Sequence[str],
    skipped: ArrayLike,
    rel_change: np.ndarray,
    out_change: np.ndarray,
    mode: Sequence[str] | None = None,
) -> dict[str, pa.Table]:
    """The rows of :data:`~layerdiv.schemas.FUTURE_EFFECTS` (doc, split, sublayer, skipped,
    mode, block) and :data:`~layerdiv.schemas.FUTURE_OUTPUT` (doc, split, sublayer, skipped) of
    R skips given by the key arrays: ``rel_change`` is (R, L), every block j; ``out_change`` (R,),
    read for the ``total`` rows only (``mode``, default all ``total``: a ``local`` run has no
    output change, methods §10)."""
    rows, blocks = np.shape(rel_change)
    modes = np.array(
        [MODES.index(m) for m in mode] if mode is not None else np.zeros(rows), np.int8
    )
    effects = {
        **_skip_key(doc, split, sublayer, skipped, blocks),
        "mode": pa.DictionaryArray.from_arrays(
            pa.array(np.repeat(modes, blocks)), pa.array(MODES, pa.string())
        ),
        "block": pa.array(np.tile(np.arange(blocks, dtype=np.int16), rows)),
        "rel_change": pa.array(np.asarray(rel_change, np.float32).reshape(-1)),
    }
    total = modes == MODES.index("total")
    output = {
        **_skip_key(
            np.broadcast_to(doc, rows)[total],
            np.broadcast_to(split, rows)[total],
            [s for s, keep in zip(sublayer, total, strict=True) if keep],
            np.broadcast_to(skipped, rows)[total],
            1,
        ),
        "out_change": pa.array(np.asarray(out_change, np.float32).reshape(-1)[total]),
    }
    return {
        "future_effects": pa.table(effects, schema=FUTURE_EFFECTS),
        "future_output": pa.table(output, schema=FUTURE_OUTPUT),
    }


def future_row_counts(
    rows: Mapping[str, int], blocks: int, settings: Mapping[str, Any]
) -> tuple[str, str] | None:
    """``future_effects`` holds a row per block and mode (total, local) of each (total)
    ``future_output`` row of the chunk."""
    effects, output = rows.get("future_effects"), rows.get("future_output")
    modes = len(settings.get("skip_modes") or ["total"])
    if effects is None or output is None or effects == output * blocks * modes:
        return None
    return "future_effects", (
        f"{effects} rows where the chunk's {output} future_output rows need "
        f"{output * blocks * modes} (one per block and mode)"
    )


def future_rows(docs: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The tables of documents ``docs`` from each one's future effects
    (``layerdiv.measurements.future.hooks.FutureRows``: split, sublayer, skipped, mode, rel_change,
    out_change)."""
    doc = np.concatenate([np.full(len(f.split), i) for i, f in zip(docs, values, strict=True)])
    blocks = values[0].rel_change.shape[1]
    return future_tables(
        doc,
        np.concatenate([f.split for f in values]),
        [s for f in values for s in f.sublayer],
        np.concatenate([f.skipped for f in values]),
        np.concatenate([f.rel_change.reshape(-1, blocks) for f in values]),
        np.concatenate([f.out_change for f in values]),
        [m for f in values for m in f.mode],
    )


def plan_future(plan: Planning) -> list[tuple[int, int]] | None:
    """The future effects' check of a text task's plan: refuses local effects without the
    total ones or of a sublayer (methods §10 defines them for whole blocks) and random split
    points where ``max_tokens`` leaves none; with an answer-anchored rule, per document its
    answer's start s and length A (:func:`answers`; None for the other rules)."""
    spec, settings = plan.task, plan.settings
    modes = tuple(settings.get("skip_modes") or ["total"])  # absent: recorded before local
    if "total" not in modes:
        raise SplitError(
            "--skip-mode local adds the local effects beside the total ones (their output "
            "change and row counts); give --skip-mode total --skip-mode local"
        )
    if "local" in modes and tuple(settings["skip_sublayers"]) != ("block",):
        raise SplitError(
            "--skip-mode local removes the whole block's update (methods §10), not a "
            "sublayer's; drop --skip-sublayer attn/mlp or --skip-mode local"
        )
    short = spec.max_tokens is not None and spec.max_tokens <= SPLIT_STEP + SPLIT_MARGIN
    if settings["skip_split"] == "random" and short:
        raise SplitError(
            f"task {spec.name}: --skips needs split points 8, 16, ... < T - 4, and max_tokens "
            f"{spec.max_tokens} leaves none; raise max_tokens above 12, use --skip-split all, "
            "or drop --skips"
        )
    return None if parse_split(settings["skip_split"]) is None else answers(plan)


def answers(plan: Planning) -> list[tuple[int, int]]:
    """Per document, its answer's start s = T - A and length A (``Planning.require_answers``); with
    ``answer:N:S``, refuses an answer of fewer than ``ANSWER_MARGIN + 1`` tokens (no offset below
    A - 4)."""
    split = plan.settings["skip_split"]
    spans = plan.require_answers(
        f"--skip-split {split} anchors the split points at the answer", "--skip-split random"
    )
    for doc, (_, length) in enumerate(spans):
        if split != "answer" and length <= ANSWER_MARGIN:
            raise SplitError(
                f"task {plan.task.name}: document {doc}'s answer is {length} tokens, and "
                f"--skip-split {split} draws offsets below A - {ANSWER_MARGIN}, so it needs "
                f"answers of at least {ANSWER_MARGIN + 1}; use --skip-split answer, or filter "
                "short answers out"
            )
    return spans


def random_splits(tokens: int) -> list[int]:
    """The candidate random split points of a document (8, 16, ... < T - 4, methods §9)."""
    return list(range(SPLIT_STEP, tokens - SPLIT_MARGIN, SPLIT_STEP))


def future_cost(shape: ModelShape, kind: str, tokens: int, settings: Mapping[str, Any]) -> float:
    """FLOPs of the future effects of a document: the clean readout of every token, and per
    random split point t (drawn at random: its mean), blocks l..L-1 per removed block l and
    their readouts after t."""
    L, cut = shape.layers, random_splits(tokens)
    k, after = min(SPLITS, len(cut)), tokens - sum(cut) / max(len(cut), 1)
    per_split = L * (L + 1) / 2 * shape.block(tokens) + L * shape.readout() * after
    return shape.readout(tokens) + k * per_split


FUTURE = Measurement(
    name="future_effects",
    flag="--skips",  # declared by layerdiv.measurements.skips
    tables={"text": ("future_effects", "future_output")},
    settings=(
        Setting(
            "skip_split",
            click.Option(
                ["--skip-split"],
                type=SplitRule(),
                default=None,
                help="Text tasks with --skips: 4 seeded split points per document (random, "
                "the default), every position but the first (all), the answer's first token "
                "(answer) or N seeded points among the answer's offsets 0, S, 2S, ... < A - 4 "
                "(answer:N:S); the answer rules need a task with an 'answer' template.",
            ),
            "random",
        ),
        Setting(
            "skip_sublayers",
            click.Option(
                ["--skip-sublayer", "skip_sublayers"],
                type=click.Choice(list(SUBLAYERS)),
                multiple=True,
                help="Text tasks with --skips: remove the whole block (default), or only its "
                "attention or MLP addition; repeat for several.",
            ),
            ("block",),
        ),
        Setting(
            "skip_modes",
            click.Option(
                ["--skip-mode", "skip_modes"],
                type=click.Choice(list(MODES)),
                multiple=True,
                help="Text tasks with --skips: the total future effects (default), or the "
                "local ones (every later block reads the clean stream minus the removed "
                "update: the direct effect, methods §10); repeat for both.",
            ),
            ("total",),
        ),
        Setting(
            "skip_seed",
            click.Option(
                ["--skip-seed"],
                type=click.IntRange(min=0),
                default=None,
                help="Text tasks with --skips: seed of the random split points (default 0).",
            ),
            0,
        ),
    ),
    legacy=True,
    vocab_rows=("text",),
    attach=f"{__name__}.hooks:FutureCapture",
    rows=future_rows,
    check_rows=future_row_counts,
    flops=future_cost,
    plan_check=plan_future,
    rules={
        "future_effects": Rules(
            bounds={"skipped": (0, "L-1"), "block": (0, "L-1"), "rel_change": NONNEGATIVE}
        ),
        "future_output": Rules(bounds={"skipped": (0, "L-1"), "out_change": DISTANCE}),
    },
    since={"future_effects": 4, "future_output": 4},
    order=50,
)
