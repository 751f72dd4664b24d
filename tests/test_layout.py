"""The snippet of the docs page "The store" that reads the store's hive layout with a plain
Parquet engine (DuckDB) sees exactly the complete chunks that layerdiv's own reader sees."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from layerdiv.analyze.synthetic import decoder_kinds, write_partition
from layerdiv.store import Store
from layerdiv.store.key import KEY
from layerdiv.store.writer import PartitionWriter

STORE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "store.md"


def store_page_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", STORE_PAGE.read_text(), flags=re.S)
    (snippet,) = [b for b in blocks if "complete chunks only" in b]
    return snippet


def test_the_store_page_snippet_reads_complete_chunks_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    store = tmp_path / "layerdiv-store"
    for model, n, k in (("org/a", 20, 2), ("org/b", 12, 3)):
        logits = rng.normal(size=(n, 5, k)).astype(np.float32)
        gold = rng.integers(0, k, n)
        write_partition(store, model, "sst2", logits, gold, decoder_kinds(2), chunk=8)
    # What an interrupted run leaves: its record without an end, a components part without its
    # instances part, a temp file.
    PartitionWriter(store, "org/a", "sst2").start_run({"n_requested": 28})
    comps = store / "components" / "model=org--a" / "revision=main" / "task=sst2"
    shutil.copy(comps / "part-0000000-000008.parquet", comps / "part-0000020-000008.parquet")
    (comps / ".part-0000028-000008.parquet.x.tmp").write_bytes(b"half")

    scope: dict[str, Any] = {}
    exec(store_page_snippet().replace('"layerdiv-store"', repr(str(store))), scope)
    counts = scope["counts"].sort("model")
    expected = (Store(store).scan("components").group_by(*KEY).len("rows").sort("model")).collect()
    assert counts["rows"].to_list() == [20 * 5 * 2, 12 * 5 * 3]
    assert counts.select(*KEY, pl.col("rows").cast(pl.UInt32)).equals(expected)
