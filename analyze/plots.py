"""What every analysis's figures share: matplotlib (the ``plot`` extra, imported on first use)
for the PNG figures of ``report.md``, Plotly (the ``html`` extra) for the interactive figures of
``report.html``, colours, model labels, saving, and linking a figure into the report.

Figures are built with :class:`matplotlib.figure.Figure` directly: no pyplot state, no GUI backend.
Interactive figures are Plotly figures serialised to JSON-able dicts; the page draws them with the
Plotly bundle it inlines (:mod:`layerdiv.analyze.html`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import polars as pl

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


def text_vs_last_token(
    panels: Sequence[tuple[str, str, str]],
    text: pl.DataFrame,
    last: pl.DataFrame | None,
    path: Path,
    names: dict[str, str],
    xlabel: str,
    title: str,
) -> Path:
    """One panel per (column of ``text``, column of ``last``, label) of ``panels``: per model of
    ``text``, its running-text curve (solid) and, where ``last`` has rows of the model, its curve
    at the last prompt token of the choice tasks (dashed), both against ``relative_depth``."""
    models = sorted(text["model"].unique())
    color = dict(zip(models, colors(len(models)), strict=False))
    fig = new_figure(figsize=(13, 4), layout="constrained")
    for ax, (solid, dashed, label) in zip(fig.subplots(1, len(panels)), panels, strict=True):
        for model in models:
            sub = text.filter(pl.col("model") == model)
            other = None if last is None else last.filter(pl.col("model") == model)
            name = names.get(model, model)
            ax.plot(sub["relative_depth"], sub[solid], marker="o", markersize=2.5,
                    color=color[model], label=f"{name} text")  # fmt: skip
            if other is not None and other.height:
                ax.plot(other["relative_depth"], other[dashed], "--", color=color[model],
                        label=f"{name} last prompt token")  # fmt: skip
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    return save(fig, path)


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
                "x": 1,
                "xanchor": "right",
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


def overlay(
    title: str,
    panels: list[dict[str, Any]],
    names: dict[str, str],
    height: int = 460,
) -> Any:
    """A grid of panels (two per row) overlaying every model's mean-over-tasks curve, one colour
    per model (a legend entry toggles it in every panel).

    Each panel is a dict: ``title``, ``frame`` (rows with ``model``, the ``x`` and ``y``
    columns), ``x``, ``y``, ``xtitle``, ``ytitle``; optionally ``split`` (a column whose values
    get dash styles, e.g. ``kind``), ``label`` (a column shown in the hover, e.g. the component
    name), ``log`` (log-log axes) and ``fits`` (model -> (x, y) of a dashed fitted line)."""
    models = sorted({m for p in panels for m in p["frame"]["model"].unique()})
    color = dict(zip(models, map(css_color, colors(len(models))), strict=False))
    rows = -(-len(panels) // 2)
    fig = subplots(rows=rows, cols=min(2, len(panels)), subplot_titles=[p["title"] for p in panels],
                   vertical_spacing=0.35 / rows, horizontal_spacing=0.1)  # fmt: skip
    dashes = ["solid", "dash", "dot", "dashdot"]
    shown: set[str] = set()
    for i, panel in enumerate(panels):
        at = {"row": i // 2 + 1, "col": i % 2 + 1}
        for model in models:
            sub = panel["frame"].filter(panel["frame"]["model"] == model)
            split = panel.get("split")
            groups = sub.partition_by(split, maintain_order=True) if split else [sub]
            label = names.get(model, model)
            for d, group in enumerate(groups):
                tag = f" {group[split][0]}" if split else ""
                hover = "%{customdata}<br>" if panel.get("label") else ""
                fig.add_scatter(
                    x=group[panel["x"]].to_list(), y=group[panel["y"]].to_list(),
                    customdata=group[panel["label"]].to_list() if panel.get("label") else None,
                    mode="lines+markers", marker={"size": 4}, name=label, legendgroup=model,
                    showlegend=model not in shown,
                    line={"color": color[model], "dash": dashes[d % len(dashes)], "width": 1.3},
                    hovertemplate=f"{label}{tag}, mean over tasks<br>{hover}{panel['xtitle']} "
                    f"%{{x:.3g}}<br>{panel['ytitle']} %{{y:.4g}}<extra></extra>",
                    **at,
                )  # fmt: skip
                shown.add(model)
            fit = panel.get("fits", {}).get(model)
            if fit is not None:
                fig.add_scatter(x=list(fit[0]), y=list(fit[1]), mode="lines", name=label,
                                legendgroup=model, showlegend=False,
                                line={"color": color[model], "dash": "dash", "width": 1},
                                hovertemplate=f"{label}: fit {fit[2]}<extra></extra>",
                                **at)  # fmt: skip
        kind = "log" if panel.get("log") else "linear"
        fig.update_xaxes(title_text=panel["xtitle"], type=kind, **at)
        fig.update_yaxes(title_text=panel["ytitle"], type=kind, **at)
    fig.update_layout(title=title, height=height * rows)
    return fig
