"""Cost of ``extract --states all`` on a text task (a script, not a test): SmolLM2-135M-Instruct
(fp32, CPU) on BBC News running text, a plain text extraction against the same with every
position's residual states, each into a fresh store.

    python benchmarks/bench_states.py [--docs 16] [--max-tokens 256] [--repeats 3] [--threads 1]
        [--quick]

Each repeat runs both extractions (in rotating order) through ``run_extract``; the time of one is
that of its ``extract_task`` (the partition opened, every chunk computed and written, the model
already loaded): CPU seconds of the process (every thread, the background writer's included) and
wall seconds. The disk's speed is measured here: the states' byte count written to a file in
the same folder and fsynced.

Torch runs ``--threads`` threads (default 1, as ``bench_text_extract.py``): the states' Parquet
part is written by the extraction's background writer thread while the next chunk's forward
runs, and with as many torch threads as cores the threads of every parallel operation spin while
the writer holds one of them, which counts the wait, not the work, in CPU time.

Targets: ``--states all`` at most 1.15 x the plain extraction's CPU time plus its bytes at the
disk's speed; the ``states`` files on disk within 1.10 x rows x (L + 1) x d x dtype bytes
(``layerdiv.measurements.states.states_size``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from common import against_plain, bbc_text_task, record, text_extract_args

from layerdiv.demo import DEMO_MODEL
from layerdiv.measurements.states import states_size
from layerdiv.store import Store
from layerdiv.store.location import human_bytes


def disk_rate(folder: Path, size: int) -> float:
    """Bytes per second of writing ``size`` bytes to a file in ``folder`` and fsyncing it."""
    data = np.random.default_rng(0).integers(0, 255, size=size, dtype=np.uint8)
    path = folder / "disk-speed.bin"
    start = time.perf_counter()
    with path.open("wb") as fh:
        fh.write(data.tobytes())
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return size / seconds


def main() -> None:
    args = text_extract_args(__doc__.split("\n\n")[0])
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        task = bbc_text_task(root, args.docs, args.max_tokens, "bbc-states-bench")
        runs = against_plain(task, root, {"states": {"states": "all"}}, args.repeats, loads)
        (info,) = Store(root / "store-0-1").select()
        key, _, values, _ = info.states()
        on_disk = sum(f.stat().st_size for f in (info.partition.dir("states")).glob("*.parquet"))
        dtype = info.manifest.settings["states"]["states_dtype"]
        layers, width = values.shape[1], values.shape[2]
        expected = states_size(len(key), layers, width, dtype)
        rate = disk_rate(root, on_disk)
    plain_cpu = statistics.median(c for c, _ in runs[False])
    states_cpu = statistics.median(c for c, _ in runs[True])
    plain_wall = statistics.median(w for _, w in runs[False])
    states_wall = statistics.median(w for _, w in runs[True])
    disk_s = on_disk / rate
    allowed = 1.15 * plain_cpu + disk_s
    tokens = len(key) + args.docs  # every stored position and each document's first
    print(f"{DEMO_MODEL} (fp32, CPU) on {args.docs} BBC News documents, {tokens} tokens; "
          f"{os.cpu_count()} CPUs, load average {min(loads):.1f} to {max(loads):.1f} (other "
          f"work shares this machine); medians of {args.repeats} repeats")  # fmt: skip
    print(f"plain text extraction: {plain_cpu:.2f} s CPU ({plain_wall:.2f} s wall)")
    print(f"--states all:          {states_cpu:.2f} s CPU ({states_wall:.2f} s wall); ratio "
          f"{states_cpu / plain_cpu:.3f} CPU, {states_wall / plain_wall:.3f} wall")  # fmt: skip
    print(f"states written: {human_bytes(on_disk)} at the disk's {human_bytes(rate)}/s = "
          f"{disk_s:.2f} s; target: CPU <= 1.15 x plain + that = {allowed:.2f} s -> "
          f"{'met' if states_cpu <= allowed else 'NOT met'}")  # fmt: skip
    ratio = on_disk / expected
    print(f"states on disk: {on_disk:,} bytes for {len(key):,} positions x {layers} layers x d "
          f"{width} x {dtype} = {expected:,} bytes: {ratio:.3f} x (target <= 1.10 -> "
          f"{'met' if ratio <= 1.10 else 'NOT met'})")  # fmt: skip
    if not args.quick:
        record(
            "bench_states",
            ["measure", "figure", "target"],
            [
                ["plain text extraction, CPU s", round(plain_cpu, 2), ""],
                ["--states all, CPU s", round(states_cpu, 2), f"<= {allowed:.2f}"],
                ["--states all / plain, CPU", round(states_cpu / plain_cpu, 3), ""],
                ["states written at disk speed, s", round(disk_s, 2), ""],
                ["states on disk / (rows x (L + 1) x d x dtype)", round(ratio, 3), "<= 1.10"],
            ],
            loads,
            threads=args.threads,
        )


if __name__ == "__main__":
    main()
