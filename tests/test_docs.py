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


# --- citations of the methods page ---------------------------------------------------------

CITED = re.compile(r"§ ?(\d+)(?:-(\d+))?")
"""A citation of a numbered section of the methods page: ``methods §9``, ``§2-6``."""
LINKED = re.compile(r"methods\.(?:md|html)#([A-Za-z0-9_-]+)")
"""A link to an anchor of the methods page (docs, report text)."""
UNCITED = re.compile(r"METHODS\.md|\b[Ss]ections? \d")
"""A citation the reader cannot follow: the internal spec's name, or a bare "section N"."""
SKIP = {".venv", "build", "layerdiv-demo", ".git", "layerdiv.egg-info", "node_modules"}


def package_texts() -> dict[str, str]:
    """Every source and documentation file of the package (code, docstrings, report text,
    docs pages, README), by path relative to the repository; the methods page itself and this
    test (whose examples are wrong on purpose) left out."""
    out = {}
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if set(rel.parts) & SKIP or path.suffix not in {".py", ".md", ".js", ".css", ".yml"}:
            continue
        if rel.as_posix() not in {"docs/methods.md", "tests/test_docs.py"} and path.is_file():
            out[rel.as_posix()] = path.read_text(encoding="utf-8")
    return out


def unresolved_citations(texts: dict[str, str], anchors: set[str]) -> list[str]:
    """``path: citation`` for every citation of ``texts`` that names no anchor in ``anchors``."""
    bad = []
    for path, text in texts.items():
        for m in CITED.finditer(text):
            ends = [m.group(1), *([m.group(2)] if m.group(2) else [])]
            bad += [f"{path}: {m.group(0)}" for n in ends if f"section-{n}" not in anchors]
        bad += [f"{path}: #{a}" for a in LINKED.findall(text) if a not in anchors]
        bad += [f"{path}: {m.group(0)!r}" for m in UNCITED.finditer(text)]
    return bad


def test_every_citation_in_the_package_resolves_to_an_anchor_of_the_methods_page() -> None:
    from layerdiv.analyze import methods

    anchors = methods.anchors()
    assert {f"section-{n}" for n in range(1, 13)} <= anchors
    texts = package_texts()
    assert sum(len(CITED.findall(t)) for t in texts.values()) > 50  # the citations are found
    assert unresolved_citations(texts, anchors) == []


def test_an_unresolvable_citation_is_found() -> None:
    anchors = {"section-1", "section-2", "logit-lens"}
    texts = {
        "a.py": "methods §1, §2; [x](methods.md#logit-lens)",
        "b.py": "methods §13 and §1-3",
        "c.md": "[y](../methods.md#nowhere)",
        "d.py": "see METHODS.md and section 4",
    }
    assert unresolved_citations(texts, anchors) == [
        "b.py: §13",
        "b.py: §1-3",
        "c.md: #nowhere",
        "d.py: 'METHODS.md'",
        "d.py: 'section 4'",
    ]


def test_the_methods_page_names_each_paper_with_its_arxiv_id_as_the_readme_does() -> None:
    page = (ROOT / "docs/methods.md").read_text()
    for arxiv in ("2505.24009", "2505.13898", "2602.05970"):
        assert f"arXiv:{arxiv}" in page and f"arXiv:{arxiv}" in README.read_text()
        assert arxiv in (ROOT / "CITATION.cff").read_text()


def test_the_methods_page_renders_with_its_anchors_for_the_report() -> None:
    from layerdiv.analyze import methods

    page = methods.render_html("")
    for anchor in methods.anchors():
        assert f'id="{anchor}"' in page
    assert "{ #" not in page


def test_the_extract_page_lists_every_extract_option() -> None:
    """Every option ``extract`` builds from its declarations (``ExtractConfig``'s fields, every
    registered measurement's flag and settings) has a row of the options table of
    docs/extract.md (a measurement's settings in its flag's row)."""
    from layerdiv.extract.config import ExtractConfig
    from layerdiv.measurements import registered

    text = (ROOT / "docs" / "extract.md").read_text()
    lines = [r for r in text.splitlines() if r.startswith("| `--")]
    rows = {r.split(" | ")[0].removeprefix("| "): r for r in lines}
    missing = []
    for option in ExtractConfig.field_options():
        if not any(f"`{option.opts[0]}" in head for head in rows):
            missing.append(option.opts[0])
    for m in registered():
        row = next((r for head, r in rows.items() if head.startswith(f"`{m.flag}")), None)
        if row is None:
            missing.append(m.flag)
            continue
        missing += [s.option.opts[0] for s in m.settings if s.option.opts[0] not in row]
    assert not missing, f"docs/extract.md's option table lacks {', '.join(missing)}"


def test_getting_started_describes_the_demo_tasks_as_the_demo_runs_them() -> None:
    """The numbers of getting-started's description of the demo's tasks are the demo's own
    (``layerdiv.demo``'s constants): a change to one is a change to the other."""
    from layerdiv import demo

    full = demo.FULL
    text = " ".join((ROOT / "docs" / "getting-started.md").read_text().split())
    said = [
        f"`{demo.SKIPS_TASK}`, the first {full.skips_n} instances of `{demo.SKIPS_OF}`",
        f"`{demo.ERASE_TASK}`, the {full.erase_n} instances of `{demo.SKIPS_OF}`",
        f"`{demo.TEXT_TASK}`, {full.text_docs} BBC News articles cut to {full.text_tokens} tokens",
        f"`{demo.STATES_TASK}`, {full.states_docs} other articles cut to {full.states_tokens} "
        "tokens",
        f"`{demo.MULTIHOP_TASK}`, the handwritten multi-hop questions",
        f"first {full.multihop_docs} documents are extracted with `--igrad`",
        f"M = {full.multihop_steps} steps",
        f"`layerdiv demo --quick` ({demo.QUICK.n} instances per choice task, "
        f"{demo.QUICK.text_docs} documents of running text and {demo.QUICK.multihop_docs} "
        "multi-hop documents",
    ]
    missing = [s for s in said if s not in text]
    assert not missing, f"docs/getting-started.md does not say: {missing}"
