"""Scale benchmark of the running-text analyses (a script, not a test).

Synthesises FineWeb-sized text stores (``analyze.synthetic.synthesize_text_store``: 2 models x
4,800 documents x 1,024 tokens x 32 blocks, about 315 million ``token_blocks`` rows, written through
the store's writer) at each size of ``--sizes`` (a fraction of ``--docs``), then times
``layerdiv analyze`` on each in a fresh process and prints wall time, CPU time (user + system) and
peak memory (max RSS). The text analyses read one part file at a time in batches of whole tokens,
so time should grow with the documents and peak memory should not.

With ``--stages``, it also times in this process the pass over the first model's ``token_blocks``
(in the store of the last size) stage by stage, each stage a pass of its own that adds one step:
reading the Arrow batches, the dot products as arrays, the geometry, the per-block sums and
profile moments (CPU seconds and minor page faults), at each of ``--batch-tokens``.

    python benchmarks/bench_text_analyze.py [--store DIR] [--sizes 0.25,1] [--docs 4800]
        [--tokens 1024] [--blocks 32] [--models 2] [--lens] [--skips]
        [--stages] [--batch-tokens 4096,1024]

Stores are kept under ``--store`` (default: a folder under the system temp directory) and reused
when one of the same shape is there.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_quick, record, stamp_rows, stored_rows


def ensure_store(root: Path, shape: dict[str, int | bool]) -> int:
    """Synthesise the store unless one of the same shape and layout is already at ``root``; its
    rows."""
    from layerdiv.analyze.synthetic import synthesize_text_store

    rows = stored_rows(root, shape)
    if rows is not None:
        return rows
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
    stamp_rows(root, shape, rows)
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


def usage() -> tuple[float, int]:
    """(CPU seconds of user + system, minor page faults) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def stages(store: Path, batch_tokens: int) -> list[tuple[str, float, int]]:
    """Per stage of the pass over the first partition's ``token_blocks`` (each stage a pass that
    adds one step to the one before): (stage, CPU s, minor page faults)."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    from layerdiv.analyze import text
    from layerdiv.store import Store

    info = Store(store).select()[0]
    blocks = info.manifest.n_blocks
    columns = ["doc", "pos", "block", *text.DOTS]
    steps = ["read Arrow batches", "+ dot products as arrays", "+ geometry", "+ sums, moments"]
    out = []
    with threadpool_limits(1, user_api="blas"):
        for depth, name in enumerate(steps):
            stats, moments = text.BlockStats.empty(blocks), text.ProfileMoments.empty(blocks)
            dots_buffer = np.empty(len(text.DOTS) * blocks * batch_tokens)
            work_buffer = np.empty((len(text.GEOMETRY) + text.WORK) * blocks * batch_tokens)
            cpu, faults = usage()
            for batch in info.batches("token_blocks", columns, batch_tokens * blocks):
                if depth >= 1:
                    pos, dots = text.token_dots(batch, blocks, out=dots_buffer)
                if depth >= 2:
                    geometry = text.token_geometry(dots, work_buffer)
                if depth >= 3:
                    stats.add(geometry)
                    moments.add(geometry[text.THETA_STATE], pos)
            cpu_end, faults_end = usage()
            out.append((name, cpu_end - cpu, faults_end - faults))
    return out


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
    parser.add_argument("--stages", action="store_true", help="time the pass stage by stage")
    parser.add_argument("--batch-tokens", default="4096,1024", help="tokens per batch (--stages)")
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:  # small stores beside the full-size ones, every option's code path
        args.docs, args.tokens, args.blocks, args.sizes, args.batch_tokens = 8, 64, 4, "1", "256"
        args.lens = args.skips = args.stages = True
        args.store = Path(f"{args.store}-quick")
    runs = []
    loads = [os.getloadavg()[0]]
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
    loads.append(os.getloadavg()[0])
    if not (args.lens or args.skips):  # the docs' table: token_blocks alone
        columns = ["documents", "token_blocks rows", "wall (s)", "wall/model (s)", "CPU (s)",
                   "CPU/model (s)", "peak RSS (MiB)"]  # fmt: skip
        table = [[docs, rows, round(wall, 1), round(wall / args.models, 1), round(cpu, 1),
                  round(cpu / args.models, 1), round(peak)]
                 for docs, rows, wall, cpu, peak in runs]  # fmt: skip
        record("bench_text_analyze", columns, table, loads,
               formats=[",", ",", ".1f", ".1f", ".1f", ".1f", ".0f"])  # fmt: skip
    if args.stages:
        print(
            f"\nOne model's token_blocks pass ({runs[-1][0]:,} documents) in this process, stage "
            "by stage (each a pass adding one step to the one above):"
        )
        print(f"{'batch tokens':>12}  {'stage':<26}  {'CPU (s)':>8}  {'page faults':>11}")
        for tokens in (int(t) for t in args.batch_tokens.split(",")):
            for name, cpu, faults in stages(Path(f"{args.store}-{runs[-1][0]}"), tokens):
                print(f"{tokens:>12,}  {name:<26}  {cpu:8.1f}  {faults:>11,}")


if __name__ == "__main__":
    main()
