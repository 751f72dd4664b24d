"""The README's layer-maps figures, from the demo's results (``make demo``): the region between
``<!-- demo:maps -->`` and ``<!-- /demo:maps -->`` of README.md (Spearman's correlation per
space over the source layers whose best map reaches the R² gate, and the best target of every
source layer, from ``layer_map_best``) and
``docs/demo-layer-maps.png`` (the report's ``layer_maps.png``).

    python scripts/demo_maps.py [--demo layerdiv-demo] [--check]

``--check`` only reports (exit 1) a README region that differs from the demo's results.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import polars as pl

from layerdiv.analyze.analyses.maps import MIN_LAYERS, R2_GATE, spearman
from layerdiv.analyze.markdown import fmt, markdown_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIGURE = ROOT / "docs" / "demo-layer-maps.png"
REGION = re.compile(r"(<!-- demo:maps -->\n)(.*?)(<!-- /demo:maps -->)", re.S)


def region(results: Path) -> str:
    """The README's text: one sentence per space, then the best targets of the states."""
    best = pl.read_parquet(results / "layer_map_best.parquet")
    maps = pl.read_parquet(results / "layer_maps.parquet")
    rho = {r["space"]: r for r in spearman(best).iter_rows(named=True)}
    n_train, n_held = maps["n_train"][0], maps["n_heldout"][0]
    states = best.filter(pl.col("space") == "states").sort("source_layer")
    rows = [
        [str(r["source_layer"]), fmt(r["source_depth"], digits=2),
         "none beats the mean" if r["target_layer"] is None else str(r["target_layer"]),
         fmt(r["target_depth"], digits=2), fmt(r["rel_error"], digits=3),
         fmt(r["mean_rel_error"], digits=3), fmt(r["r2"], digits=2)]
        for r in states.iter_rows(named=True)
    ]  # fmt: skip
    table = markdown_table(
        ["sibling layer i", "i / L_A", "best SmolLM2 layer j", "j / L_B", "rel_error",
         "mean predictor's rel_error", "R²"], rows
    )  # fmt: skip

    def space(name: str) -> str:
        r = rho[name]
        found = (
            f"{r['n_best']} of {r['n_sources']} source layers have a map that beats the mean "
            f"predictor and {r['n']} a best map (the largest held-out R²) with R² >= {R2_GATE:g}"
        )
        if r["spearman"] is None:
            why = "too few for a verdict" if r["n"] < MIN_LAYERS else "every one the same target"
            return f"{found} on the {name} ({why}: no correspondence claimed)"
        return (
            f"{found} on the {name}, and over those Spearman's correlation of the best target's "
            f"relative depth with the source's is {r['spearman']:.2f} "
            f"[{r['low']:.2f}, {r['high']:.2f}] (against permuted targets p = {r['p_value']:.3g})"
        )

    return (
        f"Fitted on {n_train:,} token rows (ridge cross-validated per map), scored on "
        f"{n_held:,} held-out rows: {space('states')}; {space('updates')}.\n\n{table}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=ROOT / "layerdiv-demo")
    parser.add_argument("--check", action="store_true", help="report a stale README, change none")
    args = parser.parse_args()
    old = README.read_text()
    body = region(args.demo / "results")
    new = REGION.sub(lambda m: m.group(1) + body + m.group(3), old)
    if args.check:
        if new != old:
            print("README.md: the layer-maps region differs from the demo's results")
            sys.exit(1)
        return
    README.write_text(new)
    shutil.copyfile(args.demo / "report" / "figures" / "layer_maps.png", FIGURE)
    print(f"README.md and {FIGURE.relative_to(ROOT)} rewritten from {args.demo}")


if __name__ == "__main__":
    main()
