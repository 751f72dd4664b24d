"""Nothing partial presented as whole, nothing lost: optional tables that some stored instances
lack are left out of every reader with a note naming the command that completes them, and a
folder replaced into place (merge, analyze --out, report --out) survives a crash at any rename."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner, Result
from polars.testing import assert_frame_equal

from layerdiv.analyze.api import analyze
from layerdiv.analyze.synthetic import random_partition, write_partition
from layerdiv.cli import main
from layerdiv.demo import write_demo_tasks
from layerdiv.extract.launchers import LaunchError, Shard, parse_shard
from layerdiv.store import Store, atomic
from layerdiv.store.writer import PartitionWriter
from tests.conftest import write_synthetic_store

N, CHUNK = 16, 4


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def extract(model: Path, task: Path, store: Path, *args: str) -> Result:
    result = run("extract", "--model", str(model), "--task", str(task), "--store", str(store),
                 "--chunk-size", str(CHUNK), "--batch-size", "4", *args)  # fmt: skip
    assert result.exit_code == 0, result.output
    return result


def note_command(text: str, table: str) -> list[str]:
    """The arguments of the command a note names to complete ``table``."""
    where = r"partition model=\S+ revision=\S+ task=reviews"
    m = re.search(rf"{table} left out for {where}: .*?`(layerdiv [^`]+)`",
                  text)  # fmt: skip
    assert m, text
    return shlex.split(m.group(1))[1:]


class Killed(BaseException):
    """The process dies here (nothing after this point runs, as after kill -9)."""


def die_after_first_part(monkeypatch: pytest.MonkeyPatch, table: str) -> None:
    write = PartitionWriter.write_table_part

    def write_then_die(self: PartitionWriter, name: str, *args: Any) -> None:
        write(self, name, *args)
        if name == table:
            raise Killed

    monkeypatch.setattr(PartitionWriter, "write_table_part", write_then_die)


def test_killed_backfill_is_left_out_then_completed(
    tmp_path: Path, model_dirs: Any, make_task: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, task = model_dirs("llama"), make_task(tmp_path / "task", n=N)
    store, whole = tmp_path / "store", tmp_path / "whole"
    extract(model, task, whole, "--gram")
    extract(model, task, store)
    with monkeypatch.context() as patch, pytest.raises(Killed):
        die_after_first_part(patch, "gram")
        run("extract", "--model", str(model), "--task", str(task), "--store", str(store),
            "--chunk-size", str(CHUNK), "--batch-size", "4", "--gram")  # fmt: skip
    assert not list(store.rglob("tables/gram"))  # no marker before every chunk has its part
    [info] = Store(store).select()
    assert len(info.files("gram")) == 1 and "gram" not in info.tables

    results = analyze(store)
    assert "gram_blocks" not in results.names() and "geometry" in results.names()
    [note] = [n for n in results.notes if n.startswith("gram left out")]
    assert f"{N - CHUNK} of its {N} stored instances lack it" in note
    listed = run("ls", "--store", str(store))
    assert "gram (incomplete)" in listed.output and "gram left out" in listed.output
    query = run("query", "SELECT count(*) AS n FROM gram", "--store", str(store))
    assert query.exit_code == 1 and "gram" in query.output
    query = run("query", "SELECT count(*) AS n FROM instances", "--store", str(store))
    assert query.exit_code == 0 and "gram left out" in query.stderr

    done = run(*note_command(note, "gram"))
    assert done.exit_code == 0, done.output
    assert f"added gram to {N - CHUNK} stored instances" in done.output
    assert list(store.rglob("tables/gram"))
    completed, reference = analyze(store), analyze(whole)
    assert not [n for n in completed.notes if "left out" in n]
    assert_frame_equal(completed.gram_blocks, reference.gram_blocks, rel_tol=1e-5, abs_tol=1e-5)


def test_shards_with_mixed_flags_never_give_half_a_table(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    model, task = model_dirs("llama"), make_task(tmp_path / "task", n=N)
    store = tmp_path / "store"
    extract(model, task, store, "--shard", "1/2")  # started at once: neither saw the other's flags
    with_heads = extract(model, task, store, "--shard", "0/2", "--heads")
    assert "heads left out for partition" in with_heads.output
    query = run("query", "SELECT count(*) FROM heads", "--store", str(store))
    assert query.exit_code == 1  # no heads view over half the instances
    assert "heads left out" in run("ls", "--store", str(store)).output
    note_command(with_heads.output, "heads")
    # the shard without --heads, run again, follows the partition: it adds them to its chunks
    again = extract(model, task, store, "--shard", "1/2")
    assert f"added heads to {N // 2} stored instances" in again.output
    [info] = Store(store).select()
    assert info.tables == ["heads"] and len(info.files("heads")) == N // CHUNK
    query = run("query", "SELECT count(DISTINCT instance) AS n FROM heads", "--store", str(store))
    assert query.exit_code == 0 and re.search(rf"\b{N}\b", query.output) and not query.stderr
    # a later shard without --heads adds them too: the partition has them
    for table in ("instances", "heads"):
        (part,) = store.glob(f"{table}/**/part-0000012-000004.parquet")
        part.unlink()
    extract(model, task, store, "--shard", "1/2")
    assert "heads" in Store(store).select()[0].tables


def test_backfill_with_a_smaller_limit_adds_what_it_can(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    model, task = model_dirs("llama"), make_task(tmp_path / "task", n=N)
    store = tmp_path / "store"
    extract(model, task, store)
    half = extract(model, task, store, "--gram", "--limit", str(N // 2))
    assert f"added gram to {N // 2} stored instances" in half.output
    assert f"{N // 2} of its {N} stored instances lack it" in half.output
    assert f"--limit {N}" in half.output
    assert not list(store.rglob("tables/gram"))
    extract(model, task, store, "--gram")
    assert Store(store).select()[0].tables == ["gram"]


# --- crash at every rename of a replacement -----------------------------------------------------

CRASH_AT = """
import os, sys
from layerdiv.store import atomic
k, calls = int(sys.argv[1]), [0]
def crashing(rename):
    def call(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            os._exit(86)  # killed here: no cleanup runs
        return rename(*args, **kwargs)
    return call
os.replace, os.rename = crashing(os.replace), crashing(os.rename)
atomic._exchange = crashing(atomic._exchange) if sys.argv[2] == "exchange" else (lambda a, b: False)
from layerdiv.cli import main
from layerdiv.demo import write_demo_tasks
from layerdiv.extract.launchers import LaunchError, Shard, parse_shard
main(sys.argv[3:])
"""
SWAPS = ["exchange", "renames"]
"""Folder replacement in one step (Linux), and by two renames (elsewhere)."""


def crash_at_each_rename(swap: str, fresh: Any, args: Any, check: Any) -> int:
    """For k = 1, 2, ...: on a ``fresh(k)`` copy, run the command ``args(k)`` killed at its k-th
    rename (``os.replace``, ``os.rename`` or the folder exchange), then ``check(k)``; until a
    run completes. Returns the number of renames of a complete run."""
    for k in itertools.count(1):
        fresh(k)
        proc = subprocess.run([sys.executable, "-c", CRASH_AT, str(k), swap, *args(k)],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode == 0:
            return k - 1
        assert proc.returncode == 86, proc.stderr
        check(k)
    raise AssertionError("unreachable")


def contents(root: Path) -> dict[tuple[str, str], list[int]]:
    """Every partition's instances and components rows (their hashes, sorted)."""
    return {
        (p.model, p.task): sorted(
            h for t in ("instances", "components") for h in pl.read_parquet(p.files(t)).hash_rows()
        )
        for p in Store(root).partitions
    }


@pytest.mark.parametrize("swap", SWAPS)
def test_merge_killed_at_any_rename_loses_nothing(tmp_path: Path, swap: str) -> None:
    full = write_synthetic_store(tmp_path / "full", seed=3, n=6, blocks=(2, 3))
    into, source = tmp_path / "into", tmp_path / "source"
    for folder, dropped in ((into, "org--large"), (source, "org--small")):
        shutil.copytree(full, folder)
        for part in folder.glob(f"*/model={dropped}"):
            shutil.rmtree(part)
    before, after = contents(into), contents(full)
    dst = lambda k: tmp_path / f"into-{k}"  # noqa: E731

    def check(k: int) -> None:
        assert contents(dst(k)) in (before, after)  # a reader finds the old store or the new
        rerun = run("merge", str(source), "--into", str(dst(k)))
        assert rerun.exit_code == 0, rerun.output
        assert contents(dst(k)) == after
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]

    renames = crash_at_each_rename(
        swap,
        lambda k: shutil.copytree(into, dst(k)),
        lambda k: ["merge", str(source), "--into", str(dst(k))],
        check,
    )
    assert renames >= (3 if swap == "exchange" else 4)


def test_result_folder_killed_at_any_rename_is_old_or_new(tmp_path: Path) -> None:
    """``analyze --out`` (``report --out`` replaces its folder the same way: ``result_dir``)."""
    store = write_synthetic_store(tmp_path / "store", seed=4, n=6, blocks=(2, 3))
    out = tmp_path / "out"
    args = ["analyze", "--store", str(store), "--out", str(out), "--task", "boolq", "--model",
            "org/small"]  # fmt: skip
    first = run(*args)
    assert first.exit_code == 0, first.output
    old = sorted(p.relative_to(out) for p in out.rglob("*"))

    def check(k: int) -> None:
        if swap == "renames" and not out.exists():  # between the two renames: kept aside
            [kept] = tmp_path.glob(".out.*.kept")
            assert sorted(p.relative_to(kept) for p in kept.rglob("*")) == old
        else:
            assert sorted(p.relative_to(out) for p in out.rglob("*")) == old
        rerun = run(*args)
        assert rerun.exit_code == 0, rerun.output
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == old
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]

    for swap in SWAPS:
        renames = crash_at_each_rename(
            swap,
            lambda k: None,
            lambda k: args,
            check,
        )
        assert renames == (1 if swap == "exchange" else 2)


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_two_tasks_of_one_name_are_refused_before_anything_is_written(
    tmp_path: Path, model_dirs: Any, make_task: Any, overwrite: list[str]
) -> None:
    one, two = make_task(tmp_path / "one", n=4), make_task(tmp_path / "two", n=6)
    store = tmp_path / "store"
    result = run("extract", "--model", str(model_dirs("llama")), "--task", str(one), "--task",
                 str(two), "--store", str(store), *overwrite)  # fmt: skip
    assert result.exit_code == 1
    [line] = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert str(one) in line and str(two) in line and "both named 'reviews'" in line
    assert not store.exists() or not [p for p in store.rglob("*") if p.is_file()]


def test_shard_syntax_is_strict_and_errors_name_their_source(tmp_path: Path) -> None:
    for value in ("1_0/2_0", "+0/2", "0/2_0", "0/²"):
        with pytest.raises(LaunchError, match=rf"--shard {re.escape(value)}: .* not an integer"):
            parse_shard(value, {})
    assert parse_shard("1/20", {}) == Shard(1, 20)
    task = tmp_path / "missing.yaml"
    result = CliRunner(env={"LAYERDIV_SHARD": "5/2"}).invoke(
        main, ["extract", "--model", "m", "--task", str(task), "--store", str(tmp_path)]
    )
    assert result.exit_code != 0
    assert "LAYERDIV_SHARD=5/2: need 0 <= i < N" in result.output
    assert "--shard" not in result.output.split("LAYERDIV_SHARD=5/2")[1].split(",")[0]
    result = run("extract", "--model", "m", "--task", str(task), "--shard", "1_0/2_0")
    assert "--shard 1_0/2_0: '2_0' is not an integer" in result.output


def test_sql_may_start_with_a_comment_and_rows_come_before_the_count(tmp_path: Path) -> None:
    store = str(write_synthetic_store(tmp_path / "store", seed=5, n=4, blocks=(2, 2)))
    result = run("query", "-- instances per task\nSELECT count(*) AS n FROM instances", "--store",
                 store)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert re.search(r"\b16\b", result.output)
    # The first rows are printed before the rest is counted: a failure late in a huge result
    # comes after them.
    late = (
        "SELECT CASE WHEN i < 900000 THEN i ELSE error('late failure') END AS i "
        "FROM range(1000000) t(i)"
    )
    result = run("query", late, "--store", store, "--max-rows", "3")
    assert result.exit_code == 1
    table, error = result.output.rsplit("Error:", 1)
    assert re.search(r"│ 0\s+│", table) and re.search(r"│ 2\s+│", table) and "late failure" in error


def test_min_params_nan_is_refused(tmp_path: Path) -> None:
    store = str(write_synthetic_store(tmp_path / "store", seed=6, n=4, blocks=(2, 2)))
    for command in ("analyze", "report"):
        result = run(command, "--store", store, "--min-params", "nan", "--out", str(tmp_path / "o"))
        assert (
            result.exit_code == 2 and "--min-params" in result.output and "not nan" in result.output
        )
        assert not (tmp_path / "o").exists()


def gram_store(root: Path, task: str) -> Path:
    """A synthetic partition of 6 instances in chunks of 2 with a (made-up) gram table."""
    rng = np.random.default_rng(7)
    logits, gold, rms, kinds = random_partition(rng, 6, 2, 2)
    write_partition(
        root,
        "org/m",
        task,
        logits,
        gold,
        kinds,
        rms,
        chunk=2,
        optional={"gram": rng.random((6, 3))},
    )
    return root


def test_merge_keeps_what_it_is_given_and_says_what_is_wrong(tmp_path: Path) -> None:
    src, other = gram_store(tmp_path / "src", "boolq"), gram_store(tmp_path / "other", "mnli")
    # an unfinished addition: one chunk has no gram part yet
    next(src.glob("gram/**/part-0000002-000002.parquet")).unlink()
    listed = run("ls", "--store", str(src))
    assert listed.exit_code == 0 and "gram (incomplete)" in listed.output
    real = tmp_path / "real"
    merged = run("merge", str(src), "--into", str(real))
    assert merged.exit_code == 0, merged.output
    [info] = Store(real).select()
    assert info.lacking == {"gram": [(2, 2)]} and not list(real.rglob("tables/gram"))
    # --into a link: the folder it names is updated, the link stays
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    merged = run("merge", str(other), "--into", str(link))
    assert merged.exit_code == 0, merged.output
    assert link.is_symlink() and {p.task for p in Store(real).partitions} == {"boolq", "mnli"}
    # a store inside a store is refused
    nested = run("merge", str(other), "--into", str(other / "inner"))
    assert nested.exit_code == 1 and "is inside the source" in nested.output
    assert not (other / "inner").exists()
    # a folder that is not empty but holds no store is not called empty
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    junk = run("merge", str(tmp_path / "junk"), "--into", str(tmp_path / "x"))
    assert junk.exit_code == 1 and "empty" not in junk.output
    assert "holds no layerdiv partition" in junk.output


def test_layernorm_store_with_gram_is_not_told_to_extract_gram(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    store = tmp_path / "store"
    extract(model_dirs("gpt2"), make_task(tmp_path / "task", n=4), store, "--gram")
    results = analyze(store)
    assert "gram_blocks" in results.names()
    assert not [n for n in results.notes if "--gram" in n], results.notes
    assert [n for n in results.notes if "exact angles are in gram_blocks" in n], results.notes


def test_demo_with_another_n_is_refused_before_its_tasks_change(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    write_demo_tasks(out / "tasks", 10, 0)
    (out / "store").mkdir()  # the demo extracted these tasks
    before = {p.name: p.read_text() for p in (out / "tasks").iterdir()}
    result = run("demo", "--n", "12", "--out", str(out))
    assert result.exit_code == 1
    line = result.output.strip()
    assert "\n" not in line and "another --n, --seed or profile" in line
    assert "--overwrite" not in line
    assert {p.name: p.read_text() for p in (out / "tasks").iterdir()} == before
    assert write_demo_tasks(out / "tasks", 10, 0, out / "store")  # the same demo: fine


def test_a_kept_folder_is_restored_through_a_link_and_dropped_behind_a_new_one(
    tmp_path: Path,
) -> None:
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    (real / "a").write_text("old")
    link.symlink_to(real, target_is_directory=True)
    dead = f".real.{atomic.host()}.999999999.kept"  # left by a killed process
    os.rename(real, tmp_path / dead)
    atomic.restore(link)
    assert (real / "a").read_text() == "old" and not (tmp_path / dead).exists()
    (tmp_path / dead).mkdir()  # killed after the new folder was in place
    atomic.restore(real)
    assert not (tmp_path / dead).exists() and (real / "a").read_text() == "old"
