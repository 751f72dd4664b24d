"""Nothing partial presented as whole, nothing lost: optional tables that some stored instances
lack are left out of every reader with a note naming the command that completes them, and a
folder replaced into place (merge, analyze --out, report --out) survives a crash at any rename."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from polars.testing import assert_frame_equal

from layerdiv.analyze.api import analyze
from layerdiv.cli import main
from layerdiv.store import Store
from layerdiv.store.writer import PartitionWriter

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
    m = re.search(rf"{table} left out for partition model=\S+ task=reviews: .*?`(layerdiv [^`]+)`",
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
    done = run(*note_command(with_heads.output, "heads"))
    assert done.exit_code == 0, done.output
    [info] = Store(store).select()
    assert info.tables == ["heads"] and len(info.files("heads")) == N // CHUNK
    query = run("query", "SELECT count(DISTINCT instance) AS n FROM heads", "--store", str(store))
    assert query.exit_code == 0 and re.search(rf"\b{N}\b", query.output) and not query.stderr
    # a later shard without --heads adds them too: the partition has them
    for table in ("instances", "heads"):
        (part,) = store.glob(f"{table}/*/*/part-0000012-000004.parquet")
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
