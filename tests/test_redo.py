"""``extract --redo NAME``: one measurement's tables and settings replaced in a stored partition,
everything else kept byte for byte; the same numbers as a fresh extraction with the new
settings; a redo that fails before it commits leaves the old partition as it was, one killed
after it commits is completed by the next reader; refusals in one line, before anything is
written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from layerdiv.store import Store
from layerdiv.store import redo as redo_module
from layerdiv.store.paths import MANIFESTS
from tests.test_multihop import SHORT, multihop_task
from tests.test_text_extract import extract

IGRAD_TABLES = ("igrad", "igrad_ends")


def files(store: Path) -> dict[str, str]:
    """Every stored file but the run records and temporaries, by path: its bytes' sha256."""
    return {
        str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(store.rglob("*"))
        if p.is_file() and "/runs/" not in str(p) and not p.name.startswith(".")
    }


def igrad_values(store: Path) -> pl.DataFrame:
    (info,) = Store(store).select()
    frame = pl.read_parquet(info.partition.dir("igrad") / "*.parquet")
    return frame.sort(frame.columns[:4])


@pytest.fixture
def stored(tmp_path: Path, model_dirs: Any) -> tuple[list[str], Path]:
    """The arguments of a run (tiny llama, the multi-hop task, 3 documents in chunks of 2) and
    its store, extracted with ``--igrad --igrad-steps 2`` and ``--lens``."""
    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
            "--limit", "3", "--chunk-size", "2"]  # fmt: skip
    first = extract(*args, "--igrad", "--igrad-steps", "2", "--lens", "final")
    assert first.exit_code == 0, first.output
    assert "at this machine's measured rate" in first.output  # igrad: always estimated
    return args, store


def test_redo_replaces_one_measurement_and_keeps_the_rest(
    stored: tuple[list[str], Path], tmp_path: Path
) -> None:
    args, store = stored
    before, old = files(store), igrad_values(store)
    (info,) = Store(store).select()
    settings = info.manifest.settings
    redone = extract(*args, "--redo", "igrad", "--igrad-steps", "3")
    assert redone.exit_code == 0, redone.output
    assert "igrad redone over 3 stored documents with --igrad --igrad-site block " in (
        redone.output
    )
    after = files(store)
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    # the igrad parts and the manifest (its igrad settings) only; lens, tokens, ... kept
    assert changed, "nothing was redone"
    assert all(p.split("/")[0] in IGRAD_TABLES or p.endswith("manifest.json") for p in changed)
    assert {p.split("/")[0] for p in changed} >= set(IGRAD_TABLES)
    (info,) = Store(store).select()
    assert info.manifest.settings["igrad"]["igrad_steps"] == 3
    assert {k: v for k, v in info.manifest.settings.items() if k != "igrad"} == {
        k: v for k, v in settings.items() if k != "igrad"
    }
    runs = info.partition.manifest.parent.glob("runs/*.json")
    records = [json.loads(p.read_text()) for p in runs]
    assert [r.get("redo") for r in records].count("igrad") == 1
    assert len(records) == 2  # the first run's record kept
    # the numbers of a fresh extraction with M = 3, not those of M = 2
    fresh = tmp_path / "fresh"
    i = args.index("--store")
    again = [*args[:i], "--store", str(fresh), *args[i + 2 :]]
    assert extract(*again, "--igrad", "--igrad-steps", "3", "--lens", "final").exit_code == 0
    new, reference = igrad_values(store), igrad_values(fresh)
    assert new.equals(reference)
    assert not new.equals(old)
    # a rerun with the new settings has nothing to do; the old ones are refused
    assert "nothing to do" in extract(*args, "--igrad", "--igrad-steps", "3").output
    other = extract(*args, "--igrad", "--igrad-steps", "2")
    assert other.exit_code == 1 and "--redo igrad" in other.output


def test_a_redo_that_fails_before_its_commit_changes_nothing(
    stored: tuple[list[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    args, store = stored
    before = files(store)
    calls: list[int] = []
    staged = redo_module.MeasurementRedo.write_part

    def fail_on_the_second_chunk(self: Any, table: str, start: int, *rest: Any) -> None:
        calls.append(start)
        if start > 0:  # the first chunk is staged, then the process fails
            raise KeyboardInterrupt
        staged(self, table, start, *rest)

    monkeypatch.setattr(redo_module.MeasurementRedo, "write_part", fail_on_the_second_chunk)
    out = extract(*args, "--redo", "igrad", "--igrad-steps", "3")
    assert out.exit_code != 0 and calls[-1] > 0
    assert files(store) == before
    assert not list((store / MANIFESTS).rglob(".redo*"))  # the staging folder removed
    (info,) = Store(store).select()
    assert info.manifest.settings["igrad"]["igrad_steps"] == 2
    assert igrad_values(store).height > 0


def test_a_redo_killed_after_its_commit_is_completed_by_the_next_reader(
    stored: tuple[list[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args, store = stored
    before = files(store)
    finish = redo_module.finish

    def killed_between_the_tables_and_the_manifest(*a: Any) -> None:
        raise KeyboardInterrupt

    # killed after the tables were swapped in, before the manifest recorded the new settings
    monkeypatch.setattr(redo_module, "write_manifest", killed_between_the_tables_and_the_manifest)
    out = extract(*args, "--redo", "igrad", "--igrad-steps", "3")
    assert out.exit_code != 0
    journal = next((store / MANIFESTS).rglob(redo_module.JOURNAL))
    assert (journal / redo_module.RECORD).is_file()
    assert files(store) != before
    monkeypatch.undo()
    assert redo_module.finish is finish
    (info,) = Store(store).select()  # the reader completes the redo
    assert not journal.exists()
    assert info.manifest.settings["igrad"]["igrad_steps"] == 3
    fresh = tmp_path / "fresh"
    i = args.index("--store")
    again = [*args[:i], "--store", str(fresh), *args[i + 2 :]]
    assert extract(*again, "--igrad", "--igrad-steps", "3", "--lens", "final").exit_code == 0
    assert igrad_values(store).equals(igrad_values(fresh))


def test_a_redo_is_refused_in_one_line_before_anything_is_written(
    stored: tuple[list[str], Path], tmp_path: Path
) -> None:
    args, store = stored
    before = files(store)
    cases = {
        ("--redo", "tokens"): "--redo tokens: a core table of every partition; --redo takes a "
        "measurement",
        ("--redo", "nothing"): "--redo nothing: not a measurement",
        ("--redo", "states"): "holds no states to redo; extract it with --states",
        ("--redo", "igrad", "--overwrite"): "drop --overwrite",
        ("--redo", "igrad", "--limit", "2"): "stores 3 documents, this run covers 2: give "
        "--limit 3",
    }
    for flags, message in cases.items():
        i = args.index("--limit")
        run = [*args[:i], *args[i + 2 :]] if "--limit" in flags else args
        out = extract(*run, *flags)
        lines = [line for line in out.output.splitlines() if line.strip()]
        assert out.exit_code != 0 and len(lines) == 1, out.output
        assert message in lines[0], (flags, lines[0])
    assert files(store) == before
    elsewhere = [*args[: args.index("--store")], "--store", str(tmp_path / "none"),
                 *args[args.index("--store") + 2 :]]  # fmt: skip
    out = extract(*elsewhere, "--redo", "igrad")
    assert out.exit_code != 0 and "is not stored; extract task" in out.output
