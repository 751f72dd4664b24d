"""MkDocs hook: what each extraction option costs, generated from ``layerdiv.extract.cost`` at
build time (forward passes counted from the demo model's shape, seconds at the benchmarks'
measured FLOP rate).

A page line ``<!-- layerdiv:cost-table -->`` becomes the table.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from layerdiv.extract import cost

MARKER = "<!-- layerdiv:cost-table -->"


def cost_table() -> str:
    """The cost table of SmolLM2-135M (``cost.SMOLLM2``) at ``cost.DOC_TOKENS`` tokens."""
    shape = cost.Shape.from_config(SimpleNamespace(**cost.SMOLLM2))
    rows = cost.cost_rows(shape, cost.DOC_TOKENS)
    head = [
        "| task kind | tokens per sequence | option | forward passes | CPU s per 1,000 tokens "
        "| H100 ms per 1,000 tokens (lower bound) |",
        "| --- | --: | --- | --: | --: | --: |",
    ]
    return "\n".join([*head, *("| " + " | ".join(r) + " |" for r in rows)])


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace the marker line with the generated table."""
    return markdown.replace(MARKER, cost_table()) if MARKER in markdown else markdown
