"""`layerdiv merge`: shard stores from different machines become one store with the same analysis
as a single run; every refusal is one line and leaves the target as it was."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from polars.testing import assert_frame_equal

from layerdiv.analyze.api import analyze
from layerdiv.cli import main
from layerdiv.schemas import INSTANCES
from layerdiv.store import Store
from layerdiv.store import merge as merge_module
from layerdiv.store.atomic import temp_path

N = 30


def run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones included) with its content."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, model_dirs: Any, make_task: Any) -> Path:
    """``whole`` (one run), ``a`` and ``b`` (shards 0/2 and 1/2 of the same run, as on two
    machines) and ``six`` (shard 0/2 with chunks of 6, overlapping ``a``'s chunks of 4)."""
    root = tmp_path_factory.mktemp("stores")
    task = make_task(root / "task", n=N)
    common = ["extract", "--model", str(model_dirs("llama")), "--task", str(task)]
    for name, extra in (
        ("whole", []),
        ("a", ["--shard", "0/2"]),
        ("b", ["--shard", "1/2"]),
        ("six", ["--shard", "0/2", "--chunk-size", "6", "--limit", "12"]),
    ):
        chunk = [] if "--chunk-size" in extra else ["--chunk-size", "4"]
        out = run(*common, "--store", str(root / name), *chunk, *extra)
        assert out.exit_code == 0, out.output
    return root


def test_merged_shards_give_the_analysis_of_one_store(stores: Path, tmp_path: Path) -> None:
    dst = tmp_path / "merged"
    out = run("merge", str(stores / "a"), str(stores / "b"), "--into", str(dst))
    assert out.exit_code == 0, out.output
    assert f"task=reviews: {N} instances ({N} new)" in out.output
    inst = Store(dst).scan("instances").collect()
    assert sorted(inst["instance"].to_list()) == list(range(N))
    merged, whole = analyze(dst).tables(), analyze(stores / "whole").tables()
    assert merged.keys() == whole.keys()
    for name, frame in whole.items():  # everything but the time each store was created
        assert_frame_equal(
            merged[name].drop("created_at", strict=False),
            frame.drop("created_at", strict=False),
            check_exact=False,
        )
    (info,) = Store(dst).partitions
    assert sorted(r["shard"] for r in info.manifest.runs) == [[0, 2], [1, 2]]  # both runs kept
    # Merging again, or a shard already held, adds nothing and changes no part.
    parts = {k: v for k, v in snapshot(dst).items() if k.endswith(".parquet")}
    again = run("merge", str(stores / "b"), str(dst), "--into", str(dst))
    assert again.exit_code == 0, again.output
    assert f"{N} instances (0 new)" in again.output
    assert {k: v for k, v in snapshot(dst).items() if k.endswith(".parquet")} == parts
    assert not leftovers(tmp_path)


def test_a_shard_merges_into_an_existing_store(stores: Path, tmp_path: Path) -> None:
    dst = tmp_path / "merged"
    shutil.copytree(stores / "a", dst)
    out = run("merge", str(stores / "b"), "--into", str(dst))
    assert out.exit_code == 0, out.output
    assert f"{N} instances ({N - 16} new)" in out.output  # a holds chunks 0, 2, 4, 6 of 4
    assert Store(dst).partitions[0].n_done == N


def refused(tmp_path: Path, dst: Path, *sources: Path) -> str:
    """Run a merge that must be refused; returns its one line after checking that ``dst`` and
    its folder are unchanged."""
    before = snapshot(dst) if dst.is_dir() else dst.read_bytes() if dst.exists() else None
    out = run("merge", *map(str, sources), "--into", str(dst))
    assert out.exit_code == 1, out.output
    (line,) = out.output.strip().splitlines()
    after = snapshot(dst) if dst.is_dir() else dst.read_bytes() if dst.exists() else None
    assert after == before
    assert not leftovers(dst.parent)
    return line


def test_another_extraction_is_refused(stores: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(stores / "b", other)
    (manifest,) = other.glob("manifests/**/manifest.json")
    data = json.loads(manifest.read_text())
    data["dtype"] = "bfloat16"
    manifest.write_text(json.dumps(data))
    dst = tmp_path / "dst"
    shutil.copytree(stores / "a", dst)
    line = refused(tmp_path, dst, other)
    assert "task=reviews:" in line and "hold different extractions" in line
    assert f"dtype: {dst} 'float32', {other} 'bfloat16'" in line


def test_overlapping_chunks_are_refused(stores: Path, tmp_path: Path) -> None:
    line = refused(tmp_path, tmp_path / "dst", stores / "a", stores / "six")
    assert "instances 0..3 of" in line and "overlap instances 0..5 of" in line
    assert "stored twice" in line


def test_two_different_copies_of_one_chunk_are_refused(stores: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(stores / "a", other)
    part = sorted(other.glob("instances/**/part-*.parquet"))[1]
    table = pq.read_table(part)
    table = table.set_column(
        table.schema.get_field_index("sum_error"),
        "sum_error",
        pc.add(table["sum_error"], 1.0),
    )
    pq.write_table(table.cast(INSTANCES), part)
    line = refused(tmp_path, tmp_path / "dst", stores / "a", other)
    assert "instances 8..11 extracted twice, with different bytes" in line


def test_a_source_with_an_unreadable_partition_is_refused(stores: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(stores / "a", other)
    part = sorted(other.glob("instances/**/part-*.parquet"))[1]
    part.write_bytes(part.read_bytes()[:100])
    line = refused(tmp_path, tmp_path / "dst", stores / "b", other)
    assert f"{other} cannot be merged" in line and "part-0000008-000004.parquet" in line


def test_a_target_that_is_not_a_store_is_refused(stores: Path, tmp_path: Path) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("mine")
    line = refused(tmp_path, folder, stores / "a")
    assert "is neither empty nor a readable layerdiv store" in line
    file = tmp_path / "file"
    file.write_text("x")
    assert "is a file, not a store" in refused(tmp_path, file, stores / "a")
    missing = refused(tmp_path, tmp_path / "dst", stores / "a", tmp_path / "nowhere")
    assert missing.startswith("Error: no store at") and not (tmp_path / "dst").exists()


def test_a_failure_while_writing_leaves_the_target_as_it_was(
    stores: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "dst"
    shutil.copytree(stores / "a", dst)
    real, calls = merge_module._link, []

    def link_then_fail(src: Path, out: Path) -> None:
        calls.append(out)
        if len(calls) > 20:
            raise OSError(28, "No space left on device", str(out))
        real(src, out)

    monkeypatch.setattr(merge_module, "_link", link_then_fail)
    line = refused(tmp_path, dst, stores / "b")
    assert "No space left on device" in line and len(calls) == 21


def test_a_killed_merge_leaves_nothing_that_stays(stores: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    stale = tmp_path / temp_path(dst).name.replace(f".{os.getpid()}.", ".999999999.")
    (stale / "components").mkdir(parents=True)
    out = run("merge", str(stores / "a"), "--into", str(dst))
    assert out.exit_code == 0, out.output
    assert not stale.exists() and not leftovers(tmp_path)


def test_files_beside_the_manifest_are_kept_and_must_agree(stores: Path, tmp_path: Path) -> None:
    copies = []
    for name, record in (("a", "r1"), ("b", "r2")):
        shutil.copytree(stores / name, tmp_path / name)
        (folder,) = (tmp_path / name).glob("manifests/**/task=*")
        (folder / "runs").mkdir(exist_ok=True)
        (folder / "runs" / f"{record}.json").write_text(json.dumps({"run": record}))
        (folder / ".claim.tmp").write_text("being written")
        copies.append(folder)
    out = run("merge", str(tmp_path / "a"), str(tmp_path / "b"), "--into", str(tmp_path / "m"))
    assert out.exit_code == 0, out.output
    (merged,) = (tmp_path / "m").glob("manifests/**/task=*")
    records = {p.name for c in copies for p in (c / "runs").iterdir()}
    assert {"r1.json", "r2.json"} < records
    assert {p.name for p in (merged / "runs").iterdir()} == records
    assert not (merged / ".claim.tmp").exists()
    (copies[1] / "runs" / "r1.json").write_text(json.dumps({"run": "another"}))
    line = refused(tmp_path, tmp_path / "dst", tmp_path / "a", tmp_path / "b")
    assert "r1.json differs from the file of that name in another store" in line


def test_one_checkpoint_under_two_revisions_is_refused_as_extract_refuses_it(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    """Two revisions of identical weights, extracted into two stores: `merge` refuses them in
    one line naming both revisions, with the rule `extract` applies to the pair in one store."""
    task = make_task(tmp_path / "task", n=8)
    common = ["extract", "--model", str(model_dirs("llama")), "--task", str(task), "--limit", "4"]
    for revision in ("r1", "r2"):
        out = run(*common, "--revision", revision, "--store", str(tmp_path / revision))
        assert out.exit_code == 0, out.output
    same = "revision r2 equal those stored as revision r1"
    line = refused(tmp_path, tmp_path / "dst", tmp_path / "r1", tmp_path / "r2")
    assert same in line and "one checkpoint under two names" in line
    assert "merge only one of the two revisions" in line and not (tmp_path / "dst").exists()
    into = refused(tmp_path, tmp_path / "r1", tmp_path / "r2")  # the target holds r1
    assert same in into

    extract = run(*common, "--revision", "r2", "--store", str(tmp_path / "r1"))
    assert extract.exit_code == 1
    (error,) = [x for x in extract.output.splitlines() if x.startswith("Error")]
    rule = error.split(": ", 1)[1].rsplit(";", 1)[0]  # the problem, without the hint
    assert rule in line
