"""One chunk of the partition's grid at a time: claim it, find what it still lacks (redoing
damaged parts), compute that, and store it while releasing the claim."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from layerdiv.errors import DecompositionError
from layerdiv.extract.batching import chunk_runs
from layerdiv.extract.forward import ModelRunner
from layerdiv.extract.kinds import Results
from layerdiv.measurements import all_optional_tables
from layerdiv.schemas.kinds import KINDS
from layerdiv.store.manifest import Manifest, read_manifest
from layerdiv.store.writer import ChunkClaim, PartitionWriter


def extra_tables(writer: PartitionWriter, asked: list[str], overwrite: bool) -> list[str]:
    """The optional tables to write: those ``asked`` for, and those the partition already has,
    complete (marked) or not (a part of it stored: a run adding it stopped, or a shard started
    with other flags), unless it is to be replaced, so that no chunk stored later lacks them."""
    manifest = writer.part.manifest
    if overwrite or not manifest.exists():
        return [t for t in all_optional_tables() if t in asked]
    kept = read_manifest(manifest).extra_tables
    return [t for t in all_optional_tables() if t in asked or t in kept or writer.part.parts(t)]


def pending(
    writer: PartitionWriter, n: int, tables: list[str], chunk_size: int, shard: tuple[int, int]
) -> bool:
    """Whether this shard has instances ``0..n-1`` left in an existing partition: not stored,
    in damaged parts, or in stored chunks lacking one of the optional ``tables``."""
    stored = read_manifest(writer.part.manifest)
    done = writer.done_instances(stored)
    todo = [i for i in range(n) if i not in done]
    todo += [i for t in tables for s, c in backfillable(writer, t, n) for i in range(s, s + c)]
    return bool(chunk_runs(sorted(set(todo)), stored.chunk_size or chunk_size, shard))


def backfillable(writer: PartitionWriter, table: str, n: int) -> list[tuple[int, int]]:
    """The complete chunks that lack the optional ``table`` and lie within instances
    ``0..n-1`` of this run (a chunk beyond ``--limit`` has no prompts here)."""
    return [(s, c) for s, c in writer.chunks_missing(table) if s + c <= n]


def claimed(writer: PartitionWriter, chunks: list[int]) -> Iterator[tuple[int, ChunkClaim]]:
    """Claim ``chunks`` in turn: first those no other process holds, then (waiting for their
    holders) the rest, of which only what their holder left undone remains."""
    busy = []
    for j in chunks:
        claim = writer.try_claim(j)
        if claim is None:
            busy.append(j)
        else:
            yield j, claim
    for j in busy:
        yield j, writer.claim(j)


def missing_runs(
    writer: PartitionWriter, j: int, grid: int, n: int, manifest: Manifest
) -> tuple[list[list[int]], list[str]]:
    """Under the claim of chunk ``j``: the contiguous runs of its instances (below ``n``) that are
    not stored, after deleting its parts that are unreadable, have wrong row counts or record
    other settings (than the partition's ``manifest``); and a note per deleted part. Refuses
    (``StoreConflict``) a partition replaced or changed since this run opened it."""
    writer.recheck()
    lo, hi = j * grid, min(n, (j + 1) * grid)
    inside = [(s, c) for s, c in writer.part.done_parts() if s < hi and s + c > lo]
    notes = []
    marker = KINDS[manifest.kind].marker
    for s, c in writer.unreadable(inside, manifest):
        writer.remove_chunk(s, c)
        notes.append(
            f"{writer.part.part(marker, s, c)} was unreadable, incomplete or of other settings: "
            "redone"
        )
    have = writer.done_instances()
    return chunk_runs([i for i in range(lo, hi) if i not in have], grid).get(j, []), notes


def compute(
    runner: ModelRunner,
    runs: list[list[int]],
    seqs: list[list[int]],
    batch_size: int | None,
    names: list[str],
    check: Callable[[Any, list[int]], None],
    progress: Callable[[float], object],
) -> Results:
    """Run every instance of ``runs``, checking each batch and its component ``names``;
    ``progress`` is told the units done (``ModelRunner.run_chunk``)."""
    results: Results = {}
    for run in runs:
        for dec, ids in runner.run_chunk(seqs, run, batch_size, progress):
            check(dec, ids)
            if [c.name for c in dec.components] != names:
                raise DecompositionError(
                    f"instance {ids[0]} ran a different component sequence than the stored "
                    "partition's"
                )
            results.update((i, (dec, row)) for row, i in enumerate(ids))
    return results


def store(
    writer: PartitionWriter, claim: ChunkClaim, parts: list[tuple[list[int], dict[str, pa.Table]]]
) -> None:
    """Write a claimed chunk's parts (whole chunks, or optional tables alone for chunks that are
    stored already: a backfill), then release the claim; nothing when the partition was replaced
    or changed since this run opened it (``StoreConflict``)."""
    markers = {k.marker for k in KINDS.values()}
    try:
        writer.recheck()
        for ids, tables in parts:
            if markers & set(tables):
                writer.write_chunk(ids[0], len(ids), tables)
            else:
                for name, table in tables.items():
                    writer.write_table_part(name, ids[0], len(ids), table)
    finally:
        claim.release()


def backfill(
    writer: PartitionWriter,
    tables: list[str],
    grid: int,
    shard: tuple[int, int],
    n_items: int,
    compute_run: Callable[[list[int]], Results],
    make: Callable[[list[int], Results], dict[str, pa.Table]],
) -> int:
    """Add the optional ``tables`` to this shard's complete chunks within instances
    ``0..n_items-1`` stored without them, part by part under the chunk's claim, without
    rewriting their components; returns the number of instances run. ``compute_run`` runs (and
    checks) one contiguous run of instances, ``make`` gives its optional tables."""
    missing = sorted({p for t in tables for p in backfillable(writer, t, n_items)})
    ids = [i for s, c in missing for i in range(s, s + c)]
    n = 0
    for j, claim in claimed(writer, sorted(chunk_runs(ids, grid, shard))):
        try:  # what is still lacking, under the claim
            writer.recheck()
            lacking = {t: set(backfillable(writer, t, n_items)) for t in tables}
            for s, c in sorted({p for ps in lacking.values() for p in ps if p[0] // grid == j}):
                run = list(range(s, s + c))
                made = make(run, compute_run(run))
                writer.recheck()
                for table in tables:
                    if (s, c) in lacking[table]:
                        writer.write_table_part(table, s, c, made[table])
                n += c
        finally:
            claim.release()
    return n
