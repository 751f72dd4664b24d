"""What the paper-scale analysis benchmarks share (``bench_analyze.py``, ``bench_report_html.py``):
their command-line options for the synthetic store, its synthesis (once per shape), and timing
a ``layerdiv`` command in a fresh process."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_quick, stamp_rows, stored_rows


def store_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc``, with the store's options: ``--store``
    (kept and reused), ``--models``, ``--tasks`` and ``--instances`` (default: paper scale)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        "--store", type=Path, default=Path(tempfile.gettempdir()) / "layerdiv-bench"
    )
    parser.add_argument("--models", type=int, default=16)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--instances", type=int, default=2000)
    add_quick(parser)
    return parser


def parse_store_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed options; ``--quick``: a store of 2 models x 2 tasks x 40 instances beside
    ``--store`` (``<store>-quick``, so that the paper-scale one is kept)."""
    args = parser.parse_args()
    if args.quick:
        args.models, args.tasks, args.instances = 2, 2, 40
        args.store = Path(f"{args.store}-quick")
    return args


def ensure_store(root: Path, models: int, tasks: int, instances: int) -> int:
    """Synthesise the store unless a store of the same shape is already at ``root``."""
    from layerdiv.analyze.synthetic import synthesize_store

    shape = {"models": models, "tasks": tasks, "instances": instances}
    rows = stored_rows(root, shape)
    if rows is not None:
        return rows
    start = time.perf_counter()
    rows = synthesize_store(root, models, tasks, instances, progress=True)
    print(f"synthesised {rows:,} component-option rows in {time.perf_counter() - start:.1f} s")
    stamp_rows(root, shape, rows)
    return rows


def timed(label: str, args: list[str]) -> tuple[str, float, float]:
    """Run ``layerdiv ARGS`` in a fresh process; (label, wall seconds, peak RSS in MiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "layerdiv.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{label} failed: {proc.stderr.read() if proc.stderr else ''}")
    return label, wall, usage.ru_maxrss / 1024
