"""The cost of ``layerdiv analyze --executor ray`` against the local executor (a script, not a
test).

Synthesises the paper-scale store (``paper_store.py``: 16 models x 8 tasks x 2,000 instances,
about 60 million component-option rows; reused when it is there), starts a Ray cluster on this
machine (``analyze.cluster.local_cluster``: a head node, and ``--workers`` worker nodes started
apart that share ``--cpus`` CPUs and run every task; with ``--workers 0`` the head node alone,
bound to 127.0.0.1, with the CPUs; stopped at the end), then times ``layerdiv analyze`` in a
fresh process with the local executor and with ``--executor ray``, alternating, ``--repeat``
times each, and prints each run's wall time and the ratio of the medians (Ray / local). The
cluster's start is not counted (a cluster is up before analyses are sent to it); connecting to
it is.

    python benchmarks/bench_cluster.py [--store DIR] [--cpus 2] [--workers 1] [--repeat 3]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from common import record
from paper_store import ensure_store, parse_store_args, store_parser, timed

from layerdiv.analyze.cluster import local_cluster


def main() -> None:
    parser = store_parser(__doc__ or "")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parse_store_args(parser)
    if args.quick:
        args.repeat = 1
    ensure_store(args.store, args.models, args.tasks, args.instances)
    out = Path(tempfile.mkdtemp(prefix="layerdiv-bench-cluster-"))
    base = ["analyze", "--store", str(args.store), "--out"]
    walls: dict[str, list[float]] = {"local": [], "ray": []}
    rss_mib: dict[str, list[float]] = {"local": [], "ray": []}
    loads = [os.getloadavg()[0]]
    start = time.perf_counter()
    with local_cluster(cpus=args.cpus, workers=args.workers) as address:
        print(f"Ray head on {address} and {args.workers} worker node(s), {args.cpus} CPUs, up "
              f"in {time.perf_counter() - start:.1f} s (not counted)")  # fmt: skip
        for i in range(args.repeat):
            for name, extra in (
                ("local", []),
                ("ray", ["--executor", "ray", "--ray-address", address]),
            ):
                label, wall, rss = timed(name, [*base, str(out / f"{name}{i}"), *extra])
                walls[name].append(wall)
                rss_mib[name].append(rss)
                loads.append(os.getloadavg()[0])
                print(f"{label:>5} run {i + 1}: {wall:7.1f} s wall, driver peak RSS {rss:,.0f} MiB")
    local, ray = (statistics.median(walls[k]) for k in ("local", "ray"))
    print(f"median wall: local {local:.1f} s, ray {ray:.1f} s: ray / local = {ray / local:.2f} "
          f"on {os.cpu_count()} cores (target <= 1.3)")  # fmt: skip
    rows = [[i + 1, round(walls["local"][i], 1), round(walls["ray"][i], 1),
             f"{rss_mib['local'][i]:.0f} / {rss_mib['ray'][i]:.0f}"]
            for i in range(args.repeat)]  # fmt: skip
    columns = ["run", "local wall s", "ray wall s", "driver peak RSS MiB (local / ray)"]
    record("bench_cluster", columns, rows, loads, formats=["", ".1f", ".1f", ""],
           ray_over_local=round(ray / local, 2))  # fmt: skip


if __name__ == "__main__":
    main()
