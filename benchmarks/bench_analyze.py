"""Scale benchmark of the analysis stage (a script, not a test).

Synthesises a paper-scale store (16 models x 8 tasks x 2,000 instances, 61-81 components, 2-4
options: about 60 million component-option rows), then times, each in a fresh process:

- ``layerdiv analyze`` (every score, curve, correlation, fit and table),
- ``layerdiv report`` (Markdown and all PNG figures),
- ``layerdiv query`` on one model and one task,
- ``layerdiv analyze --scale prefix`` on one model (the O(L^2) prefix-scaled curves),

the same single-model, single-task query in-process (store opened, views built, query run) and
the depth-use tables in-process (what they add to ``layerdiv analyze``), printing wall time and
peak memory (max RSS of the process) of each.

    python benchmarks/bench_analyze.py [--store DIR] [--models 16] [--tasks 8] [--instances 2000]

The store is kept in ``--store`` (default: a folder under the system temp directory) and reused
when it is already there.

With ``--scales 1,10`` it instead times ``layerdiv analyze`` alone on stores of 1x and 10x as many
models (``<store>-x1``, ``<store>-x10``; 10x is about 600 million rows) and prints wall time, peak
memory and their ratios to the first scale: the analysis reads one partition at a time, so time
should grow linearly with the rows and peak memory should stay bounded.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from common import record
from paper_store import ensure_store, parse_store_args, store_parser, timed

QUERY = (
    "SELECT instance, option, sum(logit) AS logit FROM components "
    "GROUP BY instance, option ORDER BY instance, option"
)


def store_mb(root: Path) -> float:
    """Megabytes (10^6 bytes) of Parquet in the store."""
    return sum(f.stat().st_size for f in root.rglob("*.parquet")) / 1e6


def in_process_query(store: Path, model: str, task: str) -> tuple[str, float, float]:
    """Open the store, build the views for one model and task, run :data:`QUERY`."""
    from layerdiv.store import Store

    start = time.perf_counter()
    rows = Store(store).duckdb([model], [task]).sql(QUERY).pl().height
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return f"query, 1 model x 1 task, in-process ({rows:,} rows out)", wall, peak


def in_process_depth(store: Path) -> tuple[str, float, float]:
    """The depth-use tables alone (what registering them adds to ``layerdiv analyze``)."""
    from layerdiv.analyze.analyses import depth

    start = time.perf_counter()
    rows = depth.geometry(store)["geometry"].height
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return f"depth tables (methods §7), in-process ({rows:,} geometry rows)", wall, peak


def scaling(args: argparse.Namespace, scales: list[int]) -> None:
    """Time ``layerdiv analyze`` on stores of ``scale`` x ``--models`` models each."""
    runs = []
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for scale in scales:
            root = Path(f"{args.store}-x{scale}")
            rows = ensure_store(root, args.models * scale, args.tasks, args.instances)
            _, wall, peak = timed(
                f"analyze x{scale}", ["analyze", "--store", str(root), "--out", f"{tmp}/x{scale}"]
            )
            runs.append((scale, rows, wall, peak))
            print(f"x{scale}: {store_mb(root):,.0f} MB of Parquet")
    print(f"\nlayerdiv analyze, {args.tasks} tasks x {args.instances:,} instances per model")
    print(
        f"{'scale':>5}  {'models':>6}  {'rows':>13}  {'wall (s)':>9}  {'peak RSS (MiB)':>14}  "
        f"{'wall / rows ratio':>17}  {'peak ratio':>10}"
    )
    _, rows0, wall0, peak0 = runs[0]
    table = []
    for scale, rows, wall, peak in runs:
        per_row = (wall / rows) / (wall0 / rows0)
        print(
            f"{scale:>5}  {args.models * scale:>6}  {rows:>13,}  {wall:9.1f}  {peak:14.0f}  "
            f"{per_row:17.2f}  {peak / peak0:10.2f}"
        )
        table.append([scale, args.models * scale, rows, round(wall, 1), round(peak),
                      round(per_row, 2), round(peak / peak0, 2)])  # fmt: skip
    loads.append(os.getloadavg()[0])
    columns = ["scale", "models", "rows", "wall s", "peak RSS MiB", "wall per row, relative",
               "peak, relative"]  # fmt: skip
    record("bench_analyze-scales", columns, table, loads,
           formats=["", "", ",", ".1f", ".0f", ".2f", ".2f"])  # fmt: skip


def main() -> None:
    parser = store_parser(__doc__)
    parser.add_argument(
        "--scales",
        default=None,
        help="comma-separated multiples of --models (e.g. 1,10): time analyze at each scale",
    )
    args = parse_store_args(parser)
    if args.scales:
        scaling(args, [int(v) for v in args.scales.split(",")])
        return

    rows = ensure_store(args.store, args.models, args.tasks, args.instances)
    store = str(args.store)
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        model, task = "synth/model-00", "task0"
        results = [
            timed(
                "layerdiv analyze (all scores and curves)",
                ["analyze", "--store", store, "--out", f"{tmp}/results"],
            ),
            timed(
                "layerdiv report (tables and all figures)",
                ["report", "--store", store, "--out", f"{tmp}/report"],
            ),
            timed(
                "layerdiv query, 1 model x 1 task (CLI, fresh process)",
                [
                    "query",
                    QUERY,
                    "--store",
                    store,
                    "--model",
                    model,
                    "--task",
                    task,
                    "--out",
                    f"{tmp}/q.parquet",
                ],
            ),
            in_process_query(args.store, model, task),
            in_process_depth(args.store),
            timed(
                f"layerdiv analyze --scale prefix, 1 model x {args.tasks} tasks",
                [
                    "analyze",
                    "--store",
                    store,
                    "--model",
                    model,
                    "--scale",
                    "prefix",
                    "--out",
                    f"{tmp}/prefix",
                ],
            ),
        ]
    print(
        f"\nstore: {rows:,} component-option rows ({store_mb(args.store):,.0f} MB of Parquet), "
        f"{args.models} models x {args.tasks} tasks x {args.instances:,} instances; "
        f"{os.cpu_count()} CPU cores"
    )
    width = max(len(r[0]) for r in results)
    print(f"{'step':<{width}}  {'wall (s)':>9}  {'peak RSS (MiB)':>14}")
    for label, wall, peak in results:
        print(f"{label:<{width}}  {wall:9.2f}  {peak:14.0f}")
    loads.append(os.getloadavg()[0])
    table = [[label, round(wall, 2), round(peak)] for label, wall, peak in results]
    record("bench_analyze", ["step", "wall s", "peak RSS MiB"], table, loads,
           formats=["", ".2f", ".0f"])  # fmt: skip


if __name__ == "__main__":
    main()
