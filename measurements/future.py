"""``--skips`` on a text task: the future effects of removing each block's update at the
positions before a split point (methods §9; ``future_effects`` and ``future_output``),
with the settings ``--skip-split``, ``--skip-sublayer`` and ``--skip-seed`` (recorded in the
manifest, compared on a rerun)."""

from collections.abc import Sequence
from typing import Any

import click
import numpy as np
import pyarrow as pa
from numpy.typing import ArrayLike

from layerdiv.measurements.registry import Measurement, Setting, register
from layerdiv.schemas import FUTURE_EFFECTS, FUTURE_OUTPUT, SUBLAYERS


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
) -> dict[str, pa.Table]:
    """The rows of :data:`~layerdiv.schemas.FUTURE_EFFECTS` (doc, split, sublayer, skipped,
    block) and :data:`~layerdiv.schemas.FUTURE_OUTPUT` (doc, split, sublayer, skipped) of R
    skips given by the key arrays: ``rel_change`` is (R, L), every block j; ``out_change`` (R,)."""
    rows, blocks = np.shape(rel_change)
    effects = {
        **_skip_key(doc, split, sublayer, skipped, blocks),
        "block": pa.array(np.tile(np.arange(blocks, dtype=np.int16), rows)),
        "rel_change": pa.array(np.asarray(rel_change, np.float32).reshape(-1)),
    }
    output = {
        **_skip_key(doc, split, sublayer, skipped, 1),
        "out_change": pa.array(np.asarray(out_change, np.float32).reshape(-1)),
    }
    return {
        "future_effects": pa.table(effects, schema=FUTURE_EFFECTS),
        "future_output": pa.table(output, schema=FUTURE_OUTPUT),
    }


def future_rows(docs: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The tables of documents ``docs`` from each one's future effects
    (``layerdiv.extract.future.FutureRows``: split, sublayer, skipped, rel_change, out_change)."""
    doc = np.concatenate([np.full(len(f.split), i) for i, f in zip(docs, values, strict=True)])
    blocks = values[0].rel_change.shape[1]
    return future_tables(
        doc,
        np.concatenate([f.split for f in values]),
        [s for f in values for s in f.sublayer],
        np.concatenate([f.skipped for f in values]),
        np.concatenate([f.rel_change.reshape(-1, blocks) for f in values]),
        np.concatenate([f.out_change for f in values]),
    )


FUTURE = register(
    Measurement(
        name="future_effects",
        flag="--skips",  # declared by layerdiv.measurements.skips
        tables={"text": ("future_effects", "future_output")},
        settings=(
            Setting(
                "skip_split",
                click.Option(
                    ["--skip-split"],
                    type=click.Choice(["random", "all"]),
                    default=None,
                    help="Text tasks with --skips: 4 seeded split points per document (random, "
                    "the default) or every position but the first (all).",
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
        readout=("text",),
        rows=future_rows,
    )
)
