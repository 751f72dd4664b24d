"""Rows and values that no extraction writes are refused by every reader, in one line naming the
part or the manifest: parts copied under another name, one instance's rows in place of
another's, ids renumbered, a removed chunk marker, gold and option indices outside the task's
options, NaN and infinite values, components that no longer sum to the model's logits, and a
manifest edited by hand. The store here is synthetic: 8 instances of a 2-option task, in chunks
of 4."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

from layerdiv.analyze.api import analyze
from layerdiv.analyze.synthetic import random_partition, write_partition
from layerdiv.cli import main
from layerdiv.store import Store, StoreError
from layerdiv.store.writer import PartitionWriter

N, CHUNK = 8, 4


@pytest.fixture
def store(tmp_path: Path) -> Path:
    logits, gold, rms, kinds = random_partition(np.random.default_rng(3), N, 3, 2)
    write_partition(tmp_path / "store", "org/m", "boolq", logits, gold, kinds, rms, chunk=CHUNK)
    return tmp_path / "store"


def part(store: Path, table: str, start: int = 4, count: int = CHUNK) -> Path:
    return PartitionWriter(store, "org/m", "boolq").part.part(table, start, count)


def rewrite(path: Path, change: Any) -> None:
    """Rewrite a part (checksums and all) as ``change`` of its table."""
    pq.write_table(change(pq.read_table(path)), path, write_page_checksum=True)


def column(name: str, change: Any) -> Any:
    """A table change: column ``name`` replaced by ``change`` of its values (numpy)."""

    def apply(table: pa.Table) -> pa.Table:
        i = table.schema.get_field_index(name)
        values = change(table[name].to_numpy().copy())
        return table.set_column(
            i, table.schema.field(i), pa.array(values, table.schema.field(i).type)
        )

    return apply


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def refused_by_every_reader(store: Path, message: str) -> None:
    """``ls``, ``query`` and ``analyze`` (CLI) each exit 1 with ``message`` on one line, and
    ``Store.select`` raises it."""
    with pytest.raises(StoreError, match=message):
        Store(store).select()
    for args in (("ls",), ("query", "SELECT count(*) FROM components"), ("analyze",)):
        out = store.parent / "out"
        extra = ("--out", str(out)) if args[0] == "analyze" else ()
        result = cli(*args, "--store", str(store), *extra)
        assert result.exit_code == 1, (args, result.output)
        assert "Traceback" not in result.output
        lines = [line for line in result.output.splitlines() if line.startswith("Error")]
        assert lines and any(re.search(message, line) for line in lines), (
            args,
            result.output,
        )


def test_a_part_copied_under_another_range_is_refused(store: Path) -> None:
    """Today ``ls`` reports 12 of 8 instances and ``query`` counts the copy's rows."""
    for table in ("components", "instances"):
        shutil.copy(part(store, table, 0), part(store, table, 8))
    refused_by_every_reader(
        store, rf"{part(store, 'components', 8)}: instance takes 0\.\.3, outside the 8\.\.11"
    )


def test_one_instances_rows_in_place_of_anothers_are_refused(store: Path) -> None:
    """Instance 5's components rows replaced by instance 6's: the row count holds."""
    rewrite(part(store, "components"), column("instance", lambda v: np.where(v == 5, 6, v)))
    refused_by_every_reader(
        store, rf"{part(store, 'components')}: instance 5 has 0 rows where it needs 14"
    )


def test_an_instance_repeated_in_the_instances_part_is_refused(store: Path) -> None:
    rewrite(part(store, "instances"), column("instance", lambda v: np.where(v == 5, 6, v)))
    refused_by_every_reader(store, rf"{part(store, 'instances')}: instance 5 has 0 rows")


def test_ids_renumbered_inside_a_part_are_refused(store: Path) -> None:
    for table in ("components", "instances"):
        rewrite(part(store, table), column("instance", lambda v: v + 1))
    refused_by_every_reader(store, r"instance takes 5\.\.8, outside the 4\.\.7")


def test_a_removed_chunk_marker_is_refused_once_every_run_finished(store: Path) -> None:
    """Today the partition is analysed on 4 of its 8 instances without a word."""
    part(store, "instances").unlink()
    refused_by_every_reader(
        store, rf"{part(store, 'components')}: its chunk has no instances part, although every run"
    )


def test_a_stopped_runs_parts_are_left_out_with_a_note(store: Path) -> None:
    """A run killed between a chunk's parts and its marker left them: read as 4 instances, with
    a note naming the command that completes them (as after kill -9)."""
    writer = PartitionWriter(store, "org/m", "boolq")
    writer.start_run({"n_requested": N})  # never finished
    part(store, "instances").unlink()
    (info,) = Store(store).partitions
    assert info.n_done == 4
    listed = cli("ls", "--store", str(store))
    assert listed.exit_code == 0, listed.output
    assert "4 instances of partition model=org--m revision=main task=boolq have parts but no " \
        "instances part" in listed.output.replace("\n", " ")  # fmt: skip


def test_a_gold_outside_the_options_is_refused(store: Path) -> None:
    """Today a gold of 7 in a 2-option task moves the accuracy."""
    rewrite(
        part(store, "instances"), column("gold", lambda v: np.where(np.arange(len(v)) == 1, 7, v))
    )
    refused_by_every_reader(
        store, rf"{part(store, 'instances')}: gold takes 0\.\.7, outside the 0\.\.1"
    )


def test_an_option_outside_the_options_is_refused(store: Path) -> None:
    rewrite(part(store, "components"), column("option", lambda v: v * 3))
    refused_by_every_reader(store, r"option takes 0\.\.3, outside the 0\.\.1")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("inf"), r"logit holds an infinite value"),
        (float("nan"), r"components\.logit holds a NaN or an infinite value"),
    ],
)
def test_non_finite_logits_are_refused_naming_the_part(
    store: Path, value: float, message: str
) -> None:
    """Today NaN or inf in ``components.logit`` is a traceback (``LinAlgError: SVD did not
    converge``)."""
    rewrite(
        part(store, "components"),
        column("logit", lambda v: np.where(np.arange(len(v)) == 9, value, v)),
    )
    for args in (("analyze", "--out", str(store.parent / "out")),
                 ("query", "SELECT avg(logit) FROM components")):  # fmt: skip
        result = cli(*args, "--store", str(store))
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert f"Error: {part(store, 'components')}: " in result.output, result.output
        assert re.search(message, result.output), result.output


def test_a_nan_in_an_optional_table_is_refused_naming_the_part(tmp_path: Path) -> None:
    logits, gold, rms, kinds = random_partition(np.random.default_rng(3), N, 3, 2)
    skips = np.random.default_rng(4).normal(size=(N, 3, 2))
    skips[5, 1, 0] = np.nan
    write_partition(
        tmp_path, "org/m", "boolq", logits, gold, kinds, rms, chunk=CHUNK, optional={"skips": skips}
    )
    skipped = PartitionWriter(tmp_path, "org/m", "boolq").part.part("skips", 4, CHUNK)
    with pytest.raises(StoreError, match=rf"^{skipped}: skips\.logit holds a NaN"):
        Store(tmp_path).scan("skips").collect()


def test_a_changed_logit_fails_the_sum_check(store: Path) -> None:
    """Today one logit set to 1e30 moves the MSE with exit 0."""
    rewrite(
        part(store, "components"),
        column("logit", lambda v: np.where(np.arange(len(v)) == 9, 1e30, v)),
    )
    with pytest.raises(StoreError, match=r"components of instance 4 sum to the stored model logits "
                       r"only within 1 \(relative\), above the tolerance 0\.0001"):  # fmt: skip
        analyze(store)
    result = cli("analyze", "--store", str(store), "--out", str(store.parent / "out"))
    assert result.exit_code == 1 and "instance 4" in result.output, result.output


def edit_manifest(store: Path, change: Any) -> Path:
    path = PartitionWriter(store, "org/m", "boolq").part.manifest
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


def test_a_manifest_with_its_options_swapped_is_refused(store: Path) -> None:
    def swap(data: dict[str, Any]) -> None:
        data["options"] = ["yes", "no"]
        data["option_tokens"] = ["\u0120no", "\u0120yes"]
        data["task_spec"]["options"] = ["yes", "no"]

    path = edit_manifest(store, swap)
    refused_by_every_reader(
        store,
        rf"{path}: option 0 'yes' is scored by the token 'Ġno', option 1's by 'Ġyes' \(a "
        r"manifest edited or copied by hand\)",
    )


def test_a_manifest_whose_options_are_not_its_tasks_is_refused(store: Path) -> None:
    path = edit_manifest(store, lambda d: d["task_spec"].update(options=["option1", "option0"]))
    refused_by_every_reader(
        store, rf"{path}: its options \['option0', 'option1'\] are not its task's"
    )


def test_a_manifest_naming_another_model_is_refused(store: Path) -> None:
    path = edit_manifest(store, lambda d: d.update(model="other/model"))
    refused_by_every_reader(
        store, rf"{path}: it names model 'other/model', its folder model=org--m"
    )


def test_a_revision_that_makes_no_store_name_is_refused_in_one_line(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    """Today a traceback naming the model."""
    task = make_task(tmp_path / "task", n=4)
    result = cli("extract", "--model", str(model_dirs("llama")), "--task", str(task),
                 "--revision", '""', "--store", str(tmp_path / "store"))  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.exception.__class__ is SystemExit
    assert "cannot make a store name from revision '\"\"'" in result.output
    assert not (tmp_path / "store").exists()


def test_an_intact_store_reads_as_before(store: Path) -> None:
    """The checks refuse nothing in a store as extraction writes it, its rows shuffled within
    each part (the store promises no row order) included."""
    shuffled = store.parent / "shuffled"
    logits, gold, rms, kinds = random_partition(np.random.default_rng(3), N, 3, 2)
    write_partition(shuffled, "org/m", "boolq", logits, gold, kinds, rms, chunk=CHUNK,
                    shuffle=np.random.default_rng(0))  # fmt: skip
    assert analyze(shuffled).notes == analyze(store).notes
    for root in (store, shuffled):
        (info,) = Store(root).partitions
        comps, inst = info.read(["logit"], ["gold"])
        assert comps.height == N * 7 * 2 and inst.height == N
        assert pc.sum(pa.array(comps["logit"].to_numpy())).as_py() == pytest.approx(
            float(logits.astype(np.float32).sum()), rel=1e-5, abs=1e-3
        )


def test_a_part_of_no_rows_holds_no_nan() -> None:
    """A part with no rows (``--skips`` over documents too short for a split point) is read, a
    NaN or an infinite value in a float or list column is found."""
    from layerdiv.store.parts import not_finite

    floats, lists = pa.array([], pa.float32()), pa.array([], pa.list_(pa.float32()))
    assert not_finite(pa.table({"x": floats, "y": lists})) is None
    assert not_finite(pa.table({"x": pa.array([1.0, float("nan")], pa.float32())})) == "x"
    assert not_finite({"y": pa.array([[1.0], [float("inf")]], pa.list_(pa.float32()))}) == "y"
