"""The store's write path on its own: atomic writes, identity, run records, optional tables,
verified resume and the refusal of overlapping parts (no model needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layerdiv.analyze.synthetic import random_partition, write_partition
from layerdiv.errors import LayerdivError
from layerdiv.schemas import GRAM, SchemaError, states_schema
from layerdiv.store import Store
from layerdiv.store.atomic import atomic_path, is_stale_temp, temp_path, write_bytes
from layerdiv.store.manifest import read_manifest
from layerdiv.store.paths import OverlappingParts, list_partitions
from layerdiv.store.writer import (
    ROW_GROUP_BYTES,
    PartitionWriter,
    StoreConflict,
    Verdict,
    dictionary_columns,
    row_group_rows,
)

N, CHUNK = 12, 4


def synthetic(root: Path, n: int = N) -> PartitionWriter:
    logits, gold, rms, kinds = random_partition(np.random.default_rng(0), n, 2, 3)
    write_partition(root, "m", "t", logits, gold, kinds, rms, chunk=CHUNK)
    return PartitionWriter(root, "m", "t")


def gram(ids: list[int]) -> pa.Table:
    return pa.table(
        {"instance": pa.array(ids, pa.int32()), "gram": [[1.0, 2.0, 3.0]] * len(ids)},
        schema=GRAM,
    )


def test_atomic_path_renames_on_success_and_cleans_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "a" / "file.bin"
    assert write_bytes(target, b"one") and target.read_bytes() == b"one"
    assert not write_bytes(target, b"two", exclusive=True) and target.read_bytes() == b"one"
    assert write_bytes(target, b"three") and target.read_bytes() == b"three"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("crash")
    assert target.read_bytes() == b"three"
    folder = tmp_path / "model"
    with atomic_path(folder, exclusive=True) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    with pytest.raises(FileExistsError), atomic_path(folder, exclusive=True) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    with atomic_path(folder) as tmp:  # replaces the non-empty folder
        tmp.mkdir()
        (tmp / "new.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "file.bin", "model", "new.json"]


def test_stale_temporaries_are_those_of_dead_processes_of_this_host(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    mine = temp_path(tmp_path / "part-0000000-000004.parquet")
    theirs = tmp_path / mine.name.replace(f".{os.getpid()}.", f".{dead.stdout.strip()}.")
    other_host = tmp_path / ".part.parquet.elsewhere.1.ab12.tmp"
    assert not is_stale_temp(mine) and is_stale_temp(theirs) and not is_stale_temp(other_host)


def test_open_keeps_live_writers_temporaries(tmp_path: Path) -> None:
    writer = synthetic(tmp_path)
    folder = writer.part.dir("components")
    live = temp_path(folder / "part-0000012-000004.parquet")  # this (live) process
    dead = folder / live.name.replace(f".{os.getpid()}.", ".999999999.")
    live.write_bytes(b"x")
    dead.write_bytes(b"x")
    manifest = read_manifest(writer.part.manifest)
    writer.open(manifest, overwrite=False)
    assert live.exists() and not dead.exists()


def test_identity_is_one_type_and_differences_name_fields(tmp_path: Path) -> None:
    writer = synthetic(tmp_path)
    stored = read_manifest(writer.part.manifest).identity()
    assert writer.check(stored, overwrite=False) is Verdict.RESUME
    other = replace(stored, data_sha256="edited")
    with pytest.raises(StoreConflict, match="data_sha256: stored 'synthetic', now 'edited'"):
        writer.check(other, overwrite=False)
    assert writer.check(other, overwrite=True, shards=2) is Verdict.REPLACE
    assert writer.check(stored, overwrite=True, shards=2) is Verdict.RESUME
    assert writer.check(stored, overwrite=True, shards=1) is Verdict.REPLACE


def test_run_records_are_one_file_per_run(tmp_path: Path) -> None:
    writer = synthetic(tmp_path)
    first = writer.start_run({"n_requested": 20, "shard": [0, 2]})
    second = writer.start_run({"n_requested": 16, "shard": [1, 2]})
    first.write(instances=4)
    assert first.path != second.path and first.path.parent.name == "runs"
    m = read_manifest(writer.part.manifest)
    assert m.n_requested == 20  # the largest n any run asked for
    assert sorted(r["shard"][0] for r in m.runs) == [0, 1]
    assert [r.get("instances") for r in m.runs if r["shard"] == [0, 2]] == [4]
    assert '"runs": []' in writer.part.manifest.read_text()  # never rewritten


def test_optional_tables_are_written_first_and_backfilled(tmp_path: Path) -> None:
    writer = synthetic(tmp_path)
    assert writer.chunks_missing("gram") == [(0, 4), (4, 4), (8, 4)]
    # an optional table's folder is made with its first part, never left empty
    assert writer.part.dir("instances").is_dir() and not writer.part.dir("gram").exists()
    assert not any((tmp_path / t).exists() for t in ("gram", "skips", "heads", "lens"))
    writer.mark_table("gram")
    writer.write_table_part("gram", 4, 4, gram([4, 5, 6, 7]))
    assert writer.chunks_missing("gram") == [(0, 4), (8, 4)]
    info = Store(tmp_path).partitions[0]
    assert info.manifest.extra_tables == ["gram"]
    assert [p.name for p in info.files("gram")] == ["part-0000004-000004.parquet"]
    with pytest.raises(SchemaError, match="gram table does not match"):
        writer.write_table_part("gram", 0, 4, gram([0, 1, 2, 3]).drop_columns(["gram"]))
    # A new chunk: optional tables first, the instances part (the marker) last.
    chunk = {t: pq.read_table(writer.part.part(t, 0, 4)) for t in ("components", "instances")}
    order: list[str] = []
    write = writer.write_table_part

    def record(table: str, start: int, count: int, data: pa.Table) -> None:
        order.append(table)
        write(table, start, count, data)

    writer.write_table_part = record  # type: ignore[method-assign]
    writer.write_chunk(12, 4, {"instances": chunk["instances"], "gram": gram([12, 13, 14, 15]),
                               "components": chunk["components"]})  # fmt: skip
    assert order == ["gram", "components", "instances"]


def test_float_columns_are_not_dictionary_encoded(tmp_path: Path) -> None:
    writer = synthetic(tmp_path)
    assert dictionary_columns(GRAM) == ["instance"]
    n, values = 64, 1891  # a Gram triangle of 61 components
    rows = np.random.default_rng(1).normal(size=(n, values)).astype(np.float32)
    table = pa.table({"instance": pa.array(range(n), pa.int32()), "gram": list(rows)}, schema=GRAM)
    writer.write_table_part("gram", 0, n, table)
    path = writer.part.part("gram", 0, n)
    meta = pq.ParquetFile(path).metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema: meta.column(i).encodings for i in range(2)}
    assert not any("DICTIONARY" in e for e in encodings["gram.list.element"])
    # the vector's elements carry no min/max statistics; its key does
    assert not meta.column(1).is_stats_set and meta.column(0).is_stats_set
    # noise does not compress: the file holds the raw floats and little else (a dictionary
    # made it about 1.5 times as large)
    assert path.stat().st_size < 1.05 * rows.nbytes
    assert np.array_equal(
        np.stack(pq.read_table(path)["gram"].to_numpy(zero_copy_only=False)), rows
    )


def test_wide_rows_are_written_in_row_groups_of_about_16_mib() -> None:
    states = states_schema(576, "float16")  # SmolLM2's states: 1,152 bytes a row
    assert row_group_rows(states) == ROW_GROUP_BYTES // 1152
    assert row_group_rows(states_schema(8192, "float32")) == 1024  # never fewer
    assert row_group_rows(GRAM) == 1 << 20  # a variable-length list: rows of any width


def test_unreadable_parts_are_not_counted_done(tmp_path: Path) -> None:
    writer = synthetic(tmp_path)
    manifest = read_manifest(writer.part.manifest)
    assert writer.done_instances(manifest) == set(range(N))
    part = writer.part.part("components", 4, 4)
    part.write_bytes(part.read_bytes()[:-100])  # an interrupted copy
    assert writer.done_instances(manifest) == set(range(N)) - {4, 5, 6, 7}
    assert writer.unreadable(writer.part.done_parts(), manifest) == [(4, 4)]
    writer.remove_chunk(4, 4)
    assert writer.part.done_parts() == [(0, 4), (8, 4)] and not part.exists()


def test_readers_refuse_overlapping_parts(tmp_path: Path) -> None:
    writer = synthetic(tmp_path)
    src = writer.part.part("instances", 4, 4)
    dup = writer.part.part("instances", 4, 8)
    dup.write_bytes(src.read_bytes())
    with pytest.raises(OverlappingParts) as err:
        Store(tmp_path)
    assert str(src) in str(err.value) and str(dup) in str(err.value)
    assert isinstance(err.value, LayerdivError)


def test_a_partition_without_manifest_is_refused(tmp_path: Path) -> None:
    writer = synthetic(tmp_path)
    stored = read_manifest(writer.part.manifest)
    writer.part.manifest.unlink()
    with pytest.raises(StoreConflict, match="has data but no manifest"):
        writer.check(stored.identity(), overwrite=False)
    assert writer.check(stored.identity(), overwrite=True) is Verdict.REPLACE
    # A leftover temporary of a manifest alone is not data.
    empty = PartitionWriter(tmp_path / "other", "m", "t")
    empty.part.manifest.parent.mkdir(parents=True)
    (empty.part.manifest.parent / ".manifest.json.host.1.ab.tmp").write_text("{")
    assert empty.check(stored.identity(), overwrite=False) is Verdict.NEW
    assert list_partitions(tmp_path / "other") == []


def test_unwritable_store_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    for root in (Path("/proc/layerdiv-store"), blocker / "store"):
        with pytest.raises(LayerdivError, match=f"cannot write the store {root}"):
            PartitionWriter(root, "m", "t").ensure_writable()
