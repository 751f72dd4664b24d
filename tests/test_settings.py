"""A partition holds one extraction: every setting that changes a stored number (a measurement's
settings, ``layerdiv.measurements.Measurement.settings``) is recorded in the manifest and in each
of its parts, a flag not given keeps the stored setting, another value is refused before anything
is written, readers and ``merge`` refuse mixed settings, and a writer stops when another run
replaced the partition under it (``--overwrite``)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

from layerdiv.cli import main
from layerdiv.extract import chunks
from layerdiv.measurements import measurement_of
from layerdiv.measurements.lens import readout_of
from layerdiv.measurements.registry import SETTINGS_KEY
from layerdiv.store import PartitionWriter, Store, StoreError
from layerdiv.store.manifest import read_manifest
from layerdiv.store.writer import StoreConflict
from tests.test_text_extract import random_texts, text_task
from tests.tolerance import assert_within

CHUNK = 2


class Killed(BaseException):
    """The process dies here (nothing after this point runs, as after kill -9)."""


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def setup(tmp_path: Path, model_dirs: Any) -> tuple[list[str], Path]:
    """The arguments of an extraction of 6 short documents in chunks of 2, and its store."""
    task = text_task(tmp_path / "task", random_texts(6, seed=3), max_tokens=24)
    store = tmp_path / "store"
    args = ["extract", "--model", str(model_dirs("llama")), "--task", str(task), "--store",
            str(store), "--chunk-size", str(CHUNK), "--batch-size", "3"]  # fmt: skip
    return args, store


def files(store: Path) -> dict[Path, int]:
    """Every file of the store with its modification time."""
    return {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()}


def writer_of(store: Path) -> PartitionWriter:
    """A writer of the store's one partition."""
    (path,) = store.glob("manifests/**/manifest.json")
    m = read_manifest(path)
    return PartitionWriter(store, m.model, m.task, m.revision or "main")


def settings(store: Path) -> dict[str, Any]:
    (manifest,) = store.glob("manifests/**/manifest.json")
    return dict(json.loads(manifest.read_text())["settings"])


def test_a_flag_not_given_keeps_the_stored_setting(setup: tuple[list[str], Path]) -> None:
    args, store = setup
    first = run(*args, "--lens", "last-block")
    assert first.exit_code == 0, first.output
    skips = run(*args, "--skips")  # the lens is kept, with its readout
    assert skips.exit_code == 0, skips.output
    assert settings(store)["lens"] == {"lens": "last-block"}
    assert settings(store)["future_effects"]["skip_seed"] == 0
    (info,) = Store(store).select()
    assert info.tables == ["token_lens", "future_effects", "future_output"]
    for table in info.tables:  # each part records its measurement's settings
        for part in info.files(table):
            recorded = pq.read_metadata(part).metadata[SETTINGS_KEY]
            assert json.loads(recorded) == settings(store)[measurement_of(table).name]


def test_another_value_is_refused_before_anything_is_written(
    setup: tuple[list[str], Path],
) -> None:
    args, store = setup
    assert run(*args, "--lens").exit_code == 0
    before = files(store)
    for other in (["--lens", "last-block"], ["--limit", "4", "--lens", "last-block"]):
        refused = run(*args, *other)  # complete, or with work left: refused all the same
        assert refused.exit_code == 1
        line = refused.output.strip()
        assert "\n" not in line and "Traceback" not in line
        assert "the stored lens was extracted with --lens final, this run asks for --lens " in line
        assert "last-block" in line
        assert files(store) == before
    assert run(*args, "--skips").exit_code == 0
    refused = run(*args, "--skips", "--skip-seed", "5")
    assert refused.exit_code == 1 and "--skip-seed 0" in refused.output
    assert "--skip-seed 5" in refused.output
    assert settings(store)["future_effects"]["skip_seed"] == 0


def test_a_killed_run_resumes_without_its_flags_and_by_the_command_ls_prints(
    setup: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    args, store = setup
    assert run(*args).exit_code == 0
    write = PartitionWriter.write_table_part

    def write_then_die(self: PartitionWriter, name: str, *rest: Any) -> None:
        write(self, name, *rest)
        if name == "token_lens":
            raise Killed

    with monkeypatch.context() as patch, pytest.raises(Killed):
        patch.setattr(PartitionWriter, "write_table_part", write_then_die)
        CliRunner().invoke(main, [*args, "--lens", "last-block"], catch_exceptions=False)
    resumed = run(*args)  # without --lens: the stored lens is completed, with its readout
    assert resumed.exit_code == 0, resumed.output
    assert "added token_lens to 4 stored documents" in resumed.output
    (info,) = Store(store).select()
    assert "token_lens" in info.tables and readout_of(info.manifest) == "last-block"
    info.files("token_lens")[0].unlink()  # incomplete again: ls says how to complete it
    listed = run("ls", "--store", str(store))
    command = next(line for line in listed.output.splitlines() if "token_lens left out" in line)
    printed = shlex.split(command.split("`")[1])
    assert printed[printed.index("--lens") + 1] == "last-block"
    completed = run(*printed[1:])  # the command that ls prints
    assert completed.exit_code == 0, completed.output
    assert "added token_lens to 2 stored documents" in completed.output
    assert settings(store)["lens"] == {"lens": "last-block"}


def test_a_part_of_other_settings_is_refused_by_readers_and_redone_by_writers(
    setup: tuple[list[str], Path],
) -> None:
    args, store = setup
    assert run(*args, "--skips").exit_code == 0
    (info,) = Store(store).select()
    part = info.files("future_output")[1]  # as a lock-less writer with --skip-seed 5 left it
    table = pq.read_table(part)
    other = {**settings(store)["future_effects"], "skip_seed": 5}
    metadata = {**table.schema.metadata, SETTINGS_KEY: json.dumps(other).encode()}
    pq.write_table(table.replace_schema_metadata(metadata), part, write_page_checksum=True)
    store_ = Store(store)
    assert not store_.partitions
    with pytest.raises(StoreError, match=rf"^{part} was written with --skips .*--skip-seed 5.*, "
                       "the manifest records --skips .*--skip-seed 0"):  # fmt: skip
        store_.select()
    assert run("query", "SELECT 1", "--store", str(store)).exit_code == 1
    redone = run(*args)  # the chunk is redone with the partition's settings
    assert redone.exit_code == 0, redone.output
    assert "of other settings: redone" in redone.output
    assert Store(store).select()[0].n_done == 6


def test_two_runs_opening_one_partition_with_other_settings(
    setup: tuple[list[str], Path],
) -> None:
    args, store = setup
    assert run(*args, "--skips").exit_code == 0
    writer = writer_of(store)
    manifest = read_manifest(writer.part.manifest)
    manifest.settings["future_effects"] = {**manifest.settings["future_effects"], "skip_seed": 5}
    before = files(store)
    with pytest.raises(StoreConflict, match=r"the stored future_effects was extracted with .*"
                       r"--skip-seed 0, this run asks for .*--skip-seed 5"):  # fmt: skip
        writer.open(manifest, overwrite=False)  # planned before the other run created it
    assert files(store) == before


def test_shards_and_merges_of_other_settings_are_refused(setup: tuple[list[str], Path]) -> None:
    args, store = setup
    assert run(*args, "--shard", "0/2", "--lens").exit_code == 0
    other = run(*args, "--shard", "1/2", "--lens", "last-block")
    assert other.exit_code == 1 and "--lens final" in other.output
    root = store.parent
    seeds = {}
    for i, seed in enumerate(("0", "5")):
        seeds[i] = root / f"s{i}"
        shard = [a if a != str(store) else str(seeds[i]) for a in args]
        done = run(*shard, "--shard", f"{i}/2", "--skips", "--skip-seed", seed)
        assert done.exit_code == 0, done.output
    merged = run("merge", str(seeds[0]), str(seeds[1]), "--into", str(root / "m"))
    assert merged.exit_code == 1 and "'skip_seed': 0" in merged.output
    assert "'skip_seed': 5" in merged.output and not (root / "m").exists()


def test_a_writer_stops_when_another_run_replaced_the_partition(
    setup: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    args, store = setup
    store_chunk = chunks.store
    replaced: list[int] = []

    def store_then_replace(writer: PartitionWriter, *rest: Any) -> None:
        store_chunk(writer, *rest)
        if not replaced:  # another run's --overwrite, between this run's chunks
            manifest = read_manifest(writer.part.manifest)
            replaced.append(writer_of(store).open(manifest, overwrite=True).generation)

    monkeypatch.setattr(chunks, "store", store_then_replace)
    stopped = run(*args, "--lens")
    assert replaced == [1]
    assert stopped.exit_code == 1
    assert stopped.output.strip().endswith(
        "was replaced by another run (--overwrite) while this run wrote it: this run stopped; "
        "rerun it to extend the new extraction"
    )
    writer = writer_of(store)
    assert read_manifest(writer.part.manifest).generation == 1
    assert writer.done_instances() == set()  # nothing of the stopped run after the replacement
    monkeypatch.undo()
    assert run(*args).exit_code == 0
    assert Store(store).select()[0].n_done == 6


def test_a_manifest_with_the_older_settings_fields_keeps_them(
    setup: tuple[list[str], Path],
) -> None:
    args, store = setup
    assert run(*args, "--lens", "last-block", "--skips", "--skip-seed", "3").exit_code == 0
    (path,) = store.glob("manifests/**/manifest.json")
    data = json.loads(path.read_text())
    recorded = data.pop("settings")
    data.pop("generation")
    future = recorded["future_effects"]
    data.update(lens="last-block", skip_split=future["skip_split"], skip_seed=3)  # no sublayers
    path.write_text(json.dumps(data))
    (info,) = Store(store).select()
    assert info.manifest.settings == recorded and readout_of(info.manifest) == "last-block"
    again = run(*args)
    assert again.exit_code == 0, again.output
    assert run(*args, "--skips", "--skip-seed", "4").exit_code == 1


def test_two_processes_started_at_once_with_other_settings(setup: tuple[list[str], Path]) -> None:
    args, store = setup
    base = [sys.executable, "-m", "layerdiv.cli", *args, "--batch-size", "1", "--skips"]
    procs = [
        subprocess.Popen(
            [*base, "--skip-seed", seed], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for seed in ("0", "5")
    ]
    ended = [(p.wait(timeout=300), p.communicate()) for p in procs]
    codes = sorted(code for code, _ in ended)
    assert codes == [0, 1], ended
    seed, (_, err) = next((s, out) for s, (code, out) in zip((0, 5), ended, strict=True) if code)
    winner = 5 - seed
    assert "the stored future_effects was extracted with" in err
    assert f"--skip-seed {winner}, this run asks for" in err
    (info,) = Store(store).select()  # every part checked against the manifest: one extraction
    assert info.manifest.settings["future_effects"]["skip_seed"] == winner
    assert info.n_done == 6 and not info.incomplete()


def test_igrad_settings_are_the_partitions_identity(
    tmp_path: Path, model_dirs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_multihop import SHORT, multihop_task

    task = multihop_task(tmp_path / "task", **SHORT)
    root = tmp_path / "stores"

    def args(store: str, *more: str) -> list[str]:
        return ["extract", "--model", str(model_dirs("llama")), "--task", str(task), "--store",
                str(root / store), "--limit", "4", "--chunk-size", str(CHUNK), *more]  # fmt: skip

    igrad = ["--igrad", "--igrad-steps", "2"]
    whole = run(*args("whole", *igrad))
    assert whole.exit_code == 0, whole.output
    assert settings(root / "whole")["igrad"] == {
        "igrad_sites": ["block"],
        "igrad_steps": 2,
        "igrad_rule": "riemann",
    }
    before = files(root / "whole")
    for other in (["--igrad-steps", "3"], ["--igrad-site", "attn"], ["--igrad-rule", "gauss"]):
        refused = run(*args("whole", "--igrad", *other))
        assert refused.exit_code == 1
        line = refused.output.strip()
        stored = (
            "the stored igrad was extracted with --igrad --igrad-site block --igrad-steps 2 "
            "--igrad-rule riemann"
        )
        assert "\n" not in line and f"{stored}, this run asks for" in line
        assert " ".join(other) in line
        assert files(root / "whole") == before
    write = PartitionWriter.write_table_part

    def write_then_die(self: PartitionWriter, name: str, *rest: Any) -> None:
        write(self, name, *rest)
        if name == "igrad_ends":
            raise Killed

    with monkeypatch.context() as patch, pytest.raises(Killed):  # killed after its first part
        patch.setattr(PartitionWriter, "write_table_part", write_then_die)
        CliRunner().invoke(main, args("a", "--shard", "0/2", *igrad), catch_exceptions=False)
    resumed = run(*args("a", "--shard", "0/2"))  # without its flags: the stored settings
    assert resumed.exit_code == 0, resumed.output
    assert settings(root / "a")["igrad"]["igrad_steps"] == 2
    shard = run(*args("b", "--shard", "1/2", "--igrad", "--igrad-steps", "3"))
    assert shard.exit_code == 0, shard.output
    refused = run("merge", str(root / "a"), str(root / "b"), "--into", str(root / "m"))
    assert refused.exit_code == 1 and "'igrad_steps': 2" in refused.output
    assert "'igrad_steps': 3" in refused.output and not (root / "m").exists()
    same = run(*args("c", "--shard", "1/2", *igrad))
    assert same.exit_code == 0, same.output
    merged = run("merge", str(root / "a"), str(root / "c"), "--into", str(root / "m"))
    assert merged.exit_code == 0, merged.output
    for table in ("igrad", "igrad_ends"):
        got = Store(root / "m").scan(table).collect().sort("doc", "block")
        want = Store(root / "whole").scan(table).collect().sort("doc", "block")
        assert got.drop("attribution", "f_input", "f_baseline", strict=False).equals(
            want.drop("attribution", "f_input", "f_baseline", strict=False)
        )
        # the same computation on the same kernels in batches of other documents
        for column in ("attribution", "f_input", "f_baseline"):
            if column in got.columns:
                scale = float(np.abs(want[column].to_numpy()).max())
                assert_within(got[column].to_numpy(), want[column].to_numpy(), scale)
