"""The analysis commands of the CLI (analyze, report, query, ls): outputs and bad input."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner, Result

from layerdiv.analyze import analyze
from layerdiv.analyze.synthetic import random_partition, write_partition
from layerdiv.cli import main


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(1)
    for model, blocks, params in (("org/small", 3, 1e8), ("org/large", 5, 2e9)):
        for task, k in (("boolq", 2), ("mnli", 3)):
            logits, gold, rms, kinds = random_partition(rng, 40, blocks, k)
            write_partition(root, model, task, logits, gold, kinds, rms, n_params=int(params))
    return root


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its content."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --- outputs -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_analyze_writes_every_table(store: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "results"
    result = run("analyze", "--store", str(store), "--out", str(out), "--format", fmt)
    assert result.exit_code == 0, result.output
    expected = analyze(store)
    index = json.loads((out / "index.json").read_text())
    assert set(index["tables"]) == set(expected.tables())
    read = pl.read_parquet if fmt == "parquet" else pl.read_csv
    scores = read(out / f"scores.{fmt}").sort("model", "task", "estimator")
    np.testing.assert_allclose(scores["mse"], expected.scores["mse"], rtol=1e-12)
    assert index["tables"]["curves"]["rows"] == expected.curves.height
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_analyze_replaces_its_own_output_but_nothing_else(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "results"
    assert run("analyze", "--store", str(store), "--out", str(out)).exit_code == 0
    assert (
        run("analyze", "--store", str(store), "--out", str(out), "--task", "boolq").exit_code == 0
    )
    assert set(pl.read_parquet(out / "scores.parquet")["task"]) == {"boolq"}
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    result = run("analyze", "--store", str(store), "--out", str(foreign))
    assert result.exit_code == 1
    assert "not a layerdiv result folder" in result.stderr
    assert snapshot(foreign) == {"notes.txt": hashlib.sha256(b"keep me").hexdigest()}


def test_filters_and_lens(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "r"
    result = run(
        "analyze",
        "--store",
        str(store),
        "--out",
        str(out),
        "--model",
        "org/large",
        "--task",
        "mnli",
        "--lens",
        "prefix",
        "--min-params",
        "1e9",
    )
    assert result.exit_code == 0, result.output
    scores = pl.read_parquet(out / "scores.parquet")
    assert set(zip(scores["model"], scores["task"], strict=True)) == {("org--large", "mnli")}
    assert json.loads((out / "index.json").read_text())["settings"]["lens"] == "prefix"


def test_report(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = run("report", "--store", str(store), "--out", str(out), "--min-params", "1e9")
    assert result.exit_code == 0, result.output
    text = (out / "report.md").read_text()
    results = analyze(store)
    acc = results.scores.filter(
        (pl.col("model") == "org--small")
        & (pl.col("task") == "mnli")
        & (pl.col("estimator") == "paper")
    )["accuracy"].item()
    row = next(
        line
        for line in text.splitlines()
        if line.startswith("| small |") or line.startswith("| org/small |")
    )
    assert f"{100 * acc:.1f}" in row  # the first table is accuracy; mnli is its second task
    for heading in (
        "Table 1",
        "Fig. 3",
        "Fig. 4",
        "Fig. 5",
        "Fig. 6",
        "Saturation",
        "Information-theoretic",
        "*Majority class*",
        "Estimator **`paper`**",
    ):
        assert heading in text
    pngs = sorted(p.name for p in (out / "figures").glob("*.png"))
    assert pngs == [
        "depth_geometry.png",
        "fig3_correlations.png",
        "fig4_module_shares.png",
        "fig5_curves_org--large.png",
        "fig5_curves_org--small.png",
        "fig6_depth.png",
    ]
    for name in pngs:
        assert f"(figures/{name})" in text
        assert (out / "figures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_matplotlib(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import layerdiv.analyze

    # Forget the plotting module and make `import matplotlib(.figure)` raise ImportError.
    monkeypatch.delattr(layerdiv.analyze, "plots", raising=False)
    monkeypatch.delitem(sys.modules, "layerdiv.analyze.plots", raising=False)
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "report"
    result = run("report", "--store", str(store), "--out", str(out), "--estimator", "ensemble")
    assert result.exit_code == 0, result.output
    assert "pip install 'layerdiv[plot]'" in result.output
    text = (out / "report.md").read_text()
    assert "matplotlib is not installed" in text and "Estimator **`ensemble`**" in text
    assert not (out / "figures").exists()


def test_query_prints_and_writes(store: Path, tmp_path: Path) -> None:
    sql = "SELECT model, task, count(*) AS n FROM instances GROUP BY ALL ORDER BY ALL"
    result = run("query", sql, "--store", str(store))
    assert result.exit_code == 0, result.output
    assert "org--large" in result.output and "40" in result.output
    for suffix in ("parquet", "csv"):
        out = tmp_path / f"q.{suffix}"
        result = run("query", sql, "--store", str(store), "--out", str(out), "--task", "mnli")
        assert result.exit_code == 0, result.output
        frame = pl.read_parquet(out) if suffix == "parquet" else pl.read_csv(out)
        assert frame.rows() == [("org--large", "mnli", 40), ("org--small", "mnli", 40)]


def test_query_recomputes_a_score_from_raw_rows(store: Path) -> None:
    """The cache answers questions on its own: full-stack accuracy from the components rows."""
    sql = """
        WITH totals AS (
            SELECT model, task, instance, option, sum(logit) AS s FROM components GROUP BY ALL),
        pred AS (SELECT model, task, instance, arg_max(option, s) AS p FROM totals GROUP BY ALL)
        SELECT avg((p = gold)::DOUBLE) AS acc FROM pred JOIN instances USING (model, task, instance)
        WHERE model = 'org--small' AND task = 'boolq'
    """
    from layerdiv.analyze import query

    acc = query(store, sql)["acc"].item()
    expected = analyze(store, models=["org/small"], tasks=["boolq"]).scores["accuracy"][0]
    assert acc == pytest.approx(expected)


def test_ls(store: Path) -> None:
    result = run("ls", "--store", str(store))
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if "org/" in ln]
    assert len(lines) == 4 and all("40" in ln and "2025-01-01" in ln for ln in lines)


# --- bad input: one clear line, exit 1, nothing changed ------------------------------------


BROKEN = ("org--large", "boolq")
"""The partition the damages below break; the store's three others stay readable."""
ONLY_BROKEN = ["--model", "org/large", "--task", "boolq"]


def _partition_files(root: Path, table: str) -> list[Path]:
    model, task = BROKEN
    return sorted((root / table / f"model={model}" / f"task={task}").glob("*"))


def _empty(root: Path) -> None:
    for p in sorted(root.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()


def _newer_schema(root: Path) -> None:
    manifest = _partition_files(root, "manifests")[0]
    data = json.loads(manifest.read_text())
    data["schema_version"] = 999
    manifest.write_text(json.dumps(data))


def _missing_manifest(root: Path) -> None:
    _partition_files(root, "manifests")[0].unlink()


def _truncated_part(root: Path) -> None:
    part = _partition_files(root, "components")[0]
    part.write_bytes(part.read_bytes()[:-100])


def _logit_as_float64(root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    part = _partition_files(root, "components")[0]
    table = pq.read_table(part)
    column = table.schema.get_field_index("logit")
    pq.write_table(table.set_column(column, "logit", table["logit"].cast(pa.float64())), part)


def _unchanged(root: Path) -> None:
    pass


DAMAGES: list[tuple[str, Callable[[Path], None], str]] = [  # label, damage, the error says
    ("newer schema", _newer_schema, "schema version 999, newer than this layerdiv reads"),
    ("missing manifest", _missing_manifest, "has data but no manifest"),
    ("truncated part", _truncated_part, "unreadable Parquet"),
    ("logit as float64", _logit_as_float64, "columns do not match the components schema"),
]
BAD: list[tuple[str, Callable[[Path], None], list[str], str]] = [  # label, damage, flags, says
    ("empty store", _empty, [], "is empty"),
    *((f"{label}, filtered to it", d, ONLY_BROKEN, says) for label, d, says in DAMAGES),
    ("task matches nothing", _unchanged, ["--task", "nosuchtask"], "no extracted data matches"),
]
COMMANDS = ("analyze", "report", "query", "ls")


@pytest.fixture
def bad_store(store: Path, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    return copy


def command_args(command: str, out: Path) -> list[str]:
    return {
        "analyze": ["analyze", "--out", str(out)],
        "report": ["report", "--out", str(out)],
        "query": [
            "query",
            "SELECT model, task, count(*) AS n FROM components GROUP BY ALL ORDER BY ALL",
            "--out",
            str(out / "q.csv"),
        ],
        "ls": ["ls"],
    }[command]


@pytest.mark.parametrize(
    ("command", "damage", "extra", "message"),
    [
        pytest.param(command, damage, extra, message, id=f"{command}-{label}")
        for label, damage, extra, message in BAD
        for command in COMMANDS
    ],
)
def test_bad_input_gives_one_line(
    bad_store: Path,
    tmp_path: Path,
    command: str,
    damage: Callable[[Path], None],
    extra: list[str],
    message: str,
) -> None:
    damage(bad_store)
    before = snapshot(bad_store)
    out = tmp_path / "out"
    result = run(*command_args(command, out), "--store", str(bad_store), *extra)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines
    assert result.stdout == ""
    assert not out.exists()
    assert snapshot(bad_store) == before


@pytest.mark.parametrize(
    ("command", "damage", "message"),
    [
        pytest.param(command, damage, message, id=f"{command}-{label}")
        for label, damage, message in DAMAGES
        for command in COMMANDS
    ],
)
def test_one_bad_partition_leaves_the_others_usable(
    bad_store: Path, tmp_path: Path, command: str, damage: Callable[[Path], None], message: str
) -> None:
    """The damaged partition is named on stderr (exit 1); the other three are served."""
    damage(bad_store)
    before = snapshot(bad_store)
    out = tmp_path / "out"
    (out if command == "query" else tmp_path).mkdir(exist_ok=True)
    result = run(*command_args(command, out), "--store", str(bad_store))
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("Error: left out partition model=org--large task=boolq: ")
    assert message in lines[0]
    good = {("org--large", "mnli"), ("org--small", "boolq"), ("org--small", "mnli")}
    if command == "analyze":
        scores = pl.read_parquet(out / "scores.parquet")
        assert set(zip(scores["model"], scores["task"], strict=True)) == good
    elif command == "report":
        text = (out / "report.md").read_text()
        assert "left out partition model=org--large task=boolq" in text
        assert "| org/large | boolq |" not in text and "| org/large | mnli |" in text
    elif command == "query":
        # 40 instances x components (small: 7, large: 11) x options (boolq: 2, mnli: 3)
        assert pl.read_csv(out / "q.csv").rows() == [
            ("org--large", "mnli", 40 * 11 * 3),
            ("org--small", "boolq", 40 * 7 * 2),
            ("org--small", "mnli", 40 * 7 * 3),
        ]
    else:
        listed = [ln for ln in result.stdout.splitlines() if "org/" in ln]
        assert len(listed) == 3 and not any("org/large" in ln and "boolq" in ln for ln in listed)
    assert snapshot(bad_store) == before


@pytest.mark.parametrize(
    "sql", ["SELEC 1", "SELECT * FROM nosuchview", "SELECT nosuchcol FROM instances"]
)
def test_malformed_sql_gives_one_line(store: Path, tmp_path: Path, sql: str) -> None:
    before = snapshot(store)
    result = run("query", sql, "--store", str(store), "--out", str(tmp_path / "q.parquet"))
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "views are" in lines[0]
    assert list(tmp_path.iterdir()) == []
    assert snapshot(store) == before


def test_query_refuses_unknown_output_type(store: Path, tmp_path: Path) -> None:
    result = run("query", "SELECT 1", "--store", str(store), "--out", str(tmp_path / "q.xlsx"))
    assert result.exit_code == 1 and "*.parquet or *.csv" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_real_entry_point_has_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "layerdiv.cli", "analyze", "--store", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"Error: no store at {tmp_path / 'nothing'}: run `layerdiv extract` first"
    ]


# --- no torch ------------------------------------------------------------------------------


def test_analysis_never_imports_torch() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import layerdiv.analyze, layerdiv.store\n"
        "for m in pkgutil.iter_modules(layerdiv.analyze.__path__):\n"
        "    importlib.import_module('layerdiv.analyze.' + m.name)\n"
        "for m in pkgutil.iter_modules(layerdiv.store.__path__):\n"
        "    importlib.import_module('layerdiv.store.' + m.name)\n"
        "import layerdiv.cli\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'transformers'))\n"
        "print(len(list(pkgutil.iter_modules(layerdiv.analyze.__path__))), bad)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, bad = proc.stdout.split(" ", 1)
    assert int(count) >= 8  # every analysis module was imported
    assert bad.strip() == "[]"
