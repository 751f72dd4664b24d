"""Combining stores extracted on different machines into one (``layerdiv merge``).

A partition found in several stores must hold the same extraction (equal manifest identity,
optional tables and measurement settings) in each; its chunks come from whichever store has
them, and two stores may hold the same chunk only as identical files, so no instance is ever
stored twice. Two revisions of one model with equal weights are refused, as ``extract`` refuses
them in one store. The merged store is built beside the target and renamed into place: on any
refusal or failure the target is left as it was.
"""

from __future__ import annotations

import filecmp
import itertools
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from layerdiv.errors import LayerdivError
from layerdiv.measurements import registered
from layerdiv.store.atomic import atomic_path, remove_stale_temps, restore, write_bytes
from layerdiv.store.key import PartitionKey
from layerdiv.store.location import local_root
from layerdiv.store.manifest import TABLES_DIR, Manifest, read_manifest, write_manifest
from layerdiv.store.paths import Partition
from layerdiv.store.reader import PartitionInfo, Store, StoreError
from layerdiv.store.writer import one_checkpoint_twice


class MergeConflict(LayerdivError, RuntimeError):
    """The stores cannot be combined; nothing was written."""


@dataclass(frozen=True)
class MergedPartition:
    """One partition of the merged store."""

    key: PartitionKey
    n_done: int
    """Instances it holds after the merge."""
    n_added: int
    """Instances the target did not hold before."""


@dataclass(frozen=True)
class _Copy:
    """One store's copy of a partition."""

    store: Path
    info: PartitionInfo

    def chunk_files(self, start: int, count: int) -> dict[str, Path]:
        """The chunk's part of each table it has (an optional table that a run was adding may
        lack some; the merged store says so as its source did)."""
        part, lacking = self.info.partition, self.info.lacking
        optional = [t for t, m in lacking.items() if (start, count) not in m]
        return {t: part.part(t, start, count) for t in (*self.info.kind.required, *optional)}


def merge_stores(sources: Sequence[str | Path], into: str | Path) -> list[MergedPartition]:
    """Merge the stores ``sources`` into ``into`` (created, or an existing store that keeps what
    it holds); returns what each partition holds afterwards."""
    dst = local_root(into, "--into")
    if dst.is_symlink():  # the folder it names is merged into; the link stays
        dst = Path(os.path.realpath(dst))
    restore(dst)
    target = _target_store(dst)
    stores = [] if target is None else [(dst, target)]
    seen = {dst.resolve()}
    for src in (local_root(s, "merge source") for s in sources):
        _refuse_nested(src, dst)
        if src.resolve() not in seen:
            seen.add(src.resolve())
            store = Store(src)
            if problems := store.problems():
                raise MergeConflict(f"{src} cannot be merged: {problems[0]}")
            stores.append((src, store))
    copies: dict[PartitionKey, list[_Copy]] = {}
    for root, store in stores:
        for info in store.partitions:
            _check_whole(root, info)
            copies.setdefault(info.key, []).append(_Copy(root, info))
    _refuse_one_checkpoint_twice(copies)
    plans = {key: _plan(found) for key, found in copies.items()}

    remove_stale_temps(dst.parent, dst.name)
    with atomic_path(dst) as stage:
        stage.mkdir()
        if target is not None:
            _link_tree(dst, stage)
        merged = []
        for key, (manifest, chunks) in plans.items():
            out = Partition(stage, key)  # in today's layout, whatever the sources' layouts
            for copy in copies[key]:
                if copy.store == dst and copy.info.partition.absent:
                    for d in Partition(stage, key, copy.info.partition.absent).dirs():
                        shutil.rmtree(d, ignore_errors=True)  # the target's older layout
            for (start, count), held in sorted(chunks.items()):
                files: dict[str, Path] = {}  # each table from a copy having it
                for copy in held:
                    for table, src in copy.chunk_files(start, count).items():
                        files.setdefault(table, src)
                for table, src in files.items():
                    linked = out.part(table, start, count)
                    linked.unlink(missing_ok=True)  # e.g. the target's orphan from a crash
                    _link(src, linked)
            for copy in copies[key]:
                _copy_side_files(copy.info.partition, out)
            write_manifest(out.manifest, manifest)
            for table in PartitionInfo(out, read_manifest(out.manifest)).tables:
                write_bytes(out.manifest.parent / TABLES_DIR / table, b"")
            before = 0 if target is None else _n_done(target, key)
            n_done = sum(count for _, count in chunks)
            merged.append(MergedPartition(key, n_done, n_done - before))
    return merged


def _check_whole(root: Path, info: PartitionInfo) -> None:
    """Refuse (``MergeConflict``) a partition of the store at ``root`` whose file of a table
    stored once per partition cannot be read or does not give the fingerprint its manifest
    records (``PartitionInfo.whole``)."""
    for m in registered():
        if m.name not in info.manifest.settings:
            continue
        for table in m.whole:
            try:
                info.whole(table)
            except StoreError as err:
                raise MergeConflict(f"{root} cannot be merged: {err}") from err


def _target_store(dst: Path) -> Store | None:
    """The store already at ``dst``, or None where there is nothing (or an empty folder)."""
    if not dst.exists():
        return None
    if not dst.is_dir():
        raise MergeConflict(f"{dst} is a file, not a store: choose another --into")
    if not any(dst.iterdir()):
        return None
    try:
        return Store(dst)
    except StoreError as err:
        raise MergeConflict(
            f"--into {dst} is neither empty nor a readable layerdiv store ({err})"
        ) from None


def _plan(copies: list[_Copy]) -> tuple[Manifest, dict[tuple[int, int], list[_Copy]]]:
    """The merged manifest of one partition and, for each chunk, the copies that hold it;
    refuses other extractions, overlapping chunks and differing copies of a chunk."""
    first = copies[0]
    where = " ".join(first.info.key.dirs())
    chunks: dict[tuple[int, int], list[_Copy]] = {}
    for copy in copies:
        _same_extraction(first, copy, where)
        for start, count in copy.info.done:
            held = chunks.setdefault((start, count), [])
            if held:
                _same_files(held[0], copy, start, count, where)
            held.append(copy)
    ranges = sorted(chunks)
    for (a, na), (b, nb) in itertools.pairwise(ranges):
        if b < a + na:
            raise MergeConflict(
                f"{where}: instances {a}..{a + na - 1} of {chunks[a, na][0].store} overlap "
                f"instances {b}..{b + nb - 1} of {chunks[b, nb][0].store} (different chunk sizes), "
                "so some would be stored twice: remove one of the two parts from its store, "
                "then merge again"
            )
    manifest = first.info.manifest
    manifests = [c.info.manifest for c in copies]
    runs: list[dict[str, object]] = []
    for m in manifests:
        runs += [r for r in m.runs if r not in runs]
    manifest.runs = sorted(runs, key=lambda r: str(r.get("finished_at", "")))
    manifest.n_requested = max(m.n_requested for m in manifests)
    manifest.created_at = min((m.created_at for m in manifests if m.created_at), default="")
    return manifest, chunks


def _refuse_one_checkpoint_twice(copies: dict[PartitionKey, list[_Copy]]) -> None:
    """Refuse two revisions of one model whose weights are equal, in one store or in two
    (:func:`~layerdiv.store.writer.one_checkpoint_twice`, the rule of ``extract``)."""
    revisions: dict[tuple[str, str], _Copy] = {}  # (model, revision): a copy recording it
    for key, found in copies.items():
        for copy, seen in itertools.product(found, list(revisions.values())):
            info = seen.info
            problem = one_checkpoint_twice(
                key, copy.info.manifest.weights_hash, info.partition, info.manifest
            )
            if problem:
                raise MergeConflict(
                    f"{copy.info.partition.manifest.parent}: {problem}; merge only one of the "
                    "two revisions (leave the other's store out, or remove it from its store)"
                )
        revisions.setdefault((key.model, key.revision), found[0])


def _same_extraction(first: _Copy, copy: _Copy, where: str) -> None:
    a, b = first.info.manifest, copy.info.manifest
    diff = a.identity().differences(b.identity(), (str(first.store), str(copy.store)))
    tables_a, tables_b = sorted(first.info.lacking), sorted(copy.info.lacking)
    if tables_a != tables_b:
        diff.append(f"optional tables: {tables_a} vs {tables_b}")
    for name in sorted({*a.settings, *b.settings}):  # the measurements' settings
        if a.settings.get(name) != b.settings.get(name):
            diff.append(f"{name}: {a.settings.get(name)!r} vs {b.settings.get(name)!r}")
    if diff:
        raise MergeConflict(
            f"{where}: {first.store} and {copy.store} hold different extractions "
            f"({'; '.join(diff)}); merge only stores of the same extraction"
        )


def _same_files(held: _Copy, copy: _Copy, start: int, count: int, where: str) -> None:
    theirs = copy.chunk_files(start, count)
    for table, a in held.chunk_files(start, count).items():
        b = theirs.get(table)
        if b is not None and not filecmp.cmp(a, b, shallow=False):
            raise MergeConflict(
                f"{where}: {a} and {b} hold instances {start}..{start + count - 1} extracted "
                "twice, with different bytes: delete one of them, then merge again"
            )


def _refuse_nested(src: Path, dst: Path) -> None:
    """Refuse a source inside the target or the target inside a source (a store in a store)."""
    a, b = src.resolve(), dst.resolve()
    if a != b and (b in a.parents or a in b.parents):
        inner, outer = ("--into", "the source") if a in b.parents else ("the source", "--into")
        raise MergeConflict(
            f"{inner} {dst if inner == '--into' else src} is inside {outer} "
            f"{src if outer == 'the source' else dst}: a store would hold another store; choose "
            "an --into folder outside every source"
        )


def _n_done(store: Store, key: PartitionKey) -> int:
    return sum(p.n_done for p in store.partitions if p.key == key)


def _copy_side_files(src: Partition, dst: Partition) -> None:
    """Every other file under the partition's manifest folder (run records; never a hidden
    temporary one, nor an optional table's marker: the merged partition is marked for the tables
    it has whole); two stores' files of the same name must be equal."""
    folder = src.manifest.parent
    for f in sorted(folder.rglob("*")) if folder.is_dir() else []:
        rel = f.relative_to(folder)
        hidden = any(p.startswith(".") for p in rel.parts)
        if f == src.manifest or hidden or rel.parts[0] == TABLES_DIR or not f.is_file():
            continue
        out = dst.manifest.parent / rel
        if not out.exists():
            _link(f, out)
        elif not filecmp.cmp(f, out, shallow=False):
            raise MergeConflict(f"{f} differs from the file of that name in another store")


def _link(src: Path, dst: Path) -> None:
    """Hard-link ``src`` at ``dst`` (parts are never changed in place), or copy it across file
    systems."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _link_tree(src: Path, dst: Path) -> None:
    for folder, _, files in os.walk(src):
        for name in files:
            path = Path(folder) / name
            _link(path, dst / path.relative_to(src))
