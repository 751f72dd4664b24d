"""The stored tables of a ``--gram --skips --heads --lens`` extraction of a choice task and of a
``--skips --lens`` extraction of a text task on a tiny seeded model, compared frame by frame
against frames stored under ``tests/data/frames`` (written once by an earlier release of the
extraction code: restructuring it must not change a stored number).

``LAYERDIV_WRITE_FRAMES=1 pytest tests/test_frames.py`` rewrites them (only when the numbers are
meant to change)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from layerdiv.store import Store
from layerdiv.store.key import KEY
from tests.test_text_extract import extract, random_texts, text_task

FRAMES = Path(__file__).parent / "data" / "frames"
WRITE = os.environ.get("LAYERDIV_WRITE_FRAMES") == "1"

RUNS = {
    "choice": ["--gram", "--skips", "--heads", "--lens"],
    "text": ["--skips", "--lens"],
}
"""The flags of each task kind's extraction."""

LENS_STATISTICS = ("kl", "ce")
"""Summed in another order since the frames were recorded (the lens's statistics in larger
slices, the log-sum-exp read at the top-five's first index): equal to float32 rounding, every
other column exactly."""

ADDED = {
    "tokens": {"loss"},
    "future_effects": {"mode"},
    "token_blocks": {"h_embed"},
    "token_lens": {"final_rank", "top1"},
    "lens": {"final_rank", "top1"},
}
"""Columns added since the frames were recorded (schema version 5: the model's own loss, the
future effects' mode, h_l . h_0 of the progress proj; version 6: the lens's rank of the model's
own top-1 token and its own top-1 token)."""


def _task(kind: str, folder: Path, make_task: Any) -> Path:
    if kind == "choice":
        return make_task(folder, n=6)
    return text_task(folder, random_texts(4, seed=3), max_tokens=24)


def _frames(store: Path) -> dict[str, pl.DataFrame]:
    """Every table of the store, sorted by all its columns (the order of parts is no promise)."""
    opened = Store(store)
    out = {}
    for table in opened.tables():
        frame = opened.scan(table).drop(*KEY).collect()
        out[table] = frame.sort(frame.columns)
    return out


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_stored_tables_equal_the_recorded_frames(
    kind: str, tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    task = _task(kind, tmp_path / "task", make_task)
    store = tmp_path / "store"
    result = extract("--model", str(model_dirs("qwen2")), "--task", str(task), "--store",
                     str(store), "--device", "cpu", "--dtype", "fp32", "--batch-size", "2",
                     "--chunk-size", "4", *RUNS[kind])  # fmt: skip
    assert result.exit_code == 0, result.output
    frames = _frames(store)
    folder = FRAMES / kind
    if WRITE:
        folder.mkdir(parents=True, exist_ok=True)
        for table, frame in frames.items():
            frame.write_parquet(folder / f"{table}.parquet", compression="zstd")
    recorded = {p.stem: pl.read_parquet(p) for p in sorted(folder.glob("*.parquet"))}
    assert sorted(frames) == sorted(recorded)
    assert len(recorded) == 6  # the required tables and every optional one of the kind
    for table, frame in frames.items():
        assert frame.height > 0, table
        assert set(frame.columns) - set(recorded[table].columns) == ADDED.get(table, set())
        kept = recorded[table].columns
        exact = [c for c in kept if c not in LENS_STATISTICS]
        got = frame.select(kept).sort(exact)
        want = recorded[table].sort(exact)
        assert_frame_equal(got.select(exact), want.select(exact), check_exact=True)
        close = [c for c in kept if c in LENS_STATISTICS]
        assert_frame_equal(got.select(close), want.select(close), rel_tol=1e-5, abs_tol=1e-7)
