"""The benchmark figures of the docs and the README, rendered from the results files the full
benchmark runs write (``docs/benchmarks/<name>.json``, ``benchmarks/common.py``'s ``record``).

A region of ``docs/benchmarks.md`` or ``README.md`` between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->`` is rendered from the results file NAME (its table, with the command,
date, commit and load average it ran at; ``NAME#KEY``: its table under ``KEY``); the README's
``readme-text`` region quotes the running-text extraction rows. ``python
scripts/bench_tables.py`` rewrites the regions; ``--check`` only reports (exit 1) the files whose
regions differ from their results files, as ``tests/test_bench_tables.py`` does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks"
FILES = [ROOT / "docs" / "benchmarks.md", ROOT / "README.md"]
"""The files whose regions are rendered."""
REGION = re.compile(r"(<!-- bench:([\w.#-]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)


def load(name: str, results: Path = RESULTS) -> dict[str, Any]:
    """The results file ``name``."""
    path = results / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"{path.relative_to(ROOT)}: no such results file (run its benchmark)")
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def provenance(result: dict[str, Any]) -> str:
    """The run's command, date, commit and load average, as one line."""
    low, high = result["load_average"]
    load = f"{low:.2f}" if low == high else f"{low:.2f} to {high:.2f}"
    return (f"`{result['command']}` on {result['date']}, commit `{result['commit']}`, "
            f"{result['cores']} cores at a load average of {load}:")  # fmt: skip


def cell(value: Any, fmt: str) -> str:
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


def readme_text(results: Path) -> str:
    """The README's running-text extraction figures (the text and lens rows of
    ``bench_text_extract``): each CPU-time ratio to the plain forward with its target."""
    result = load("bench_text_extract", results)
    rows = {row[0]: dict(zip(result["columns"], row, strict=True)) for row in result["rows"]}
    what = {
        "text": "extraction without options, against a plain forward (`bench_text_extract.py`)",
        "lens": "`--lens`, against a plain forward",
        "lens last-block": "`--lens last-block`, against a plain forward",
    }
    lines = ["| measure | figure | target |", "|---|---|---|"]
    for name, label in what.items():
        row = rows[name]
        if row["FLOP ratio"] == 1.0:
            figure, limit = f"{row['CPU ratio']:.2f} x", f"<= {row['target']:.2f} x"
        else:
            figure = f"{row['CPU ratio']:.2f} x (FLOP ratio {row['FLOP ratio']:.2f})"
            flop_target = row["target"] / row["FLOP ratio"]
            limit = f"<= {flop_target:.2f} x FLOP ratio ({row['target']:.2f})"
        lines.append(f"| {label} | {figure} | {limit} |")
    low, high = result["load_average"]
    lines.append(f"| (CPU time; {result['date']}, commit `{result['commit']}`, load average "
                 f"{low:.1f} to {high:.1f} on {result['cores']} cores) | | |")  # fmt: skip
    return "\n".join(lines) + "\n"


SPECIAL: dict[str, Callable[[Path], str]] = {"readme-text": readme_text}
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
