"""The methods page (``docs/methods.md``, shipped with the package) and citations of its sections.

Every formula the package computes is defined in a numbered section of that page, whose heading
carries the anchor ``section-<n>`` (``{ #section-<n> }``, Markdown attribute syntax). Code and
docstrings cite it as ``methods §<n>``; report text links it with :func:`cite`, and the report
writes the page beside itself (:data:`PAGE`, and :data:`HTML_PAGE` for the HTML report).
"""

from __future__ import annotations

import html
import re
from importlib import resources

PAGE = "methods.md"
"""File name of the page, in the documentation and beside a written report."""
HTML_PAGE = "methods.html"
"""The page rendered for the HTML report."""
_ANCHOR = re.compile(r"^#+ .*?\{ *#([A-Za-z0-9_-]+) *\}\s*$", re.MULTILINE)


def source() -> str:
    """The Markdown of the methods page."""
    return resources.files("layerdiv").joinpath("docs", PAGE).read_text(encoding="utf-8")


def anchors(text: str | None = None) -> set[str]:
    """The heading anchors of the methods page (of ``text`` if given)."""
    return set(_ANCHOR.findall(source() if text is None else text))


def anchor(section: int | str) -> str:
    """The anchor of a numbered section (``9`` -> ``section-9``) or a named one."""
    return f"section-{section}" if isinstance(section, int) else section


def cite(*sections: int | str, page: str = PAGE) -> str:
    """Markdown links to sections of the methods page, e.g. ``cite(7, 9)`` ->
    ``[methods §7](methods.md#section-7), [§9](methods.md#section-9)``; a named anchor is linked
    by its words (``cite("logit-lens")`` -> ``[methods: logit lens](methods.md#logit-lens)``)."""
    links = []
    for i, s in enumerate(sections):
        text = f"§{s}" if isinstance(s, int) else s.replace("-", " ")
        lead = "" if i else ("methods " if isinstance(s, int) else "methods: ")
        links.append(f"[{lead}{text}]({page}#{anchor(s)})")
    return ", ".join(links)


def render_html(css: str) -> str:
    """The methods page as a standalone HTML page (headings keep their anchors)."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(source())
    body = re.sub(
        r"<h([1-6])>(.*?) *\{ *#([A-Za-z0-9_-]+) *\}</h\1>", r'<h\1 id="\3">\2</h\1>', body
    )
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{html.escape('layerdiv: methods')}</title>",
            f"<style>{css}</style>",
            "</head><body>",
            f"<main>{body}</main>",
            "</body></html>",
        ]
    )
