"""The stored tables of a ``--gram --skips --heads --lens`` extraction of a choice task and of a
``--skips --lens`` extraction of a text task on a tiny seeded model, compared frame by frame
against frames stored under ``tests/data/frames`` (written once by an earlier release of the
extraction code: restructuring it, or running it on another processor, must not change a stored
number beyond float32 rounding; keys and integers exactly, floats within
:data:`~tests.tolerance.FLOAT32` of their column's scale).

``LAYERDIV_WRITE_FRAMES=1 pytest tests/test_frames.py`` rewrites them (only when the numbers are
meant to change)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
import transformers

from layerdiv.store import Store
from layerdiv.store.key import KEY
from tests.test_text_extract import extract, random_texts, text_task
from tests.tolerance import FLOAT32

FRAMES = Path(__file__).parent / "data" / "frames"
WRITE = os.environ.get("LAYERDIV_WRITE_FRAMES") == "1"

RUNS = {
    "choice": ["--gram", "--skips", "--heads", "--lens"],
    "text": ["--skips", "--lens"],
}
"""The flags of each task kind's extraction."""

SCALE_OF = {"sum_error": "model_logits", "kl": "ce"}
"""Floats compared on the scale of the magnitudes that produce them, another column's: the
decomposition's sum error is the rounding error of the logits it sums to; the lens's KL divergence
sum_v p(v) (log p(v) - log p_L(v)) is a small difference of log-probabilities, whose size the
cross-entropy column measures."""

ADDED = {
    "tokens": {"loss", "piece"},
    "future_effects": {"mode"},
    "token_blocks": {"h_embed"},
    "token_lens": {"final_rank", "top1"},
    "lens": {"final_rank", "top1"},
    "documents": {"answer_start"},
    "instances": {"pieces"},
}
"""Columns added since the frames were recorded (schema version 5: the model's own loss, the
future effects' mode, h_l . h_0 of the progress proj; version 6: the lens's rank of the model's
own top-1 token and its own top-1 token; version 7: the answer's start, the tokens' spelling;
version 10: the choice prompts' spelling)."""


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


def _is_float(dtype: pl.DataType) -> bool:
    return dtype.is_float() or (isinstance(dtype, pl.List) and dtype.inner.is_float())


def frame_mismatches(got: pl.DataFrame, want: pl.DataFrame) -> list[str]:
    """What differs between a table ``got`` and its recorded frame ``want`` (both with the
    recorded columns): the keys and integers (every column that is not a float or a list of
    floats) exactly, each row's floats within :data:`~tests.tolerance.FLOAT32` of their column's
    scale."""
    if got.height != want.height:
        return [f"{got.height} rows, recorded {want.height}"]
    exact = [c for c, t in want.schema.items() if not _is_float(t)]
    floats = [c for c in want.columns if c not in exact]
    assert not want.select(exact).is_duplicated().any(), "the exact columns must key the rows"
    got, want = got.sort(exact), want.sort(exact)
    if not got.select(exact).equals(want.select(exact)):
        return [f"the exact columns {exact} differ"]
    problems = []
    for column in floats:
        a, b = got[column], want[column]
        if isinstance(want.schema[column], pl.List):
            if not a.list.len().equals(b.list.len()):
                problems.append(f"{column}: list lengths differ")
                continue
            a, b = a.explode(), b.explode()
        x, y = a.to_numpy().astype(np.float64), b.to_numpy().astype(np.float64)
        if not np.array_equal(np.isnan(x), np.isnan(y)):
            problems.append(f"{column}: nulls or NaNs at other rows")
            continue
        scale = _scale(want[SCALE_OF.get(column, column)])
        # |got - want| <= FLOAT32 * max |want| of the column: each value is a float32 sum or dot
        # product over d = 32 features or V ~ 400 vocabulary entries, two blocks deep (another
        # kernel moved them by up to 7e-7 of their column's scale); a change of method (a norm's
        # epsilon left out, a column stored in bfloat16) moves them by 1e-4 to 1e-2
        worst = np.nanmax(np.abs(x - y), initial=0.0)
        if worst > FLOAT32 * scale:
            problems.append(f"{column}: max |difference| {worst:.3g} > "
                            f"{FLOAT32:g} x column scale {scale:.3g}")  # fmt: skip
    return problems


def _scale(column: pl.Series) -> float:
    """The largest magnitude of a float column (of every element of a list column)."""
    values = column.explode() if isinstance(column.dtype, pl.List) else column
    return float(np.nanmax(np.abs(values.to_numpy().astype(np.float64)), initial=0.0))


def _recorded(kind: str) -> dict[str, pl.DataFrame]:
    return {p.stem: pl.read_parquet(p) for p in sorted((FRAMES / kind).glob("*.parquet"))}


@pytest.mark.numerical
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
    recorded = _recorded(kind)
    assert sorted(frames) == sorted(recorded)
    assert len(recorded) == 6  # the required tables and every optional one of the kind
    for table, frame in frames.items():
        assert frame.height > 0, table
        assert set(frame.columns) - set(recorded[table].columns) == ADDED.get(table, set())
        assert frame_mismatches(frame.select(recorded[table].columns), recorded[table]) == [], table


def test_a_change_of_method_fails_the_frames_guard() -> None:
    """The guard tolerates rounding (a few units in the last place of every float) but not a
    change of method: the final norm's epsilon left out of the stored RMS, or the logits stored
    in bfloat16, or one top-5 overlap off by one token."""
    components = _recorded("choice")["components"]
    instances = _recorded("choice")["instances"]
    lens = _recorded("text")["token_lens"]

    def two_ulps(s: pl.Series) -> pl.Series:
        return pl.Series(np.nextafter(np.nextafter(s.to_numpy(), np.inf), np.inf))

    ulps = components.with_columns(pl.col(pl.Float32).map_batches(two_ulps))
    assert frame_mismatches(ulps, components) == []
    eps = transformers.Qwen2Config().rms_norm_eps  # rms = sqrt(mean(x^2) + eps)
    no_eps = instances.with_columns((pl.col("final_rms") ** 2 - eps).sqrt())
    assert [p.split(":")[0] for p in frame_mismatches(no_eps, instances)] == ["final_rms"]
    bf16 = components.with_columns(
        pl.Series("logit", torch.tensor(components["logit"].to_numpy()).bfloat16().float().numpy())
    )
    assert [p.split(":")[0] for p in frame_mismatches(bf16, components)] == ["logit"]
    one_token = pl.int_range(pl.len()) == 7
    top5 = pl.col("top5_overlap")
    overlap = lens.with_columns(pl.when(one_token).then(top5 - 0.2).otherwise(top5))
    assert frame_mismatches(overlap, lens) != []
