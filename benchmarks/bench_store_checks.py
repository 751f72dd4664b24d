"""What the readers' checks cost (a script, not a test).

Synthesises one FineWeb-shaped text partition (``analyze.synthetic.synthesize_text_store``,
``--skips``: documents of ``--tokens`` tokens and ``--blocks`` blocks, in chunks of 64 documents)
and prints, in CPU seconds of this process (user + system, so the figures hold on a busy
machine better than wall time), each check against the reading it guards:

- opening the store (every part's footer: schema and row counts) against the part of it that
  reads each chunk's ``documents.n_tokens`` (what the row-count check of ``token_blocks``,
  ``tokens`` and ``token_lens`` adds to the footers);
- reading every ``token_blocks`` part with page checksums verified against unverified;
- the checks of the dot products (finite, squared norms >= 0) and of the (doc, pos) order against
  the pass over ``token_blocks`` that computes the geometry;
- the key uniqueness check of ``future_effects`` against reading the table;
- the key grid check of ``token_lens`` (``layerdiv.schemas.Rules``) against reading the table;
- opening a choice store (one synthetic partition of ``--instances`` instances, 40 blocks, 4
  options, in chunks of 1,024) against the part of it that reads the instance ids of each
  chunk's parts (the row check of every reader: each instance's rows counted).

    python benchmarks/bench_store_checks.py [--store DIR] [--docs 320] [--tokens 1024]
        [--blocks 32] [--instances 4096]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from common import add_quick, timed


def cpu(fn: Callable[[], Any], repeat: int = 3) -> float:
    """The least CPU time of ``repeat`` calls of ``fn``."""
    return min(timed(fn, repeat)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=None)
    parser.add_argument("--docs", type=int, default=320)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--instances", type=int, default=4096)
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.docs, args.tokens, args.blocks, args.instances = 8, 64, 4, 64

    import numpy as np

    from layerdiv.analyze import text
    from layerdiv.analyze.synthetic import random_partition, synthesize_text_store, write_partition
    from layerdiv.schemas import SKIP_KEYS
    from layerdiv.store import Store

    root = args.store or Path(tempfile.mkdtemp(prefix="layerdiv-checks-"))
    if not (root / "manifests").is_dir():
        synthesize_text_store(
            root, 1, args.docs, args.tokens, args.blocks, lens=True, skips=True, progress=False
        )
    (info,) = Store(root).partitions
    blocks = info.manifest.n_blocks
    rows = sum(pq.read_metadata(f).num_rows for f in info.files("token_blocks"))
    print(f"store {root}: {info.n_done} documents, {rows:,} token_blocks rows, "
          f"{len(info.done)} chunks")  # fmt: skip

    opening = cpu(lambda: Store(root))
    n_tokens = cpu(
        lambda: [pq.read_table(f, columns=["n_tokens"]) for f in info.files("documents")]
    )
    print(f"open the store: {opening:.3f} s CPU, of which reading documents.n_tokens per chunk "
          f"{n_tokens:.3f} s ({n_tokens / opening:.0%})")  # fmt: skip

    def read_all(verify: bool) -> None:
        for f in info.files("token_blocks"):
            pq.ParquetFile(f, page_checksum_verification=verify).read(use_threads=False)

    plain, verified = cpu(lambda: read_all(False)), cpu(lambda: read_all(True))
    print(f"read token_blocks: {plain:.3f} s CPU unverified, {verified:.3f} s with page "
          f"checksums verified ({verified / plain:.2f} x)")  # fmt: skip

    columns = ["doc", "pos", "block", *text.DOTS]
    buffer = np.empty(len(text.DOTS) * blocks * text.BATCH_TOKENS)

    def checks() -> float:
        """The CPU time of the checks alone, run again on each batch's dot products."""
        spent, last = 0.0, -1
        for batch in info.batches("token_blocks", columns, text.BATCH_TOKENS * blocks):
            pos, dots = text.token_dots(batch, blocks, info.where, buffer)
            doc = batch.column("doc").to_numpy()[::blocks]
            start = time.process_time()
            text._check_dots(dots, doc, pos, info.where)
            last = text.check_token_order(batch, blocks, last, info.where)
            spent += time.process_time() - start
        return spent

    passing = cpu(lambda: text.text_pass(info), repeat=1)
    checking = min(checks() for _ in range(2))
    print(f"geometry pass over token_blocks: {passing:.3f} s CPU, of which the dot-product and "
          f"(doc, pos) checks {checking:.3f} s ({checking / passing:.1%})")  # fmt: skip

    effect_columns = ["sublayer", "skipped", "block", "rel_change"]
    key = SKIP_KEYS["future_effects"]

    def effects(unique: tuple[str, ...]) -> None:
        for _ in info.batches("future_effects", effect_columns, 1 << 20, unique):
            pass

    unchecked, checked = cpu(lambda: effects(())), cpu(lambda: effects(key))
    print(f"read future_effects: {unchecked:.3f} s CPU, {checked:.3f} s with its keys checked "
          f"unique per part ({checked / unchecked:.2f} x)")  # fmt: skip

    lens = info.files("token_lens")

    def read_lens() -> None:
        for _ in info.batches("token_lens", ["doc", "layer", "kl"], 1 << 20):
            pass

    keys = [pq.read_table(f, columns=info.grid_columns("token_lens")) for f in lens]
    reading = cpu(read_lens)

    def check_lens() -> None:
        for f, k in zip(lens, keys, strict=True):
            info.check_keys("token_lens", f, k)

    grid = cpu(check_lens)
    print(f"read token_lens: {reading:.3f} s CPU, of which its key grid check (each token's "
          f"layers once) {grid:.3f} s ({grid / reading:.0%})")  # fmt: skip

    choice = root.with_name(root.name + "-choice")
    if not (choice / "manifests").is_dir():
        logits, gold, rms, kinds = random_partition(np.random.default_rng(0), args.instances, 40, 4)
        write_partition(choice, "synth/choice", "task", logits, gold, kinds, rms, chunk=1024)
    (part,) = Store(choice).partitions
    n_rows = sum(pq.read_metadata(f).num_rows for f in part.files("components"))
    opening = cpu(lambda: Store(choice))
    ids = cpu(
        lambda: [
            pq.read_table(f, columns=["instance"])
            for t in ("components", "instances")
            for f in part.files(t)
        ]
    )
    print(f"open a choice store ({part.n_done} instances, {n_rows:,} components rows, "
          f"{len(part.done)} chunks): {opening:.3f} s CPU, of which reading the instance ids "
          f"{ids:.3f} s ({ids / opening:.0%})")  # fmt: skip


if __name__ == "__main__":
    main()
