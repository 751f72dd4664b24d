"""What every analysis's figures share: matplotlib (the ``plot`` extra, imported on first use),
colours, model labels, saving, and linking a figure into the report.

Figures are built with :class:`matplotlib.figure.Figure` directly: no pyplot state, no GUI backend.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerdiv.analyze.registry import ReportContext

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 120
KIND_COLORS = {"embed": "#7f7f7f", "attn": "#1f77b4", "mlp": "#ff7f0e", "bias": "#2ca02c"}
"""Colour of each component kind, in every figure."""
NO_MATPLOTLIB = (
    "Figures were not drawn: matplotlib is not installed. Install the plot extra "
    "(`pip install 'layerdiv[plot]'`) and run `layerdiv report` again."
)


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


def new_figure(**kwargs: Any) -> Figure:
    """A matplotlib :class:`Figure` (keyword arguments as for ``Figure``)."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


def colors(n: int) -> list[tuple[float, float, float, float]]:
    """``n`` distinguishable line colours."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(max(n, 1))]


def short_names(names: dict[str, str]) -> dict[str, str]:
    """Model ids without their organisation (``org/name`` -> ``name``) when that stays unique."""
    short = {slug: model.rstrip("/").split("/")[-1] for slug, model in names.items()}
    return short if len(set(short.values())) == len(short) else dict(names)


def figure_link(ctx: ReportContext, file: str, caption: str, draw: Callable[[Path], object]) -> str:
    """Draw a figure with ``draw(ctx.figures / file)`` and return its Markdown link; without
    matplotlib, return "" and add one note saying how to get figures."""
    if not available():
        if NO_MATPLOTLIB not in ctx.notes:
            ctx.notes.append(NO_MATPLOTLIB)
        return ""
    draw(ctx.figures / file)
    return f"![{caption}](figures/{file})"
