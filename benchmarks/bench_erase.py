"""Cost of ``extract --erase`` (a script, not a test): SmolLM2-135M-Instruct (fp32, CPU) on BBC
News running text with an answer (each document's first ``--chars`` characters, then the next
``--answer`` as its answer), its time against the FLOPs of its prefix-reusing passes at the FLOP
rate of a plain forward pass measured in the same run.

    python benchmarks/bench_erase.py [--docs 2] [--chars 160] [--answer 40] [--repeats 3]
        [--threads 1] [--quick]

Each repeat runs a plain text extraction and the same with ``--erase`` (in rotating order, each
into a fresh store; the CPU seconds of ``extract_task``, the model loaded:
``common.against_plain``); then a plain forward pass over each document alone (one position read
out: ``layerdiv.extract.cost.Shape.forward``) is timed five times per repeat. The
erasure's seconds are the difference of the two extractions; its FLOPs are those of its passes,
counted per document from its tokens T and its answer's start s
(``layerdiv.measurements.erase.erase_flops``: per state l and position t <= T - 2, blocks l..L-1
over the queries t..T-1 and the readout at max(s - 1, t)..T-2, and the clean pass that keeps the
keys and values). Target: at most 1.15 x those FLOPs at the plain forward's rate.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import against_plain, bbc_text_task, record, text_extract_args

from layerdiv.demo import DEMO_MODEL
from layerdiv.extract.config import ExtractConfig
from layerdiv.extract.cost import Shape
from layerdiv.extract.models import load_model, load_tokenizer, resolve_source
from layerdiv.extract.plan import plan_task
from layerdiv.measurements.erase import erase_flops

TARGET = 1.15
"""Target: the erasure's time at most this multiple of its FLOPs at a plain forward's rate."""


def main() -> None:
    args = text_extract_args(
        __doc__.split("\n\n")[0],
        docs=(2, 1),
        sizes={
            "chars": (160, 24, "characters before the answer"),
            "answer": (40, 12, "characters of the answer"),
        },
    )
    source = resolve_source(DEMO_MODEL, None, None, False)
    loaded = load_model(source, load_tokenizer(source), torch.device("cpu"), torch.float32)
    shape = Shape.from_config(source.config)
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="layerdiv-bench-erase-") as tmp:
        root = Path(tmp)
        answer = (args.chars, args.answer)
        task = bbc_text_task(root, args.docs, None, "bbc-erase-bench", answer, paragraphs=2)
        erase = {"erase": {"erase_reference": 1}}
        cfg = ExtractConfig(
            DEMO_MODEL, [], root / "plan", progress=False, measurement_settings=erase
        )
        plan = plan_task(str(task), loaded.tokenizer, cfg)
        assert plan.documents is not None
        seqs = plan.documents[0]
        starts = [s for s, _ in plan.planned["erase"].spans]
        flops = sum(
            erase_flops(shape, len(q), max(s - 1, 0), len(q) - 2)
            for q, s in zip(seqs, starts, strict=True)
        )
        forward_flops = sum(shape.forward(len(q)) for q in seqs)

        def forward() -> float:
            """CPU seconds of a plain forward pass over each document alone."""
            cpu = time.process_time()
            with torch.inference_mode():
                for q in seqs:
                    loaded.model(torch.tensor([q]), use_cache=False, logits_to_keep=1)
            return time.process_time() - cpu

        runs = against_plain(task, root, erase, args.repeats, loads)
        forward()
        fwd = statistics.median(forward() for _ in range(5 * args.repeats))
        loads.append(os.getloadavg()[0])
    plain, with_erase = (statistics.median(c for c, _ in runs[k]) for k in (False, True))
    rate = forward_flops / fwd
    predicted = flops / rate
    measured = with_erase - plain
    ratio = measured / predicted
    tokens = sum(len(q) for q in seqs)
    print(f"{DEMO_MODEL} (fp32, CPU) on {args.docs} BBC News documents, {tokens} tokens "
          f"(answers from token {min(starts)} on); {os.cpu_count()} CPUs, load average "
          f"{min(loads):.1f} to {max(loads):.1f}; medians of {args.repeats} repeats")  # fmt: skip
    print(f"plain forward: {fwd:.3f} s CPU for {forward_flops / 1e9:.2f} GFLOP = "
          f"{rate / 1e9:.1f} GFLOP/s")  # fmt: skip
    print(f"plain text extraction {plain:.2f} s, with --erase {with_erase:.2f} s: the erasure "
          f"{measured:.2f} s for {flops / 1e12:.3f} TFLOP, {predicted:.2f} s at the forward's "
          f"rate: {ratio:.3f} x (target <= {TARGET} -> "
          f"{'met' if ratio <= TARGET else 'NOT met'})")  # fmt: skip
    record(
        "bench_erase",
        ["measure", "figure", "target"],
        [
            ["plain forward, GFLOP/s", round(rate / 1e9, 1), ""],
            ["--erase passes, TFLOP", round(flops / 1e12, 3), ""],
            ["--erase, CPU s (extraction with it less without)", round(measured, 2), ""],
            ["--erase / its FLOPs at the forward's rate", round(ratio, 3), f"<= {TARGET}"],
        ],
        loads,
        threads=args.threads,
    )


if __name__ == "__main__":
    main()
