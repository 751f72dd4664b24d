"""The analysis commands of the CLI (analyze, report, query, ls): outputs and bad input; what
the reading side must never do (change the store through ``query``, delete what it did not write
with ``--out``, refuse a whole store for one bad partition, serve a part of the wrong schema, stop
reading version-1 stores); and the analysis registry that new analyses plug into."""

from __future__ import annotations

import gc
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from polars.testing import assert_frame_equal

from layerdiv.analyze import analyze
from layerdiv.analyze import registry as reg
from layerdiv.analyze.output import INDEX_NAME
from layerdiv.analyze.synthetic import random_partition, write_partition
from layerdiv.cli import main
from layerdiv.store import Store, StoreError
from layerdiv.store.atomic import temp_path
from tests.conftest import tables_as_version, write_synthetic_store

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_store(tmp_path_factory.mktemp("store"), 1, 40, (3, 5))


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its content."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def box_rows(text: str) -> list[list[str]]:
    """The body rows of the tables Polars prints (``│ a ┆ b │``; a header row is followed by
    ``╞═══``), as lists of cell strings."""
    lines = text.splitlines()
    return [
        [cell.strip() for cell in line.strip().strip("│").split("┆")]
        for line, after in zip(lines, [*lines[1:], ""], strict=True)
        if line.startswith("│") and not after.startswith("╞")
    ]


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
    # the spilled table is streamed to the output: the same rows, in (model, task, ...) order
    written = read(out / f"instance_scores.{fmt}")
    assert index["tables"]["instance_scores"]["rows"] == written.height > 0
    assert_frame_equal(written, expected.instance_scores, check_dtypes=fmt == "parquet")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_instance_scores_are_spilled_not_held(store: Path) -> None:
    results = analyze(store)
    assert "instance_scores" not in results.by_name  # not in memory
    (scan,) = results.spill.tables().values()
    folder = results.spill.folder
    assert len(list((folder / "instance_scores").glob("part-*.parquet"))) == len(
        Store(store).partitions
    )
    frame = results.instance_scores
    assert frame.equals(scan.collect())
    keys = frame.select("model", "task", "estimator", "instance")
    assert keys.equals(keys.sort(pl.all()))
    counts = frame.group_by("model", "task", "estimator").len()
    scores = results.scores.join(counts, on=["model", "task", "estimator"])
    assert scores["len"].to_list() == scores["n_instances"].to_list()
    assert results.names()[-1] == "instance_scores"
    del results, scan
    gc.collect()
    assert not folder.exists()  # removed with the results


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


def test_filters_and_scale(store: Path, tmp_path: Path) -> None:
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
        "--scale",
        "prefix",
        "--min-params",
        "1e9",
    )
    assert result.exit_code == 0, result.output
    scores = pl.read_parquet(out / "scores.parquet")
    assert set(zip(scores["model"], scores["task"], strict=True)) == {("org--large", "mnli")}
    assert json.loads((out / "index.json").read_text())["settings"]["scale"] == "prefix"
    old = CliRunner().invoke(main, ["analyze", "--store", str(store), "--lens", "prefix"])
    assert old.exit_code == 2 and "--lens prefix: the junction scale is now --scale" in old.output


def methods_links_resolve(text: str, page: str) -> list[str]:
    """The anchors of the methods page that ``text`` links as ``page#anchor``."""
    from layerdiv.analyze import methods

    linked = re.findall(re.escape(page) + r"#([A-Za-z0-9_-]+)", text)
    assert linked and set(linked) <= methods.anchors(), set(linked) - methods.anchors()
    return linked


def markdown_rows(text: str, heading: str) -> dict[str, list[str]]:
    """The rows of the first Markdown table after ``heading``, by their first cell."""
    lines = text[text.index(heading + "\n") :].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| "))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return {row[0]: row[1:] for row in rows}


def test_report(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = run("report", "--store", str(store), "--out", str(out), "--min-params", "1e9")
    assert result.exit_code == 0, result.output
    text = (out / "report.md").read_text()
    scores = analyze(store).scores.filter(pl.col("estimator") == "paper")

    def cells(metric: str, scale: float, digits: int) -> list[str]:
        values = scores.filter(pl.col("model") == "org--small").sort("task")[metric].to_list()
        return [f"{scale * v:.{digits}f}" for v in [*values, float(np.mean(values))]]

    # Table 1 in the paper's units: accuracy %, MSE and bias x100, diversity in logit units^2.
    for heading, metric, scale, digits in (
        ("#### Accuracy (%)", "accuracy", 100, 1),
        ("#### MSE (×100)", "mse", 100, 1),
        ("#### Bias (×100)", "bias", 100, 1),
        ("#### Diversity (logit²)", "diversity", 1, 2),
    ):
        assert markdown_rows(text, heading)["org/small"] == cells(metric, scale, digits), heading
    for heading in (
        "### Table 1",
        "### Fig. 3",
        "### Fig. 4",
        "### Fig. 5",
        "### Fig. 6",
        "### Saturation",
        "### Information-theoretic",
        "Estimator **`paper`**",
        "Methods: [methods §1](methods.md#section-1), [§2](methods.md#section-2)",
    ):
        assert heading in text
    # every section links the methods it uses, to an anchor of the page written beside it
    assert (out / "methods.md").read_text() == (ROOT / "docs" / "methods.md").read_text()
    assert {"section-2", "section-3", "section-7"} <= set(methods_links_resolve(text, "methods.md"))
    majority = markdown_rows(text, "#### Accuracy (%)")["*Majority class*"]
    assert len(majority) == 3  # boolq, mnli, Avg.
    pngs = sorted(p.name for p in (out / "figures").glob("*.png"))
    assert pngs == [  # two models: compared on relative depth too
        "compare_curves.png",
        "compare_depth.png",
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
    assert "#### Diversity (×100)" in text  # the ensemble's diversity is in probability units
    assert not (out / "figures").exists()


def test_query_prints_and_writes(store: Path, tmp_path: Path) -> None:
    sql = "SELECT model, task, count(*) AS n FROM instances GROUP BY ALL ORDER BY ALL"
    result = run("query", sql, "--store", str(store))
    assert result.exit_code == 0, result.output
    assert box_rows(result.stdout) == [
        [model, task, "40"] for model in ("org--large", "org--small") for task in ("boolq", "mnli")
    ]
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
    rows = box_rows(result.stdout)
    assert [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows] == [
        (model, "main", task, "40", "40", "instances")
        for model in ("org/large", "org/small")
        for task in ("boolq", "mnli")
    ]
    assert {r[-1] for r in rows} == {"2025-01-01T00:00:00Z"}
    # size: every file of the partition's folders (manifest and tables), in binary units
    from layerdiv.store import Store
    from layerdiv.store.location import human_bytes

    sizes = Store(store).sizes()
    for r, row in zip(sizes.iter_rows(named=True), rows, strict=True):
        key = {f"model={r['model']}", f"task={r['task']}"}
        files = [f for f in store.rglob("*") if f.is_file() and key <= set(f.parts)]
        assert r["bytes"] == sum(f.stat().st_size for f in files if f.name[0] != ".") > 10_000
        assert human_bytes(r["bytes"]) in row
    assert human_bytes(1023) == "1023 B" and human_bytes(3 * 2**30 + 2**29) == "3.5 GiB"


def test_a_text_only_store_summarises_lists_queries_and_reports(tmp_path: Path) -> None:
    """Running text has no options and no accuracy: ``task_summary`` leaves it out (an empty frame
    of the usual columns), and ``ls``, ``query`` and ``report`` work on it."""
    pytest.importorskip("plotly")
    from layerdiv.analyze import task_summary
    from layerdiv.analyze.api import SUMMARY_SCHEMA
    from layerdiv.analyze.report import NO_CHOICE_EXPLORER
    from layerdiv.analyze.synthetic import synthesize_text_store

    store = tmp_path / "store"
    synthesize_text_store(store, 1, 6, 20, 3, chunk=4, lens=True, skips=True, progress=False)
    summary = task_summary(analyze(store))
    assert summary.is_empty() and summary.schema == SUMMARY_SCHEMA
    result = run("ls", "--store", str(store))
    assert result.exit_code == 0, result.output
    rows = [r[:8] for r in box_rows(result.stdout)]
    # documents counted as such, 1 + 2 x 3 components, no option count (a text task has none)
    assert rows == [["synth/text-model-00", "main", "fineweb", "6", "6", "documents", "7", "null"]]
    sql = "SELECT count(*) AS n, count(DISTINCT doc) AS docs FROM token_blocks"
    result = run("query", sql, "--store", str(store))
    assert result.exit_code == 0, result.output
    assert box_rows(result.stdout) == [[str(6 * 20 * 3), "6"]]
    typo = CliRunner().invoke(main, ["query", "SELECT * FROM token_block", "--store", str(store)])
    assert typo.exit_code != 0 and "the views of this store are" in typo.output
    assert "token_blocks" in typo.output.splitlines()[-1]
    out = tmp_path / "report"
    result = run("report", "--store", str(store), "--out", str(out), "--format", "md,html")
    assert result.exit_code == 0, result.output
    assert NO_CHOICE_EXPLORER in result.output and "no store was given" not in result.output
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "## Running text: geometry" in md and "Running text: geometry" in html
    # the choice analyses' estimator and junction scale are not named where none ran
    assert "Estimator" not in md and "scale" not in md.split("\n## ")[0]
    methods_links_resolve(html, "methods.html")
    assert 'id="section-9"' in (out / "methods.html").read_text()
    assert 'id="explorer"' not in html
    # beside a choice task: the summary has its rows only, with the same columns
    logits, gold, rms, kinds = random_partition(np.random.default_rng(0), 10, 3, 2)
    write_partition(store, "org/choice", "boolq", logits, gold, kinds, rms)
    mixed = task_summary(analyze(store))
    assert mixed.schema == SUMMARY_SCHEMA
    assert mixed.select("model", "task").rows() == [("org--choice", "boolq")]


# --- bad input: one clear line, exit 1, nothing changed ------------------------------------


BROKEN = ("org--large", "boolq")
"""The partition the damages below break; the store's three others stay readable."""
ONLY_BROKEN = ["--model", "org/large", "--task", "boolq"]


def _partition_files(root: Path, table: str) -> list[Path]:
    model, task = BROKEN
    return sorted((root / table / f"model={model}" / "revision=main" / f"task={task}").glob("*"))


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
    where = "partition model=org--large revision=main task=boolq"
    assert lines[0].startswith(f"Error: left out {where}: ")
    assert message in lines[0]
    good = {("org--large", "mnli"), ("org--small", "boolq"), ("org--small", "mnli")}
    if command == "analyze":
        scores = pl.read_parquet(out / "scores.parquet")
        assert set(zip(scores["model"], scores["task"], strict=True)) == good
    elif command == "report":
        text = (out / "report.md").read_text()
        assert "left out partition model=org--large revision=main task=boolq" in text
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
    assert len(lines) == 1 and lines[0].startswith("Error: ")
    assert "the views of this store are components, instances, manifests" in lines[0]
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


# --- reading a store written in several parts ----------------------------------------------

N = 20  # instances per partition


@pytest.fixture(scope="module")
def chunked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two models x one task of N instances, written in chunks of 8 (parts 0-7, 8-15, 16-19)."""
    root = tmp_path_factory.mktemp("chunked")
    rng = np.random.default_rng(5)
    for model in ("org/a", "org/b"):
        logits, gold, rms, kinds = random_partition(rng, N, 2, 3)
        write_partition(root, model, "t", logits, gold, kinds, rms, chunk=8)
    return root


@pytest.fixture
def copy(chunked: Path, tmp_path: Path) -> Path:
    target = tmp_path / "store"
    shutil.copytree(chunked, target)
    return target


# --- query cannot change the store -----------------------------------------------------------


@pytest.mark.parametrize(
    "sql",
    [
        "COPY (SELECT 1 AS x) TO '{chunked}/instances' (FORMAT parquet, OVERWRITE)",
        "COPY instances TO "
        "'{chunked}/instances/model=org--a/revision=main/task=t/part-0000000-000008.parquet'",
        "EXPORT DATABASE '{chunked}/exported'",
        "ATTACH '{chunked}/new.duckdb' AS extra",
        "SELECT * FROM read_parquet('{chunked}/components/**/*.parquet')",
    ],
)
def test_query_touches_no_file(copy: Path, sql: str) -> None:
    before = snapshot(copy)
    result = run("query", sql.format(chunked=copy), "--store", str(copy))
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("Error: Permission Error") and "writes no file" in line, line
    assert snapshot(copy) == before


def test_query_cannot_lift_its_own_limits(copy: Path) -> None:
    before = snapshot(copy)
    sql = f"SET allowed_directories = ['{copy}']; COPY (SELECT 1 AS x) TO '{copy}/x.csv'"
    result = run("query", sql, "--store", str(copy))
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert "the configuration has been locked" in line, line
    assert snapshot(copy) == before


def test_query_out_inside_the_store_is_refused(copy: Path) -> None:
    before = snapshot(copy)
    folder = copy / "instances" / "model=org--a" / "revision=main" / "task=t"
    part = folder / "part-0000000-000008.parquet"
    for target in (part, copy / "q.csv"):
        result = run("query", "SELECT 1 AS x", "--store", str(copy), "--out", str(target))
        assert result.exit_code == 1
        assert result.stderr.strip() == (
            f"Error: {target} is inside the store {copy}; layerdiv writes nothing there outside "
            "`extract`: choose another output path"
        )
    assert snapshot(copy) == before


def test_query_max_rows_must_be_positive(chunked: Path) -> None:
    result = run("query", "SELECT 1", "--store", str(chunked), "--max-rows", "-1")
    assert result.exit_code == 2
    assert "Invalid value for '--max-rows': -1 is not in the range x>=1" in result.stderr


def test_query_says_how_many_rows_it_did_not_show(chunked: Path) -> None:
    sql = "SELECT model, instance FROM instances ORDER BY model, instance"
    result = run("query", sql, "--store", str(chunked), "--max-rows", "3")
    assert result.exit_code == 0, result.output
    assert box_rows(result.stdout) == [["org--a", "0"], ["org--a", "1"], ["org--a", "2"]]
    assert result.stdout.strip().splitlines()[-1] == (
        f"{2 * N - 3} more rows not shown ({2 * N} in all): raise --max-rows, or write them all "
        "with --out FILE"
    )
    whole = run("query", sql, "--store", str(chunked), "--max-rows", str(2 * N))
    assert len(box_rows(whole.stdout)) == 2 * N and "more rows" not in whole.stdout


def test_query_prints_every_statement(chunked: Path, tmp_path: Path) -> None:
    sql = (
        "SELECT count(*) AS n FROM instances; "
        "CREATE TEMP TABLE per AS SELECT model, count(*) AS n FROM instances GROUP BY ALL; "
        "SELECT * FROM per ORDER BY model"
    )
    result = run("query", sql, "--store", str(chunked))
    assert result.exit_code == 0, result.output
    assert box_rows(result.stdout) == [
        [str(2 * N)],
        ["2"],  # CREATE reports the rows it stored
        ["org--a", str(N)],
        ["org--b", str(N)],
    ]
    out = tmp_path / "per.csv"
    result = run("query", sql, "--store", str(chunked), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert pl.read_csv(out).rows() == [("org--a", N), ("org--b", N)]


# --- --out replaces only what layerdiv wrote -----------------------------------------------


def test_out_replaces_its_own_files_only(chunked: Path, tmp_path: Path) -> None:
    out = tmp_path / "results"
    assert run("analyze", "--store", str(chunked), "--out", str(out)).exit_code == 0
    index = json.loads((out / INDEX_NAME).read_text())
    assert sorted(index["files"]) == sorted(f"{name}.parquet" for name in index["tables"])
    # A second run replaces it...
    result = run("analyze", "--store", str(chunked), "--out", str(out), "--model", "org/a")
    assert result.exit_code == 0, result.output
    assert set(pl.read_parquet(out / "scores.parquet")["model"]) == {"org--a"}
    # ...but not once the user has put something there: a file, or a whole store.
    mine = out / "notes.txt"
    mine.write_text("keep me")
    before = snapshot(out)
    result = run("analyze", "--store", str(chunked), "--out", str(out))
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"Error: {out} holds notes.txt, which layerdiv did not write; it replaces only its own "
        "results: move them away or choose another output folder"
    )
    assert snapshot(out) == before
    mine.unlink()
    shutil.copytree(chunked, out / "store")
    before = snapshot(out)
    result = run("report", "--store", str(out / "store"), "--out", str(out))
    assert result.exit_code == 1 and "holds store and " in result.stderr
    assert snapshot(out) == before


def test_report_index_lists_its_figures(chunked: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert run("report", "--store", str(chunked), "--out", str(out)).exit_code == 0
    files = json.loads((out / INDEX_NAME).read_text())["files"]
    assert sorted(files) == sorted(
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if p.is_file() and p.name != INDEX_NAME
    )
    assert "report.md" in files and "figures/fig3_correlations.png" in files
    assert run("report", "--store", str(chunked), "--out", str(out)).exit_code == 0


def test_out_inside_the_store_is_refused(copy: Path) -> None:
    before = snapshot(copy)
    for command in ("analyze", "report"):
        result = run(command, "--store", str(copy), "--out", str(copy / "results"))
        assert result.exit_code == 1 and "is inside the store" in result.stderr
    assert snapshot(copy) == before


def test_temporary_folders_of_a_killed_run_are_cleaned(chunked: Path, tmp_path: Path) -> None:
    """A run killed with SIGKILL inside the output's temporary folder leaves it behind; the next
    run removes it (its process is gone) but not one a live process is writing."""
    out = tmp_path / "results"
    code = (
        "import os, signal, sys\n"
        "from layerdiv.analyze.output import result_dir\n"
        "with result_dir(sys.argv[1], {}) as tmp:\n"
        "    (tmp / 'half.parquet').write_bytes(b'x')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(out)], check=False)
    assert proc.returncode == -9
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".results.")]
    assert left.name.endswith(".tmp") and (left / "half.parquet").exists()
    live = temp_path(out)  # this (live) process's
    live.mkdir()
    assert run("analyze", "--store", str(chunked), "--out", str(out)).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "results"]


# --- every reader checks every part --------------------------------------------------------


def test_a_damaged_later_part_is_named(copy: Path, tmp_path: Path) -> None:
    folder = copy / "components" / "model=org--a" / "revision=main" / "task=t"
    part = folder / "part-0000008-000008.parquet"
    part.write_bytes(part.read_bytes()[:-64])
    for args in (
        ["analyze", "--out", str(tmp_path / "r")],
        ["query", "SELECT count(*) FROM components"],
        ["ls"],
    ):
        result = run(*args, "--store", str(copy), "--model", "org/a")
        assert result.exit_code == 1
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"Error: {part}: unreadable Parquet (")
        where = "partition model=org--a revision=main task=t"
        assert line.endswith(f"re-extract {where} with --overwrite")


def test_a_part_with_bad_pages_is_named_when_read(copy: Path) -> None:
    """A part whose footer is intact but whose data pages are not: found when its rows are read,
    and the error names the file."""
    folder = copy / "components" / "model=org--b" / "revision=main" / "task=t"
    part = folder / "part-0000016-000004.parquet"
    data = bytearray(part.read_bytes())
    data[8:400] = b"\xab" * 392
    part.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"^{part}: unreadable part .*re-extract partition"):
        analyze(copy, models=["org/b"])


# --- schema version 1 stays readable -------------------------------------------------------


def downgrade_to_version_1(root: Path) -> None:
    """Rewrite a store as layerdiv wrote it at schema version 1 (no ``cos_prev``, no
    ``hidden_size`` or ``extra_tables`` in the manifest)."""
    tables_as_version(root, 1)
    for path in root.glob("manifests/**/manifest.json"):
        data = json.loads(path.read_text())
        data["schema_version"] = 1
        del data["hidden_size"], data["extra_tables"]
        path.write_text(json.dumps(data))


def test_version_1_store_is_read_like_today(chunked: Path, copy: Path) -> None:
    downgrade_to_version_1(copy)
    assert "cos_prev" not in pq.read_schema(next(copy.glob("components/**/*.parquet"))).names
    assert {p.manifest.schema_version for p in Store(copy).partitions} == {1}
    new, old = analyze(chunked), analyze(copy)
    for name in ("scores", "curves", "modules", "correlations", "information"):
        assert_frame_equal(old.tables()[name], new.tables()[name], rel_tol=1e-12, abs_tol=0)
    result = run(
        "query",
        "SELECT count(*) AS n, count(cos_prev) AS with_cos_prev FROM components",
        "--store",
        str(copy),
    )
    assert result.exit_code == 0, result.output
    assert box_rows(result.stdout) == [[str(2 * N * 5 * 3), "0"]]
    assert run("ls", "--store", str(copy)).exit_code == 0


# --- ls filters ----------------------------------------------------------------------------


def test_ls_takes_model_and_task(chunked: Path) -> None:
    result = run("ls", "--store", str(chunked), "--model", "org/b", "--task", "t")
    assert result.exit_code == 0, result.output
    assert [row[:4] for row in box_rows(result.stdout)] == [["org/b", "main", "t", str(N)]]
    result = run("ls", "--store", str(chunked), "--task", "other")
    assert result.exit_code == 1 and "no extracted data matches" in result.stderr


# --- the analysis registry -----------------------------------------------------------------


def _extra_tables(ctx: reg.Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    ctx.notes.append(f"extra: saw {sorted(prior)}")
    sizes = prior["scores"].group_by("model").agg(pl.col("n_instances").max())
    return {"extra": sizes.with_columns(pl.lit(len(ctx.parts)).alias("n_parts")).sort("model")}


def _extra_report(ctx: reg.ReportContext) -> str:
    return f"The extra analysis saw {ctx.tables['extra'].height} models."


@pytest.fixture
def extra_analysis(monkeypatch: pytest.MonkeyPatch) -> reg.Analysis:
    reg.registered()  # the built-in analyses first
    monkeypatch.setattr(reg.ANALYSES, "by_name", dict(reg.ANALYSES.by_name))
    return reg.register(reg.Analysis("extra", "An extra analysis", _extra_tables, _extra_report))


def test_a_registered_analysis_runs_writes_and_reports(
    chunked: Path, tmp_path: Path, extra_analysis: reg.Analysis
) -> None:
    texts = [
        "text_geometry",
        "text_lens",
        "text_skips",
        "text_profiles",
        "text_groups",
        "effective_depth",
        "decided_depth",
        "lens_comparison",
        "igrad",
        "choice_igrad",
        "erasure",
        "choice_erasure",
        "sinks",
        "bos_norm",
        "revisions",
        "depth_law",
        "maps",
        "compare",
    ]
    names = ["paper", "depth", "gram", "skips", "heads", "reweight", "lens_curves", *texts, "extra"]
    assert [a.name for a in reg.registered()] == names
    results = analyze(chunked)
    assert results.extra.rows() == [("org--a", N, 2), ("org--b", N, 2)]
    # The store has no heads: the heads analysis says so; its and depth's notes come first.
    missing = "Head scores: not extracted for any partition (`layerdiv extract --heads` adds it)"
    assert any(n.startswith(missing) for n in results.notes)
    note = results.notes[-1]
    assert note.startswith(
        "extra: saw ['component_scores', 'correlation_means', 'correlations', 'curves'"
    )
    out = tmp_path / "results"
    result = run("analyze", "--store", str(chunked), "--out", str(out))
    assert result.exit_code == 0 and result.stdout.strip().splitlines()[-1] == note
    assert pl.read_parquet(out / "extra.parquet").equals(results.extra)
    report = tmp_path / "report"
    assert run("report", "--store", str(chunked), "--out", str(report)).exit_code == 0
    text = (report / "report.md").read_text()
    assert "## An extra analysis\n\nThe extra analysis saw 2 models.\n\n## Provenance" in text
    assert text.index("## The paper's analysis") < text.index("## An extra analysis")


def test_analyses_run_after_those_they_follow_and_a_cycle_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reg.registered()
    monkeypatch.setattr(reg.ANALYSES, "by_name", dict(reg.ANALYSES.by_name))

    def none(ctx: reg.Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
        return {}

    reg.register(reg.Analysis("reads_later", "Reads later", none, after=("later",)))
    reg.register(reg.Analysis("later", "Later", none, after=("paper",)))
    names = [a.name for a in reg.registered()]
    assert names.index("paper") < names.index("later") < names.index("reads_later")
    assert names.index("text_geometry") < names.index("text_profiles")
    reg.register(reg.Analysis("later", "Later", none, after=("reads_later",)))
    with pytest.raises(reg.RegistryError, match="reads_later, later each run after another"):
        reg.registered()
    reg.register(reg.Analysis("later", "Later", none, after=("nothing",)))
    names = [a.name for a in reg.registered()]  # left out, with those after it, each named
    assert "later" not in names and "reads_later" not in names and "paper" in names
    assert reg.plugin_problems() == [
        "analysis 'later' (module tests.test_analyze_cli) left out: it runs after 'nothing', "
        "which is not registered",
        "analysis 'reads_later' (module tests.test_analyze_cli) left out: it runs after "
        "'later', which is not registered",
    ]


def test_an_analysis_may_not_replace_a_table(
    chunked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg.registered()
    monkeypatch.setattr(reg.ANALYSES, "by_name", dict(reg.ANALYSES.by_name))
    reg.register(reg.Analysis("clash", "Clash", lambda ctx, prior: {"scores": prior["scores"]}))
    results = analyze(chunked)  # left out with a note; the built-in scores kept
    assert (
        "analysis 'clash' (module tests.test_analyze_cli) left out: it returned table "
        "'scores', which exists (another analysis's)" in results.notes
    )
    assert "clash" not in results.analyses and results.scores.height > 0


def test_results_name_every_table(chunked: Path) -> None:
    results = analyze(chunked)
    assert results.scores is results.tables()["scores"]
    with pytest.raises(AttributeError, match="no result table 'nosuch'; the tables are manifests"):
        results.nosuch  # noqa: B018


def test_analyses_run_on_the_in_memory_engine_and_leave_the_setting_alone() -> None:
    @reg.partition_engine
    def affinity() -> str | None:
        return pl.Config.state().get("POLARS_ENGINE_AFFINITY")

    with pl.Config(engine_affinity="streaming"):
        assert [affinity(), affinity()] == ["in-memory", "in-memory"]  # every call
        assert pl.Config.state()["POLARS_ENGINE_AFFINITY"] == "streaming"


def test_map_partitions_keeps_the_order_runs_them_at_once_and_bounds_what_waits() -> None:
    started: list[int] = []
    finished: list[int] = []

    def slow_first(i: int) -> int:
        started.append(i)
        time.sleep(0.3 if i == 0 else 0.0)
        finished.append(i)
        return i * i

    workers = reg.PARTITION_WORKERS
    results = reg.map_partitions(slow_first, range(3 * workers))
    assert next(results) == 0
    assert finished[-1] == 0  # the others ran while the first one slept, yet it comes first
    assert len(started) <= workers  # no more submitted than can be waited on
    assert list(results) == [i * i for i in range(1, 3 * workers)]


# --- no torch ------------------------------------------------------------------------------


def test_analysis_never_imports_torch() -> None:
    """Every module of analyze/ and store/ (analyses included), every measurement's but its hooks
    (its declaration and analyses) and the CLI import without torch."""
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import layerdiv.analyze, layerdiv.measurements, layerdiv.store\n"
        "names = [m.name for p in (layerdiv.analyze, layerdiv.measurements, layerdiv.store)\n"
        "         for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')\n"
        "         if not m.name.endswith('.hooks')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "import layerdiv.cli\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'transformers'))\n"
        "print(json.dumps([names, bad]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names, bad = json.loads(proc.stdout)
    root = Path(__file__).parents[1]
    on_disk = {
        ".".join(["layerdiv", *p.relative_to(root).with_suffix("").parts]).removesuffix(".__init__")
        for folder in ("analyze", "measurements", "store")
        for p in (root / folder).rglob("*.py")
        if p.stem != "hooks"
    }
    assert sorted(names) == sorted(
        on_disk - {"layerdiv.analyze", "layerdiv.measurements", "layerdiv.store"}
    )
    assert "layerdiv.measurements.igrad.analysis" in names
    assert "layerdiv.analyze.analyses.paper" in names
    assert bad == []
