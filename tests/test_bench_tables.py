"""The benchmark figures of the docs and the README are those of the results files the full
benchmark runs wrote (``scripts/bench_tables.py`` renders them)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def bench_tables() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "scripts/bench_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_and_readme_quote_the_results_files() -> None:
    """Every region is rendered from its results file as it stands (rerun
    ``python scripts/bench_tables.py`` after a full benchmark run), and there are regions."""
    tables = bench_tables()
    regions = 0
    for path in tables.FILES:
        text = path.read_text()
        regions += len(tables.REGION.findall(text))
        assert tables.render(text) == text, f"{path.name}: run python scripts/bench_tables.py"
    assert regions >= 3


def test_a_changed_result_changes_the_readme(tmp_path: Path) -> None:
    """The README's lens figure follows the results file: a different CPU ratio, another text."""
    tables = bench_tables()
    shutil.copytree(tables.RESULTS, tmp_path, dirs_exist_ok=True)
    path = tmp_path / "bench_text_extract.json"
    result = json.loads(path.read_text())
    lens = next(row for row in result["rows"] if row[0] == "lens")
    lens[4] = 123.456
    path.write_text(json.dumps(result))
    readme = (ROOT / "README.md").read_text()
    assert "123.46 x (FLOP ratio" in tables.render(readme, tmp_path)
    assert "123.46" not in tables.render(readme)


def test_every_table_of_the_benchmarks_page_comes_from_a_results_file() -> None:
    """No table line of docs/benchmarks.md outside a rendered region, every results file rendered
    somewhere, and each with its command, date, commit and load average (or the conditions its
    figures were recorded under)."""
    tables = bench_tables()
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    outside = tables.REGION.sub("", page)
    typed = [line for line in outside.splitlines() if line.lstrip().startswith("|")]
    assert not typed, f"tables typed into docs/benchmarks.md: {typed[:2]}"
    names = {m.group(2).partition("#")[0] for p in tables.FILES
             for m in tables.REGION.finditer(p.read_text())}  # fmt: skip
    names |= {name for name, *_ in tables.README_ROWS}
    files = {path.stem for path in tables.RESULTS.glob("*.json")}
    assert files == names - set(tables.SPECIAL), "results files and regions differ"
    for name in files:
        result = tables.load(name)
        assert {"command", "date", "commit", "columns", "rows"} <= set(result), name
        assert result["load_average"] is not None or result.get("before"), name
        assert result["command"].startswith("python benchmarks/"), name


def test_the_cost_estimate_uses_the_measured_gpu_rate() -> None:
    """``extract.cost.GPU_FLOPS`` is the useful rate the GPU benchmark last measured for
    Llama-3.1-8B (its results file), to three significant figures."""
    from layerdiv.extract.cost import GPU_FLOPS

    result = json.loads((Path(__file__).parents[1] / "docs/benchmarks/bench_gpu.json").read_text())
    rows = {row[0]: dict(zip(result["columns"], row, strict=True)) for row in result["rows"]}
    llama = next(row for name, row in rows.items() if name.startswith("llama-3.1-8b"))
    assert float(f"{llama['useful TFLOP/s']:.3g}") * 1e12 == GPU_FLOPS
