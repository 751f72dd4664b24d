"""What every benchmark shares: the ``--quick`` flag (tiny sizes, one repeat: the check that the
script still runs, which ``make bench-quick`` makes of every script), wall and CPU timing
(:func:`timed`), the demo's choice tasks by name, a running-text task of BBC News articles and
the timed extraction of a task into a fresh store (:func:`extract_seconds`), and the results
file a full run writes (``docs/benchmarks/<name>.json``: its table, with the date, commit and
load average it ran at), from which ``scripts/bench_tables.py`` renders the benchmark tables of
the docs and the README."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks"
"""The results files of the full runs, one per benchmark table."""


def add_quick(parser: argparse.ArgumentParser) -> None:
    """The ``--quick`` flag: tiny sizes and one repeat, in seconds; the results file goes to a
    temporary folder (:func:`record`), not the docs."""
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, one repeat: check that it runs"
    )


def timed(fn: Callable[[], Any], repeat: int = 3) -> tuple[list[float], list[float]]:
    """The wall seconds and the CPU seconds (user + system, of this process and of the child
    processes it waited for) of each of ``repeat`` calls of ``fn``."""
    walls, cpus = [], []
    for _ in range(repeat):
        cpu, wall = _cpu_seconds(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(_cpu_seconds() - cpu)
    return walls, cpus


def _cpu_seconds() -> float:
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def demo_choice_tasks(folder: Path, n: int, seed: int) -> list[Path]:
    """The YAMLs of the demo's choice tasks (``n`` instances each, written into ``folder``) in
    the order of ``DEMO_TASKS``, taken by name: the demo also writes its running-text task."""
    from layerdiv.demo import DEMO_TASKS, write_demo_tasks

    paths = {path.stem: path for path in write_demo_tasks(folder, n, seed)}
    return [paths[task.name] for task in DEMO_TASKS]


def bbc_text_task(
    folder: Path,
    docs: int,
    max_tokens: int | None,
    name: str,
    answer: tuple[int, int] | None = None,
    paragraphs: int = 8,
) -> Path:
    """A text task ``name`` of ``docs`` BBC News articles (evenly spread over the corpus, each of
    its first ``paragraphs`` paragraphs), each cut to ``max_tokens`` tokens (None: whole), written
    into ``folder``. With ``answer`` (chars, length): each article's first ``chars`` characters,
    then the next ``length`` as its answer (shorter articles left out)."""
    from layerdiv.demo import bbc_articles

    articles = bbc_articles(paragraphs=paragraphs)
    if answer is not None:
        articles = [r for r in articles if len(r["text"]) > sum(answer)]
    rows = articles[:: max(1, len(articles) // docs)][:docs]
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec: dict[str, Any] = {"name": name, "kind": "text", "data": f"{name}.jsonl",
                            "text": "{{ text }}", "n": len(rows)}  # fmt: skip
    if max_tokens is not None:
        spec["max_tokens"] = max_tokens
    if answer is not None:
        chars, length = answer
        spec["text"] = f"{{{{ text[:{chars}] }}}}"
        spec["answer"] = f"{{{{ text[{chars}:{chars + length}] }}}}"
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(spec))
    return path


def extract_seconds(task: Path, store: Path, settings: dict[str, Any]) -> tuple[float, float]:
    """Extract the demo's model on ``task`` into the fresh ``store`` with the measurements of
    ``settings`` (by name: their settings given, ``ExtractConfig.measurement_settings``):
    (CPU, wall) seconds of its ``extract_task`` (the partition opened, every chunk computed and
    written, the model already loaded; CPU of the process, every thread, the background
    writer's included)."""
    import layerdiv.extract.runner as runner_module
    from layerdiv.demo import DEMO_MODEL
    from layerdiv.extract.config import ExtractConfig

    times: list[tuple[float, float]] = []
    inner = runner_module.extract_task

    def timed_task(*args: Any, **kwargs: Any) -> Any:
        cpu, wall = time.process_time(), time.perf_counter()
        out = inner(*args, **kwargs)
        times.append((time.process_time() - cpu, time.perf_counter() - wall))
        return out

    config = ExtractConfig(
        DEMO_MODEL, [str(task)], store, measurement_settings=settings, progress=False
    )
    runner_module.extract_task = timed_task
    try:
        runner_module.run_extract(config)
    finally:
        runner_module.extract_task = inner
    return times[-1]


def text_extract_args(
    description: str,
    docs: tuple[int, int] = (16, 2),
    sizes: Mapping[str, tuple[int, int, str]] | None = None,
) -> argparse.Namespace:
    """The options of a benchmark of a measurement on running text, torch's threads set:
    ``--docs`` (``docs``: the default and the ``--quick`` value), ``--repeats 3`` (``--quick``:
    1), ``--threads 1``, and each of ``sizes`` (option name: its default, its ``--quick``
    value and help; default ``--max-tokens 256``, ``--quick`` 32)."""
    import torch

    sizes = {"max-tokens": (256, 32, "tokens per article (cut)")} if sizes is None else sizes
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--docs", type=int, default=docs[0], help="BBC News articles")
    for name, (default, _, help) in sizes.items():
        parser.add_argument(f"--{name}", type=int, default=default, help=help)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    add_quick(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.docs, args.repeats = docs[1], 1
        for name, (_, quick, _) in sizes.items():
            setattr(args, name.replace("-", "_"), quick)
    return args


def against_plain(
    task: Path, root: Path, settings: dict[str, Any], repeats: int, loads: list[float]
) -> dict[bool, list[tuple[float, float]]]:
    """(CPU, wall) seconds of ``repeats`` plain extractions of ``task`` (False) and as many with
    the measurements of ``settings`` (True), in rotating order, each into a fresh store
    ``root/store-<repeat>-<0|1>``, after a plain warm-up (the model converted and cached, pages
    warm); the load average after each run appended to ``loads``."""
    extract_seconds(task, root / "warm-up", {})
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for r in range(repeats):
        for measured in (False, True) if r % 2 == 0 else (True, False):
            store = root / f"store-{r}-{int(measured)}"
            runs[measured].append(extract_seconds(task, store, settings if measured else {}))
            loads.append(os.getloadavg()[0])
    return runs


def _commit() -> str:
    """The checkout's commit (short), ``+changes`` when its tracked files differ from it; in a
    copy without git, the environment's ``LAYERDIV_COMMIT`` (else ``unknown``)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/benchmarks")
    head = git("rev-parse", "--short", "HEAD")
    if not head:  # a copy without git (a GPU node): the commit the copy was made from, if named
        return os.environ.get("LAYERDIV_COMMIT", "unknown")
    return head + ("+changes" if dirty else "")


def record(name: str, columns: list[str], rows: list[list[Any]], loads: list[float],
           **extra: Any) -> Path:  # fmt: skip
    """Write the results file ``name`` (a table: ``columns`` and ``rows``, numbers unformatted)
    with the command, date (UTC), commit, cores and the load averages seen during the run; a
    ``--quick`` run's into a temporary folder (the check that it is still written)."""
    quick = "--quick" in sys.argv[1:]
    folder = Path(tempfile.gettempdir()) / "layerdiv-bench-results-quick" if quick else RESULTS
    path = folder / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "command": shlex.join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "cores": os.cpu_count(),
        "load_average": [round(min(loads), 2), round(max(loads), 2)],
        "columns": columns,
        "rows": rows,
        **extra,
    }
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results written to {path if quick else os.path.relpath(path, ROOT)}")
    return path


def _layout() -> str:
    """A digest of the store layout this code writes (the key columns and every table's schema),
    so that a store synthesised by another release is not reused."""
    from layerdiv.measurements import tables_of
    from layerdiv.schemas import SCHEMA_VERSION
    from layerdiv.store.key import KEY

    schemas = sorted((name, str(schema)) for name, schema in tables_of(SCHEMA_VERSION).items())
    return hashlib.sha256(repr((KEY, schemas)).encode()).hexdigest()


def stored_rows(root: Path, shape: dict[str, Any]) -> int | None:
    """The rows of the synthetic store at ``root`` if it has this ``shape`` and this release's
    layout (its ``bench.json``); otherwise None, with the folder removed for a new one."""
    stamp = root / "bench.json"
    if stamp.is_file():
        found = json.loads(stamp.read_text())
        if found.get("shape") == shape and found.get("layout") == _layout():
            return int(found["rows"])
    shutil.rmtree(root, ignore_errors=True)
    return None


def stamp_rows(root: Path, shape: dict[str, Any], rows: int) -> None:
    """Record that the store at ``root`` has this ``shape``, layout and ``rows``."""
    (root / "bench.json").write_text(
        json.dumps({"shape": shape, "layout": _layout(), "rows": rows})
    )
