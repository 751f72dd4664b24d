"""Bytes per token per block of a running-text store, measured on a real SmolLM2 extraction.

    python benchmarks/text_store_size.py [--docs 40] [--max-tokens 256] [--store DIR]

Extracts ``--docs`` packaged BBC News articles (title and first paragraphs, cut to
``--max-tokens`` tokens) through SmolLM2-135M-Instruct as a text task (``kind: text``), then
prints the Parquet bytes of each text table, per token and (``token_blocks``) per token per
block, and what a FineWeb-sized run (4,800 documents x 1,024 tokens) of 30- and 32-block models
would take at that rate.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from click.testing import CliRunner
from common import add_quick, record

from layerdiv.cli import main
from layerdiv.demo import bbc_articles
from layerdiv.store import Store


def extract(store: Path, docs: int, max_tokens: int) -> None:
    folder = store.parent / "task"
    folder.mkdir(parents=True, exist_ok=True)
    rows = bbc_articles(paragraphs=4)[:: max(1, len(bbc_articles()) // docs)][:docs]
    (folder / "bbc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"name": "bbc-text", "kind": "text", "data": "bbc.jsonl", "text": "{{ text }}",
            "group_field": "label", "max_tokens": max_tokens, "n": docs}  # fmt: skip
    (folder / "bbc.yaml").write_text(json.dumps(spec))
    args = ["extract", "--model", "smollm2-135m-instruct", "--task", str(folder / "bbc.yaml"),
            "--store", str(store)]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    if result.exit_code != 0:
        raise SystemExit(result.output)


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--store", type=Path, default=None)
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.docs, args.max_tokens = 2, 24
    store = args.store or Path(tempfile.mkdtemp(prefix="layerdiv-text-")) / "store"
    loads = [os.getloadavg()[0]]
    if not store.exists():
        extract(store, args.docs, args.max_tokens)
    (info,) = Store(store).partitions
    n_docs, blocks = info.n_done, info.manifest.n_blocks
    tokens = Store(store).scan("documents").collect()["n_tokens"].sum()
    print(f"store {store}: {n_docs} documents, {tokens} tokens, {blocks} blocks "
          f"({info.manifest.model}, {info.manifest.dtype})")  # fmt: skip
    per_block = 0.0
    rows: list[list[object]] = []
    for table in info.kind.required:
        size = sum(f.stat().st_size for f in info.files(table))
        line = f"  {table:<13} {size:>10,} bytes  {size / tokens:8.2f} bytes/token"
        rows.append([f"`{table}`", round(size / tokens, 2), ""])
        if table == "token_blocks":
            per_block = size / tokens / blocks
            line += f"  {per_block:6.2f} bytes/token/block"
            rows[-1][2] = round(per_block, 2)
        print(line)
    loads.append(os.getloadavg()[0])
    if args.store is None:  # the docs' table: a fresh extraction
        columns = ["table", "bytes per token", "bytes per token per block"]
        record("text_store_size", columns, rows, loads, formats=["", ".2f", ".2f"])
    fineweb = 4_800 * 1_024
    for n_blocks in (30, 32):
        gib = fineweb * n_blocks * per_block / 2**30
        print(f"FineWeb-sized run (4,800 x 1,024 tokens), {n_blocks} blocks: "
              f"token_blocks about {gib:.2f} GiB per model")  # fmt: skip


if __name__ == "__main__":
    main_()
