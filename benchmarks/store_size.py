"""How large a store grows: Parquet bytes per row, measured, and the rows and bytes of studies.

    python benchmarks/store_size.py [--store DIR ...]

Measures the bytes per component-option row of the ``components`` table and per instance of the
``instances`` table on a synthetic store (``analyze/synthetic.py``: random logits, which compress
like real ones) and on each real store given, the bytes per instance of every table each real
store holds, then the rows and bytes of study sizes at the largest measured bytes per row (the
docs page "The store", "Scale of a store").
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import yaml
from common import add_quick

import layerdiv.tasks
from layerdiv.analyze.synthetic import synthesize_store
from layerdiv.schemas import TABLES
from layerdiv.store import Store

TASKS = Path(layerdiv.tasks.__file__).parent
_SPECS = [yaml.safe_load(f.read_text()) for f in TASKS.glob("*.yaml")]
PAPER_OPTIONS = float(np.mean([len(s["options"]) for s in _SPECS if "options" in s]))
"""Mean option count of the paper's eight tasks (the built-in choice task YAMLs)."""

PYTHIA_LAYERS = (6, 12, 24, 16, 24, 32, 32, 36)
"""Decoder blocks of Pythia 70M, 160M, 410M, 1B, 1.4B, 2.8B, 6.9B and 12B (their configs)."""

STUDIES = [
    # name, models, tasks, instances per task, components per model (embed, attn and mlp per
    # block, and the LayerNorm models' bias)
    ("the paper: 16 models of 30-40 blocks, its 8 tasks", 16, 8, 2_000, 1 + 2 * 35),
    ("one 70B model (80 blocks), 8 tasks", 1, 8, 2_000, 1 + 2 * 80),
    (
        "Pythia: 8 sizes x 154 checkpoints, 8 tasks",
        8 * 154,
        8,
        2_000,
        2 + 2 * float(np.mean(PYTHIA_LAYERS)),
    ),
    ("1,000 models of 40 blocks, 8 tasks of 100k instances", 1_000, 8, 100_000, 1 + 2 * 40),
]


def measure(root: Path) -> tuple[float, float, int]:
    """(bytes per component-option row, bytes per instance, component-option rows) of a store:
    file sizes over the row counts of the Parquet footers."""
    out = []
    for table in ("components", "instances"):
        files = [f for p in Store(root).partitions for f in p.files(table)]
        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        out.append((sum(f.stat().st_size for f in files) / rows, rows))
    (per_row, rows), (per_instance, _) = out
    return per_row, per_instance, rows


def table_bytes(root: Path) -> dict[str, float]:
    """Bytes per instance of every table the store holds (file sizes over the instances)."""
    parts = Store(root).partitions
    n = sum(pq.ParquetFile(f).metadata.num_rows for p in parts for f in p.files("instances"))
    sizes = {t: sum(f.stat().st_size for p in parts for f in p.files(t)) for t in TABLES}
    return {t: size / n for t, size in sizes.items() if size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", action="append", default=[], help="a real store to measure")
    add_quick(parser)
    args = parser.parse_args()
    n = 40 if args.quick else 2_000
    measured = []
    with tempfile.TemporaryDirectory() as tmp:
        synthesize_store(tmp, n_models=2, n_tasks=4, n_instances=n, progress=False)
        measured.append((f"synthetic, 2 models x 4 tasks x {n:,}", *measure(Path(tmp))))
    for root in args.store:
        held = ", ".join(f"{p.model}/{p.task}" for p in Store(root).partitions)
        measured.append((f"{held} ({root})", *measure(Path(root))))
    print("| store | component-option rows | bytes per row | bytes per instance row |")
    print("| --- | --: | --: | --: |")
    for name, per_row, per_instance, rows in measured:
        print(f"| {name} | {rows:,} | {per_row:.2f} | {per_instance:.1f} |")
    print("\nBytes per instance of each table (a table the store lacks is empty):\n")
    print("| store | " + " | ".join(TABLES) + " |")
    print("| --- |" + " --: |" * len(TABLES))
    for root in args.store:
        sizes = table_bytes(Path(root))
        cells = [f"{sizes[t]:,.0f}" if t in sizes else "" for t in TABLES]
        print(f"| {root} | " + " | ".join(cells) + " |")
    per_row = max(m[1] for m in measured)
    print(f"\nStudies at {per_row:.2f} bytes per component-option row and {PAPER_OPTIONS} options")
    print("per task (the paper's):\n")
    print("| study | component-option rows | components table |")
    print("| --- | --: | --: |")
    for name, models, tasks, instances, components in STUDIES:
        size = models * tasks * instances * components * PAPER_OPTIONS
        print(f"| {name} | {size:,.0f} | {size * per_row / 1e9:,.2f} GB |")


if __name__ == "__main__":
    main()
