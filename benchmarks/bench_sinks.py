"""Cost of ``extract --sinks`` on a text task (a script, not a test): SmolLM2-135M-Instruct (fp32,
CPU) on BBC News running text, a plain text extraction against the same with the attention
sinks, each into a fresh store.

    python benchmarks/bench_sinks.py [--docs 16] [--max-tokens 256] [--repeats 3] [--threads 1]
        [--quick]

Each repeat runs both extractions (in rotating order); the time of one is that of its
``extract_task`` (``common.extract_seconds``): CPU seconds of the process and wall seconds. The
work each does is the cost model's (``layerdiv.extract.cost.passes``, what ``extract``'s
estimate sums): the plain pass over every document, and with ``--sinks`` the scores of every
block once more (``layerdiv.measurements.sinks.sink_cost``), from the documents' stored token
counts. Torch runs ``--threads`` threads (default 1, as ``bench_states.py``).

Target: the CPU time with ``--sinks`` over the plain one at most 1.15 x the ratio of their
FLOPs.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

from common import against_plain, bbc_text_task, record, text_extract_args

from layerdiv.demo import DEMO_MODEL
from layerdiv.extract import cost
from layerdiv.extract.models import resolve_source
from layerdiv.store import Store

TARGET = 1.15
"""Target: the CPU ratio (``--sinks`` / plain) at most this multiple of the FLOP ratio."""


def flop_ratio(store: Path) -> tuple[float, int]:
    """(FLOPs with ``--sinks`` / FLOPs of the plain pass, summed over the stored documents; their
    tokens), from the cost model and the ``documents`` table's token counts."""
    shape = cost.Shape.from_config(resolve_source(DEMO_MODEL, None, None, False).config)
    lengths = Store(store).scan("documents").collect()["n_tokens"].to_list()
    plain = sum(shape.forward(t) for t in lengths)
    sinks = sum(cost.passes(shape, "text", t, {"sinks": {}}) * shape.forward(t) for t in lengths)
    return sinks / plain, sum(lengths)


def main() -> None:
    args = text_extract_args(__doc__.split("\n\n")[0])
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        task = bbc_text_task(root, args.docs, args.max_tokens, "bbc-sinks-bench")
        runs = against_plain(task, root, {"sinks": {}}, args.repeats, loads)
        flops, tokens = flop_ratio(root / "store-0-1")
    plain_cpu, sinks_cpu = (statistics.median(c for c, _ in runs[s]) for s in (False, True))
    plain_wall, sinks_wall = (statistics.median(w for _, w in runs[s]) for s in (False, True))
    ratio = sinks_cpu / plain_cpu
    met = ratio <= TARGET * flops
    print(f"{DEMO_MODEL} (fp32, CPU) on {args.docs} BBC News documents, {tokens} tokens; "
          f"{os.cpu_count()} CPUs, load average {min(loads):.1f} to {max(loads):.1f} (other "
          f"work shares this machine); medians of {args.repeats} repeats")  # fmt: skip
    print(f"plain text extraction: {plain_cpu:.2f} s CPU ({plain_wall:.2f} s wall)")
    print(f"--sinks:               {sinks_cpu:.2f} s CPU ({sinks_wall:.2f} s wall); ratio "
          f"{ratio:.3f} CPU, {sinks_wall / plain_wall:.3f} wall")  # fmt: skip
    print(f"FLOPs with --sinks / plain (cost model): {flops:.3f}; target: CPU ratio <= "
          f"{TARGET} x that = {TARGET * flops:.3f} -> {'met' if met else 'NOT met'}")  # fmt: skip
    if not args.quick:
        record(
            "bench_sinks",
            ["measure", "figure", "target"],
            [
                ["plain text extraction, CPU s", round(plain_cpu, 2), ""],
                ["--sinks, CPU s", round(sinks_cpu, 2), ""],
                ["--sinks / plain, CPU", round(ratio, 3), f"<= {TARGET * flops:.3f}"],
                ["--sinks / plain, FLOPs (cost model)", round(flops, 3), ""],
            ],
            loads,
            threads=args.threads,
        )


if __name__ == "__main__":
    main()
