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
from layerdiv.demo import STATES_TASK, WORDS_TASK

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIGURE = ROOT / "docs" / "demo-layer-maps.png"
REGION = re.compile(r"(<!-- demo:maps -->\n)(.*?)(<!-- /demo:maps -->)", re.S)


def _sentence(r: dict, name: str) -> str:
    """One pair's finding on one space (a row of ``spearman``)."""
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
        f"[{fmt(r['low'], digits=2)}, {fmt(r['high'], digits=2)}] over {r['n_units']} held-out "
        f"{r['units']} resampled (against permuted targets p = {r['p_value']:.3g})"
    )


def _name(model: str) -> str:
    return Path(model).name if model.startswith("/") else model


def region(results: Path) -> str:
    """The README's text: the sibling onto SmolLM2 (one sentence per space, then the best targets
    of the states), then SmolLM2 and Gemma 3 onto each other at word ends."""
    all_best = pl.read_parquet(results / "layer_map_best.parquet")
    all_maps = pl.read_parquet(results / "layer_maps.parquet")
    all_intervals = pl.read_parquet(results / "layer_map_intervals.parquet")
    best = all_best.filter(pl.col("task") == STATES_TASK)
    maps = all_maps.filter(pl.col("task") == STATES_TASK)
    rho = {r["space"]: r for r in spearman(best, all_intervals).iter_rows(named=True)}
    n_train, n_held = maps["n_train"][0], maps["n_heldout"][0]
    ridges = all_maps["ridge"].unique()
    ridge = f"ridge {ridges[0]:g}" if ridges.len() == 1 else "ridge cross-validated per map"
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
    words = spearman(all_best.filter(pl.col("task") == WORDS_TASK), all_intervals)
    pairs = []
    for (src, tgt), group in words.group_by("source_model", "target_model", maintain_order=True):
        held = all_maps.filter(
            (pl.col("task") == WORDS_TASK) & (pl.col("source_model") == src)
            & (pl.col("target_model") == tgt)
        )  # fmt: skip
        by_space = {r["space"]: r for r in group.iter_rows(named=True)}
        pairs.append(
            f"- {_name(str(src))} onto {_name(str(tgt))} ({held['n_train'][0]:,} training and "
            f"{held['n_heldout'][0]:,} held-out word ends): "
            f"{_sentence(by_space['states'], 'states')}; "
            f"{_sentence(by_space['updates'], 'updates')}."
        )
    return (
        f"Fitted on {n_train:,} token rows ({ridge}), scored on "
        f"{n_held:,} held-out rows: {_sentence(rho['states'], 'states')}; "
        f"{_sentence(rho['updates'], 'updates')}.\n\n{table}\n\n"
        "Between SmolLM2 and Gemma 3 270M, whose tokenizers differ, the maps are fitted on the "
        "tokens of the same documents that end at the same character (`--states words`, the "
        f"demo's `{WORDS_TASK}`):\n\n" + "\n".join(pairs) + "\n"
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
