"""CPU benchmark of ``extract --heads``: the extraction with and without per-head logits on
SmolLM2-135M-Instruct in fp32, over the same real prompts (the demo tasks tweets2, tweets3 and
bbc5; ``--n`` prompts in all, fixed ``--seed``), and the size of the heads table.

Both contenders are the real extraction path (``plan_task`` outside the clock, then
``extract_task`` into a fresh store: hooks, decomposition, checks, Parquet writing), with
automatic batching; they differ only in ``--heads``. A warm-up run of each, then ``--rounds``
rounds, each running both in alternating order; it prints median wall and CPU seconds (process
time: steadier than wall time on a shared machine) and the medians of the per-round ratios (heads
/ without). Bytes per instance: the Parquet parts of each table over
the instances stored (from the last ``--heads`` run).

    python benchmarks/bench_heads_extract.py [--n 300] [--rounds 5] [--seed 0] [--threads 0]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import add_quick, demo_choice_tasks, record

from layerdiv.demo import DEMO_MODEL
from layerdiv.extract.adapters import adapter_for, check_softcap
from layerdiv.extract.config import ExtractConfig, measurement_options
from layerdiv.extract.models import load_model, load_tokenizer, resolve_source
from layerdiv.extract.plan import plan_task
from layerdiv.extract.runner import extract_task
from layerdiv.store import Store

TARGET = 1.10
"""Target: ``--heads`` costs at most this multiple of the extraction time without it."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="prompts in all (split over tasks)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.n, args.rounds = 6, 1
    if args.threads:
        torch.set_num_threads(args.threads)

    source = resolve_source(DEMO_MODEL, None, None, False)
    loaded = load_model(source, load_tokenizer(source), torch.device("cpu"), torch.float32)
    adapter, config = adapter_for(source.config), source.config
    approximate = check_softcap(config, False)
    per_task = -(-args.n // 3)
    with tempfile.TemporaryDirectory(prefix="layerdiv-bench-heads-") as tmp:
        paths = demo_choice_tasks(Path(tmp) / "tasks", -(-per_task // 30) * 30, args.seed)

        def run(heads: bool, store: Path) -> tuple[float, float]:
            settings = measurement_options({"heads": heads})
            cfg = ExtractConfig(DEMO_MODEL, [], store, limit=per_task, progress=False,
                                measurement_settings=settings)  # fmt: skip
            plans = [plan_task(str(p), loaded.tokenizer, cfg) for p in paths]
            gc.collect()
            start, cpu = time.perf_counter(), time.process_time()
            for plan in plans:
                extract_task(loaded, adapter, plan, cfg, approximate)
            return time.perf_counter() - start, time.process_time() - cpu

        times: dict[bool, list[float]] = {False: [], True: []}
        cpus: dict[bool, list[float]] = {False: [], True: []}
        ratios, cpu_ratios = [], []
        loads = [os.getloadavg()[0]]
        for r in range(args.rounds + 1):  # round 0 warms up
            order = (False, True) if r % 2 else (True, False)
            got = {}
            for heads in order:
                with tempfile.TemporaryDirectory(dir=tmp) as store:
                    got[heads] = run(heads, Path(store))
                    if heads:
                        sizes = table_sizes(Path(store))
            if r:
                for heads, (seconds, cpu) in got.items():
                    times[heads].append(seconds)
                    cpus[heads].append(cpu)
                ratios.append(got[True][0] / got[False][0])
                cpu_ratios.append(got[True][1] / got[False][1])
                loads.append(os.getloadavg()[0])
    n = 3 * per_task
    print(
        f"\nSmolLM2-135M-Instruct fp32 CPU ({os.cpu_count()} cores, {torch.get_num_threads()} "
        f"torch threads), {n} prompts (3 demo tasks), {args.rounds} interleaved rounds"
    )
    rows = []
    for label, values, per_round in (("wall", times, ratios), ("CPU", cpus, cpu_ratios)):
        ratio = statistics.median(per_round)
        rows.append([f"{label} time" if label == "wall" else "CPU time (process)",
                     round(statistics.median(values[False]), 2),
                     round(statistics.median(values[True]), 2), round(ratio, 3)])  # fmt: skip
        verdict = "meets" if ratio <= TARGET else "misses"
        print(
            f"{label} time: without --heads median {statistics.median(values[False]):7.2f} s, "
            f"with --heads {statistics.median(values[True]):7.2f} s; ratio (median of per-round "
            f"ratios) {ratio:.3f} ({verdict} the target {TARGET}); per round: "
            + ", ".join(f"{x:.3f}" for x in per_round)
        )
    for table, size in sizes.items():
        print(f"{table} table: {size / n:9.0f} bytes per instance (Parquet, zstd)")
    columns = ["measure", "without `--heads` (median s)", "with `--heads` (median s)",
               "median per-round ratio"]  # fmt: skip
    record("bench_heads_extract", columns, rows, loads, formats=["", ".2f", ".2f", ".3f"],
           threads=torch.get_num_threads())  # fmt: skip


def table_sizes(store: Path) -> dict[str, int]:
    """Bytes of the complete parts of each table in ``store``, summed over partitions."""
    parts = Store(store).select()
    return {
        table: sum(f.stat().st_size for p in parts for f in p.files(table))
        for table in ("components", "instances", "heads")
    }


if __name__ == "__main__":
    main()
