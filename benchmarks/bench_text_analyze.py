"""Scale benchmark of the running-text analyses (a script, not a test).

Synthesises FineWeb-sized text stores (``analyze.synthetic.synthesize_text_store``: 2 models x
4,800 documents x 1,024 tokens x 32 blocks, about 315 million ``token_blocks`` rows, written through
the store's writer) at each size of ``--sizes`` (a fraction of ``--docs``), then times
``layerdiv analyze`` on each in a fresh process and prints wall time, CPU time (user + system) and
peak memory (max RSS). The text analyses read one part file at a time in batches of whole tokens,
so time should grow with the documents and peak memory should not.

    python benchmarks/bench_text_analyze.py [--store DIR] [--sizes 0.25,1] [--docs 4800]
        [--tokens 1024] [--blocks 32] [--models 2] [--lens] [--skips]

Stores are kept under ``--store`` (default: a folder under the system temp directory) and reused
when one of the same shape is there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def ensure_store(root: Path, shape: dict[str, int | bool]) -> int:
    """Synthesise the store unless one of the same shape is already at ``root``; its rows."""
    from layerdiv.analyze.synthetic import synthesize_text_store

    stamp = root / "bench.json"
    if stamp.is_file() and json.loads(stamp.read_text())["shape"] == shape:
        return int(json.loads(stamp.read_text())["rows"])
    shutil.rmtree(root, ignore_errors=True)
    start = time.perf_counter()
    rows = synthesize_text_store(
        root,
        n_models=int(shape["models"]),
        n_docs=int(shape["docs"]),
        n_tokens=int(shape["tokens"]),
        blocks=int(shape["blocks"]),
        lens=bool(shape["lens"]),
        skips=bool(shape["skips"]),
    )
    print(f"synthesised {rows:,} token_blocks rows in {time.perf_counter() - start:.0f} s")
    stamp.write_text(json.dumps({"shape": shape, "rows": rows}))
    return rows


def timed_analyze(store: Path, out: Path) -> tuple[float, float, float]:
    """``layerdiv analyze`` in a fresh process: (wall s, CPU s of user + system, peak RSS MiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "layerdiv.cli", "analyze", "--store", str(store), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"analyze failed: {proc.stderr.read() if proc.stderr else ''}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=Path(tempfile.gettempdir()) / "bench-text")
    parser.add_argument("--sizes", default="0.25,1", help="fractions of --docs, one store each")
    parser.add_argument("--docs", type=int, default=4800)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--models", type=int, default=2)
    parser.add_argument("--lens", action="store_true", help="add token_lens (extract --lens)")
    parser.add_argument("--skips", action="store_true", help="add the future-effects tables")
    args = parser.parse_args()
    runs = []
    for size in (float(s) for s in args.sizes.split(",")):
        docs = round(args.docs * size)
        shape = {
            "models": args.models,
            "docs": docs,
            "tokens": args.tokens,
            "blocks": args.blocks,
            "lens": args.lens,
            "skips": args.skips,
        }
        store = Path(f"{args.store}-{docs}")
        rows = ensure_store(store, shape)
        with tempfile.TemporaryDirectory() as out:
            wall, cpu, peak = timed_analyze(store, Path(out) / "tables")
        runs.append((docs, rows, wall, cpu, peak))
    print(
        f"\n{args.models} models x {args.tokens} tokens x {args.blocks} blocks"
        f"{' + token_lens' if args.lens else ''}{' + future effects' if args.skips else ''}, "
        f"{os.cpu_count()} CPU cores, `layerdiv analyze` in a fresh process:"
    )
    print(
        f"{'documents':>9}  {'token_blocks rows':>17}  {'wall (s)':>8}  {'wall/model (s)':>14}  "
        f"{'CPU (s)':>8}  {'CPU/model (s)':>13}  {'peak RSS (MiB)':>14}"
    )
    for docs, rows, wall, cpu, peak in runs:
        print(
            f"{docs:>9,}  {rows:>17,}  {wall:8.1f}  {wall / args.models:14.1f}  {cpu:8.1f}  "
            f"{cpu / args.models:13.1f}  {peak:14.0f}"
        )


if __name__ == "__main__":
    main()
