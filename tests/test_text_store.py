"""The store's side of running-text partitions (no model): text tables written by the writer,
read back through Store, checked for row counts on resume; choice stores of schema version 2
still read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from layerdiv.analyze.synthetic import (
    random_partition,
    write_partition,
)
from layerdiv.analyze.synthetic import (
    text_manifest as synthetic_text_manifest,
)
from layerdiv.schemas import KINDS, SCHEMA_VERSION, tables_of
from layerdiv.store import Manifest, PartitionWriter, Store
from layerdiv.store.manifest import read_manifest
from layerdiv.store.paths import OverlappingParts
from layerdiv.store.tables import (
    documents_table,
    future_effects_table,
    future_output_table,
    token_blocks_table,
    token_lens_table,
    tokens_table,
)

BLOCKS = 3
LENGTHS = [5, 9, 3, 7, 4]  # tokens of documents 0..4
CHUNK = 2


def text_manifest(n: int) -> Manifest:
    return synthetic_text_manifest(
        "m", "txt", n, BLOCKS, 16, CHUNK, lens=True, skips=True, hidden_size=8
    )


def chunk(docs: list[int], rng: np.random.Generator) -> dict:
    """Every text table of documents ``docs``."""
    n_tok = [LENGTHS[d] for d in docs]
    total = sum(n_tok)
    dots = rng.normal(size=(total, BLOCKS, 8))
    dots[:, -1, 6] = np.nan  # dd_next of the last block
    ce = rng.uniform(size=(total, BLOCKS + 1))
    ce[np.cumsum(n_tok) - 1] = np.nan  # no next token at each document's end
    doc = [d for d in docs for _ in range(BLOCKS)]
    skipped = [s for _ in docs for s in range(BLOCKS)]
    split, sublayer = [8] * len(doc), ["block"] * len(doc)
    return {
        "token_lens": token_lens_table(
            docs, n_tok, rng.uniform(size=(total, BLOCKS + 1)), np.ones((total, BLOCKS + 1)), ce
        ),
        "future_effects": future_effects_table(
            doc, split, sublayer, skipped, rng.uniform(size=(len(doc), BLOCKS))
        ),
        "future_output": future_output_table(
            doc, split, sublayer, skipped, rng.uniform(size=len(doc))
        ),
        "tokens": tokens_table(
            docs, [list(range(100 * d, 100 * d + n)) for d, n in zip(docs, n_tok, strict=True)]
        ),
        "token_blocks": token_blocks_table(docs, n_tok, dots),
        "documents": documents_table(
            docs, n_tok, [n > 6 for n in n_tok], [str(d % 2) for d in docs]
        ),
    }


@pytest.fixture
def text_store(tmp_path: Path) -> Path:
    writer = PartitionWriter(tmp_path, "m", "txt")
    writer.open(text_manifest(len(LENGTHS)), overwrite=False)
    for table in KINDS["text"].optional:
        writer.mark_table(table)
    rng = np.random.default_rng(0)
    for start in range(0, len(LENGTHS), CHUNK):
        docs = list(range(start, min(len(LENGTHS), start + CHUNK)))
        writer.write_chunk(start, len(docs), chunk(docs, rng))
    return tmp_path


def test_text_partition_reads_back(text_store: Path) -> None:
    store = Store(text_store)
    (info,) = store.select()
    assert info.manifest.kind == "text" and info.manifest.n_blocks == BLOCKS
    assert info.n_done == len(LENGTHS)
    assert info.tables == list(KINDS["text"].optional) and not info.incomplete()
    assert not (text_store / "components").exists()  # only the text kind's folders are made
    con = store.duckdb()
    total = sum(LENGTHS)
    got = con.execute(
        "SELECT (SELECT count(*) FROM tokens), (SELECT count(*) FROM token_blocks), "
        "(SELECT count(*) FROM token_lens), (SELECT count(dd_next) FROM token_blocks), "
        "(SELECT count(ce) FROM token_lens), (SELECT sum(n_tokens) FROM documents), "
        "(SELECT count(*) FROM future_effects), (SELECT count(*) FROM future_output)"
    ).fetchone()
    n_skips = len(LENGTHS) * BLOCKS
    assert got == (
        total, total * BLOCKS, total * (BLOCKS + 1), total * (BLOCKS - 1),
        (total - len(LENGTHS)) * (BLOCKS + 1), total, n_skips * BLOCKS, n_skips,
    )  # fmt: skip
    tokens = con.execute("SELECT doc, pos, token FROM tokens ORDER BY doc, pos").fetchall()
    assert tokens[:6] == [(0, p, p) for p in range(5)] + [(1, 0, 100)]
    assert con.execute("SELECT DISTINCT sublayer FROM future_effects").fetchall() == [("block",)]
    assert "components" not in {r[0] for r in con.execute("SHOW TABLES").fetchall()}
    assert store.manifests()["kind"].to_list() == ["text"]


def test_text_chunk_row_counts_are_checked(text_store: Path) -> None:
    writer = PartitionWriter(text_store, "m", "txt")
    manifest = read_manifest(writer.part.manifest)
    assert writer.done_instances(manifest) == set(range(len(LENGTHS)))
    part = writer.part.part("token_blocks", 2, 2)
    table = pq.read_table(part)
    pq.write_table(table.slice(0, table.num_rows - 1), part)  # one row short
    assert writer.unreadable(writer.part.done_parts(), manifest) == [(2, 2)]
    writer.remove_chunk(2, 2)
    assert writer.part.done_parts() == [(0, 2), (4, 1)]
    assert not writer.part.part("documents", 2, 2).exists()
    assert writer.done_instances(manifest) == {0, 1, 4}


def test_text_chunk_needs_its_required_tables(text_store: Path) -> None:
    writer = PartitionWriter(text_store, "m", "txt")
    tables = chunk([0], np.random.default_rng(1))
    del tables["tokens"]
    with pytest.raises(ValueError, match="no tokens table"):
        writer.write_chunk(0, 1, tables)


def test_marker_parts_of_two_kinds_are_refused(text_store: Path) -> None:
    writer = PartitionWriter(text_store, "m", "txt")
    stray = writer.part.part("instances", 10, 2)
    stray.parent.mkdir(parents=True)
    stray.write_bytes(writer.part.part("documents", 0, 2).read_bytes())
    with pytest.raises(OverlappingParts, match="chunks of two task kinds"):
        writer.part.done_parts()


def test_version_3_choice_store_still_reads(tmp_path: Path) -> None:
    logits, gold, rms, kinds = random_partition(np.random.default_rng(0), 8, 2, 3)
    write_partition(tmp_path, "m", "t", logits, gold, kinds, rms, chunk=4)
    path = next(tmp_path.glob("manifests/*/*/manifest.json"))
    data = json.loads(path.read_text())
    for name in ("kind", "max_tokens", "lens", "skip_split", "skip_seed", "weights"):
        del data[name]  # fields of versions 4 and 5
    data["schema_version"] = 3
    path.write_text(json.dumps(data))
    assert SCHEMA_VERSION == 5 and "lens" not in tables_of(3) and "tokens" not in tables_of(3)
    assert "prompt" in tables_of(3)["instances"].names
    store = Store(tmp_path)
    (info,) = store.select()
    assert info.manifest.kind == "choice" and info.manifest.schema_version == 3
    components, instances = info.read(["logit"], ["gold"])
    assert components.height == 8 * len(kinds) * 3 and instances["gold"].to_list() == list(gold)
    n = store.duckdb().execute("SELECT count(*) FROM components").fetchone()
    assert n == (8 * len(kinds) * 3,)
    writer = PartitionWriter(tmp_path, "m", "t")
    assert writer.done_instances(read_manifest(path)) == set(range(8))


def test_version_4_store_reads_without_the_weights_note(tmp_path: Path) -> None:
    logits, gold, rms, kinds = random_partition(np.random.default_rng(0), 8, 2, 3)
    write_partition(tmp_path, "m", "t", logits, gold, kinds, rms, chunk=4)
    path = next(tmp_path.glob("manifests/*/*/manifest.json"))
    data = json.loads(path.read_text())
    del data["weights"]  # the field of version 5
    data["schema_version"] = 4
    path.write_text(json.dumps(data))
    assert tables_of(4) == tables_of(5)
    store = Store(tmp_path)
    (info,) = store.select()
    assert info.manifest.schema_version == 4 and info.manifest.weights is None
    assert store.manifests()["weights"].to_list() == [None]
    components, _ = info.read(["logit"], ["gold"])
    assert components.height == 8 * len(kinds) * 3
