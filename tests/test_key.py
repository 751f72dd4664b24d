"""The partition key is declared once (``layerdiv.store.key``)."""

from __future__ import annotations

import re
from pathlib import Path

import layerdiv
from layerdiv.store.key import KEY, PartitionKey

PACKAGE = Path(layerdiv.__file__).parent


def test_no_module_spells_out_the_key_columns() -> None:
    spelled = re.compile(r"""["']model["'],\s*["']task["']""")
    found = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if not {".venv", "tests", "benchmarks"} & set(p.relative_to(PACKAGE).parts)
        and spelled.search(p.read_text())
    ]
    assert found == []


def test_the_key_names_folders_in_column_order() -> None:
    key = PartitionKey(*(f"v{i}" for i in range(len(KEY))))
    assert key.dirs() == [f"{c}=v{i}" for i, c in enumerate(KEY)]
    assert key.values() == tuple(f"v{i}" for i in range(len(KEY)))
    assert key.where == "partition " + " ".join(key.dirs())
