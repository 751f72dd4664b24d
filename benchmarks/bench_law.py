"""``layerdiv fit-law`` at the paper's size (a script, not a test): 245 synthetic points
(``analyze.law.synthetic_points``, made-up parameters), the fit from every start, 200 bootstrap
refits and 5 held-out splits, timed in wall-clock and CPU seconds, ``--repeats`` times; the
figures are written to ``docs/benchmarks/bench_law.json`` (rendered into docs/benchmarks.md).

    python benchmarks/bench_law.py [--points 245] [--bootstrap 200] [--heldout 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time

from common import add_quick, record

from layerdiv.analyze.law import fit_law, synthetic_points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=245)
    parser.add_argument("--bootstrap", type=int, default=200)
    parser.add_argument("--heldout", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.bootstrap = 10
    points = synthetic_points(0, n=args.points)
    rows, loads = [], [os.getloadavg()[0]]
    for run in range(1, args.repeats + 1):
        wall, cpu = time.perf_counter(), time.process_time()
        fit = fit_law(points, bootstrap=args.bootstrap, heldout=args.heldout)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        loads.append(os.getloadavg()[0])
        print(
            f"fit-law: {args.points} points, {fit.n_bootstrap} bootstrap fits, {args.heldout} "
            f"held-out splits: {wall:.2f} s wall, {cpu:.2f} s CPU on {os.cpu_count()} cores"
        )
        rows.append([run, args.points, fit.n_bootstrap, args.heldout, wall, cpu, 60])
    print(
        f"objective {fit.objective:.6g}, gradient norm {fit.gradient_norm:.2g}, held-out "
        f"error {fit.heldout_error}"
    )
    print(fit.table)
    record(
        "bench_law",
        ["run", "points", "bootstrap fits", "held-out splits", "wall s", "CPU s", "target s"],
        rows,
        loads,
        formats=["", "", "", "", ".2f", ".2f", ""],
    )


if __name__ == "__main__":
    main()
