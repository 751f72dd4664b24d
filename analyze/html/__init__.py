"""The HTML report: one self-contained page (``report.html``) that opens from disk with no
network. It is the Markdown report converted to HTML (markdown-it-py), its figures replaced by
the interactive Plotly figures drawn from the analyses' figure specs
(:func:`layerdiv.analyze.plots.figure_link`), sortable tables, and the per-instance explorer
(:mod:`layerdiv.analyze.html.explorer`). Plotly's JavaScript is inlined once from its wheel; a
Content-Security-Policy lets the page load nothing from anywhere.
"""

from __future__ import annotations

import html
import json
import re
from importlib import resources
from typing import Any

from layerdiv.analyze import methods
from layerdiv.analyze.plots import PLOTLY_CONFIG
from layerdiv.errors import LayerdivError

CSP = (
    "default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; "
    "img-src data:; font-src data:"
)
"""The page's Content-Security-Policy: nothing but its own inline scripts, styles and data: URLs."""

NO_PLOTLY = (
    "the HTML report needs Plotly and markdown-it-py: install the html extra "
    "(pip install 'layerdiv[html]') and run `layerdiv report` again"
)


class HtmlUnavailable(LayerdivError, RuntimeError):
    """The ``html`` extra (Plotly, markdown-it-py) is not installed."""


def check_available() -> None:
    """Refuse (one line) when the ``html`` extra is missing."""
    try:
        import markdown_it  # noqa: F401
        import plotly  # noqa: F401
    except ImportError:
        raise HtmlUnavailable(NO_PLOTLY) from None


def _script_json(value: Any, encoder: type[json.JSONEncoder] | None = None) -> str:
    """JSON that is safe inside ``<script type="application/json">`` (no ``</``)."""
    return json.dumps(value, cls=encoder, separators=(",", ":")).replace("</", "<\\/")


def _slug(text: str, seen: set[str]) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", html.unescape(re.sub("<[^>]+>", "", text)).lower()).strip("-")
    slug, i = base or "section", 1
    while slug in seen:
        i += 1
        slug = f"{base}-{i}"
    seen.add(slug)
    return slug


_HEADING = re.compile(r"<h([23])>(.*?)</h\1>")
_IMAGE = re.compile(r'<p><img src="figures/([^"]+)" alt="([^"]*)" ?/?></p>')


def _body(markdown: str, interactive: dict[str, Any]) -> tuple[str, list[str]]:
    """The Markdown as HTML with its figure links replaced, and the navigation links."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)

    def figure(match: re.Match[str]) -> str:
        file = match.group(1)
        if file in interactive:
            return f'<div class="plotly-figure" data-figure="{html.escape(file)}"></div>'
        return ""

    seen: set[str] = set()
    nav: list[str] = []

    def heading(match: re.Match[str]) -> str:
        level, text = match.group(1), match.group(2)
        slug = _slug(text, seen)
        nav.append(f'<a href="#{slug}"{" class=sub" if level == "3" else ""}>{text}</a>')
        return f'<h{level} id="{slug}">{text}</h{level}>'

    body = body.replace(f'href="{methods.PAGE}', f'href="{methods.HTML_PAGE}')
    return _HEADING.sub(heading, _IMAGE.sub(figure, body)), nav


EXPLORER = """<h2 id="explorer">Per-instance explorer</h2>
<p>{intro}</p>
<div class="controls">
<label>Model and task<select id="ex-part"></select></label>
<label>Show<select id="ex-filter"><option value="all">all</option>
<option value="correct">correct</option><option value="wrong">wrong</option>
<option value="late">flipped late</option></select></label>
<label>Instance<select id="ex-instance"></select></label>
<label>Find instance index<input id="ex-search" type="number" min="0" placeholder="index"></label>
<label>Option shown<select id="ex-option"></select></label>
<span id="ex-count"></span>
</div>
<div id="ex-summary"></div>
<pre id="ex-prompt"></pre>
<div id="ex-waterfall" class="plotly-figure"></div>
<div id="ex-running" class="plotly-figure"></div>
<div id="ex-heads" class="plotly-figure"></div>
<div id="ex-skips" class="plotly-figure"></div>
"""


def _explorer(data: dict[str, Any]) -> str:
    n = data["per_partition"]
    late = data["late"]
    how = "every instance" if n is None else f"at most {n} instances"
    intro = (
        f"Per (model, task), {how} of the store, chosen deterministically and stratified by "
        "correct / wrong (evenly spaced within each; <code>--explorer-instances N|all</code>). "
        "For the chosen instance: its prompt, gold and predicted option, the waterfall of every "
        "component's logit for one option (u_c[k] minus its mean over the options, "
        f'<a href="{methods.HTML_PAGE}#section-1">methods §1</a>, final scale frozen), the '
        "running option logits over junctions with the "
        "junctions where the prediction flips, and, where extracted, the heads (layer x head) "
        "and the layer skips. <em>Flipped late</em>: the running prediction settles on the "
        f"final answer after {late:.0%} of the junctions."
    )
    return EXPLORER.format(intro=intro)


def render_methods() -> str:
    """The methods page the report links, as HTML with the report's style."""
    return methods.render_html(resources.files(__name__).joinpath("page.css").read_text())


def render_page(
    markdown: str,
    interactive: dict[str, Any],
    explorer: dict[str, Any] | None,
    title: str = "layerdiv report",
) -> str:
    """The whole page: ``markdown`` (the Markdown report) as HTML with the ``interactive``
    figures (by PNG file name: every figure has its spec, so no image is inlined) and, when
    given, the explorer's data (:func:`~layerdiv.analyze.html.explorer.explorer_data`) before
    the provenance section."""
    from plotly.offline import get_plotlyjs
    from plotly.utils import PlotlyJSONEncoder

    body, nav = _body(markdown, interactive)
    if explorer is not None:
        section = _explorer(explorer)
        marker = '<h2 id="provenance">'
        body = body.replace(marker, section + marker) if marker in body else body + section
        at = next((i for i, a in enumerate(nav) if 'href="#provenance"' in a), len(nav))
        nav.insert(at, '<a href="#explorer">Per-instance explorer</a>')
    here = resources.files(__name__)
    blobs = {"plotly-config": _script_json(PLOTLY_CONFIG)}
    blobs["figures-data"] = _script_json(interactive, PlotlyJSONEncoder)
    if explorer is not None:
        blobs["explorer-data"] = _script_json(explorer)
    data = [f'<script type="application/json" id="{k}">{v}</script>' for k, v in blobs.items()]
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{html.escape(title)}</title>",
            f"<style>{here.joinpath('page.css').read_text()}</style>",
            f"<script>{get_plotlyjs()}</script>",
            "</head><body>",
            f"<nav>{''.join(nav)}</nav>",
            f"<main>{body}</main>",
            *data,
            f"<script>{here.joinpath('page.js').read_text()}</script>",
            "</body></html>",
        ]
    )
