"""CPU benchmark of ``extract --igrad``: ``ModelRunner.run`` of a text task with the integrated
gradients against a plain forward pass over the same documents and batches
(SmolLM2-135M-Instruct, fp32, BBC News; each article's second half taken as its answer).

    python benchmarks/bench_igrad.py [--docs 2] [--max-tokens 64] [--batch-size 2]
                                     [--steps 8] [--repeats 2] [--threads 1] [--quick]

Documents and batches as ``benchmarks/bench_text_extract.py`` forms them. Rows: ``plain``
(``model(**inputs)`` as ``ModelRunner`` runs it), ``text`` (``ModelRunner.run`` of a text task
without options) and ``igrad`` (with ``--igrad --igrad-steps M``, site ``block``).
FLOPs (:func:`igrad_flops`), over every padded token: the text row's, plus the gradient pass (one
more forward), plus per block l, M + 1 path points per document, each a forward and a backward
pass (input gradients: 2 x the weights per token again, and twice the attention's forward for
its three products) through blocks l+1..L-1 over the batch's width, and the readout of the
answer-predicting positions forward and backward (4 d V per position).
Target: the ``igrad`` row's CPU-time ratio to ``plain`` at most 1.15 x its FLOP ratio; the table
and verdict as ``bench_text_extract.py``'s.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from typing import Any

import torch
from bench_text_extract import (
    COLUMNS,
    FORMATS,
    Batches,
    Row,
    answers,
    documents,
    flop_counts,
    load,
    measured,
    plain_forward,
    repeated,
    report,
)
from common import add_quick, record

from layerdiv.demo import DEMO_MODEL
from layerdiv.extract.models import LoadedModel
from layerdiv.measurements.igrad import IGRAD_MEASUREMENT


def igrad_flops(config: Any, data: Batches, flops: dict[str, float], steps: int) -> float:
    """FLOPs ``--igrad`` (site ``block``, ``steps`` steps) adds to the text row over ``data``
    (see the module docstring)."""
    layers, per_position = int(flops["layers"]), 2 * config.hidden_size * config.vocab_size
    total, spans, doc = flops["forward"], answers(data), 0
    for batch in data:
        width = max(len(s) for s in batch)
        attention = flops["attention"] * width * (width + 1) / 2
        row = 2 * (2 * flops["weights"] * width) + 3 * attention  # a block, forward + backward
        for seq in batch:
            predicted = len(seq) - max(spans[doc][0], 1)  # the answer-predicting positions
            runs = layers * (layers - 1) / 2  # blocks l+1..L-1 for every l
            total += (steps + 1) * (runs * row + layers * 2 * per_position * predicted)
            doc += 1
    return total


def rows(loaded: LoadedModel, flops: dict[str, float], data: Batches, steps: int) -> list[Row]:
    """The timed rows: the plain forward (the reference), the text task, the text task with
    ``--igrad``."""
    settings = {**IGRAD_MEASUREMENT.defaults(), "igrad_steps": steps}
    igrad = {IGRAD_MEASUREMENT.name: settings}
    text = flops["forward"] + flops["readout"]  # the loss: every token read out
    return [
        ("plain", plain_forward(loaded), flops["forward"]),
        ("text", measured(loaded, {}, {}), text),
        (
            "igrad",
            measured(loaded, igrad, {IGRAD_MEASUREMENT.name: answers(data)}),
            text + igrad_flops(loaded.model.config, data, flops, steps),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=2, help="BBC News articles")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per article (cut)")
    parser.add_argument("--batch-size", type=int, default=2, help="documents per forward pass")
    parser.add_argument("--steps", type=int, default=8, help="--igrad-steps")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of every row")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.docs, args.max_tokens, args.batch_size, args.steps, args.repeats = 1, 12, 1, 1, 1
    torch.set_num_threads(args.threads)
    print(f"command: {shlex.join(['python', *sys.argv])}")
    loaded = load()
    data = documents(loaded, args.docs, args.max_tokens, args.batch_size)
    padded = sum(len(b) * max(len(s) for s in b) for b in data)
    print(f"model: {DEMO_MODEL} fp32 cpu, torch threads {torch.get_num_threads()}; "
          f"{sum(len(b) for b in data)} documents, {padded} padded tokens, --igrad-steps "
          f"{args.steps}")  # fmt: skip
    flops = flop_counts(loaded.model.config, data)
    table = rows(loaded, flops, data, args.steps)
    times, loads = repeated(table, data, args.repeats, [[data[0][0][:8]]])
    results = report(table, times, flops["forward"])
    loads.append(os.getloadavg()[0])
    record("bench_igrad", COLUMNS, results, loads, formats=FORMATS,
           forward_gflop=round(flops["forward"] / 1e9, 2), repeats=args.repeats,
           threads=args.threads, steps=args.steps,
           plain_cpu_s=round(statistics.median(t[1] for t in times["plain"]), 3))  # fmt: skip


if __name__ == "__main__":
    main()
