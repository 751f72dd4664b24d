"""Write-path integrity of `layerdiv extract`: concurrent writers, interrupted runs, damaged or
tampered stores and overwrites. Where two processes are needed they are real subprocesses with
staggered starts (one mid-run when the next opens the partition)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner

from layerdiv.cli import main
from layerdiv.store import Store

TIMEOUT = 180


def command(model: Path, task: Path, store: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "layerdiv.cli", "extract", "--model", str(model),
            "--task", str(task), "--store", str(store), *args]  # fmt: skip


def start(cmd: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def parts(store: Path) -> list[Path]:
    return sorted(store.glob("instances/**/part-*.parquet"))


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, out, err


def check_exact(store: Path, n: int, per_instance: int) -> None:
    """Exactly instances 0..n-1, each once, in both tables."""
    s = Store(store)
    inst = s.scan("instances").collect()
    assert sorted(inst["instance"].to_list()) == list(range(n))
    comps = s.scan("components").collect()
    assert comps.height == n * per_instance
    keys = comps.select(pl.struct("instance", "component", "option").n_unique()).item()
    assert keys == comps.height


def extract(*args: str) -> Any:
    return CliRunner().invoke(main, ["extract", *args], catch_exceptions=False)


def first_run(
    tmp_path: Path, model_dirs: Any, make_task: Any, *args: str
) -> tuple[list[str], Path, Path]:
    """A stored extraction of a 12-instance task: (its arguments, the store, the task YAML)."""
    task = make_task(tmp_path / "task", n=12)
    store = tmp_path / "store"
    common = ["--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store)]
    assert extract(*common, *args).exit_code == 0
    return common, store, task


def run_records(store: Path) -> int:
    return len(list(store.glob("manifests/**/runs/*.json")))


def test_three_concurrent_shards_store_each_instance_once(
    tmp_path: Path, model_dirs: Any, make_task: Any, stored: Any
) -> None:
    n = 36
    task = make_task(tmp_path / "task", n=n)
    store = tmp_path / "store"
    base = command(model_dirs("llama"), task, store, "--chunk-size", "3", "--batch-size", "1")
    procs: list[subprocess.Popen[str]] = []
    try:
        for i in range(3):  # each opens the partition while the earlier shards are mid-run
            procs.append(start([*base, "--shard", f"{i}/3"]))
            wait_for(lambda: run_records(store) == i + 1, "the shard's run record")  # noqa: B023
            if i < 2:
                have = len(parts(store))
                wait_for(lambda: len(parts(store)) > have, "the shard's first part")  # noqa: B023
                procs[-1].send_signal(signal.SIGSTOP)  # frozen mid-run
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
    results = [finish(p) for p in procs]
    assert [r[0] for r in results] == [0, 0, 0], results
    assert [stored(r[1])[2] for r in results] == [12, 12, 12]
    check_exact(store, n, 5 * 2)


@pytest.mark.parametrize(
    ("first", "second", "n"),
    [
        (["--chunk-size", "8", "--limit", "48"], ["--chunk-size", "12", "--limit", "48"], 48),
        (["--chunk-size", "16", "--limit", "20"], ["--chunk-size", "16", "--limit", "32"], 32),
    ],
    ids=["chunk-sizes", "limits"],
)
def test_two_runs_at_once_claim_chunks_instead_of_duplicating(
    first: list[str],
    second: list[str],
    n: int,
    tmp_path: Path,
    model_dirs: Any,
    make_task: Any,
    stored: Any,
) -> None:
    task = make_task(tmp_path / "task", n=60)
    store = tmp_path / "store"
    base = command(model_dirs("llama"), task, store, "--batch-size", "1")
    one = start([*base, *first])
    wait_for(lambda: len(parts(store)) >= 1, "the first run's first part")
    one.send_signal(signal.SIGSTOP)  # frozen mid-run, holding the chunk it computes
    try:
        two = start([*base, *second])
        runs = next(store.glob("manifests/*/*/*")) / "runs"
        wait_for(lambda: len(list(runs.glob("*.json"))) == 2, "the second run's record")
        seen = -1
        while seen != len(parts(store)):  # until the second run has taken what it could
            seen = len(parts(store))
            time.sleep(1.0)
    finally:
        one.send_signal(signal.SIGCONT)
    (rc1, out1, err1), (rc2, out2, err2) = finish(one), finish(two)
    assert rc1 == rc2 == 0, (err1, err2)
    assert stored(out2)[2] > 0 and stored(out1)[2] + stored(out2)[2] == n  # nothing done twice
    if "--chunk-size" in second and second[1] != first[1]:
        assert f"chunk grid is {first[1]} instances (--chunk-size {second[1]}" in out2
    check_exact(store, n, 5 * 2)  # the reader refuses overlapping parts


def interrupt(signum: int, tmp_path: Path, model: Path, task: Path) -> tuple[list[str], int]:
    """Start an extraction, send ``signum`` once three chunks are stored, and check that it
    exits 128 + signum with one line saying how to resume and every stored part intact;
    returns the command and the number of chunks stored."""
    store = tmp_path / "store"
    cmd = command(model, task, store, "--chunk-size", "4", "--batch-size", "1")
    proc = start(cmd)
    wait_for(lambda: len(parts(store)) >= 3, "three chunks")
    proc.send_signal(signum)
    rc, _, err = finish(proc)
    assert rc == 128 + signum, err
    assert "Traceback" not in err
    (line,) = [s for s in err.splitlines() if s.startswith("Error:")]
    assert f"interrupted by {signal.Signals(signum).name}" in line
    assert "run the same command again to resume" in line
    assert not list(store.rglob("*.tmp"))  # no partial chunk left behind
    Store(store)  # every stored part is complete and readable
    return cmd, len(parts(store))


def test_sigterm_mid_run_then_resume_gives_exactly_n(
    tmp_path: Path, model_dirs: Any, make_task: Any, stored: Any
) -> None:
    n = 160
    cmd, done = interrupt(signal.SIGTERM, tmp_path, model_dirs("llama"), make_task(tmp_path, n=n))
    assert 3 <= done < n // 4
    resumed = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert stored(resumed.stdout)[2] == n - 4 * done
    check_exact(tmp_path / "store", n, 5 * 2)


def test_ctrl_c_exits_130(tmp_path: Path, model_dirs: Any, make_task: Any) -> None:
    _, done = interrupt(signal.SIGINT, tmp_path, model_dirs("llama"), make_task(tmp_path, n=400))
    assert 3 <= done < 100


def test_overwrite_with_shards_happens_once(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    n = 60
    store = tmp_path / "store"
    old = make_task(tmp_path / "old", n=n, template="{{ text }} Answer: {{ answer }}")
    model = str(model_dirs("llama"))
    assert extract("--model", model, "--task", str(old), "--store", str(store)).exit_code == 0
    task = make_task(tmp_path / "task", n=n)
    args = ["--model", model, "--task", str(task), "--store", str(store), "--chunk-size", "4"]
    first = extract(*args, "--shard", "0/2", "--overwrite")
    assert first.exit_code == 0 and "resumed" not in first.output
    second = extract(*args, "--shard", "1/2", "--overwrite")
    assert second.exit_code == 0, second.output
    assert "holds this extraction already (another shard replaced it), so it is resumed" in (
        second.output
    )
    check_exact(store, n, 5 * 2)


def test_edited_data_is_a_different_extraction(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    args, store, task = first_run(tmp_path, model_dirs, make_task, "--limit", "6")
    data = task.with_suffix(".jsonl")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[9]["text"] = "an edited row"  # beyond --limit 6, within the task's n
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = sorted(p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file())
    out = extract(*args, "--limit", "12")
    assert out.exit_code == 1
    assert "holds a different extraction (data_sha256: stored '" in out.output
    assert sorted(p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()) == before


def test_damaged_parts_are_redone(
    tmp_path: Path, model_dirs: Any, make_task: Any, stored: Any
) -> None:
    args, store, _ = first_run(tmp_path, model_dirs, make_task, "--chunk-size", "4")
    (inst,) = store.glob("instances/**/part-0000004-000004.parquet")
    (comp,) = store.glob("components/**/part-0000008-000004.parquet")
    inst.write_bytes(inst.read_bytes()[:-50])  # truncated copies
    comp.write_bytes(comp.read_bytes()[: comp.stat().st_size // 2])
    out = extract(*args)
    assert out.exit_code == 0, out.output
    redone = "was unreadable, incomplete or of other settings: redone"
    assert f"{inst} {redone}" in out.output
    assert f"{inst.parent / comp.name} {redone}" in out.output
    assert stored(out.output)[2] == 8
    check_exact(store, 12, 5 * 2)


def test_a_partition_without_manifest_is_never_adopted(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    args, store, _ = first_run(tmp_path, model_dirs, make_task, "--limit", "6")
    (manifest,) = store.glob("manifests/**/manifest.json")
    (manifest.parent / ".manifest.json.somehost.1.ab12.tmp").write_text("{")
    out = extract(*args)  # a leftover manifest temporary is no problem
    assert out.exit_code == 0 and "Traceback" not in out.output, out.output
    manifest.unlink()
    for extra in ([], ["--limit", "6"]):
        out = extract(*args, *extra)
        assert out.exit_code == 1
        assert "has data but no manifest: it cannot be trusted" in out.output
        assert not manifest.exists()
    assert extract(*args, "--overwrite").exit_code == 0
    check_exact(store, 12, 5 * 2)


def test_an_unwritable_store_is_refused_before_the_model_loads(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    task = make_task(tmp_path / "task", n=4)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for store in ("/proc/layerdiv-store", str(blocker / "store")):
        out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", store)
        assert out.exit_code == 1
        assert f"cannot write the store {store}" in out.output
        assert "Loading weights" not in out.output and "Traceback" not in out.output


def test_writers_without_working_locks_redo_work_but_store_each_instance_once(
    tmp_path: Path, model_dirs: Any, make_task: Any, stored: Any
) -> None:
    """A file system whose locks do nothing across writers (NFS without lockd, Lustre without
    ``-o flock``, as a node-local lock acts): three runs at once each compute the chunks they see
    missing; renames into place keep every part whole, so the store holds each instance once."""
    n = 18
    task = make_task(tmp_path / "task", n=n)
    store = tmp_path / "store"
    no_locks = "import fcntl, sys; fcntl.flock = lambda fd, op: None; from layerdiv.cli import main; sys.argv[0] = 'layerdiv'; main()"  # noqa: E501
    base = [sys.executable, "-c", no_locks,
            *command(model_dirs("llama"), task, store, "--chunk-size", "3", "--batch-size", "1")[3:]]  # fmt: skip  # noqa: E501
    procs = [start(base) for _ in range(3)]
    results = [finish(p) for p in procs]
    assert [r[0] for r in results] == [0, 0, 0], results
    assert sum(stored(r[1])[2] for r in results) >= n  # work done more than once, maybe
    check_exact(store, n, 5 * 2)
