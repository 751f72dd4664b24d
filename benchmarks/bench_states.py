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

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import add_quick, record

import layerdiv.extract.runner as runner_module
from layerdiv.demo import DEMO_MODEL, bbc_articles
from layerdiv.extract.config import ExtractConfig
from layerdiv.extract.runner import run_extract
from layerdiv.measurements.states import states_size
from layerdiv.store import Store
from layerdiv.store.location import human_bytes


def write_task(folder: Path, docs: int, max_tokens: int) -> Path:
    """A text task of ``docs`` BBC News articles (evenly spread over the corpus), each cut to
    ``max_tokens`` tokens."""
    articles = bbc_articles(paragraphs=8)
    rows = articles[:: max(1, len(articles) // docs)][:docs]
    (folder / "bbc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"name": "bbc-states-bench", "kind": "text", "data": "bbc.jsonl",
            "text": "{{ text }}", "max_tokens": max_tokens, "n": len(rows)}  # fmt: skip
    path = folder / "bbc.yaml"
    path.write_text(json.dumps(spec))
    return path


TIMES: list[tuple[float, float]] = []
"""(CPU, wall) seconds of each ``extract_task`` call."""


def timed_extract_task(*args: Any, **kwargs: Any) -> Any:
    cpu, wall = time.process_time(), time.perf_counter()
    out = _EXTRACT_TASK(*args, **kwargs)
    TIMES.append((time.process_time() - cpu, time.perf_counter() - wall))
    return out


_EXTRACT_TASK = runner_module.extract_task
runner_module.extract_task = timed_extract_task


def extract(task: Path, store: Path, states: bool) -> tuple[float, float]:
    """One extraction into the fresh ``store``: (CPU, wall) seconds of its ``extract_task``."""
    measures = {"states": {"states": "all"}} if states else {}
    config = ExtractConfig(DEMO_MODEL, [str(task)], store, measures=measures, progress=False)
    run_extract(config)
    return TIMES[-1]


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    add_quick(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.docs, args.max_tokens, args.repeats = 2, 32, 1
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        task = write_task(root, args.docs, args.max_tokens)
        extract(task, root / "warm-up", False)  # the model converted and cached, pages warm
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for r in range(args.repeats):
            for states in (False, True) if r % 2 == 0 else (True, False):
                store = root / f"store-{r}-{int(states)}"
                runs[states].append(extract(task, store, states))
                loads.append(os.getloadavg()[0])
        (info,) = Store(root / "store-0-1").select()
        key, _, values = info.states()
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
