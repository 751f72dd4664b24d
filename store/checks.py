"""The checks every partition passes when a store is opened, so that ``ls``, the ``query``
views, ``analyze`` and ``report`` (every reader opens the store) refuse the same damage, naming
the part or the manifest: the manifest against its partition's key and itself, every part's schema
and settings, and each complete chunk's rows against the part's name and the manifest.

They cost Parquet footers (schemas, row counts and min/max statistics) and, per chunk, one key
column of the tables whose rows per instance (document) are fixed; ``benchmarks/
bench_store_checks.py`` measures them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from layerdiv.errors import LayerdivError
from layerdiv.measurements import (
    ruled_tables,
    table_rules,
    table_schemas,
    tables_of,
    tables_of_kind,
)
from layerdiv.schemas import Rules, schema_matches
from layerdiv.store.key import DEFAULT_REVISION
from layerdiv.store.location import open_parquet
from layerdiv.store.parts import StoreError, first_line, naming
from layerdiv.store.paths import slug

if TYPE_CHECKING:
    from layerdiv.store.reader import PartitionInfo


def check_partition(info: PartitionInfo[Any]) -> None:
    """Refuse (``StoreError``, one line naming the file) a partition whose manifest disagrees
    with its key or with itself (:func:`manifest_problem`), whose parts outside its complete
    chunks show a removed marker (:func:`stray_parts`), or one of whose complete chunks holds a
    part of another schema or settings, or rows that its name and the manifest rule out
    (:func:`check_chunk`)."""
    problem = manifest_problem(info)
    if problem:
        raise StoreError(
            f"{info.partition.manifest}: {problem} (a manifest edited or copied by hand); "
            f"re-extract {info.where} with --overwrite"
        )
    stray = stray_parts(info)
    if stray and all(run.get("finished_at") for run in info.manifest.runs):
        table, start, count = stray[0]
        raise StoreError(
            f"{info.partition.part(table, start, count)}: its chunk has no "
            f"{info.kind.marker} part, although every run of {info.where} finished (the "
            "chunk's marker was removed); re-extract it with --overwrite"
        )
    lacking = {t: set(chunks) for t, chunks in info.lacking.items()}
    for start, count in info.done:
        tables = [
            t for t in (*info.kind.required, *lacking) if (start, count) not in lacking.get(t, ())
        ]
        check_chunk(info, start, count, tables)


def manifest_problem(info: PartitionInfo[Any]) -> str | None:
    """What a partition's manifest says that its key (folders), its option tokens or its task
    definition contradict, or None: the model, revision and task against the key; as many options
    as option tokens; the options as the task definition lists them; and each option's token
    (as the tokenizer writes it) the start of its own option where it is the start of another
    one (options swapped)."""
    m, key = info.manifest, info.key
    try:
        revision = slug(m.revision or DEFAULT_REVISION, "revision")
        named = {"model": slug(m.model), "revision": revision, "task": m.task}
    except LayerdivError as err:
        return str(err)
    for column, value in named.items():
        if value != getattr(key, column):
            said = getattr(m, column)
            return f"it names {column} {said!r}, its folder {column}={getattr(key, column)}"
    if not len(m.options) == len(m.option_tokens) == len(m.option_token_ids):
        return (
            f"it lists {len(m.options)} options, {len(m.option_tokens)} option tokens and "
            f"{len(m.option_token_ids)} token ids"
        )
    listed = m.task_spec.get("options")
    if isinstance(listed, list) and listed != m.options:
        return f"its options {m.options} are not its task's {listed}"
    return _swapped(tuple(m.options), tuple(m.option_tokens))


@functools.lru_cache(maxsize=256)
def _swapped(options: tuple[str, ...], tokens: tuple[str, ...]) -> str | None:
    """An option whose token (as the tokenizer writes it) is the start of another option but not
    of its own, said in words; None where there is none (made once for the many manifests of a
    sweep that list the same options)."""
    words = [o.strip().lower() for o in options]
    texts = [_token_text(t) for t in tokens]
    for i, word in enumerate(words):
        starts = [bool(t) and word.startswith(t) for t in texts]
        if not starts[i] and any(starts):
            j = starts.index(True)
            return (
                f"option {i} {options[i]!r} is scored by the token {tokens[i]!r}, "
                f"option {j}'s by {tokens[j]!r}"
            )
    return None


def _token_text(token: str) -> str:
    """A token as the tokenizer writes it, as text: the byte-level and SentencePiece marks of a
    leading space dropped, lower case."""
    return token.replace("\u0120", " ").replace("\u2581", " ").strip().lower()


def stray_parts(info: PartitionInfo[Any]) -> list[tuple[str, int, int]]:
    """(table, start, count) of every part outside the partition's complete chunks: the parts of
    a chunk being written (a live run), of a run that stopped (killed) before the chunk's
    marker, or of a chunk whose marker was removed."""
    done, marker, listing = set(info.done), info.kind.marker, info.partition.listing
    return sorted(
        (table, s, n)
        for table in tables_of_kind(info.kind.name)
        if table != marker and (listing is None or listing.get(table))  # a folder with files
        for s, n in info.partition.parts(table)
        if (s, n) not in done
    )


def check_chunk(info: PartitionInfo[Any], start: int, count: int, tables: list[str]) -> None:
    """Check the complete chunk ``start``, ``count`` of a partition: each of its ``tables``' parts
    against the schema of the partition's version and the manifest's settings
    (:meth:`~layerdiv.store.Manifest.settings_problem`); its row counts
    (:meth:`~layerdiv.store.Manifest.wrong_rows`: rows removed or repeated); from each part's
    min/max statistics, its instance (document) ids inside the range its name gives, its option,
    gold and component indices inside the manifest's, the ranges its table's rules declare
    (``layerdiv.schemas.Rules``: blocks, layers, positions, token ids, ranks, probabilities,
    norms) and no infinite value; the marker's ids unique (so, with its row count, exactly the
    range); and every instance (document) holding the same rows in each table whose rows per
    instance are fixed (``tokens``: its ``n_tokens``), so that no instance's rows stand in for
    another's."""
    m = info.manifest
    schemas = {**table_schemas(), **tables_of(m.schema_version)}
    unit, marker = info.kind.unit, info.kind.marker
    rows: dict[str, int] = {}
    ids: dict[str, np.ndarray] = {}
    units = pa.table({})
    for table in tables:
        f = info.partition.part(table, start, count)
        try:
            if not units.num_columns:  # the marker's units bound the others' rows: read first
                units = _units(info, start, count)
            with open_parquet(f) as file:
                found, meta = file.schema_arrow, file.metadata
                rows[table] = meta.num_rows
                mixed = m.settings_problem(table, meta.metadata)
                key = unit if unit in found.names else "doc" if "doc" in found.names else None
                if key and table == marker:
                    ids[table] = units[key].to_numpy()
                elif key and table in _fixed(info):
                    with naming(f, info.where):  # its data pages, past the footer
                        ids[table] = file.read([key], use_threads=False)[key].to_numpy()
        except (OSError, pa.ArrowException) as err:
            raise StoreError(
                f"{f}: unreadable Parquet ({first_line(err)}); re-extract {info.where} "
                "with --overwrite"
            ) from err
        if mixed:
            raise StoreError(
                f"{f} {mixed}: a part of another extraction; re-extract {info.where} with "
                "--overwrite"
            )
        if not schema_matches(table, found, schemas[table]):
            raise StoreError(
                f"{f}: columns do not match the {table} schema of version "
                f"{m.schema_version}; re-extract {info.where} with --overwrite"
            )
        wrong = _out_of_range(meta, _ranges(info, table, key, start, count, units))
        if wrong:
            raise StoreError(f"{f}: {wrong} (a damaged or misplaced part); re-extract "
                             f"{info.where} with --overwrite")  # fmt: skip
    n_tokens = _tokens(units)
    wrong_rows = m.wrong_rows(count, rows, int(n_tokens.sum()))
    if wrong_rows:
        raise StoreError(
            f"{info.partition.part(wrong_rows[0], start, count)}: {wrong_rows[1]} (rows removed or "
            f"repeated); re-extract {info.where} with --overwrite"
        )
    wrong_ids = _uneven(info, start, count, ids, n_tokens)
    if wrong_ids:
        raise StoreError(
            f"{info.partition.part(wrong_ids[0], start, count)}: {wrong_ids[1]} (rows of one "
            f"{unit} in place of another's); re-extract {info.where} with --overwrite"
        )


UNIT_FACTS = ("n_tokens", "answer_start")
"""The columns of a chunk's marker (``instances``, ``documents``) that bound its other tables'
rows: each unit's tokens and, in a task with an answer, where the answer starts."""


def _units(info: PartitionInfo[Any], start: int, count: int) -> pa.Table:
    """The unit ids and :data:`UNIT_FACTS` of the chunk ``start``, ``count`` (its marker's)."""
    f = info.partition.part(info.kind.marker, start, count)
    with naming(f, info.where), open_parquet(f) as file:
        names = file.schema_arrow.names
        read = [c for c in (info.kind.unit, *UNIT_FACTS) if c in names]
        return file.read(read, use_threads=False)


def _tokens(units: pa.Table) -> np.ndarray:
    """Each unit's ``n_tokens`` in a chunk's marker columns ``units`` (none read: empty)."""
    if "n_tokens" not in units.column_names:
        return np.zeros(0, np.int64)
    return units["n_tokens"].to_numpy().astype(np.int64)


def _fixed(info: PartitionInfo[Any]) -> tuple[str, ...]:
    """The tables whose rows per instance (document) are fixed, counted per id on open: every
    table of a choice partition but those of a measurement with a row rule of its own (``igrad``:
    rows per prompt token); ``tokens`` of a text one (its other tables are checked where they
    are read: ``token_blocks`` in (doc, pos) order, ``future_effects`` keys unique)."""
    if info.kind.scored:
        ruled = ruled_tables(info.kind.name)
        return tuple(t for t in tables_of_kind(info.kind.name) if t not in ruled)
    return ("tokens",)


def _ranges(
    info: PartitionInfo[Any], table: str, key: str | None, start: int, count: int, units: pa.Table
) -> dict[str, tuple[float, float]]:
    """The inclusive range each column may take in a part of ``table`` in the chunk ``start``,
    ``count``: its instance (document) ids, a choice partition's option, gold and component
    indices, and the ranges of its table's rules (``layerdiv.schemas.Rules``) with the
    partition's facts (blocks L, vocabulary V) and the chunk's (its longest unit T, the most
    answer tokens A, from its marker's columns ``units``); an end whose fact is unknown (an
    older manifest's vocabulary) is open."""
    m = info.manifest
    out: dict[str, tuple[float, float]] = {} if key is None else {key: (start, start + count - 1)}
    if info.kind.scored:
        options = (0, len(m.options) - 1)
        out.update(option=options, gold=options, component=(0, len(m.components) - 1))
    n_tokens = _tokens(units)
    facts = {"L": m.n_blocks, "V": m.vocab_size, "T": int(n_tokens.max(initial=0)),
             "A": _answer_tokens(info, units, n_tokens)}  # fmt: skip
    for column, (low, high) in table_rules(table).ranges().items():
        out[column] = (_fact(low, facts, -math.inf), _fact(high, facts, math.inf))
    return out


def _answer_tokens(info: PartitionInfo[Any], units: pa.Table, n_tokens: np.ndarray) -> int | None:
    """The most answer tokens a unit of the chunk keeps: a choice task's one (the gold option's
    probability), a text task's n_tokens - answer_start (None where it records no answer)."""
    if info.kind.scored:
        return 1
    if "answer_start" not in units.column_names or units["answer_start"].null_count:
        return None
    kept = n_tokens - units["answer_start"].to_numpy().astype(np.int64)
    return int(np.maximum(kept, 0).max(initial=0))


def _fact(bound: float | str, facts: Mapping[str, int | None], unknown: float) -> float:
    """A :data:`~layerdiv.schemas.Bound` as a number (``unknown`` where its fact is)."""
    if not isinstance(bound, str):
        return bound
    name, _, less = bound.partition("-")
    value = facts[name]
    return unknown if value is None else value - int(less or 0)


SLACK = 1e-3
"""How far a floating-point value may lie outside its declared range: the rounding of values
computed in float32 (a KL divergence of two equal distributions, a mean of probabilities)."""


def _out_of_range(meta: pq.FileMetaData, ranges: Mapping[str, tuple[float, float]]) -> str | None:
    """What the min/max statistics of a part's columns (``meta``) show to be wrong: a column of
    ``ranges`` outside its range (a floating-point one beyond :data:`SLACK`), or a
    floating-point column holding an infinite value (or only NaN); None when nothing is
    (statistics see no NaN among numbers: readers check those)."""
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            name = column.path_in_schema
            stats = column.statistics
            if stats is None or "." in name:
                continue
            floating = column.physical_type in ("FLOAT", "DOUBLE")
            if not stats.has_min_max:
                if floating and stats.num_values > 0:  # values, none of them a number
                    return f"{name} holds only NaN"
                continue
            if floating and not (math.isfinite(stats.min) and math.isfinite(stats.max)):
                return f"{name} holds an infinite value"
            if name in ranges and isinstance(stats.min, int | float):
                low, high = ranges[name]
                slack = SLACK * max(1.0, abs(high) if math.isfinite(high) else 1.0)
                margin = slack if floating else 0
                if stats.min < low - margin or stats.max > high + margin:
                    return (
                        f"{name} takes {_number(stats.min)}..{_number(stats.max)}, outside the "
                        f"{_number(low)}..{_number(high)} its table, name and manifest allow"
                    )
    return None


def _number(value: float) -> str:
    """A value for messages: an integer as it is, a float in its shortest form."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _uneven(
    info: PartitionInfo[Any],
    start: int,
    count: int,
    ids: Mapping[str, np.ndarray],
    n_tokens: np.ndarray,
) -> tuple[str, str] | None:
    """The first table of the chunk whose ids (``ids``: the key column of the marker and of the
    tables of :func:`_fixed`) do not hold each instance (document) of ``start .. start+count-1``
    once in the marker and equally often elsewhere (``tokens``: as often as its ``n_tokens``),
    with what is wrong; None when they do (row counts already checked)."""
    marker = info.kind.marker
    order = np.argsort(ids.get(marker, np.arange(start, start + count)), kind="stable")
    for table in sorted(ids, key=lambda t: t != marker):  # the marker first: it orders n_tokens
        found = ids[table]
        per = np.bincount(np.asarray(found, np.int64) - start, minlength=count)[:count]
        want = (
            np.ones(count, np.int64)
            if table == marker
            else n_tokens[order]
            if table == "tokens"
            else np.full(count, len(found) // max(count, 1))
        )
        if not np.array_equal(per, want):
            i = int(np.argmax(per != want))
            return table, (
                f"{info.kind.unit} {start + i} has {per[i]} rows where it needs {want[i]}"
            )
    return None


def check_sums(ids: np.ndarray, logits: np.ndarray, model: np.ndarray, m: Any, where: str) -> None:
    """Refuse (``StoreError``) components that do not sum to the stored model logits: with
    ``ids`` (N,) the instances, ``logits`` (N, C, K) the stored u_c[k] and ``model`` (N, K) the
    model's own option logits, the relative error of methods §1, max_k |sum_c u_c[k] -
    model[k]| / max(1, max_k sum_c |u_c[k]|) (the ``sum_error`` extraction checked), must stay
    within the manifest's ``sum_tolerance`` and the float32 rounding of the C + 1 stored
    values."""
    if not logits.size:
        return
    spread = np.maximum(1.0, np.abs(logits).sum(axis=1).max(axis=1))
    error = np.abs(logits.sum(axis=1) - model).max(axis=1) / spread
    worst = int(np.argmax(error))
    if not error[worst] <= m.sum_tolerance + (logits.shape[1] + 1) * 2.0**-23:
        raise StoreError(
            f"{where}: the components of instance {ids[worst]} sum to the stored model "
            f"logits only within {error[worst]:.3g} (relative), above the tolerance "
            f"{m.sum_tolerance:g} its manifest records (a changed value); re-extract it with "
            "--overwrite"
        )


def grid_problem(
    table: str, keys: pa.Table, unit: str, units: tuple[np.ndarray, np.ndarray], blocks: int
) -> str | None:
    """What is wrong with the key rows ``keys`` of one part of ``table`` against its rules' grid
    (``layerdiv.schemas.Rules.grid``), or None: ``units`` the ids of its chunk's units (the
    ``unit`` column: ``doc``, ``instance``; sorted) and their ``n_tokens``, ``blocks`` L. Each
    unit of at least ``least`` tokens must hold each combination of the grid's columns once, and
    no other row (keys unique and inside their ranges, whole per unit, no unit's rows in place
    of another's): each unit's row count, each key inside its unit's extent, then the rows
    packed into one integer each and found distinct (one comparison of neighbours for rows in
    key order, a sort for others)."""
    rules = table_rules(table)
    ids, n_tokens = units
    got = {c: _codes(keys[c]) for c in (unit, *(c for c, _ in rules.grid))}
    at = np.minimum(np.searchsorted(ids, got[unit]), max(len(ids) - 1, 0))
    stray = ids[at] != got[unit] if len(ids) else np.ones(len(at), bool)
    if stray.any():
        return f"{unit} {got[unit][np.argmax(stray)]} is not one of its chunk's"
    shared = {c: np.unique(got[c]) for c, extent in rules.grid if extent == "shared"}
    for c, values in shared.items():
        if not pa.types.is_dictionary(keys[c].type) and not np.array_equal(
            values, np.arange(len(values))
        ):
            return f"{c} takes {', '.join(map(str, values[:8]))}: not 0..{len(values) - 1}"
    extent: dict[str, Any] = {"tokens": n_tokens, "blocks": blocks, "states": blocks + 1}
    sizes = [
        np.broadcast_to(len(shared[c]) if e == "shared" else extent[e], n_tokens.shape)
        for c, e in rules.grid
    ]
    need = np.prod(sizes, axis=0, dtype=np.int64) * (n_tokens >= rules.least)
    held = np.bincount(at, minlength=len(ids))
    if not np.array_equal(held, need):
        i = int(np.argmax(held != need))
        return f"{unit} {ids[i]} has {held[i]} rows where it needs {need[i]}"
    packed = at.astype(np.int64)
    for (c, e), size in zip(rules.grid, sizes, strict=True):
        value = np.searchsorted(shared[c], got[c]) if e == "shared" else got[c]
        limit = size[at] if e == "tokens" else int(size.max(initial=0))
        wrong = (value < 0) | (value >= limit)
        if wrong.any():
            return _wrong_row(keys, unit, rules, int(np.argmax(wrong)), "out of range")
        packed = packed * int(size.max(initial=1)) + value
    if len(packed) > 1 and not (np.diff(packed) > 0).all():
        ordered = np.sort(packed)
        same = np.diff(ordered) == 0
        if same.any():
            row = int(np.argmax(packed == ordered[np.argmax(same)]))
            return _wrong_row(keys, unit, rules, row, "repeated")
    return None


def _wrong_row(keys: pa.Table, unit: str, rules: Rules, row: int, what: str) -> str:
    """What :func:`grid_problem` says of the key row ``row`` of ``keys``."""
    columns = [c for c, _ in rules.grid]
    values = keys.slice(row, 1).to_pylist()[0]
    shown = ", ".join(f"{c} {values[c]}" for c in (unit, *columns))
    return f"its rows are not each ({', '.join(columns)}) of every {unit} once ({shown} is {what})"


def _codes(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A key column's values as int64: a dictionary column's values as their rank among the
    distinct values."""
    if isinstance(column, pa.ChunkedArray):
        column = (
            column.unify_dictionaries() if pa.types.is_dictionary(column.type) else column
        ).combine_chunks()
    if pa.types.is_dictionary(column.type):
        names = column.dictionary.to_pylist()
        rank = {name: i for i, name in enumerate(sorted(set(names)))}
        lookup = np.array([rank[n] for n in names], np.int64)
        return lookup[column.indices.to_numpy(zero_copy_only=False)]
    return np.asarray(column.to_numpy(zero_copy_only=False), np.int64)
