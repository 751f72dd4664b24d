"""What every analysis's figures share: the figure spec and its two renderers.

A figure is declared once, as data (:class:`Figure`: panels of :class:`Series` and
:class:`Heatmap`, axes, labels, scales, reference lines, notes), and drawn by
:func:`to_matplotlib` (a PNG for ``report.md``; the ``plot`` extra, imported on first use) and by
:func:`to_plotly` (an interactive figure for ``report.html``; the ``html`` extra). Analyses build
specs and link them with :func:`figure_link`; nothing else draws.

Matplotlib figures are built with :class:`matplotlib.figure.Figure` directly: no pyplot state,
no GUI backend. Plotly figures are serialised to the dicts ``Plotly.newPlot`` takes; the page
draws them with the Plotly bundle it inlines (:mod:`layerdiv.analyze.html`).
"""

from __future__ import annotations

import html
import math
import multiprocessing
import os
import textwrap
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from layerdiv.analyze.registry import ReportContext

if TYPE_CHECKING:
    import polars as pl

DPI = 120
KIND_COLORS = {"embed": "#7f7f7f", "attn": "#1f77b4", "mlp": "#ff7f0e", "bias": "#2ca02c"}
"""Colour of each component kind, in every figure."""
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
"""Line colours (matplotlib's ``tab10``), one per model, in order."""
NO_MATPLOTLIB = (
    "Figures were not drawn: matplotlib is not installed. Install the plot extra "
    "(`pip install 'layerdiv[plot]'`) and run `layerdiv report` again."
)
LEGEND_FONT = 9
"""Legend font size (points) of the PNG figures."""

Dash = Literal["solid", "dash", "dot", "dashdot"]
Scale = Literal["linear", "log", "log2"]


@dataclass
class Series:
    """One line, set of markers or set of bars of a panel."""

    name: str
    """Its legend entry (series of one name share one entry and toggle together)."""
    x: Sequence[Any]
    y: Sequence[Any]
    color: str | None = None
    dash: Dash = "solid"
    marker: str | None = "o"
    """``o`` (circle), ``s`` (square), ``^`` (triangle), ``x`` (a cross) or None (no
    markers)."""
    line: bool = True
    """False: markers only."""
    bar: bool = False
    """Bars (grouped or stacked as the panel says) instead of a line."""
    legend: bool = True
    """False: no legend entry of its own (e.g. a fitted line drawn beside its data)."""
    hover: Sequence[str] | None = None
    """Per point, a line shown on hover in the HTML report (e.g. the component's name)."""
    x_relative: Sequence[float] | None = None
    """The x values on the relative-depth axis, for :attr:`Figure.depth_switch`."""
    width: float = 1.3
    interval: tuple[Sequence[float | None], Sequence[float | None]] | None = None
    """Per point, the (low, high) ends of an interval drawn as an error bar around y (None or
    NaN: the point has no interval, and no bar)."""


@dataclass
class Heatmap:
    """A grid of values: ``z[i][k]`` at row ``y[i]``, column ``x[k]`` (None: no value)."""

    z: Sequence[Sequence[float | None]]
    x: Sequence[Any]
    y: Sequence[Any]
    colorbar: str
    cmap: Literal["RdBu_r", "viridis"] = "viridis"
    zmin: float | None = None
    zmax: float | None = None
    zmid: float | None = None
    """Centre of a diverging scale."""
    log: bool = False
    """Colour by log10 of the value (values <= 0 are not drawn)."""
    text: Sequence[Sequence[str]] | None = None
    """Printed in each cell."""
    hover: Sequence[Sequence[str]] | None = None
    origin: Literal["upper", "lower"] = "upper"
    """``upper``: the first row on top."""


@dataclass
class RefLine:
    """A horizontal (``axis="y"``) or vertical (``axis="x"``) reference line."""

    value: float
    axis: Literal["x", "y"] = "y"
    label: str = ""
    color: str = "black"
    dash: Dash = "solid"


@dataclass
class Panel:
    """One set of axes."""

    title: str
    series: list[Series] = field(default_factory=list)
    heatmap: Heatmap | None = None
    xlabel: str = ""
    ylabel: str = ""
    xscale: Scale = "linear"
    yscale: Scale = "linear"
    xrange: tuple[float, float] | None = None
    yrange: tuple[float, float] | None = None
    lines: list[RefLine] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Lines written inside the panel (e.g. a fit's R²)."""
    bars: Literal["group", "stack"] = "group"
    horizontal: bool = False
    """Horizontal bars (categories on the y axis, top to bottom)."""


@dataclass
class Figure:
    """A figure: a title, a grid of panels, and one legend of every named series."""

    title: str
    panels: list[Panel]
    cols: int = 2
    panel_size: tuple[float, float] = (5.5, 3.6)
    """Width and height of one panel (inches in the PNG; 100 px per inch in the HTML)."""
    depth_switch: str | None = None
    """When set (the absolute axis's title), buttons in the HTML report switch every series's x
    between its absolute values and :attr:`Series.x_relative`."""
    caption: str = ""
    """A second title line (e.g. what the colour scale is)."""

    def caption_lines(self) -> list[str]:
        """The caption wrapped to the figure's width (about 11 characters per inch of it)."""
        width = self.panel_size[0] * min(self.cols, len(self.panels))
        return textwrap.wrap(self.caption, max(40, int(11 * width)))

    def legend_names(self) -> list[str]:
        """The names of the legend, once each, in order of first appearance."""
        names = [s.name for p in self.panels for s in p.series if s.legend]
        return list(dict.fromkeys(names))


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def drawable(spec: Figure) -> Figure:
    """``spec`` without its series that have no value to draw (every value missing, e.g. a
    quantity a store lacks): they would stand in the legend with nothing behind them. Both
    renderers draw this."""

    def kept(panel: Panel) -> list[Series]:
        def values(s: Series) -> Sequence[Any]:
            return s.x if s.bar and panel.horizontal else s.y

        return [s for s in panel.series if not all(_missing(v) for v in values(s))]

    return replace(spec, panels=[replace(p, series=kept(p)) for p in spec.panels])


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


def colors(n: int) -> list[str]:
    """``n`` line colours (CSS hex), cycling :data:`PALETTE`."""
    return [PALETTE[i % len(PALETTE)] for i in range(max(n, 1))]


def model_colors(models: Sequence[str]) -> dict[str, str]:
    """One colour per model, in the given order."""
    return dict(zip(models, colors(len(models)), strict=False))


def short_names(names: dict[str, str]) -> dict[str, str]:
    """Model ids without their organisation (``org/name`` -> ``name``) when that stays unique."""
    short = {slug: model.rstrip("/").split("/")[-1] for slug, model in names.items()}
    return short if len(set(short.values())) == len(short) else dict(names)


def grid(
    cells: dict[tuple[Any, Any], float], rows: Sequence[Any], columns: Sequence[Any]
) -> list[list[float | None]]:
    """``cells`` keyed by (row, column) as a dense grid (None where absent)."""
    return [[cells.get((r, c)) for c in columns] for r in rows]


def figure_link(ctx: ReportContext, file: str, caption: str, spec: Callable[[], Figure]) -> str:
    """Build the figure ``spec()`` once and return its Markdown link (``figures/<file>``).

    For the Markdown report the PNG is drawn into ``ctx.figures / file`` (without matplotlib the
    link is left out and one note says how to get figures); for the HTML report the Plotly
    figure is kept in ``ctx.interactive[file]`` and stands for the link there."""
    figure = spec()
    html = "html" in ctx.formats
    if html:
        ctx.interactive[file] = to_plotly(figure)
    if "md" in ctx.formats:
        if not available():
            if NO_MATPLOTLIB not in ctx.notes:
                ctx.notes.append(NO_MATPLOTLIB)
            return f"![{caption}](figures/{file})" if html else ""
        if ctx.deferred is None:
            to_matplotlib(figure, ctx.figures / file)
        else:
            ctx.deferred.append((figure, ctx.figures / file))
    return f"![{caption}](figures/{file})"


_PENDING: Sequence[tuple[Figure, Path]] = ()
"""The figures :func:`draw_all` hands to its forked workers (read there by index: a spec is
never pickled)."""


def draw_all(drawings: Sequence[tuple[Figure, Path]]) -> list[str | None]:
    """Draw each (spec, file) of ``drawings`` as a PNG (:func:`to_matplotlib`), several at once
    in forked processes where the platform forks and has more than one CPU; per drawing, None
    or the error that stopped it (one line)."""
    global _PENDING
    workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1,
                  len(drawings))  # fmt: skip
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [_draw(spec, path) for spec, path in drawings]
    _PENDING = drawings
    try:
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            return list(pool.map(_draw_pending, range(len(drawings))))
    except BrokenProcessPool:  # a worker died (out of memory, killed): draw them here
        return [_draw(spec, path) for spec, path in drawings]
    finally:
        _PENDING = ()


def _draw_pending(i: int) -> str | None:
    return _draw(*_PENDING[i])


def _draw(spec: Figure, path: Path) -> str | None:
    try:
        to_matplotlib(spec, path)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


# --- matplotlib ------------------------------------------------------------------------------

_MPL_DASH = {"solid": "-", "dash": "--", "dot": ":", "dashdot": "-."}
AS_TEXT = {"parse_math": False}
"""Tick labels drawn as the text they are: a category or token such as ``$$`` or ``$x$`` is not
read as mathtext (which would fail or draw an italic x)."""


def _categories(series: Sequence[Series], horizontal: bool) -> list[Any]:
    """The category values of bar series, in order of first appearance."""
    values = [v for s in series for v in (s.y if horizontal else s.x)]
    return list(dict.fromkeys(values))


def _mpl_bars(ax: Any, panel: Panel) -> dict[Any, Any]:
    """Draw the panel's bar series; return where each category stands on the axis."""
    bars = [s for s in panel.series if s.bar]
    if not bars:
        return {}
    cats = _categories(bars, panel.horizontal)
    numeric = all(isinstance(c, int | float) for c in cats)
    where = {c: (c if numeric else i) for i, c in enumerate(cats)}
    base = {c: 0.0 for c in cats}
    width = 0.8 / (1 if panel.bars == "stack" else len(bars))
    for i, s in enumerate(bars):
        cat = list(s.y if panel.horizontal else s.x)
        value = [
            float("nan") if v is None else float(v) for v in (s.x if panel.horizontal else s.y)
        ]
        if panel.bars == "stack":
            pos = [where[c] for c in cat]
            start = [base[c] for c in cat]
            for c, v in zip(cat, value, strict=True):
                base[c] += 0 if math.isnan(v) else v
        else:
            pos = [where[c] + (i - (len(bars) - 1) / 2) * width for c in cat]
            start = [0.0] * len(cat)
        label = s.name if s.legend else None
        if panel.horizontal:
            ax.barh(pos, value, width, left=start, color=s.color, label=label)
        else:
            ax.bar(pos, value, width, bottom=start, color=s.color, label=label)
    if not numeric:
        ticks = ([where[c] for c in cats], [str(c) for c in cats])
        (ax.set_yticks if panel.horizontal else ax.set_xticks)(*ticks, **AS_TEXT)
    if panel.horizontal:
        ax.invert_yaxis()
    return where


def _mpl_heatmap(fig: Any, ax: Any, heat: Heatmap) -> None:
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize, TwoSlopeNorm

    z = np.array([[np.nan if v is None else v for v in row] for row in heat.z], dtype=float)
    if heat.log:
        z[z <= 0] = np.nan
        norm: Any = LogNorm(vmin=heat.zmin, vmax=heat.zmax)
    elif heat.zmid is not None:
        norm = TwoSlopeNorm(vcenter=heat.zmid, vmin=heat.zmin, vmax=heat.zmax)
    else:
        norm = Normalize(vmin=heat.zmin, vmax=heat.zmax)
    image = ax.imshow(z, cmap=heat.cmap, norm=norm, aspect="auto", origin=heat.origin)
    bar = fig.colorbar(image, ax=ax, shrink=0.9)
    bar.set_label(heat.colorbar, fontsize=8)
    if heat.log:
        _plain_ticks(bar.ax.yaxis)
    for axis, labels, setter in ((0, heat.x, ax.set_xticks), (1, heat.y, ax.set_yticks)):
        step = max(1, len(labels) // 12)
        setter(
            range(0, len(labels), step),
            [str(v) for v in labels[::step]],
            fontsize=8,
            **AS_TEXT,
            **(
                {"rotation": 45, "ha": "right"}
                if axis == 0 and any(len(str(v)) > 3 for v in labels[::step])
                else {}
            ),
        )
    if heat.text is not None:
        for (i, k), value in np.ndenumerate(z):
            if not np.isnan(value):
                ax.text(
                    k,
                    i,
                    heat.text[i][k],
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if abs(norm(value) - 0.5) > 0.3 else "black",
                )


def _gap(high: float | None, low: float | None) -> float | None:
    """high - low, None where an end is unknown (None or NaN: no error bar there)."""
    if high is None or low is None or not (math.isfinite(high) and math.isfinite(low)):
        return None
    return high - low


def _mpl_panel(fig: Any, ax: Any, panel: Panel) -> None:
    if panel.heatmap is not None:
        _mpl_heatmap(fig, ax, panel.heatmap)
    where = _mpl_bars(ax, panel)
    for s in panel.series:
        if s.bar:
            continue
        style = (_MPL_DASH[s.dash] if s.line else "") + (s.marker or "")
        x = [where.get(v, v) for v in s.x]  # points over categorical bars stand on their bar
        y = [float("nan") if v is None else v for v in s.y]
        if s.interval is not None:  # bars only where the interval is known
            up = [_gap(hi, v) for v, hi in zip(y, s.interval[1], strict=True)]
            down = [_gap(v, lo) for v, lo in zip(y, s.interval[0], strict=True)]
            known = [i for i, (u, d) in enumerate(zip(up, down, strict=True)) if None not in (u, d)]
            if known:
                ax.errorbar(
                    [x[i] for i in known],
                    [y[i] for i in known],
                    yerr=[[down[i] for i in known], [up[i] for i in known]],
                    fmt="none",
                    color=s.color,
                    capsize=3,
                    linewidth=0.9,
                )
        ax.plot(
            x,
            y,
            style or "-",
            color=s.color,
            linewidth=s.width,
            markersize=3,
            label=s.name if s.legend else None,
        )
    for line in panel.lines:
        draw = ax.axhline if line.axis == "y" else ax.axvline
        draw(
            line.value,
            color=line.color,
            linestyle=_MPL_DASH[line.dash],
            linewidth=0.9,
            label=line.label or None,
        )
    for axis, scale in (("x", panel.xscale), ("y", panel.yscale)):
        values = [v for s in panel.series for v in (s.x if axis == "x" else s.y)]
        if scale == "linear" or not _positive(values):
            continue  # nothing to place on a log axis
        base = 2 if scale == "log2" else 10
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=base)
        _plain_ticks(ax.xaxis if axis == "x" else ax.yaxis, base)
    if panel.xrange:
        ax.set_xlim(*panel.xrange)
    if panel.yrange:
        ax.set_ylim(*panel.yrange)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(panel.xlabel, fontsize=9)
    ax.set_ylabel(panel.ylabel, fontsize=9)
    if panel.heatmap is None:
        ax.grid(alpha=0.3, which="both" if "log" in panel.xscale + panel.yscale else "major")
    if panel.notes:  # under the title, where they hide no data
        lines = textwrap.wrap("; ".join(panel.notes), 70)
        ax.set_title(panel.title + "\n" + "\n".join(lines), fontsize=9)


def _positive(values: Sequence[Any]) -> list[float]:
    return [v for v in values if isinstance(v, int | float) and 0 < v < math.inf]


def _plain_ticks(axis: Any, base: float = 10) -> None:
    """Plain numbers (60 and 0.2, not 6x10^1 and 2e-01) on a log ``axis``, its minor ticks
    labelled where the axis spans few decades (matplotlib's own choice of which)."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
            return f"{x:g}"

    axis.set_major_formatter(Plain(base=base))
    axis.set_minor_formatter(Plain(base=base, labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def to_matplotlib(spec: Figure, path: Path) -> Path:
    """Draw ``spec`` as a PNG at ``path``: its panels in a grid of ``spec.cols`` columns, and
    below them one legend with an entry per name of :meth:`Figure.legend_names` (and per
    labelled reference line)."""
    from matplotlib.figure import Figure as MplFigure

    spec = drawable(spec)
    n = len(spec.panels)
    cols = min(spec.cols, n)
    rows = -(-n // cols)
    width, height = spec.panel_size
    fig = MplFigure(figsize=(width * cols, height * rows + 1.2), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, panel in zip(axes, spec.panels, strict=False):
        _mpl_panel(fig, ax, panel)
    for ax in axes[n:]:
        ax.set_visible(False)
    found: dict[str, Any] = {}
    for ax in axes[:n]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            found.setdefault(label, handle)
    if found:
        ncols = max(1, min(len(found), int(width * cols // 2.2)))
        fig.legend(
            list(found.values()),
            list(found),
            loc="outside lower center",
            ncols=ncols,
            fontsize=LEGEND_FONT,
            frameon=False,
        )
    fig.suptitle("\n".join([spec.title, *spec.caption_lines()]), fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


# --- Plotly ----------------------------------------------------------------------------------

PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}
HTML_WIDTH = 1000
"""About how wide (px) a figure of the HTML report is drawn: what titles and the legend are
wrapped to."""
"""Plotly's options for every figure of the HTML report."""

_PLOTLY_CMAP = {"RdBu_r": ("RdBu", True), "viridis": ("Viridis", False)}
_PLOTLY_SYMBOL = {"o": "circle", "s": "square", "^": "triangle-up", "x": "x"}


def _fmt(value: Any) -> str:
    return "%{" + value + (":.4g}" if value in "xy" else "}")


def _plotly_text(value: Any) -> Any:
    """A category or tick label as Plotly draws it literally: a string HTML-escaped (Plotly reads
    ``<a href>``, ``<span style>``, ``<br>``, ``<b>`` in labels and shows ``&lt;`` as ``<``);
    a number unchanged."""
    return html.escape(value, quote=False) if isinstance(value, str) else value


def _plotly_series(fig: Any, s: Series, panel: Panel, at: dict[str, int], shown: set[str]) -> None:
    first = s.legend and s.name not in shown
    shown.add(s.name) if first else None
    hover = "%{customdata}<br>" if s.hover is not None else ""
    what = (panel.ylabel, panel.xlabel) if panel.horizontal else (panel.xlabel, panel.ylabel)
    common = {
        "name": s.name,
        "legendgroup": s.name,
        "showlegend": first,
        "customdata": list(s.hover) if s.hover is not None else None,
        "hovertemplate": f"{s.name}<br>{hover}{what[0] or 'x'} %{{x}}<br>"
        f"{what[1] or 'y'} %{{y:.4g}}<extra></extra>"
        if not panel.horizontal
        else f"{s.name}<br>{hover}%{{y}}: %{{x:.4g}} {panel.xlabel}<extra></extra>",
    }
    if s.bar:
        fig.add_bar(
            x=[_plotly_text(v) for v in s.x],
            y=[_plotly_text(v) for v in s.y],
            marker_color=s.color,
            orientation="h" if panel.horizontal else "v",
            **common,
            **at,
        )
        return
    mode = ("lines" if s.line else "") + ("+markers" if s.marker else "")
    error = (
        {
            "type": "data",
            "symmetric": False,
            "array": [_gap(hi, v) for v, hi in zip(s.y, s.interval[1], strict=True)],
            "arrayminus": [_gap(v, lo) for v, lo in zip(s.y, s.interval[0], strict=True)],
        }
        if s.interval is not None
        else None
    )
    fig.add_scatter(
        x=[_plotly_text(v) for v in s.x],
        y=list(s.y),
        error_y=error,
        mode=mode.strip("+"),
        marker={"size": 5, "symbol": _PLOTLY_SYMBOL.get(s.marker or "o", "circle")},
        line={"color": s.color, "dash": s.dash, "width": s.width},
        **common,
        **at,
    )


def _colorbar(
    fig: Any, index: int, title: str, log: bool, z: list[list[float | None]], whole: bool = False
) -> dict:
    """A colour bar beside panel ``index`` (1-based), or at the right of the figure (``whole``),
    its ticks in the data's units when the colours are log10 of them."""
    suffix = "" if index == 1 else str(index)
    xd = fig.layout[f"xaxis{suffix}"].domain
    yd = (0.0, 1.0) if whole else fig.layout[f"yaxis{suffix}"].domain
    bar: dict[str, Any] = {
        "title": {"text": title, "side": "right"},
        "x": 1.01 if whole else xd[1] + 0.005,
        "y": (yd[0] + yd[1]) / 2,
        "len": yd[1] - yd[0],
        "thickness": 12,
    }
    if log:
        values = [v for row in z for v in row if v is not None]
        if values:
            lo, hi = math.floor(min(values)), math.ceil(max(values))
            ticks = list(range(lo, hi + 1))
            bar.update(tickvals=ticks, ticktext=[f"{10.0**t:g}" for t in ticks])
    return bar


def _row_labels(panel: Panel) -> list[str]:
    """The text labels of a panel's y axis: a heatmap's rows, horizontal bars' categories."""
    if panel.heatmap is not None:
        return [str(v) for v in panel.heatmap.y]
    if not panel.horizontal:
        return []
    return [str(c) for c in _categories([s for s in panel.series if s.bar], True)]


def _shared_scale(spec: Figure) -> bool:
    """Whether the figure's heatmaps (two or more) share one fixed colour scale: then one colour
    bar, at the right of the figure, stands for all of them."""
    heats = [p.heatmap for p in spec.panels if p.heatmap is not None]
    scales = {(h.colorbar, h.cmap, h.zmin, h.zmax, h.zmid, h.log) for h in heats}
    return len(heats) > 1 and len(scales) == 1 and None not in (heats[0].zmin, heats[0].zmax)


def _plotly_heatmap(
    fig: Any, heat: Heatmap, index: int, at: dict[str, int], bar: bool | Literal["figure"]
) -> None:
    """Panel ``index``'s heatmap with its colour bar beside it (``bar`` True), one for the whole
    figure at its right (``"figure"``) or none (False)."""

    def value(v: float | None) -> float | None:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return None
        if heat.log:
            return math.log10(v) if v > 0 else None
        return float(v)

    z = [[value(v) for v in row] for row in heat.z]
    scale, reverse = _PLOTLY_CMAP[heat.cmap]
    log = (lambda v: None if v is None else math.log10(v)) if heat.log else (lambda v: v)
    fig.add_heatmap(
        z=z,
        x=[_plotly_text(str(v)) for v in heat.x],
        y=[_plotly_text(str(v)) for v in heat.y],
        colorscale=scale,
        reversescale=reverse,
        zmin=log(heat.zmin),
        zmax=log(heat.zmax),
        zmid=heat.zmid,
        text=[list(r) for r in heat.text] if heat.text else None,
        texttemplate="%{text}" if heat.text else None,
        customdata=[list(r) for r in heat.hover] if heat.hover else None,
        hovertemplate=("%{customdata}" if heat.hover else "%{y} · %{x}: %{z:.3g}")
        + "<extra></extra>",
        colorbar=_colorbar(fig, index, heat.colorbar, heat.log, z, bar == "figure"),
        showscale=bool(bar),
        **at,
    )
    if heat.origin == "upper":
        fig.update_yaxes(autorange="reversed", **at)


def to_plotly(spec: Figure) -> dict[str, Any]:
    """``spec`` as the dict ``Plotly.newPlot`` takes (``data`` and ``layout``): the same panels,
    series, scales, reference lines and notes as :func:`to_matplotlib`, one legend entry per
    name (a click toggles the name in every panel), hover with each point's values."""
    from plotly.subplots import make_subplots

    spec = drawable(spec)
    n = len(spec.panels)
    cols = min(spec.cols, n)
    rows = -(-n // cols)
    titles = [textwrap.wrap(p.title, HTML_WIDTH // (9 * cols)) for p in spec.panels]
    shared = _shared_scale(spec)
    # room for a colour bar beside each heatmap, unless one stands for all
    heat = not shared and any(p.heatmap is not None for p in spec.panels)
    fig = make_subplots(
        rows=rows,
        cols=cols,
        subplot_titles=["<br>".join(lines) for lines in titles],
        horizontal_spacing=(0.16 if heat else 0.1) if cols > 1 else 0.0,
        vertical_spacing=min(0.5 / rows, 0.18) if rows > 1 else 0.0,
    )
    shown: set[str] = set()
    absolute: list[Any] = []
    relative: list[Any] = []
    for i, panel in enumerate(spec.panels):
        at = {"row": i // cols + 1, "col": i % cols + 1}
        if panel.heatmap is not None:
            bar: bool | Literal["figure"] = ("figure" if i == 0 else False) if shared else True
            _plotly_heatmap(fig, panel.heatmap, i + 1, at, bar)
            absolute.append(None)
            relative.append(None)
        labels = _row_labels(panel)
        if i % cols and labels and labels == _row_labels(spec.panels[i - i % cols]):
            fig.update_yaxes(showticklabels=False, **at)  # the row's first panel names them
        for s in panel.series:
            _plotly_series(fig, s, panel, at, shown)
            absolute.append(list(s.x))
            relative.append(list(s.x_relative) if s.x_relative is not None else list(s.x))
        for line in panel.lines:
            add = fig.add_hline if line.axis == "y" else fig.add_vline
            # an annotation on a log axis is placed at log10 of the value (the line is not)
            log = (panel.yscale if line.axis == "y" else panel.xscale) != "linear"
            where = math.log10(line.value) if log and line.value > 0 else line.value
            add(
                line.value,
                line={"color": line.color, "dash": line.dash, "width": 1},
                **(
                    {
                        "annotation_text": line.label,
                        "annotation_font_size": 10,
                        "annotation": {line.axis: where},
                    }
                    if line.label
                    else {}
                ),
                **at,
            )
        axes: tuple[tuple[Any, Literal["x", "y"], str, Any, Scale], ...] = (
            (fig.update_xaxes, "x", panel.xlabel, panel.xrange, panel.xscale),
            (fig.update_yaxes, "y", panel.ylabel, panel.yrange, panel.yscale),
        )
        for update, axis, label, bounds, scale in axes:
            kind = axis_type(panel, axis)
            update(
                title_text=label or None,
                type=kind,
                range=_range(bounds, scale),
                dtick="D2" if kind == "log" else None,  # labels at 1, 2 and 5 of each decade
                **at,
            )
        if panel.horizontal:
            fig.update_yaxes(autorange="reversed", **at)
        suffix = "" if i == 0 else str(i + 1)
        for k, note in enumerate(panel.notes):
            fig.add_annotation(
                text=note,
                xref=f"x{suffix} domain",
                yref=f"y{suffix} domain",
                x=0.01,
                y=0.99 - 0.09 * k,
                xanchor="left",
                yanchor="top",
                showarrow=False,
                font={"size": 11},
                bgcolor="rgba(255,255,255,0.8)",
            )
    height = spec.panel_size[1]
    caption = spec.caption_lines()
    title = "<br>".join([spec.title, *(f"<sub>{line}</sub>" for line in caption)])
    top = 80 + 18 * len(caption) + (30 if caption or spec.depth_switch else 0)
    top += 20 * max(0, *(len(t) - 1 for t in titles[:cols]))  # the first row's wrapped titles
    # the legend below the panels, as in the PNG: the panels keep the page's width
    legend_rows = -(-sum(60 + 7 * len(n) for n in spec.legend_names()) // HTML_WIDTH)
    bottom = 80 + 24 * legend_rows
    fig.update_layout(
        title={"text": title, "font": {"size": 15}},
        height=round(100 * height * rows + 120 + 40 * rows + top - 80 + bottom - 80),
        barmode=_barmode(spec),
        margin={"t": top, "b": bottom},
        legend={
            "font": {"size": 12},
            "orientation": "h",
            "yref": "container",
            "y": 0,
            "yanchor": "bottom",
            "x": 0.5,
            "xanchor": "center",
        },
        hovermode="closest",
        showlegend=bool(spec.legend_names()),
    )
    if spec.depth_switch:
        _depth_switch(fig, absolute, relative, spec.depth_switch)
    return cast(dict[str, Any], fig.to_plotly_json())


def axis_type(panel: Panel, axis: Literal["x", "y"]) -> str:
    """The Plotly type of a panel's ``axis``: ``category`` for a heatmap's (labels such as layer
    numbers are categories) and wherever a series places text on it (a linear axis would draw
    nothing there), else the panel's scale."""
    values = [v for s in panel.series for v in (s.x if axis == "x" else s.y)]
    if panel.heatmap is not None or any(isinstance(v, str) for v in values):
        return "category"
    return "linear" if (panel.xscale if axis == "x" else panel.yscale) == "linear" else "log"


def _range(bounds: tuple[float, float] | None, scale: Scale) -> list[float] | None:
    if bounds is None:
        return None
    return [math.log10(b) for b in bounds] if scale != "linear" else list(bounds)


def _barmode(spec: Figure) -> str:
    return "stack" if any(p.bars == "stack" for p in spec.panels) else "group"


def _depth_switch(fig: Any, absolute: list[Any], relative: list[Any], label: str) -> None:
    """Buttons above ``fig`` that switch the x values of its traces between ``absolute`` (e.g.
    components in the prefix j) and ``relative`` (e.g. j / L), so that models of different
    depth overlay; ``label`` names the absolute axis."""
    layout = fig.layout.to_plotly_json()
    axes = [k for k, v in layout.items() if k.startswith("xaxis") and v.get("title")]
    keep = [i for i, x in enumerate(absolute) if x is not None]

    def titles(text: str) -> dict[str, str]:
        return {f"{axis}.title.text": text for axis in axes}

    def update(xs: list[Any], text: str) -> list[Any]:
        return [{"x": [xs[i] for i in keep]}, titles(text), keep]

    fig.update_layout(
        updatemenus=[
            {
                "type": "buttons",
                "direction": "right",
                "x": 1,
                "xanchor": "right",
                "y": 1.0,
                "yanchor": "bottom",
                "pad": {"b": 30},
                "showactive": True,
                "buttons": [
                    {
                        "label": "absolute depth",
                        "method": "update",
                        "args": update(absolute, label),
                    },
                    {
                        "label": "relative depth",
                        "method": "update",
                        "args": update(relative, "relative depth j / L"),
                    },
                ],
            }
        ]
    )


POOR_FIT_R2 = 0.5
"""A power-law (or logarithmic) fit whose R² is below this explains less than half of the
variance of what it fits: figures and tables say "poor fit" in words beside its exponent, which
then describes the data poorly."""


def r2_text(r2: float | None) -> str:
    """``R² = 0.93``, with "(poor fit)" below :data:`POOR_FIT_R2` ("" without a value)."""
    if r2 is None or math.isnan(r2):
        return ""
    return f"R² = {r2:.2f}" + (" (poor fit)" if r2 < POOR_FIT_R2 else "")


def fit_note(label: str, beta: float | None, se: float | None, r2: float | None) -> str:
    """``label`` and the fitted exponent ± its standard error, with :func:`r2_text` ("" when
    there is no fit)."""
    if beta is None or math.isnan(beta):
        return ""
    spread = "" if se is None or math.isnan(se) else f" ± {se:.2f}"
    quality = r2_text(r2)
    return f"{label}β = {beta:.2f}{spread}" + (f", {quality}" if quality else "")


def power_law_overlay(
    panel: Panel,
    name: str,
    x: Sequence[float],
    fit: pl.DataFrame,
    label: str,
    color: str,
    width: float = Series.width,
) -> None:
    """Draw on ``panel`` the fitted a * l^(-beta) of ``fit`` (a one-row frame of
    ``POWER_FIT_SCHEMA``'s columns, or none) at ``x``, dashed, as series ``name`` (no legend entry
    of its own), and its β, s.e. and R² in the panel's notes (``label: ...``); nothing where no
    fit was made."""
    if not fit.height or fit["beta"][0] is None:
        return
    a, beta = fit["a"][0], fit["beta"][0]
    panel.series.append(
        Series(
            name,
            list(x),
            [a * float(v) ** -beta for v in x],
            color=color,
            dash="dash",
            marker=None,
            legend=False,
            width=width,
        )
    )
    panel.notes.append(fit_note(f"{label}: ", beta, fit["beta_se"][0], fit["r2"][0]))


def interval_ends(rows: pl.DataFrame) -> tuple[list[float | None], list[float | None]]:
    """The (low, high) ends of the intervals ``ci_low``/``ci_high`` of ``rows`` (None where an
    end is missing: a point drawn without a bar)."""
    return rows["ci_low"].to_list(), rows["ci_high"].to_list()
