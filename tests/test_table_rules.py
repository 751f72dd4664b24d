"""Rows of the measurements' tables that no extraction writes are refused where they are read, in
one line naming the part (the seventh audit, issue 49): a repeated row, a block, position, head,
rank or token id outside its range, a document's rows relabelled as another's, a probability or a
distance outside its domain, a choice erasure part with whole states removed or moved, and an
edited or truncated ``erasure_reference`` file (on read, on resume and by ``merge``). Empty parts
are valid, and interval columns are Float64 however few units a partition has.

The stores here are extracted once per module from the tiny Llama (a text task with an answer and
a choice task, ``--igrad --erase --sinks --lens``) and copied for each damage."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

from layerdiv.cli import main
from layerdiv.store import Store, StoreError
from layerdiv.store.parts import not_finite
from tests.test_multihop import SHORT, multihop_task

FLAGS = ("--igrad", "--igrad-steps", "2", "--erase", "--erase-reference", "2", "--sinks",
         "--lens", "--chunk-size", "2", "--limit", "4")  # fmt: skip


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, model_dirs: Any, make_task: Any) -> dict:
    """``text`` and ``choice``: a store of 4 units in chunks of 2, every measurement of the
    issue extracted."""
    root = tmp_path_factory.mktemp("rules")
    model = str(model_dirs("llama"))
    tasks = {
        "text": multihop_task(root / "text-task", **SHORT),
        "choice": make_task(root / "choice-task", n=4),
    }
    out = {}
    for kind, task in tasks.items():
        store = root / kind
        got = cli("extract", "--model", model, "--task", str(task), *FLAGS, "--store", str(store))
        assert got.exit_code == 0, got.output
        out[kind] = store
    return out


@pytest.fixture
def text(stores: dict, tmp_path: Path) -> Path:
    return Path(shutil.copytree(stores["text"], tmp_path / "text"))


@pytest.fixture
def choice(stores: dict, tmp_path: Path) -> Path:
    return Path(shutil.copytree(stores["choice"], tmp_path / "choice"))


def second_part(store: Path, table: str) -> Path:
    """The part of ``table`` of the chunk of units 2 and 3."""
    (path,) = (store / table).rglob("part-0000002-000002.parquet")
    return path


def rewrite(path: Path, change: Callable[[pa.Table], pa.Table]) -> None:
    """Rewrite a part (checksums, statistics and settings metadata kept) as ``change`` of it."""
    table = pq.read_table(path)
    pq.write_table(change(table).replace_schema_metadata(table.schema.metadata), path,
                   write_page_checksum=True)  # fmt: skip


def set_value(column: str, value: Any, row: int = 1) -> Callable[[pa.Table], pa.Table]:
    """A change: ``column`` of row ``row`` set to ``value``."""

    def apply(table: pa.Table) -> pa.Table:
        values = table[column].to_numpy().copy()
        values[row] = value
        i = table.schema.get_field_index(column)
        return table.set_column(i, table.schema.field(i), pa.array(values, table[column].type))

    return apply


def relabel(column: str, old: int, new: int) -> Callable[[pa.Table], pa.Table]:
    """A change: every ``old`` of ``column`` made ``new`` (a unit's rows as another's)."""

    def apply(table: pa.Table) -> pa.Table:
        values = table[column].to_numpy().copy()
        i = table.schema.get_field_index(column)
        changed = np.where(values == old, new, values)
        return table.set_column(i, table.schema.field(i), pa.array(changed, table[column].type))

    return apply


def repeat_row(table: pa.Table) -> pa.Table:
    """A change: row 1 in place of row 2 (the row count holds)."""
    take = np.arange(table.num_rows)
    take[2] = 1
    return table.take(pa.array(take))


def refused_on_read(store: Path, table: str, message: str, analyzed: bool = True) -> None:
    """Reading ``table`` (``Store.scan``) raises ``message`` naming its part, and (where an
    analysis reads it) ``analyze`` exits 1 with it on one line, no traceback, nothing
    written."""
    part = second_part(store, table)
    pattern = rf"^{re.escape(str(part))}: {message}"
    with pytest.raises(StoreError, match=pattern):
        Store(store).scan(table).collect()
    if not analyzed:
        return
    out = store.parent / "out"
    result = cli("analyze", "--store", str(store), "--out", str(out))
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), result.output
    assert str(part) in errors[0] and not out.exists()


def refused_on_open(store: Path, table: str, message: str) -> None:
    """Opening the store refuses the partition (every reader: ``ls``, ``query``, ``analyze``),
    naming the part."""
    part = second_part(store, table)
    with pytest.raises(StoreError, match=rf"^{re.escape(str(part))}: {message}"):
        Store(store).select()
    for args in (("ls",), ("query", "SELECT count(*) FROM tokens")):
        result = cli(*args, "--store", str(store))
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert re.search(message, result.output.replace("\n", " ")), result.output


# --- keys: unique, whole per unit, no unit's rows in place of another's ----------------------


@pytest.mark.parametrize("table", ["igrad", "igrad_ends", "erasure", "sinks", "token_lens"])
def test_a_repeated_row_is_refused(text: Path, table: str) -> None:
    """Today a repeated row passes (its count holds) and changes results: refused as a row
    repeated, or (where it stands in for the next document's) as a document's rows too many."""
    rewrite(second_part(text, table), repeat_row)
    refused_on_read(
        text,
        table,
        r"(its rows are not each \(.*\) of every doc once .* repeated|doc 2 has \d+ "
        r"rows where it needs \d+)",
    )


@pytest.mark.parametrize("table", ["igrad", "igrad_ends", "erasure", "sinks"])
def test_a_documents_rows_relabelled_as_anothers_are_refused(text: Path, table: str) -> None:
    """Document 2's rows said to be document 3's: inside the chunk's range, so the statistics
    pass; today the analyses average them in."""
    rewrite(second_part(text, table), relabel("doc", 2, 3))
    refused_on_read(text, table, r"doc 2 has 0 rows where it needs \d+")


def test_one_changed_doc_is_refused(text: Path) -> None:
    rewrite(second_part(text, "igrad"), set_value("doc", 3, row=0))
    refused_on_read(text, "igrad", r"doc 2 has \d+ rows where it needs \d+")


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("block", 77, r"block takes 0\.\.77, outside the 0\.\.1 "),
        ("pos", 999, r"pos takes 0\.\.999, outside the 0\.\.\d+ "),
    ],
)
def test_a_key_outside_its_range_is_refused_on_open(
    text: Path, column: str, value: int, message: str
) -> None:
    """``block = 77`` in a 2-block model, ``pos = 999`` in documents of fewer tokens."""
    for table in ("igrad", "erasure" if column == "pos" else "sinks"):
        fresh = text.parent / f"{table}-{column}"
        shutil.copytree(text, fresh)
        rewrite(second_part(fresh, table), set_value(column, value))
        refused_on_open(fresh, table, message)


def test_a_position_past_its_own_document_is_refused_on_read(text: Path) -> None:
    """A position inside the chunk's longest document but past this one's last token."""
    info = Store(text).partitions[0]
    ids, n_tokens = info.units
    short = int(ids[2:][np.argmin(n_tokens[2:])])
    assert n_tokens[2:].min() < n_tokens[2:].max()  # the chunk's two documents differ in length
    part = second_part(text, "erasure")
    rows = pq.read_table(part)
    first = int(np.argmax(rows["doc"].to_numpy() == short))
    rewrite(part, set_value("pos", int(n_tokens[2:].max()) - 1, row=first))
    refused_on_read(text, "erasure", r"its rows are not each \(layer, pos\) of every doc once")


def test_a_head_outside_the_models_is_refused(text: Path) -> None:
    """The tiny Llama has 4 heads: a head 9 leaves its heads not 0..H-1."""
    rewrite(second_part(text, "sinks"), set_value("head", 9))
    refused_on_read(text, "sinks", r"head takes 0, 1, 2, 3, 9: not 0\.\.4")


# --- values inside their domain -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "column", "value", "message"),
    [
        ("sinks", "bos_attention", 5.0, r"bos_attention takes .*5, outside the 0\.\.1 "),
        ("erasure", "effect", -3.0, r"effect takes -3\.\..*, outside the 0\.\.1\.41421 "),
        ("igrad_ends", "f_input", 99.5, r"f_input takes .*99\.5, outside the 0\.\.2\d "),
        ("token_lens", "final_rank", 0, r"final_rank takes 0\.\.\d+, outside the 1\.\.\d+ "),
        ("token_lens", "final_rank", -7, r"final_rank takes -7\.\.\d+, outside the 1\.\.\d+ "),
        ("token_lens", "final_rank", 999999, r"final_rank takes 1\.\.999999, outside the 1\.\."),
        ("token_lens", "top1", 999999, r"top1 takes \d+\.\.999999, outside the 0\.\.\d+ "),
        ("token_lens", "top5_overlap", 1.5, r"top5_overlap takes .*1\.5, outside the 0\.\.1 "),
    ],
)
def test_a_value_outside_its_domain_is_refused(
    text: Path, table: str, column: str, value: Any, message: str
) -> None:
    """Today ``bos_attention = 5``, ``effect = -3``, an ``f_input`` (a sum of probabilities over
    the answer's tokens) above the chunk's most answer tokens, a rank outside 1..V and a top-1
    token outside the vocabulary pass and move results (the decided depth by 0.079)."""
    rewrite(second_part(text, table), set_value(column, value))
    refused_on_open(text, table, message)


def test_the_ranges_follow_the_manifest(text: Path) -> None:
    """The vocabulary bound is the manifest's V, the answer bound the chunk's kept answer
    tokens: values at the edges pass."""
    (info,) = Store(text).partitions
    vocab = info.manifest.vocab_size
    assert vocab is not None
    rewrite(second_part(text, "token_lens"), set_value("final_rank", vocab))
    rewrite(second_part(text, "token_lens"), set_value("top1", vocab - 1, row=2))
    assert Store(text).scan("token_lens").collect().height > 0
    rewrite(second_part(text, "token_lens"), set_value("top1", vocab, row=2))
    refused_on_open(text, "token_lens", rf"top1 takes \d+\.\.{vocab}, outside the 0\.\.{vocab - 1}")


# --- choice tasks --------------------------------------------------------------------------------


def test_choice_erasure_rows_removed_in_whole_states_are_refused(choice: Path) -> None:
    """An instance's last position removed in every state (L + 1 rows): whole rows per state
    still, so the counts passed; today the map loses a position without a word."""
    part = second_part(choice, "erasure")
    rows = pq.read_table(part)
    doc, pos = rows["doc"].to_numpy(), rows["pos"].to_numpy()
    last = pos == pos[doc == 3].max()
    rewrite(part, lambda t: t.filter(pa.array(~(last & (doc == 3)))))
    refused_on_read(choice, "erasure", r"doc 3 has \d+ rows where it needs \d+")


def test_choice_erasure_rows_moved_between_instances_are_refused(choice: Path) -> None:
    """The longer instance's last position (L + 1 rows) said to be a position after the shorter
    one's last: the part's row count and its range of positions are the same."""
    part = second_part(choice, "erasure")
    rows = pq.read_table(part)
    doc, pos = rows["doc"].to_numpy(), rows["pos"].to_numpy()
    last = {d: int(pos[doc == d].max()) for d in (2, 3)}
    short, long = sorted(last, key=last.__getitem__)
    assert last[short] < last[long]
    moved = (doc == long) & (pos == last[long])
    new_doc = pa.array(np.where(moved, short, doc), pa.int32())
    new_pos = pa.array(np.where(moved, last[short] + 1, pos), pa.int32())
    rewrite(part, lambda t: t.set_column(0, t.schema.field(0), new_doc).set_column(
        2, t.schema.field(2), new_pos))  # fmt: skip
    refused_on_read(choice, "erasure", r"doc [23] has \d+ rows where it needs \d+")


def test_choice_lens_and_igrad_are_held_to_their_rules(choice: Path) -> None:
    """A choice task's target is one probability: ``f_input = 7.5`` is refused."""
    fresh = Path(shutil.copytree(choice, choice.parent / "igrad"))
    ends = Path(shutil.copytree(choice, choice.parent / "ends"))
    rewrite(second_part(ends, "igrad_ends"), set_value("f_input", 7.5))
    refused_on_open(ends, "igrad_ends", r"f_input takes .*7\.5, outside the 0\.\.1 ")
    rewrite(second_part(choice, "lens"), set_value("final_rank", 0))
    refused_on_open(choice, "lens", r"final_rank takes 0\.\.\d+, outside the 1\.\.")
    shutil.rmtree(choice)
    rewrite(second_part(fresh, "igrad"), repeat_row)
    message = r"its rows are not each \(sublayer, block, pos\) of every doc"
    refused_on_read(fresh, "igrad", message, analyzed=False)  # no analysis reads it yet


def test_the_extracted_stores_pass_every_rule(stores: dict) -> None:
    """What extraction writes is read in full: every rule holds."""
    for store in stores.values():
        opened = Store(store)
        for table in ("igrad", "igrad_ends", "erasure", "sinks"):
            assert opened.scan(table).collect().height > 0
        (info,) = opened.partitions
        lens = "token_lens" if info.manifest.kind == "text" else "lens"
        assert sum(b.num_rows for b in info.batches(lens, ["layer"], 1000)) > 0


# --- empty parts, interval types ------------------------------------------------------------


def test_an_empty_part_holds_no_nan() -> None:
    """``pc.all`` of an empty column is null: not a NaN."""
    empty = pa.table({"bos_attention": pa.array([], pa.float32())})
    assert not_finite(empty) is None
    assert not_finite(pa.table({"x": pa.array([1.0, float("nan")])})) == "x"


def test_a_chunk_of_one_token_documents_leaves_the_store_readable(tmp_path: Path) -> None:
    """``--sinks`` on a chunk of one-token documents writes an empty ``sinks`` part (no query
    position after the first); today the whole store is refused ("holds a NaN")."""
    from layerdiv.analyze.api import analyze
    from layerdiv.analyze.synthetic import text_chunk, text_manifest, write_text_partition
    from layerdiv.measurements.sinks import sink_rows

    rng = np.random.default_rng(0)
    manifest = text_manifest("org/t", "docs", 4, 3, 8, 2)
    chunks = []
    for start, n_tokens in ((0, 8), (2, 1)):
        docs = range(start, start + 2)
        tables = text_chunk(rng, docs, n_tokens, 3)
        values = rng.random((2, 3, 4)) if n_tokens > 1 else np.full((2, 3, 4), np.nan)
        tables["sinks"] = sink_rows(list(docs), list(values))["sinks"]
        chunks.append((start, 2, tables))
    assert chunks[1][2]["sinks"].num_rows == 0
    write_text_partition(tmp_path, manifest, chunks)
    assert Store(tmp_path).scan("sinks").collect().height == 2 * 3 * 4
    results = analyze(tmp_path)
    assert results.sink_rate["n_units"].to_list() == [2]


def test_intervals_are_float64_however_few_units_come_first(tmp_path: Path) -> None:
    """A partition of 3 instances (no interval) first in key order, one of 12 after: today
    "failed to vstack column 'ci_low'"."""
    from layerdiv.analyze.api import analyze
    from layerdiv.analyze.synthetic import random_partition, write_partition

    rng = np.random.default_rng(1)
    for model, n in (("org/a", 3), ("org/b", 12)):
        logits, gold, rms, kinds = random_partition(rng, n, 3, 2)
        sinks = rng.random((n, 3, 4)).astype(np.float32)
        write_partition(tmp_path, model, "boolq", logits, gold, kinds, rms, chunk=4,
                        optional={"sinks": sinks})  # fmt: skip
    rate = analyze(tmp_path).sink_rate.sort("model")
    assert rate.schema["ci_low"] == rate.schema["ci_high"] == pl.Float64
    assert rate["ci_low"].is_null().to_list() == [True, False]


# --- the reference means: checked against the manifest's fingerprint ------------------------


def edit_reference(store: Path, change: Callable[[pa.Table], pa.Table]) -> Path:
    (path,) = store.rglob("erasure_reference.parquet")
    table = pq.read_table(path)
    pq.write_table(change(table).replace_schema_metadata(table.schema.metadata), path,
                   write_page_checksum=True)  # fmt: skip
    return path


def scaled(table: pa.Table) -> pa.Table:
    state = pa.array(
        [np.asarray(s, np.float32) * 2 for s in table["state"].to_pylist()],
        pa.list_(pa.float32()),
    )
    return table.set_column(1, table.schema.field(1), state)


def test_an_edited_reference_is_refused_on_read_resume_and_merge(
    stores: dict, tmp_path: Path, model_dirs: Any
) -> None:
    """Today an edited ``erasure_reference`` is read and merged without complaint."""
    store = Path(shutil.copytree(stores["text"], tmp_path / "store"))
    path = edit_reference(store, scaled)
    message = rf"{re.escape(str(path))}: its values do not give the erase_reference_sha256 "
    (info,) = Store(store).partitions
    with pytest.raises(StoreError, match=message):
        info.whole("erasure_reference")
    merged = cli("merge", str(store), str(stores["text"]), "--into", str(tmp_path / "m"))
    assert merged.exit_code == 1 and "Traceback" not in merged.output, merged.output
    assert re.search(message, merged.output.replace("\n", " ")), merged.output
    assert "re-extract" in merged.output and not (tmp_path / "m").exists()
    task = next((stores["text"].parent / "text-task").glob("*.yaml"))
    more = [a if a != "4" else "6" for a in FLAGS]
    resumed = cli("extract", "--model", str(model_dirs("llama")), "--task", str(task), *more,
                  "--store", str(store))  # fmt: skip
    assert resumed.exit_code == 1 and "Traceback" not in resumed.output, resumed.output
    assert re.search(message, resumed.output.replace("\n", " ")), resumed.output


def test_a_truncated_reference_is_refused_by_merge(stores: dict, tmp_path: Path) -> None:
    store = Path(shutil.copytree(stores["choice"], tmp_path / "store"))
    path = edit_reference(store, lambda t: t.slice(0, t.num_rows - 1))
    merged = cli("merge", str(store), "--into", str(tmp_path / "m"))
    assert merged.exit_code == 1 and "Traceback" not in merged.output, merged.output
    assert str(path) in merged.output.replace("\n", "") and "re-extract" in merged.output
    path.write_bytes(path.read_bytes()[:100])  # cut short: not Parquet any more
    merged = cli("merge", str(store), "--into", str(tmp_path / "m"))
    assert merged.exit_code == 1 and "unreadable" in merged.output, merged.output
    assert not (tmp_path / "m").exists()
    assert pc.sum(pq.read_table(second_part(store, "erasure"))["layer"]).as_py() > 0


def test_a_measurement_declares_the_rules_of_its_own_tables() -> None:
    """A measurement registered from outside gives its tables' rules with their schemas, as a
    built-in one does in its declaration; a task kind's required tables have the kind's; rules
    for a table not its own are refused."""
    from layerdiv.measurements import (
        Measurement,
        MeasurementError,
        register,
        registered,
        table_rules,
        unregister,
    )
    from layerdiv.measurements.sinks import SINKS
    from layerdiv.schemas import Rules
    from layerdiv.schemas.kinds import TEXT

    schema = pa.schema([pa.field("doc", pa.int32()), pa.field("block", pa.int16()),
                        pa.field("share", pa.float32())])  # fmt: skip
    rules = Rules(grid=(("block", "blocks"),), bounds={"share": (0.0, 1.0)})
    register(Measurement(name="shares", flag="--shares", help="Shares.",
                         tables={"text": ("block_shares",)}, schemas={"block_shares": schema},
                         rules={"block_shares": rules}))  # fmt: skip
    try:
        assert table_rules("block_shares") == rules
        assert table_rules("sinks") is SINKS.rules["sinks"]
        assert table_rules("tokens") is TEXT.rules["tokens"]
        assert table_rules("documents") == Rules()
        assert rules.ranges() == {"block": (0, "L-1"), "share": (0.0, 1.0)}
    finally:
        unregister("shares")
    with pytest.raises(MeasurementError, match="row rules for 'tokens'"):
        register(Measurement(name="shares", flag="--shares", help="Shares.",
                             tables={"text": ("block_shares",)}, schemas={"block_shares": schema},
                             rules={"tokens": rules}))  # fmt: skip
    assert "shares" not in [m.name for m in registered()]
