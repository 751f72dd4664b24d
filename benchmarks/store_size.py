"""How large a store grows: Parquet bytes per row, measured, and the rows and bytes of studies.

    python benchmarks/store_size.py [--store DIR ...]

Measures the bytes per component-option row of the ``components`` table and per instance of the
``instances`` table on a synthetic store (``analyze/synthetic.py``: random logits, which compress
like real ones) and on each real store given, then prints the rows and bytes of study sizes at
the largest measured bytes per row (the README's "Scale of a store").
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from layerdiv.analyze.synthetic import synthesize_store
from layerdiv.store import Store

PAPER_OPTIONS = 21 / 8
"""Mean option count of the paper's eight tasks (2, 2, 3, 4, 2, 2, 2, 4)."""

STUDIES = [
    # name, models, tasks, instances per task, components per model
    ("the paper (16 models, 8 tasks)", 16, 8, 2_000, 71),
    ("one 70B model (80 blocks), 8 tasks", 1, 8, 2_000, 161),
    ("Pythia: 8 sizes x 154 checkpoints, 8 tasks", 8 * 154, 8, 2_000, 43),
    ("1,000 models, 8 tasks of 100k instances", 1_000, 8, 100_000, 81),
]


def measure(root: Path) -> tuple[float, float, int]:
    """(bytes per component-option row, bytes per instance, component-option rows) of a store."""
    store = Store(root)
    con = store.duckdb()
    rows = con.sql("SELECT count(*) FROM components").fetchone()[0]  # type: ignore[index]
    instances = con.sql("SELECT count(*) FROM instances").fetchone()[0]  # type: ignore[index]
    parts = store.partitions
    comp_bytes = sum(f.stat().st_size for p in parts for f in p.files("components"))
    inst_bytes = sum(f.stat().st_size for p in parts for f in p.files("instances"))
    return comp_bytes / rows, inst_bytes / instances, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", action="append", default=[], help="a real store to measure")
    args = parser.parse_args()
    measured = []
    with tempfile.TemporaryDirectory() as tmp:
        synthesize_store(tmp, n_models=2, n_tasks=4, n_instances=2_000, progress=False)
        measured.append(("synthetic, 2 models x 4 tasks x 2,000", *measure(Path(tmp))))
    measured += [(f"store {s}", *measure(Path(s))) for s in args.store]
    print("| store | component-option rows | bytes per row | bytes per instance row |")
    print("| --- | --: | --: | --: |")
    for name, per_row, per_instance, rows in measured:
        print(f"| {name} | {rows:,} | {per_row:.2f} | {per_instance:.1f} |")
    per_row = max(m[1] for m in measured)
    print(f"\nStudies at {per_row:.2f} bytes per component-option row:\n")
    print("| study | component-option rows | components table |")
    print("| --- | --: | --: |")
    for name, models, tasks, instances, components in STUDIES:
        rows = models * tasks * instances * components * PAPER_OPTIONS
        print(f"| {name} | {rows:,.0f} | {_size(rows * per_row)} |")


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:,.2f} GB"


if __name__ == "__main__":
    main()
