"""``layerdiv fit-law`` at the paper's size (a script, not a test): 245 synthetic points
(``analyze.law.synthetic_points``, made-up parameters), the fit from every start, 200 bootstrap
refits and 5 held-out splits, timed in wall-clock and CPU seconds.

    python benchmarks/bench_law.py [--points 245] [--bootstrap 200] [--heldout 5]
"""

from __future__ import annotations

import argparse
import os
import time

from common import add_quick

from layerdiv.analyze.law import fit_law, synthetic_points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=245)
    parser.add_argument("--bootstrap", type=int, default=200)
    parser.add_argument("--heldout", type=int, default=5)
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.bootstrap = 10
    points = synthetic_points(0, n=args.points)
    wall, cpu = time.perf_counter(), time.process_time()
    fit = fit_law(points, bootstrap=args.bootstrap, heldout=args.heldout)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(
        f"fit-law: {args.points} points, {fit.n_bootstrap} bootstrap fits, {args.heldout} "
        f"held-out splits: {wall:.2f} s wall, {cpu:.2f} s CPU on {os.cpu_count()} cores"
    )
    print(
        f"objective {fit.objective:.6g}, gradient norm {fit.gradient_norm:.2g}, held-out "
        f"error {fit.heldout_error}"
    )
    print(fit.table)


if __name__ == "__main__":
    main()
