"""MkDocs hook: the store's table schemas, written into the docs from ``layerdiv.schemas`` at
build time, so that the documented columns are the declared ones.

A page line ``<!-- layerdiv:schema-tables -->`` becomes the schema version and its history, then
one section per table of
:data:`layerdiv.schemas.TABLES`: the table's docstring (its first paragraph), then a row per
column with its Arrow type, whether it may be null, the schema version that added it and its
meaning (the ``- ``column``: meaning`` item of the docstring).
"""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

import pyarrow as pa

from layerdiv import schemas
from layerdiv.measurements import tables_of

MARKER = "<!-- layerdiv:schema-tables -->"
_ITEM = re.compile(r"^- ``(\w+)``(?: \([^)]*\))?: (.*)$")


def _docstrings() -> dict[str, str]:
    """Module-level attribute docstrings of ``layerdiv.schemas`` (the string after ``X = ...``)."""
    body = ast.parse(inspect.getsource(schemas)).body
    found = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[node.targets[0].id] = inspect.cleandoc(after.value.value)
    return found


def _rst(text: str) -> str:
    """The docstrings' reST roles and literals as Markdown code; a table's constant (``COMPONENTS``)
    by its table name."""
    tables = {name: table for table, name in _table_names().items()}
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: f"`{tables.get(m.group(1), m.group(1))}`", text)
    return text.replace("``", "`")


def _table_names() -> dict[str, str]:
    """The constant that declares each table (``components`` -> ``COMPONENTS``)."""
    by_id = {id(value): name for name, value in vars(schemas).items() if name.isupper()}
    return {table: by_id[id(schema)] for table, schema in schemas.TABLES.items()}


_ARROW = {"float": "float32", "double": "float64", "halffloat": "float16"}


def _type(kind: pa.DataType) -> str:
    if pa.types.is_dictionary(kind):
        return f"{_type(kind.value_type)} (dictionary-encoded)"
    if pa.types.is_list(kind):
        return f"list of {_type(kind.value_type)}"
    return _ARROW.get(str(kind), str(kind))


def _split(doc: str) -> tuple[str, dict[str, str], str]:
    """A table docstring as (intro, meaning per column, closing text)."""
    intro: list[str] = []
    items: dict[str, str] = {}
    tail: list[str] = []
    current = ""
    for line in doc.splitlines():
        match = _ITEM.match(line)
        if match:
            current = match.group(1)
            items[current] = match.group(2)
        elif current and line.startswith("  "):
            items[current] += " " + line.strip()
        elif items:
            current = ""
            tail.append(line)
        else:
            intro.append(line)
    return " ".join(intro).strip(), items, " ".join(tail).strip()


def _history() -> str:
    """The version list of the module docstring (its ``History:`` paragraph)."""
    doc = inspect.cleandoc(schemas.__doc__ or "")
    return doc.split("History:\n", 1)[1].split("\n\n", 1)[0]


def _since(table: str, column: str) -> int:
    return next(
        v
        for v in range(schemas.OLDEST_READABLE, schemas.SCHEMA_VERSION + 1)
        if table in tables_of(v) and column in tables_of(v)[table].names
    )


def schema_tables() -> str:
    """Markdown: a section per store table with a row per column."""
    docs = _docstrings()
    parts = {table: _split(docs[name]) for table, name in _table_names().items()}
    out = [
        f"This layerdiv writes schema version {schemas.SCHEMA_VERSION} and reads versions "
        f"{schemas.OLDEST_READABLE} to {schemas.SCHEMA_VERSION}. History:",
        "",
        _rst(_history()),
        "",
    ]
    for table, schema in schemas.TABLES.items():
        intro, items, tail = parts[table]
        out += [f"### `{table}`", "", _rst(intro), ""]
        out += ["| column | type | null | since | meaning |", "| --- | --- | --- | --: | --- |"]
        for field in schema:
            meaning = items.get(field.name) or _first_meaning(parts, field.name)
            meaning = _rst(meaning).replace("|", "\\|")
            null = "yes" if field.nullable else "no"
            out.append(
                f"| `{field.name}` | {_type(field.type)} | {null} | "
                f"{_since(table, field.name)} | {meaning} |"
            )
        out += ["", _rst(tail), ""] if tail else [""]
    return "\n".join(out)


def _first_meaning(parts: dict[str, tuple[str, dict[str, str], str]], column: str) -> str:
    """A column left undescribed in its table's docstring: as in the first table describing it."""
    table = next(t for t, (_, items, _) in parts.items() if column in items)
    return f"as in :data:`{_table_names()[table]}`: " + parts[table][1][column]


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace the marker line with the generated tables."""
    return markdown.replace(MARKER, schema_tables()) if MARKER in markdown else markdown
