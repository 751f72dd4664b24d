"""How long ``layerdiv ls`` takes on a checkpoint sweep (a script, not a test).

Writes a store of manifests only (no parts: ``ls`` reads the manifests, their run records and
table markers, and lists every table's folders) for one model at ``--revisions`` revisions
(``step0``, ``step1000``, ...) x ``--tasks`` tasks, each manifest the one a synthetic choice
partition records with its revision, step, tokens seen and fingerprint, then times
``layerdiv ls`` in fresh processes (wall and CPU seconds, best and median of ``--repeat``; on a
machine shared with other work the CPU time is the fairer figure) and prints the verdict against
the target (under 2 s for 1,000 revisions x 8 tasks).

    python benchmarks/bench_ls.py [--revisions 1000] [--tasks 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_quick, timed

TARGET_S = 2.0


def build(root: Path, revisions: int, tasks: int) -> None:
    """The manifests of ``revisions`` x ``tasks`` partitions of one model under ``root``."""
    from layerdiv.analyze.synthetic import component_infos, decoder_kinds
    from layerdiv.store.key import PartitionKey
    from layerdiv.store.manifest import Manifest
    from layerdiv.store.paths import partition, slug

    base = Manifest(
        model="org/sweep", task="", revision="", weights_fingerprint="synthetic",
        dtype="float32", model_type="synthetic", adapter="synthetic", norm="rms",
        n_params=160_000_000, context_length=2048, options=["A", "B"], option_token_ids=[1, 2],
        option_tokens=["A", "B"], template_sha256="synthetic", task_spec={},
        components=component_infos(decoder_kinds(12)), n_requested=1000, sum_tolerance=1e-4,
        chunk_size=1024, hidden_size=768, n_layers=12, vocab_size=50304,
    )  # fmt: skip
    data = json.loads(base.to_json())
    for r in range(revisions):
        step = 1000 * r
        for t in range(tasks):
            key = PartitionKey(slug(base.model), f"step{step}", f"task{t}")
            path = partition(root, key).manifest
            path.parent.mkdir(parents=True)
            data.update(task=key.task, revision=key.revision, step=step,
                        tokens_seen=step * 2_097_152, weights_hash=f"{r:032x}")  # fmt: skip
            path.write_text(json.dumps(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--revisions", type=int, default=1000)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.revisions, args.tasks, args.repeat = 10, 2, 1
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        start = time.perf_counter()
        build(store, args.revisions, args.tasks)
        n = args.revisions * args.tasks
        print(f"wrote {n:,} manifests ({args.revisions} revisions x {args.tasks} tasks) in "
              f"{time.perf_counter() - start:.1f} s")  # fmt: skip
        cmd = [sys.executable, "-m", "layerdiv.cli", "ls", "--store", str(store)]
        listed: list[str] = []
        walls, cpus = timed(
            lambda: listed.append(
                subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            ),
            args.repeat,
        )
        rows = sum(1 for line in listed[-1].splitlines() if "step" in line)
        print(f"layerdiv ls: {rows:,} partitions listed, fresh process (import included): wall "
              f"s best {min(walls):.2f}, median {statistics.median(walls):.2f}; CPU s best "
              f"{min(cpus):.2f}, median {statistics.median(cpus):.2f}")  # fmt: skip
        with open("/proc/loadavg") as f:
            print(f"load average while measured: {f.read().split()[0]}")
        verdict = {
            t: "met" if min(v) < TARGET_S else "missed" for t, v in (("wall", walls), ("CPU", cpus))
        }
        print(f"target: under {TARGET_S:.0f} s for 1,000 revisions x 8 tasks: {verdict}")


if __name__ == "__main__":
    main()
