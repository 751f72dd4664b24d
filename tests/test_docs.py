"""The README stays a landing page whose links resolve, and the store's schema tables of the docs
site describe every column (the site itself is built by ``make docs``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from layerdiv import schemas

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def local_links(text: str) -> list[str]:
    """The link and image targets of Markdown text that name a file of the repository."""
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]


def test_readme_is_a_landing_page_of_at_most_300_lines() -> None:
    assert len(README.read_text().splitlines()) <= 300


def test_every_link_of_the_readme_resolves_to_a_file() -> None:
    links = local_links(README.read_text())
    assert any(link.startswith("docs/") for link in links)
    missing = [t for t in links if not (ROOT / t.split("#")[0]).is_file()]
    assert missing == []


def test_local_links_are_found_and_urls_left_out() -> None:
    text = "[a](docs/a.md#x) ![b](docs/b.png) [c](https://c.org) [d](#d)"
    assert local_links(text) == ["docs/a.md#x", "docs/b.png"]


def schema_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "schema_tables", ROOT / "docs/hooks/schema_tables.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_schema_tables_describe_every_column_of_every_table() -> None:
    markdown = schema_hook().on_page_markdown("before\n<!-- layerdiv:schema-tables -->\nafter")
    assert markdown.startswith("before\n") and markdown.endswith("\nafter")
    assert f"schema version {schemas.SCHEMA_VERSION}" in markdown
    sections = re.split(r"^### ", markdown, flags=re.M)[1:]
    assert [s.split("`")[1] for s in sections] == list(schemas.TABLES)
    for section, schema in zip(sections, schemas.TABLES.values(), strict=True):
        rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
        assert [r[0].strip("| `") for r in rows] == schema.names
        assert all(r[4].strip(" |") for r in rows), section  # a meaning for every column
