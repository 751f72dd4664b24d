"""The benchmark figures of the docs and the README, rendered from the results files the full
benchmark runs write (``docs/benchmarks/<name>.json``, ``benchmarks/common.py``'s ``record``).

A region of a file of :data:`FILES` between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``
is rendered from the results file NAME (its table, after the command, date, commit and load
average it ran at; ``NAME#KEY``: its table under ``KEY``); the README's ``readme-text`` region
quotes rows of several (:data:`README_ROWS`). A results file of figures measured before results
files were written says so (``before``: the figures were in the docs at that commit and date; the
run's own are not known). ``python scripts/bench_tables.py`` rewrites the regions; ``--check``
only reports (exit 1) the files whose regions differ from their results files, as
``tests/test_bench_tables.py`` does.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks"
FILES = [ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "running-text.md", ROOT / "README.md"]
"""The files whose regions are rendered."""
REGION = re.compile(r"(<!-- bench:([\w.#-]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)


def load(name: str, results: Path = RESULTS) -> dict[str, Any]:
    """The results file ``name``."""
    path = results / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"{path.relative_to(ROOT)}: no such results file (run its benchmark)")
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def when(result: dict[str, Any]) -> str:
    """The run's date and commit: as recorded, or the commit (and its date) whose docs first held
    the figures of a run that recorded neither."""
    if result.get("before"):
        return f"before commit `{result['commit']}` ({result['date']}; the run's own not recorded)"
    return f"on {result['date']}, commit `{result['commit']}`"


def conditions(result: dict[str, Any]) -> str:
    """The machine and its load average during the run (or what is known of it)."""
    machine = result.get("machine") or f"{result['cores']} cores"
    loads = result.get("load_average")
    if loads is None:
        return f"{machine}, {result.get('conditions', 'load average not recorded')}"
    low, high = loads
    load = f"{low:.2f}" if low == high else f"{low:.2f} to {high:.2f}"
    threads = f", {result['threads']} torch thread(s)" if "threads" in result else ""
    return f"{machine}{threads} at a load average of {load}"


def provenance(result: dict[str, Any]) -> str:
    """The run's command, date, commit and load average, as one line."""
    return f"`{result['command']}` {when(result)}, {conditions(result)}:"


def cell(value: Any, fmt: str) -> str:
    """One figure in its format; a missing one (None: not defined for that row) as a dash."""
    if value is None:
        return "–"
    return format(value, fmt) if isinstance(value, (int, float)) else str(value)


def table(result: dict[str, Any]) -> str:
    """The results file's table in Markdown, after its provenance line."""
    formats = result.get("formats") or [""] * len(result["columns"])
    align = ["---" if isinstance(v, str) else "--:" for v in result["rows"][0]]
    lines = [provenance(result), "", "| " + " | ".join(result["columns"]) + " |",
             "| " + " | ".join(align) + " |"]  # fmt: skip
    for row in result["rows"]:
        lines.append(
            "| " + " | ".join(cell(v, f) for v, f in zip(row, formats, strict=True)) + " |"
        )
    return "\n".join(lines) + "\n"


def named_row(result: dict[str, Any], first: Any) -> dict[str, Any]:
    """The row of ``result`` whose first cell is ``first``, by column."""
    row = next(r for r in result["rows"] if r[0] == first)
    return dict(zip(result["columns"], row, strict=True))


def ratio(row: dict[str, Any]) -> tuple[str, str]:
    """A ``bench_text_extract`` row's CPU-time ratio to the plain forward and its target."""
    if row["FLOP ratio"] == 1.0:
        return f"{row['CPU ratio']:.2f} x", f"<= {row['target']:.2f} x"
    figure = f"{row['CPU ratio']:.2f} x (FLOP ratio {row['FLOP ratio']:.2f})"
    return figure, f"<= {row['target'] / row['FLOP ratio']:.2f} x FLOP ratio ({row['target']:.2f})"


def text_analysis(row: dict[str, Any]) -> tuple[str, str]:
    """A ``bench_text_analyze`` row: CPU seconds per model and peak memory."""
    return f"{row['CPU/model (s)']:.1f} CPU s per model, peak {row['peak RSS (MiB)']:.0f} MiB", (
        "<= 60 s, <= 2 GiB"
    )


def block_bytes(row: dict[str, Any]) -> tuple[str, str]:
    """A ``text_store_size`` row: bytes per token per block."""
    return f"{row['bytes per token per block']:.2f} bytes per token per block", ""


def states_cost(row: dict[str, Any]) -> tuple[str, str]:
    """A ``bench_states`` row: its figure and target as the results file gives them."""
    return f"{row['figure']}", f"{row['target']}"


def maps_ratio(row: dict[str, Any]) -> tuple[str, str]:
    """A ``bench_maps`` row: its time against the matrix multiplies' at the GEMM rate."""
    return (
        f"{row['CPU ratio']:.2f} x the GEMM time in CPU s ({row['wall ratio']:.2f} x in wall s)",
        f"<= {row['target']:.0f} x",
    )


README_ROWS: list[tuple[str, Any, str, Callable[[dict[str, Any]], tuple[str, str]]]] = [
    ("bench_text_extract", "text",
     "extraction without options, against a plain forward (`bench_text_extract.py`)", ratio),
    ("bench_text_extract", "lens", "`--lens`, against a plain forward", ratio),
    ("bench_text_extract", "lens last-block", "`--lens last-block`, against a plain forward",
     ratio),
    ("bench_text_extract-text-skips-skips-answer-skips-local", "skips",
     "`--skips`, against a plain forward (`--max-tokens 128`)", ratio),
    ("bench_text_extract-text-skips-skips-answer-skips-local", "skips answer",
     "`--skips --skip-split answer:4:4`, against a plain forward", ratio),
    ("bench_text_extract-text-skips-skips-answer-skips-local", "skips local",
     "`--skips --skip-split answer:4:4 --skip-mode local`, against a plain forward", ratio),
    ("bench_text_analyze", 4800,
     "analysis of 4,800 documents x 1,024 tokens x 32 blocks (`bench_text_analyze.py`)",
     text_analysis),
    ("text_store_size", "`token_blocks`",
     "`token_blocks` on disk (`text_store_size.py --docs 40 --max-tokens 256`)", block_bytes),
    ("bench_states", "--states all / plain, CPU",
     "`--states all`, CPU time against a plain text extraction (`bench_states.py`)", states_cost),
    ("bench_states", "--states all, CPU s",
     "`--states all`, CPU s (target: 1.15 x plain + the states' bytes at the disk's speed)",
     states_cost),
    ("bench_states", "states on disk / (rows x (L + 1) x d x dtype)",
     "`states` on disk against the vectors' bytes", states_cost),
    ("bench_maps", "32,768 + 8,192",
     "`analyze --maps` at the depth-efficiency paper's shape, every pair extrapolated from one "
     "source layer of each space (`bench_maps.py --source-layers 1`)", maps_ratio),
]  # fmt: skip
"""The README's running-text figures: (results file, first cell of its row, what it measures,
its figure and target)."""


def readme_text(results: Path) -> str:
    """The README's running-text figures (:data:`README_ROWS`), each with its run."""
    lines = ["| measure | figure | target | measured |", "|---|---|---|---|"]
    for name, first, label, figure in README_ROWS:
        result = load(name, results)
        value, limit = figure(named_row(result, first))
        lines.append(f"| {label} | {value} | {limit} | {when(result)}, {conditions(result)} |")
    return "\n".join(lines) + "\n"


def cluster_median(results: Path) -> str:
    """The medians of ``bench_cluster``'s Ray and local wall times, and their ratio."""
    result = load("bench_cluster", results)
    local, ray = (
        statistics.median(row[result["columns"].index(column)] for row in result["rows"])
        for column in ("local wall s", "ray wall s")
    )
    return (
        f"Median Ray / local: {ray:.1f} / {local:.1f} = {ray / local:.2f} (target: at most 1.3).\n"
    )


def extract_overhead(results: Path) -> str:
    """``bench_extract``'s layerdiv-auto / plain-floor: layerdiv's own work over the same
    forward passes."""
    result = load("bench_extract", results)
    own, target = result["own_overhead"], result["target"]
    verdict = "met" if own <= target else f"missed by {own / target - 1:.1%}"
    return (
        f"**{own:.3f}** times the floor's time in the run above (the median of per-round "
        f"ratios; target at most {target}: {verdict}).\n"
    )


def maps_summary(results: Path) -> str:
    """``bench_maps``'s GEMM rate, its full-size row extrapolated to every pair by the FLOP count
    (``layer_maps.map_flops``), its linearity and peak memory, beside the paper's cost."""
    from layerdiv.analyze.layer_maps import map_flops

    result = load("bench_maps", results)
    full = dict(zip(result["columns"], result["rows"][-1], strict=True))
    shape, rate = result["shape"], result["gemm_gflops"]
    every = sum(
        map_flops(shape["d_a"], shape["d_b"], shape["l_a"] - u, shape["l_b"] - u,
                  shape["train"], shape["heldout"])
        for u in (0, 1)
    )  # fmt: skip
    share = every / (full["TFLOP"] * 1e12)
    return (
        f"numpy float64 GEMM rate {rate['wall']:.1f} GFLOP/s per wall second, {rate['cpu']:.1f} "
        f"per CPU second. Every pair of both spaces at the full token count: {every / 1e15:.2f} "
        f"PFLOP, {every / rate['wall'] / 1e9 / 3600:.1f} h at the GEMM rate; ours, extrapolated "
        f"from the run above ({result['source_layers']} source layer(s) of each space): "
        f"{full['CPU s'] * share / 3600:.1f} CPU hours, {full['wall s'] * share / 3600:.1f} h wall "
        f"on these 2 cores (the paper's AdamW maps: about 80 GPU-days, as a third-party summary "
        f"puts it). CPU time per token at all of the tokens against half of them: "
        f"{result['linearity']:.2f} (1 is linear). Peak memory (max RSS): "
        f"{result['peak_gib']:.2f} GiB (target: at most 8).\n"
    )


SPECIAL: dict[str, Callable[[Path], str]] = {
    "readme-text": readme_text,
    "cluster-median": cluster_median,
    "maps-summary": maps_summary,
    "extract-overhead": extract_overhead,
}
"""Regions rendered otherwise than as a results file's whole table."""


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every region rendered from its results file."""

    def one(match: re.Match[str]) -> str:
        name = match.group(2)
        if name in SPECIAL:
            body = SPECIAL[name](results)
        else:  # NAME or NAME#KEY: the results file's table, or its table under KEY
            file, _, key = name.partition("#")
            result = load(file, results)
            body = table({**result, **result[key]} if key else result)
        return match.group(1) + body + match.group(4)

    return REGION.sub(one, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale files, change none")
    args = parser.parse_args()
    stale = []
    for path in FILES:
        old = path.read_text()
        new = render(old)
        if new != old:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new)
    verb = "differ from their results files" if args.check else "rewritten"
    print(f"{', '.join(map(str, stale))}: {verb}" if stale else "benchmark tables up to date")
    if args.check and stale:
        sys.exit(1)


if __name__ == "__main__":
    main()
