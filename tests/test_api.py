"""The Python API a notebook uses: ``import layerdiv`` and its entry points, their doctests, and
what they say about bad input (one named error at the call, listing what exists)."""

from __future__ import annotations

import doctest
import json
import pydoc
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import polars as pl
import pytest

import layerdiv
from layerdiv.analyze import api
from layerdiv.analyze.output import OutputError
from layerdiv.errors import LayerdivError, LayerdivWarning
from layerdiv.schemas import SCHEMA_VERSION, TABLES
from layerdiv.store.key import KEY
from layerdiv.store.reader import StoreError

from .conftest import write_synthetic_store

# A store of 2 models x 2 tasks of 6 instances: what the doctests show.
N_INSTANCES = 6


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_store(tmp_path_factory.mktemp("api") / "store", 0, N_INSTANCES, (2, 3))


@pytest.fixture(scope="module")
def results(store: Path) -> layerdiv.Results:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayerdivWarning)
        return layerdiv.run_analysis(store)


def test_import_is_cheap_and_lists_the_entry_points() -> None:
    code = (
        "import sys, layerdiv; "
        "print(sorted(m for m in ('torch', 'polars', 'duckdb') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    names = {"Store", "query", "run_analysis", "Results", "ls", "LayerdivError", "__version__"}
    assert names <= set(dir(layerdiv))
    text = pydoc.plain(pydoc.render_doc(layerdiv))
    for name in ("class Store", "class Results", "query(", "run_analysis", "class LayerdivError"):
        assert name in text
    assert "analyze(" in pydoc.plain(pydoc.render_doc(layerdiv.analyze))
    assert layerdiv.run_analysis is api.analyze
    assert layerdiv.analyze.__name__ == "layerdiv.analyze"  # the subpackage, not shadowed
    assert layerdiv.Store is layerdiv.store.Store and layerdiv.LayerdivError is LayerdivError


@pytest.mark.parametrize("module", ["layerdiv", "layerdiv.analyze.api"])
def test_docstring_examples_run(store: Path, module: str) -> None:
    mod = sys.modules[module]
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    found = finder.find(mod, module, globs={**vars(mod), "path": str(store)})
    assert sum(len(t.examples) for t in found) >= 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayerdivWarning)
        for test in found:
            runner.run(test)
    assert runner.failures == 0


def test_unknown_table_is_refused_at_the_call(store: Path) -> None:
    st = layerdiv.Store(store)
    with pytest.raises(StoreError, match=r"no table 'component'.*components, instances$"):
        st.scan("component")
    with pytest.raises(StoreError, match=r"no table 'heads'.*--heads"):
        st.scan("heads")
    with pytest.raises(LayerdivError, match=r"heads.*views of this store are components, inst"):
        layerdiv.query(st, "SELECT * FROM heads")
    with pytest.raises(LayerdivError, match=r"syntax error.*views of this store are comp"):
        layerdiv.query(st, "SELEC 1")


def test_unknown_names_options_and_estimators_are_refused(store: Path, results: Any) -> None:
    with pytest.raises(StoreError, match="the store holds: org--large/main/boolq"):
        layerdiv.run_analysis(store, tasks="bbc5")
    with pytest.raises(LayerdivError, match="unknown option 'reweigth': use one of reweight"):
        layerdiv.run_analysis(store, options={"reweigth": True})
    with pytest.raises(LayerdivError, match="unknown scale 'last': use one of final, prefix"):
        layerdiv.run_analysis(store, scale="last")  # type: ignore[arg-type]
    with pytest.raises(LayerdivError, match=r"lens='prefix': the junction scale is now .*scale="):
        layerdiv.run_analysis(store, lens="prefix")
    with pytest.raises(LayerdivError, match="unknown estimator 'papers': use one of paper, ens"):
        layerdiv.analyze.task_summary(results, estimator="papers")  # type: ignore[arg-type]


def test_a_string_is_one_name(store: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayerdivWarning)
        scores = layerdiv.run_analysis(store, models="org/small", tasks="mnli").scores
    assert set(scores["model"]) == {"org--small"} and set(scores["task"]) == {"mnli"}
    assert layerdiv.ls(store, tasks="boolq")["task"].to_list() == ["boolq", "boolq"]
    st = layerdiv.Store(store)
    assert st.scan("instances", tasks="boolq").collect().height == 2 * N_INSTANCES
    sql = "SELECT count(*) FROM instances"
    assert layerdiv.query(st, sql, models="org--large").item() == 2 * N_INSTANCES


def test_one_dtype_per_column_name(store: Path, results: Any) -> None:
    st = layerdiv.Store(store)
    frames = {**{f"store {t}": st.scan(t).collect() for t in st.tables()}, **results.tables()}
    frames["query components"] = layerdiv.query(st, "SELECT * FROM components")
    seen: dict[str, dict[pl.DataType, list[str]]] = {}
    for table, frame in frames.items():
        for column, dtype in frame.schema.items():
            # Result tables hold Float64 means of the store's Float32 values: one kind, float.
            kind = pl.Float64() if dtype.is_float() else dtype
            seen.setdefault(column, {}).setdefault(kind, []).append(table)
    assert {c: d for c, d in seen.items() if len(d) > 1} == {}
    assert frames["store components"]["name"].dtype == pl.String
    # A store frame joins a result table on the columns they share.
    comps = st.scan("components").filter(pl.col("option") == 0).collect()
    joined = comps.join(results.geometry, on=["model", "task", "name"], suffix="_geometry")
    assert joined.height == results.geometry["n_instances"].sum()
    curves = results.curves.filter(pl.col("estimator") == "paper")
    joined = comps.join(curves, on=["model", "task", "component", "name", "kind"])
    assert joined.height == comps.height


def test_scan_instances_returns_every_stored_column(store: Path) -> None:
    frame = layerdiv.Store(store).scan("instances").collect()
    assert frame.columns == [*TABLES["instances"].names, *KEY]


def test_notes_are_warned(store: Path) -> None:
    with pytest.warns(LayerdivWarning) as caught:
        res = layerdiv.run_analysis(store, tasks="boolq", min_params=1e12)
    said = [str(w.message) for w in caught]
    assert res.depth_curves.is_empty() and res.head_scores.is_empty()
    assert any(s.startswith("depth_curves and depth_fits are empty") for s in said)
    assert any(s.startswith("Head scores: not extracted for") for s in said)
    assert said == res.notes


def test_write_has_the_guards_of_the_command_line(store: Path, results: Any, tmp_path: Path):
    for inside in (store / "results", store):
        with pytest.raises(OutputError, match="is inside the store") as err:
            results.write(inside)
        assert "--out" not in str(err.value)
    out = results.write(tmp_path / "res")  # settings default to the analysis's own
    index = json.loads((out / "index.json").read_text())
    assert index["settings"]["store"] == str(store) and index["settings"]["scale"] == "final"
    assert results.write(out, "csv") == out  # an earlier result is replaced
    (out / "mine.txt").write_text("notes")
    with pytest.raises(OutputError, match="layerdiv did not write") as err:
        results.write(out)
    assert "--out" not in str(err.value)
    with pytest.raises(StoreError, match="folder of analysis results"):
        layerdiv.Store(out)


def test_reprs_are_short(store: Path, results: Any) -> None:
    text = repr(results)
    assert len(text) < 4000 and text.startswith("Results(scale='final', min_params=0): 23 tables")
    lines = text.splitlines()
    scores = f"{results.scores.height:,} x {results.scores.width}"
    assert any(re.fullmatch(f"  scores +{scores}", line) for line in lines)
    assert any(line.startswith("  instance_scores ") for line in lines)  # spilled, counted
    assert any(re.fullmatch(r"  head_scores +0 x \d+  \(empty\)", line) for line in lines)
    assert [line[len("note: ") :] for line in lines if line.startswith("note: ")] == results.notes
    page = results._repr_html_()
    assert "<table>" in page and "<code>curves</code>" in page and len(page) < 8000
    assert {"scores", "curves", "instance_scores"} <= set(dir(results))
    st = layerdiv.Store(store)
    assert repr(st) == f"Store({str(store)!r}): 2 models x 2 tasks, 4 partitions"
    page = st._repr_html_()
    row = "<td>org--small</td><td>main</td><td>mnli</td><td>6 of 6</td>"
    assert page.count("<tr>") == 1 + 4 and row in page
    assert repr(st.partitions[0]) == (
        "PartitionInfo(model='org--large', revision='main', task='boolq': 6 of 6 instances, "
        "7 components, 2 options)"
    )


def test_home_is_expanded(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(store.parent))
    assert layerdiv.Store("~/store").root == store


def test_the_python_api_page_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples of docs/python-api.md, on a synthetic store shaped like the demo's."""
    from layerdiv.demo import synthesize_demo_store

    page = Path(__file__).parents[1] / "docs" / "python-api.md"
    synthesize_demo_store(tmp_path / "layerdiv-demo" / "store")
    monkeypatch.chdir(tmp_path)
    test = doctest.DocTestParser().get_doctest(page.read_text(), {}, page.name, str(page), 0)
    assert len(test.examples) >= 15
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0


def test_scan_reads_every_schema_version(store: Path, tmp_path: Path) -> None:
    from .test_analyze_cli import downgrade_to_version_1

    # The old model's parts come first: the columns are today's all the same.
    mixed = tmp_path / "store"
    shutil.copytree(store, mixed)
    old = tmp_path / "old"
    for table in ("components", "instances", "manifests"):
        shutil.copytree(mixed / table / "model=org--large", old / table / "model=org--large")
    downgrade_to_version_1(old)
    for table in ("components", "instances", "manifests"):
        shutil.rmtree(mixed / table / "model=org--large")
        shutil.copytree(old / table / "model=org--large", mixed / table / "model=org--large")
    st = layerdiv.Store(mixed)
    assert {p.manifest.schema_version for p in st.partitions} == {1, SCHEMA_VERSION}
    comps = st.scan("components").collect()
    assert comps.columns == [*TABLES["components"].names, *KEY]
    by_model = comps.group_by("model").agg(pl.col("cos_prev").is_not_null().sum())
    assert dict(by_model.iter_rows())["org--large"] == 0
    assert dict(by_model.iter_rows())["org--small"] > 0


def test_what_a_notebook_user_types_works(store: Path, results: Any) -> None:
    st = layerdiv.Store(store)
    assert st.tables == ["components", "instances"]  # an attribute, a list
    assert st.tables(tasks="boolq") == ["components", "instances"]  # or called with filters
    by_task = st.scan("instances", task="boolq").collect()
    assert by_task.equals(st.scan("instances", tasks="boolq").collect())
    assert set(by_task["task"]) == {"boolq"}
    with pytest.raises(StoreError, match="tasks= or task=, not both"):
        st.scan("instances", tasks="boolq", task="mnli")
    sql = "SELECT task, count(*) AS n FROM instances GROUP BY task ORDER BY task"
    assert st.query(sql).equals(layerdiv.query(store, sql))
    with pytest.raises(LayerdivError, match="views of this store are components, instances"):
        st.query("SELECT * FROM heads")
    assert results["scores"].equals(results.scores)
    with pytest.raises(KeyError, match="no result table 'score'; the tables are"):
        results["score"]
    assert layerdiv.run_analysis.__name__ == "run_analysis"
    doc = pydoc.plain(pydoc.render_doc(layerdiv.run_analysis))
    assert "function run_analysis in" in doc and doc.splitlines()[2].startswith("run_analysis(")
