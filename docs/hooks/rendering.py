"""MkDocs hook: two fixes to the HTML of generated pages.

- The docstrings cross-reference in reST (``:func:`name```), which the Markdown of mkdocstrings
  renders as the role's text before the code: the role is dropped, the code kept.
- mkdocs-click prints an option's ``default`` as it is; click 8.3 and later keep the sentinel
  ``Sentinel.UNSET`` there for options that have none: shown as ``None``, as mkdocs-click shows a
  default of None.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:func|meth|class|data|mod|attr|exc|obj):(?=<code>)")
UNSET = "<td><code>Sentinel.UNSET</code></td>"


def on_page_content(html: str, **kwargs: Any) -> str:
    """The page's HTML with both fixes."""
    return ROLE.sub("", html).replace(UNSET, "<td>None</td>")
