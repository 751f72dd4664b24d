"""What every analysis's figures share: matplotlib (the ``plot`` extra, imported on first use)
for the PNG figures of ``report.md``, Plotly (the ``html`` extra) for the interactive figures of
``report.html``, colours, model labels, saving, and linking a figure into the report.

Figures are built with :class:`matplotlib.figure.Figure` directly: no pyplot state, no GUI backend.
Interactive figures are Plotly figures serialised to JSON-able dicts; the page draws them with the
Plotly bundle it inlines (:mod:`layerdiv.analyze.html`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

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


def figure_link(
    ctx: ReportContext,
    file: str,
    caption: str,
    draw: Callable[[Path], object],
    interactive: Callable[[], Any] | None = None,
) -> str:
    """Draw a figure and return its Markdown link (``figures/<file>``).

    For the Markdown report (and for an HTML report when the figure has no ``interactive``
    version, which then shows the PNG inline) the PNG is drawn with ``draw(ctx.figures / file)``;
    without matplotlib the link is "" and one note says how to get figures. For the HTML report,
    ``interactive()`` gives the Plotly figure that stands for the PNG, kept in
    ``ctx.interactive[file]``."""
    html = "html" in ctx.formats and interactive is not None
    if html and interactive is not None:
        ctx.interactive[file] = as_json(interactive())
    if "md" in ctx.formats or not html:
        if not available():
            if NO_MATPLOTLIB not in ctx.notes:
                ctx.notes.append(NO_MATPLOTLIB)
            return f"![{caption}](figures/{file})" if html else ""
        draw(ctx.figures / file)
    return f"![{caption}](figures/{file})"


# --- interactive figures (Plotly) ----------------------------------------------------------

PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}
"""Plotly's options for every figure of the HTML report."""


def subplots(**kwargs: Any) -> Any:
    """A Plotly figure with a grid of panels (``plotly.subplots.make_subplots`` arguments)."""
    from plotly.subplots import make_subplots

    return make_subplots(**kwargs)


def as_json(fig: Any) -> dict[str, Any]:
    """A Plotly figure as the dict ``Plotly.newPlot`` takes (``data`` and ``layout``)."""
    return cast(dict[str, Any], fig.to_plotly_json())


def css_color(color: Any) -> str:
    """A matplotlib colour (RGBA tuple in 0..1, or a CSS string) as a CSS colour."""
    if isinstance(color, str):
        return color
    r, g, b = (round(255 * c) for c in color[:3])
    return f"rgb({r},{g},{b})"


def depth_switch(fig: Any, absolute: list[Any], relative: list[Any], label: str) -> None:
    """Buttons above ``fig`` that switch the x values of its traces between ``absolute`` (one
    array per trace, e.g. components in the prefix j) and ``relative`` (e.g. j / L), so that
    models of different depth overlay; ``label`` names the absolute axis."""
    layout = fig.layout.to_plotly_json()
    axes = [k for k, v in layout.items() if k.startswith("xaxis") and v.get("title")]

    def titles(text: str) -> dict[str, str]:
        return {f"{axis}.title.text": text for axis in axes}

    fig.update_layout(
        updatemenus=[
            {
                "type": "buttons",
                "direction": "right",
                "x": 0,
                "xanchor": "left",
                "y": 1.12,
                "yanchor": "bottom",
                "showactive": True,
                "buttons": [
                    {"label": "absolute depth", "method": "update",
                     "args": [{"x": absolute}, titles(label)]},
                    {"label": "relative depth", "method": "update",
                     "args": [{"x": relative}, titles("relative depth j / L")]},
                ],
            }
        ]
    )  # fmt: skip
