"""Benchmark of the depth scores per document group (``text_groups``, methods §10; a script, not
a test).

Synthesises the skip rows of ``--docs`` documents in each of ``--groups`` groups (group values
1..groups), ``--splits`` split points each, ``--blocks`` blocks (whole-block skips), as
``future_effects`` / ``future_output`` hold them, and times in this process: the per-document
maxima over split points (Polars, as the analysis reads a partition), then the scores of both
aggregations with their bootstrap intervals and the slopes (numpy, ``--resamples`` resamples).
Prints wall and CPU seconds of each stage.

    python benchmarks/bench_text_groups.py [--quick] [--docs 500] [--groups 5] [--blocks 30]
        [--splits 4] [--resamples 1000]

``--quick``: 100 documents per group and 12 blocks. The figures are written to
``docs/benchmarks/bench_text_groups.json`` (rendered into docs/benchmarks.md). Target: the whole
in under 10 s.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import polars as pl
from common import add_quick, record

from layerdiv.measurements.future import text_groups

T = TypeVar("T")


def synthetic(docs: int, blocks: int, splits: int, groups: int) -> tuple[pl.DataFrame, ...]:
    """future_effects rows, future_output rows and documents (doc, group) of ``docs``
    documents."""
    rng = np.random.default_rng(0)
    doc, split, skipped, block = (
        a.ravel()
        for a in np.meshgrid(
            np.arange(docs), np.arange(splits), np.arange(blocks), np.arange(blocks), indexing="ij"
        )
    )
    effects = pl.DataFrame(
        {
            "doc": doc.astype(np.int32),
            "split": split.astype(np.int32),
            "sublayer": "block",
            "skipped": skipped.astype(np.int16),
            "block": block.astype(np.int16),
            "rel_change": (rng.random(doc.size) * (block > skipped)).astype(np.float32),
        }
    )
    output = (
        effects.filter(pl.col("block") == 0)
        .drop("block", "rel_change")
        .with_columns(pl.Series("out_change", rng.random(docs * splits * blocks), pl.Float32))
    )
    documents = pl.DataFrame(
        {
            "doc": np.arange(docs, dtype=np.int32),
            "group": (np.arange(docs) % groups + 1).astype(str),
        }
    )
    return effects, output, documents


STAGES: list[list[object]] = []
"""(stage, wall seconds, CPU seconds) of each :func:`timed` call, in order."""


def timed(label: str, fn: Callable[[], T]) -> T:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{label:<44} wall {wall:7.2f} s   cpu {cpu:7.2f} s")
    STAGES.append([label.strip(), wall, cpu])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_quick(parser)
    parser.add_argument("--docs", type=int, default=500, help="documents per group")
    parser.add_argument("--groups", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--splits", type=int, default=4)
    parser.add_argument("--resamples", type=int, default=text_groups.RESAMPLES)
    args = parser.parse_args()
    if args.quick:
        args.docs, args.blocks = 100, 12
    text_groups.RESAMPLES = args.resamples
    n = args.docs * args.groups
    effects, output, documents = synthetic(n, args.blocks, args.splits, args.groups)
    print(
        f"{args.docs} documents x {args.groups} groups, {args.blocks} blocks, {args.splits} "
        f"split points ({effects.height:,} future_effects rows), {args.resamples} resamples"
    )
    start, start_cpu, loads = time.perf_counter(), time.process_time(), [os.getloadavg()[0]]
    rel = timed(
        "maxima over split points (Polars)",
        lambda: text_groups.maxima([effects], text_groups.EFFECT_KEYS, "rel_change"),
    )
    out = timed(
        "  of out_change",
        lambda: text_groups.maxima([output], text_groups.OUTPUT_KEYS, "out_change"),
    )
    scores, slopes = timed(
        "scores, bootstrap intervals, slopes (numpy)",
        lambda: text_groups.frame_tables(rel, out, documents, args.blocks),
    )
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    print(f"{'total':<44} wall {wall:7.2f} s   cpu {cpu:7.2f} s   (target: under 10 s)")
    loads.append(os.getloadavg()[0])
    print(scores.select("group", "effect", "n_scored", "paper_score", "mean_low", "mean_high"))
    print(slopes)
    record(
        "bench_text_groups",
        ["stage", "wall s", "CPU s"],
        [*STAGES, ["total (target: under 10 s)", wall, cpu]],
        loads,
        formats=["", ".2f", ".2f"],
        documents=n,
        groups=args.groups,
        blocks=args.blocks,
        splits=args.splits,
        resamples=args.resamples,
    )


if __name__ == "__main__":
    main()
