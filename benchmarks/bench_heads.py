"""Scale benchmark of the heads analysis (a script, not a test).

Synthesises a paper-scale heads store (one model of 32 layers x 32 heads, 8 tasks of 2,000
instances with 2-4 options: about 57 million head-option rows), then runs, in a fresh process,
the heads analysis (head and component scores, the parts that beat the whole, component
reweighting) and its report section (tables and the heatmap PNG), printing wall time and peak
memory (max RSS of that process), and its CPU time (wall time on a shared machine is noisy).

    python benchmarks/bench_heads.py [--store DIR] [--layers 32] [--heads 32] [--tasks 8]
        [--instances 2000]

The store is kept in ``--store`` (default: a folder under the system temp directory) and reused
when it already has the same shape.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_quick, record, stamp_rows, stored_rows

ANALYSE = r"""
import sys, time
from pathlib import Path
from layerdiv.measurements.heads import reweight
from layerdiv.measurements.heads.analysis import heads_tables
from layerdiv.measurements.heads.report import heads_section
from layerdiv.analyze.registry import ReportContext
from layerdiv.store import Store

store, out = sys.argv[1], Path(sys.argv[2])
start = time.perf_counter()
notes = []
parts = Store(store).select()
tables = {**heads_tables(parts, notes), **reweight.reweight_tables(parts, notes)}
middle = time.perf_counter()
names = {m: m for m in tables["head_summary"]["model"]}
ctx = ReportContext(tables, "paper", names, out / "figures")
text = heads_section(ctx) + "\n\n" + reweight.report(ctx)
(out / "report.md").write_text(text)
print(f"{middle - start:.2f} {time.perf_counter() - middle:.2f}")
"""


def ensure_store(root: Path, layers: int, heads: int, tasks: int, instances: int) -> int:
    """Synthesise the store unless one of the same shape is already at ``root``; returns the
    number of head-option rows."""
    import numpy as np

    from layerdiv.analyze.synthetic import (
        PAPER_TASK_OPTIONS,
        random_heads,
        random_partition,
        write_partition,
    )

    shape = {"layers": layers, "heads": heads, "tasks": tasks, "instances": instances}
    found = stored_rows(root, shape)
    if found is not None:
        return found
    rng = np.random.default_rng(0)
    rows, start = 0, time.perf_counter()
    for t in range(tasks):
        k = PAPER_TASK_OPTIONS[t % len(PAPER_TASK_OPTIONS)]
        logits, gold, rms, kinds = random_partition(rng, instances, layers, k)
        logits, head_logits, ids = random_heads(rng, logits, gold, kinds, heads)
        write_partition(
            root,
            "synth/heads-model",
            f"task{t}",
            logits,
            gold,
            kinds,
            rms,
            n_params=int(7e9),
            chunk=1024,
            optional={"heads": head_logits},
            head_ids=ids,
        )
        rows += head_logits.size
    print(f"synthesised {rows:,} head-option rows in {time.perf_counter() - start:.1f} s")
    stamp_rows(root, shape, rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store", type=Path, default=Path(tempfile.gettempdir()) / "layerdiv-bench-heads"
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--instances", type=int, default=2000)
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:  # a small store beside the paper-scale one
        args.layers, args.heads, args.tasks, args.instances = 4, 4, 2, 40
        args.store = Path(f"{args.store}-quick")

    rows = ensure_store(args.store, args.layers, args.heads, args.tasks, args.instances)
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-c", ANALYSE, str(args.store), out],
            stdout=subprocess.PIPE,
            text=True,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status):
            raise SystemExit("the heads analysis failed")
        tables_s, report_s = (
            (float(v) for v in proc.stdout.read().split()) if proc.stdout else (0, 0)
        )
    print(
        f"\nstore: {rows:,} head-option rows, 1 model x {args.layers} layers x {args.heads} heads "
        f"x {args.tasks} tasks x {args.instances:,} instances; {os.cpu_count()} CPU cores"
    )
    print(f"heads tables (scores, summary, reweighting): {tables_s:6.2f} s")
    print(f"heads report section (tables, heatmap PNG):  {report_s:6.2f} s")
    print(f"whole process (imports included):            {wall:6.2f} s")
    cpu = usage.ru_utime + usage.ru_stime
    print(f"CPU time of that process (user + system):    {cpu:6.2f} s")
    print(f"peak RSS:                                    {usage.ru_maxrss / 1024:6.0f} MiB")
    loads.append(os.getloadavg()[0])
    table: list[tuple[str, float]] = [
             ("heads tables (scores, summary, reweighting)", tables_s),
             ("heads report section (tables, heatmap PNG)", report_s),
             ("whole process, wall (imports included)", wall),
             ("whole process, CPU time (user + system)", cpu)]  # fmt: skip
    record("bench_heads", ["step", "seconds"], [[k, round(v, 2)] for k, v in table], loads,
           formats=["", ".2f"], peak_rss_mib=round(usage.ru_maxrss / 1024))  # fmt: skip


if __name__ == "__main__":
    main()
