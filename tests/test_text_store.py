"""The store's side of running-text partitions (no model): text tables written by the writer,
read back through Store, checked for row counts on resume; choice stores of schema version 2
still read."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from layerdiv.analyze.api import analyze
from layerdiv.analyze.synthetic import (
    random_partition,
    write_partition,
)
from layerdiv.analyze.synthetic import (
    text_manifest as synthetic_text_manifest,
)
from layerdiv.cli import main
from layerdiv.measurements import optional_tables, tables_of
from layerdiv.measurements.erase import erasure_rows
from layerdiv.measurements.future import future_tables
from layerdiv.measurements.igrad import IgradRows, igrad_rows
from layerdiv.measurements.lens import learned_table, token_lens_table
from layerdiv.measurements.lens_stats import LensSums, lens_stats_table
from layerdiv.measurements.sinks import sink_rows
from layerdiv.measurements.states import states_table
from layerdiv.schemas import LEARNED_LENS, LEARNED_LENS_KINDS, SCHEMA_VERSION
from layerdiv.store import Manifest, PartitionWriter, Store, StoreError
from layerdiv.store.manifest import read_manifest
from layerdiv.store.paths import OverlappingParts
from layerdiv.store.tables import (
    documents_table,
    token_blocks_table,
    tokens_table,
)
from layerdiv.store.writer import StoreUnwritable
from tests.conftest import tables_as_version

BLOCKS = 3
LENGTHS = [5, 9, 3, 7, 4]  # tokens of documents 0..4
CHUNK = 2


def text_manifest(n: int) -> Manifest:
    return synthetic_text_manifest(
        "m", "txt", n, BLOCKS, 16, CHUNK, lens=True, skips=True, hidden_size=8
    )


def consistent_dots(rng: np.random.Generator, tokens: int, width: int = 4) -> np.ndarray:
    """(tokens, BLOCKS, 9) dot products of random vectors h, a, m per token and block, as a
    forward pass stores them (h_(l+1) = h_l + a_l + m_l; dd_next NaN at the last block)."""
    h = rng.normal(size=(tokens, width))
    states, adds = [], []
    for _ in range(BLOCKS):
        a, m = rng.normal(size=(2, tokens, width))
        states.append(h)
        adds.append((a, m))
        h = h + a + m
    dots = np.full((tokens, BLOCKS, 9), np.nan)
    for block, (x, (a, m)) in enumerate(zip(states, adds, strict=True)):
        pairs = ((x, x), (a, a), (m, m), (x, a), (x, m), (a, m))
        for i, (u, v) in enumerate(pairs):
            dots[:, block, i] = (u * v).sum(-1)
        if block + 1 < BLOCKS:
            dots[:, block, 6] = ((a + m) * sum(adds[block + 1])).sum(-1)
        dots[:, block, 7] = (x * h).sum(-1)
        dots[:, block, 8] = (x * states[0]).sum(-1)  # h_embed = h_l . h_0
    return dots


def chunk(docs: list[int], rng: np.random.Generator) -> dict:
    """Every text table of documents ``docs``."""
    n_tok = [LENGTHS[d] for d in docs]
    total = sum(n_tok)
    dots = consistent_dots(rng, total)
    ce = rng.uniform(size=(total, BLOCKS + 1))
    ce[np.cumsum(n_tok) - 1] = np.nan  # no next token at each document's end
    doc = [d for d in docs for _ in range(BLOCKS)]
    skipped = [s for _ in docs for s in range(BLOCKS)]
    split, sublayer = [8] * len(doc), ["block"] * len(doc)
    lens = np.stack(
        [
            rng.uniform(size=(total, BLOCKS + 1)),
            np.ones((total, BLOCKS + 1)),
            np.ones((total, BLOCKS + 1)),
            rng.integers(0, 100, (total, BLOCKS + 1)),
            ce,
        ],
        axis=-1,
    )
    return {
        "token_lens": token_lens_table(docs, n_tok, lens),
        **{
            learned_table(k): token_lens_table(docs, n_tok, lens, LEARNED_LENS[k])
            for k in LEARNED_LENS_KINDS
        },
        **future_tables(
            doc,
            split,
            sublayer,
            skipped,
            rng.uniform(size=(len(doc), BLOCKS)),
            rng.uniform(size=len(doc)),
        ),
        **igrad_rows(
            docs,
            [
                IgradRows(
                    ("block",), rng.normal(size=(1, BLOCKS, n)), *rng.uniform(size=(2, 1, BLOCKS))
                )
                for n in n_tok
            ],
        ),
        **sink_rows(docs, [rng.uniform(size=(BLOCKS, 2)) for _ in docs]),
        "tokens": tokens_table(
            docs, [list(range(100 * d, 100 * d + n)) for d, n in zip(docs, n_tok, strict=True)]
        ),
        "token_blocks": token_blocks_table(docs, n_tok, dots),
        "states": states_table(
            docs,
            [np.arange(1, n) for n in n_tok],
            [np.arange(100 * d + 1, 100 * d + n) for d, n in zip(docs, n_tok, strict=True)],
            [rng.normal(size=(n - 1, BLOCKS + 1, 8)).astype(np.float16) for n in n_tok],
        ),
        **erasure_rows(docs, [rng.uniform(size=(BLOCKS + 1, n)) for n in n_tok]),
        "lens_stats": lens_stats_table(
            LensSums(
                sum(n_tok),
                rng.normal(size=(BLOCKS, 8)),
                rng.normal(size=8),
                *rng.normal(size=(2, BLOCKS, 8, 8)),
            )
        ),
        **sink_rows(docs, [rng.uniform(size=(BLOCKS, 2)) for _ in n_tok]),
        "documents": documents_table(
            docs, n_tok, [n > 6 for n in n_tok], [str(d % 2) for d in docs]
        ),
    }


@pytest.fixture
def text_store(tmp_path: Path) -> Path:
    writer = PartitionWriter(tmp_path, "m", "txt")
    writer.open(text_manifest(len(LENGTHS)), overwrite=False)
    for table in optional_tables("text"):
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
    assert info.tables == list(optional_tables("text")) and not info.incomplete()
    assert not (text_store / "components").exists()  # only the text kind's folders are made
    key, ids, states, _ = info.states()  # every position but the first, its token and L + 1 states
    assert len(key) == sum(n - 1 for n in LENGTHS) and states.shape[1:] == (BLOCKS + 1, 8)
    assert key[:4, 1].tolist() == [1, 2, 3, 4] and ids[:5].tolist() == [1, 2, 3, 4, 101]
    con = store.duckdb()
    total = sum(LENGTHS)
    got = con.execute(
        "SELECT (SELECT count(*) FROM tokens), (SELECT count(*) FROM token_blocks), "
        "(SELECT count(*) FROM token_lens), (SELECT count(dd_next) FROM token_blocks), "
        "(SELECT count(ce) FROM token_lens), (SELECT sum(n_tokens) FROM documents), "
        "(SELECT count(*) FROM future_effects), (SELECT count(*) FROM future_output), "
        "(SELECT count(*) FROM erasure)"
    ).fetchone()
    n_skips = len(LENGTHS) * BLOCKS
    assert got == (
        total, total * BLOCKS, total * (BLOCKS + 1), total * (BLOCKS - 1),
        (total - len(LENGTHS)) * (BLOCKS + 1), total, n_skips * BLOCKS, n_skips,
        total * (BLOCKS + 1),
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
    path = next(tmp_path.glob("manifests/**/manifest.json"))
    data = json.loads(path.read_text())
    for name in ("kind", "max_tokens", "weights", "settings", "generation"):
        del data[name]  # fields of versions 4 and 5
    data["schema_version"] = 3
    path.write_text(json.dumps(data))
    tables_as_version(tmp_path, data["schema_version"])
    assert SCHEMA_VERSION == 10 and "lens" not in tables_of(3) and "tokens" not in tables_of(3)
    assert "prompt" in tables_of(3)["instances"].names
    assert (
        "pieces" not in tables_of(9)["instances"].names
        and "pieces" in tables_of(10)["instances"].names
    )
    store = Store(tmp_path)
    (info,) = store.select()
    assert info.manifest.kind == "choice" and info.manifest.schema_version == 3
    components, instances = info.read(["logit"], ["gold"])
    assert components.height == 8 * len(kinds) * 3 and instances["gold"].to_list() == list(gold)
    n = store.duckdb().execute("SELECT count(*) FROM components").fetchone()
    assert n == (8 * len(kinds) * 3,)
    writer = PartitionWriter(tmp_path, "m", "t")
    assert writer.done_instances(read_manifest(path)) == set(range(8))


def test_each_version_s_tables_come_from_the_declarations() -> None:
    """Which tables a schema version has is declared beside them: the task kinds' required ones
    and each measurement's, with the version it appeared in; the newest has every table."""
    from layerdiv.schemas import TABLES

    assert set(tables_of(SCHEMA_VERSION)) == set(TABLES)
    assert all(tables_of(SCHEMA_VERSION)[t].equals(TABLES[t]) for t in TABLES)
    assert set(tables_of(1)) == {"components", "instances"}
    assert set(tables_of(2)) == {"components", "instances", "skips", "heads", "gram"}
    new = {v: set(tables_of(v)) - set(tables_of(v - 1)) for v in range(2, SCHEMA_VERSION + 1)}
    assert new[7] == {"igrad", "igrad_ends", "erasure", "erasure_reference", "sinks"}
    assert new[6] == set() and new[5] == {"states"}
    assert (
        new[9] == {"lens_stats", "token_lens_ls", "token_lens_tuned"} and new[8] == new[10] == set()
    )


def test_version_4_store_reads_without_the_weights_note(tmp_path: Path) -> None:
    logits, gold, rms, kinds = random_partition(np.random.default_rng(0), 8, 2, 3)
    write_partition(tmp_path, "m", "t", logits, gold, kinds, rms, chunk=4)
    path = next(tmp_path.glob("manifests/**/manifest.json"))
    data = json.loads(path.read_text())
    del data["weights"]  # the field of version 5
    data["schema_version"] = 4
    path.write_text(json.dumps(data))
    tables_as_version(tmp_path, data["schema_version"])
    assert all(tables_of(4)[t] == tables_of(5)[t] for t in ("components", "instances"))
    assert "loss" not in tables_of(4)["tokens"].names
    assert set(tables_of(5)) - set(tables_of(4)) == {"states"}  # and the same others
    store = Store(tmp_path)
    (info,) = store.select()
    assert info.manifest.schema_version == 4 and info.manifest.weights is None
    assert store.manifests()["weights"].to_list() == [None]
    components, _ = info.read(["logit"], ["gold"])
    assert components.height == 8 * len(kinds) * 3


def damage_a_page(part: Path, column: str) -> None:
    """Change bytes inside ``column``'s data page of ``part`` (footer intact) so that a reader
    that does not verify page checksums still decodes the page, to other numbers."""
    meta = pq.ParquetFile(part).metadata.row_group(0)
    chunk = next(
        meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == column
    )
    original = pq.read_table(part, columns=[column])[column]
    data = part.read_bytes()
    end = chunk.data_page_offset + chunk.total_compressed_size
    for at in range(end - 2, chunk.data_page_offset, -1):  # the page's last bytes first
        damaged = bytearray(data)
        damaged[at] ^= 0x5A
        part.write_bytes(bytes(damaged))
        try:
            read = pq.read_table(part, columns=[column])[column]
        except (OSError, ValueError):
            continue
        if not read.equals(original):
            return
    raise AssertionError(f"no damage of {part} decodes")


def test_a_damaged_data_page_is_named_by_every_reader(text_store: Path) -> None:
    part = PartitionWriter(text_store, "m", "txt").part.part("token_blocks", 2, 2)
    damage_a_page(part, "hh")  # read unverified, the page gives other numbers
    assert pq.read_metadata(part).num_rows == sum(LENGTHS[2:4]) * BLOCKS  # footer intact
    store = Store(text_store)  # footers only: opens
    (info,) = store.select()
    named = f"^{part}: unreadable part .*CRC.*re-extract partition model=m revision=main task=txt"
    with pytest.raises(StoreError, match=named):
        list(info.batches("token_blocks", ["hh"], 1000))
    with pytest.raises(StoreError, match=named):
        store.scan("token_blocks").select("hh").collect()
    with pytest.raises(StoreError, match=named):
        analyze(text_store)
    assert store.scan("tokens").collect().height == sum(LENGTHS)  # the other tables read


def query(store: Path, *sql: str) -> Any:
    return CliRunner().invoke(main, ["query", "--store", str(store), *sql])


TEXT_VIEWS = (
    "documents, tokens, token_blocks, token_lens, token_lens_ls, token_lens_tuned, "
    "future_effects, future_output, igrad, igrad_ends, erasure, sinks, manifests"
)


@pytest.mark.parametrize(
    ("sql", "says"),
    [
        ("SELECT * FROM components", "the SQL refused: Catalog Error"),
        ("SELECT * FROM read_parquet('/etc/passwd')", "reads only the views of this store"),
        ("COPY documents TO '/tmp/x.csv'", "reads only the views of this store"),
        ("SELECT error('boom') FROM documents", "the SQL failed while running: Invalid Input"),
        ("SELECT 1; SELECT cast('x' || doc AS INT) FROM documents",
         "statement 2 of 2: the SQL failed while running: Conversion Error"),
    ],
)  # fmt: skip
def test_query_errors_on_a_text_store_name_its_views(text_store: Path, sql: str, says: str) -> None:
    result = query(text_store, sql)
    assert result.exit_code == 1
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error: ") and says in line and TEXT_VIEWS in line
    assert "components, instances" not in line


def test_a_failing_statement_keeps_the_incomplete_note(text_store: Path) -> None:
    PartitionWriter(text_store, "m", "txt").part.part("token_lens", 2, 2).unlink()
    result = query(text_store, "SELECT error('boom')")
    assert result.exit_code == 1
    assert "Note: token_lens left out for partition model=m revision=main task=txt" in result.output


def test_a_damaged_page_is_named_by_query(text_store: Path) -> None:
    part = PartitionWriter(text_store, "m", "txt").part.part("token_blocks", 2, 2)
    damage_a_page(part, "hh")
    result = query(text_store, "SELECT avg(hh) FROM token_blocks")
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {part}: unreadable part (could not verify page")


def test_a_file_system_without_locks_is_named_with_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_locks(fd: int, mode: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    writer = PartitionWriter(tmp_path, "m", "txt")
    with pytest.raises(StoreUnwritable, match=r"task=txt.lock: the store's file system does not "
                       r"support locks \(No locks available\); give a --store on a local or "
                       r"lock-capable file system"):  # fmt: skip
        writer.open(text_manifest(len(LENGTHS)), overwrite=False)


def test_a_partition_killed_before_its_first_chunk_says_how_to_resume(tmp_path: Path) -> None:
    PartitionWriter(tmp_path, "m", "txt").open(text_manifest(len(LENGTHS)), overwrite=False)
    with pytest.raises(StoreError, match=r"task=txt has a manifest but no complete chunk"
                       r".*resume it with `layerdiv extract --model m --task txt --limit 5 "
                       rf"--store {tmp_path}`"):  # fmt: skip
        Store(tmp_path).select()


def rewrite(part: Path, change: Any) -> None:
    """Rewrite a valid part (checksums and all) as ``change`` of its table."""
    pq.write_table(change(pq.read_table(part)), part, write_page_checksum=True)


def test_a_part_with_rows_removed_is_refused_by_readers(text_store: Path) -> None:
    part = PartitionWriter(text_store, "m", "txt").part.part("token_blocks", 2, 2)
    rewrite(part, lambda t: t.slice(BLOCKS))  # the first token's rows gone
    store = Store(text_store)
    assert not store.partitions
    with pytest.raises(StoreError, match=rf"^{part}: 27 rows where the chunk needs 30 \(rows "):
        store.select()


def test_a_token_repeated_in_place_of_another_is_refused(text_store: Path) -> None:
    part = PartitionWriter(text_store, "m", "txt").part.part("token_blocks", 2, 2)
    rewrite(part, lambda t: pa.concat_tables([t.slice(0, BLOCKS), t.slice(0, t.num_rows - BLOCKS)]))
    with pytest.raises(StoreError, match="token_blocks rows repeat a token or are out of"):
        analyze(text_store)


def test_future_effects_rows_repeated_in_a_part_are_refused(text_store: Path) -> None:
    part = PartitionWriter(text_store, "m", "txt").part.part
    rewrite(part("future_output", 2, 2), lambda t: pa.concat_tables([t, t.slice(0, 1)]))
    rewrite(part("future_effects", 2, 2), lambda t: pa.concat_tables([t, t.slice(0, BLOCKS)]))
    Store(text_store)  # whole rows: the row counts agree
    with pytest.raises(
        StoreError, match=r"future_(effects|output).*: rows repeat a \(doc, split, sublayer"
    ):
        analyze(text_store)


@pytest.mark.parametrize(
    ("table", "change"),
    [("future_effects", lambda t: t.slice(1)), ("future_output", lambda t: t.slice(1)),
     ("future_effects", lambda t: pa.concat_tables([t, t.slice(0, 1)]))],
)  # fmt: skip
def test_future_effects_rows_removed_or_repeated_are_refused_by_every_reader(
    text_store: Path, table: str, change: Any
) -> None:
    writer = PartitionWriter(text_store, "m", "txt")
    rewrite(writer.part.part(table, 2, 2), change)
    effects = writer.part.part("future_effects", 2, 2)
    with pytest.raises(StoreError, match=rf"^{effects}: \d+ rows where the chunk's \d+ "
                       "future_output rows need"):  # fmt: skip
        Store(text_store).select()
    assert query(text_store, "SELECT count(*) FROM future_effects").exit_code == 1
    assert writer.done_instances(read_manifest(writer.part.manifest)) == {0, 1, 4}  # redone


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        (float("nan"), "token_blocks.hh holds a NaN or an infinite value"),
        (float("inf"), "hh holds an infinite value"),
        (-1.0, "token_blocks of doc 2 position 1 hold a negative squared norm"),
    ],
)
def test_impossible_dot_products_are_never_averaged(
    text_store: Path, value: float, refusal: str
) -> None:
    part = PartitionWriter(text_store, "m", "txt").part.part("token_blocks", 2, 2)
    hh = pq.read_table(part)["hh"].to_numpy().copy()
    hh[4] = value  # doc 2, position 1, block 1
    column = pq.read_schema(part).get_field_index("hh")
    rewrite(part, lambda t: t.set_column(column, t.schema.field(column), pa.array(hh)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no raw numpy warning either
        with pytest.raises(StoreError, match=refusal):
            analyze(text_store)


def test_future_effects_rows_out_of_order_but_unique_are_read(text_store: Path) -> None:
    part = PartitionWriter(text_store, "m", "txt").part.part("future_effects", 2, 2)
    before = analyze(text_store).by_name["text_skips"]
    rewrite(part, lambda t: t.take(list(reversed(range(t.num_rows)))))
    assert analyze(text_store).by_name["text_skips"].equals(before)


def test_a_version_6_store_reads_with_the_answer_start_and_pieces_null(tmp_path: Path) -> None:
    """A store as version 6 wrote it (documents without ``answer_start``, tokens without
    ``piece``, none of version 7's tables) opens, reads those columns as null and is analysed."""
    import shutil

    from layerdiv.analyze.synthetic import synthesize_text_store
    from layerdiv.measurements import tables_of

    store = tmp_path / "store"
    synthesize_text_store(store, n_models=1, n_docs=4, n_tokens=8, blocks=3, chunk=2,
                          lens=True, progress=False)  # fmt: skip
    for table, column in (("documents", "answer_start"), ("tokens", "piece")):
        for part in store.glob(f"{table}/**/*.parquet"):
            pq.write_table(pq.read_table(part).drop_columns([column]), part)
    for folder in store.iterdir():
        if folder.name != "manifests" and folder.name not in tables_of(6):
            shutil.rmtree(folder)
    for path in store.glob("manifests/**/manifest.json"):
        data = json.loads(path.read_text())
        data["schema_version"] = 6
        path.write_text(json.dumps(data))
    st = Store(store)
    (info,) = st.partitions
    assert info.manifest.schema_version == 6
    documents = st.scan("documents").collect()
    tokens = st.scan("tokens").collect()
    assert documents.height == 4 and documents["answer_start"].null_count() == 4
    assert tokens.height == 4 * 8 and tokens["piece"].null_count() == tokens.height
    assert "text_geometry" in analyze(store).names()
