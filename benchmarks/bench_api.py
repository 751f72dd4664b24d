"""What a notebook user sees and waits for with the Python API (a script, not a test).

Writes a synthetic store shaped like the demo's (``layerdiv demo``: one model of 30 blocks, the
tasks tweets2, tweets3 and bbc5 with 2, 3 and 5 options, 300 instances each; made-up numbers:
``analyze.synthetic.synthesize_demo_store``), then, in a fresh process, times ``import
layerdiv``, opening the store, one query and ``layerdiv.run_analysis``, and prints
``repr(results)`` and the length of its HTML display.

    python benchmarks/bench_api.py [--store DIR] [--instances 300]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import add_quick

SESSION = """
import sys, time, warnings
start = time.perf_counter()
import layerdiv
imported = time.perf_counter()
store = layerdiv.Store(sys.argv[1])
opened = time.perf_counter()
n = layerdiv.query(store, "SELECT count(*) FROM components").item()
queried = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore", layerdiv.LayerdivWarning)
    results = layerdiv.run_analysis(store)
analysed = time.perf_counter()
print(f"import layerdiv: {1000 * (imported - start):.0f} ms")
print(f"layerdiv.Store(path): {1000 * (opened - imported):.0f} ms")
print(f"layerdiv.query (count of {n:,} components rows): {1000 * (queried - opened):.0f} ms")
print(f"layerdiv.run_analysis: {analysed - queried:.2f} s")
print(f"repr(store): {store!r}")
print(f"repr(results): {len(repr(results)):,} characters; _repr_html_: "
      f"{len(results._repr_html_()):,} characters")
print(results)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=None)
    parser.add_argument("--instances", type=int, default=300)
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.instances = 30
    root = args.store or Path(tempfile.mkdtemp(prefix="layerdiv-bench-api-")) / "store"
    if root.exists():
        shutil.rmtree(root)
    from layerdiv.demo import synthesize_demo_store

    synthesize_demo_store(root, args.instances)
    print(f"store: {root} ({args.instances} instances per task)")
    subprocess.run([sys.executable, "-c", SESSION, str(root)], check=True)


if __name__ == "__main__":
    main()
