"""MkDocs hook: the package's sources for mkdocstrings, as links in ``build/docs-src/layerdiv``.

The repository root is the package ``layerdiv`` (``package-dir``), and it also holds ``.venv``
and the build outputs, which mkdocstrings would scan when it loads the package from there. Its
``paths`` option names ``build/docs-src`` instead, where this hook links the package's modules
(every ``*.py`` of the root) and subpackages (every folder with an ``__init__.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

SOURCES = Path("build/docs-src")


@event_priority(100)  # before mkdocstrings reads its paths
def on_config(config: Any, **kwargs: Any) -> Any:
    """(Re)make the links before any page is read."""
    root = Path(config.config_file_path).resolve().parent
    package = root / SOURCES / "layerdiv"
    shutil.rmtree(package, ignore_errors=True)
    package.mkdir(parents=True)
    for path in [*root.glob("*.py"), *(p.parent for p in root.glob("*/__init__.py"))]:
        (package / path.name).symlink_to(path)
    return config
