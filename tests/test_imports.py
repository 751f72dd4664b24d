"""The package's layers, pinned: ``schemas`` and ``errors`` import nothing of the package above
them, ``store`` writes and reads without ``extract`` or ``analyze``, ``analyze`` reads without
``extract``, the demo or the package root, ``extract`` does not analyse, and no two modules import
each other; the registries import no built-in measurement or analysis (entry points register
them) and the extraction core names none."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import layerdiv
from layerdiv.measurements import registered

ROOT = Path(layerdiv.__file__).parent
SKIP = {"tests", "benchmarks", "docs", "examples", "scripts", ".venv", "build"}

FORBIDDEN = {
    "errors": {"*"},
    "version": {"*"},
    "schemas": {"store", "extract", "analyze", "measurements", "demo", "cli", ""},
    "measurements": {"extract", "analyze", "demo", "cli", ""},
    "store": {"extract", "analyze", "demo", "cli", ""},
    "analyze": {"extract", "demo", "cli", ""},
    "extract": {"analyze", "demo", "cli", ""},
}
"""Layer (top-level module or subpackage) -> the layers it must not import (``""``: the package
root, ``*``: anything of the package but ``errors``)."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP:
            continue
        parts = ["layerdiv", *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path) -> set[str]:
    """Every ``layerdiv`` module ``name`` imports (or a name of a module it imports from, as
    ``layerdiv.module.name``), at its top or inside a function (``TYPE_CHECKING`` blocks left
    out)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "layerdiv"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], base])
            if base.split(".")[0] == "layerdiv":
                out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _layer(module: str) -> str:
    """A module's layer; in a measurement's folder (``layerdiv.measurements.<name>``) the
    declaration is of ``measurements``, its ``hooks`` of ``extract`` and the rest (its analyses)
    of ``analyze``."""
    parts = module.split(".")
    if parts[1:2] == ["measurements"] and len(parts) > 3:
        return "extract" if parts[3] == "hooks" else "analyze"
    return parts[1] if len(parts) > 1 else ""


def test_no_layer_imports_a_layer_above_it() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        rules = FORBIDDEN.get(_layer(name), set())
        for target in _imports(name, path):
            hit = _layer(target)
            if target not in modules and target.rpartition(".")[0] in modules:
                hit = _layer(target.rpartition(".")[0])  # ``from layerdiv.x import name``
            if hit == _layer(name):
                continue
            if hit in rules or ("*" in rules and hit != "errors"):
                wrong.append(f"{name} imports {target}")
    assert not wrong, wrong


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {t if t in modules else t.rpartition(".")[0] for t in _imports(name, path)}
        & set(modules) - {name}
        for name, path in modules.items()
    }


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others() -> None:
    """No circle at all: the registries import no measurement and no analysis (they come through
    the entry points of pyproject.toml), and analyses share helpers through ``analyze`` modules,
    not through each other."""
    graph = _graph()
    assert not _circles(graph), [sorted(c) for c in _circles(graph)]


def test_the_registries_import_no_built_in() -> None:
    graph = _graph()
    built_in = {
        name
        for name in graph
        if name.startswith("layerdiv.analyze.analyses.")
        or (name.startswith("layerdiv.measurements.") and name != "layerdiv.measurements.registry")
    }
    registries = ["layerdiv.measurements", "layerdiv.measurements.registry",
                  "layerdiv.analyze.registry", "layerdiv.analyze.analyses"]  # fmt: skip
    assert {r: sorted(graph[r] & built_in) for r in registries} == {r: [] for r in registries}


def test_every_built_in_comes_through_an_entry_point() -> None:
    """Every measurement and analysis the package declares is registered (an entry point of
    pyproject.toml names it), as the very object its module holds."""
    from layerdiv.analyze.registry import Analysis
    from layerdiv.analyze.registry import registered as analyses
    from layerdiv.measurements.registry import Measurement

    declared: dict[str, Analysis | Measurement] = {}
    for name in _modules():
        if name.startswith(("layerdiv.measurements", "layerdiv.analyze.analyses")) and not (
            name.endswith(".hooks")
        ):
            for value in vars(importlib.import_module(name)).values():
                if isinstance(value, Analysis | Measurement):
                    declared[f"{type(value).__name__} {value.name}"] = value
    found: dict[str, Analysis | Measurement] = {f"Analysis {a.name}": a for a in analyses()}
    found |= {f"Measurement {m.name}": m for m in registered()}
    assert {k: found.get(k) for k in declared} == declared
    assert {"Measurement igrad", "Analysis igrad", "Analysis paper"} <= set(declared)


def test_no_declaration_names_a_module_up_a_floor() -> None:
    """No string of measurements/ (docstrings left out) names a module of ``layerdiv.extract``:
    a declaration names its own folder's hooks (``f"{__name__}.hooks:..."``)."""
    found = []
    for path in (ROOT / "measurements").rglob("*.py"):
        tree = ast.parse(path.read_text())
        docs = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        found += [
            f"{path.relative_to(ROOT)}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and "layerdiv.extract" in node.value
        ]
    assert not found, found


def test_the_rules_see_an_upward_import(tmp_path: Path) -> None:
    """The walker finds imports inside functions (a lazy import is still an import)."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from layerdiv.analyze.output import INDEX_NAME\n")
    assert "layerdiv.analyze.output.INDEX_NAME" in _imports("layerdiv.store.m", path)
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


CORE = ["extract/forward.py", "extract/runner.py", "extract/plan.py", "extract/cost.py",
        "extract/config.py", "store/manifest.py"]  # fmt: skip
"""The extraction core: it runs what the registered measurements declare."""


def _named(path: Path, names: set[str]) -> list[str]:
    """Where the code at ``path`` imports a module of ``names`` or holds one as a string (its
    docstrings, a string standing alone as a statement, left out)."""
    tree = ast.parse(path.read_text())
    docs = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hits = {part for a in node.names for part in a.name.split(".")} & names
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            hits = {*node.module.split("."), *(a.name for a in node.names)} & names
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docs:
                continue
            hits = set(node.value.lstrip("-").split()) & names
        else:
            continue
        out += [(node.lineno, hit) for hit in sorted(hits)]
    return [f"{path.name}:{line} {hit}" for line, hit in sorted(out)]


def test_the_extraction_core_names_no_built_in_measurement(tmp_path: Path) -> None:
    """Neither an import of a built-in measurement's module nor its name, flag or table as a
    string: the core learns of each from its declaration."""
    names = {
        word
        for m in registered()
        for word in (m.name, m.flag.lstrip("-"), *(t for ts in m.tables.values() for t in ts))
    }
    # the modules that declare them and those that hold their hooks
    names |= {p.parent.name for p in (ROOT / "measurements").glob("*/__init__.py")}
    assert {"lens", "igrad", "erasure", "sinks", "future", "erase"} <= names
    found = [hit for rel in CORE for hit in _named(ROOT / rel, names)]
    assert not found, found
    # the walker sees both ways of naming one
    path = tmp_path / "m.py"
    path.write_text(
        '"""lens"""\nfrom layerdiv.measurements.future import x\nf("--igrad")\n'
        "import layerdiv.measurements.sinks.hooks\n"
    )
    assert _named(path, names) == ["m.py:2 future", "m.py:3 igrad", "m.py:4 sinks"]
