"""The HTML report (``layerdiv report --format html``): its numbers equal the result tables and
the store, its bad input is one line, and the page works in a real browser (headless Chromium
through chromium-driver: no console error, every figure drawn, the explorer redraws, no
network)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner, Result

from layerdiv.analyze import analyze
from layerdiv.analyze.html.explorer import settle_junction, stratified_sample
from layerdiv.analyze.metrics import METRICS
from layerdiv.analyze.report import write_report
from layerdiv.analyze.synthetic import random_heads, random_partition, write_partition
from layerdiv.cli import main
from layerdiv.store import Store
from tests.conftest import DEMO, tables_as_version

N, EXPLORED = 60, 24
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
NO_BROWSER = (
    "chromium and chromium-driver are not installed and could not be (`make test` runs "
    "`apt-get install -y chromium chromium-driver` as root)"
)


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def write_store(root: Path) -> Path:
    """Two models x two tasks with heads (one model) and layer skips (one partition)."""
    rng = np.random.default_rng(7)
    for model, blocks in (("org/small", 3), ("org/large", 5)):
        for task, k in (("boolq", 2), ("mnli", 3)):
            logits, gold, rms, kinds = random_partition(rng, N, blocks, k)
            optional: dict[str, np.ndarray] = {}
            head_ids: list[int] = []
            if model == "org/small":
                logits, optional["heads"], head_ids = random_heads(rng, logits, gold, kinds, 4)
            if (model, task) == ("org/large", "mnli"):
                optional["skips"] = rng.normal(size=(N, blocks, k))
            write_partition(root, model, task, logits, gold, kinds, rms, optional=optional,
                            head_ids=head_ids, chunk=25)  # fmt: skip
    return root


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_store(tmp_path_factory.mktemp("html") / "store")


@pytest.fixture(scope="module")
def page(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html-report") / "report"
    write_report(analyze(store), out, "paper", str(store), "md,html", EXPLORED)
    return out / "report.html"


def embedded(page: Path, name: str) -> Any:
    """The JSON the page embeds under the script id ``name``."""
    text = page.read_text()
    match = re.search(f'<script type="application/json" id="{name}">(.*?)</script>', text, re.S)
    assert match is not None, name
    return json.loads(match.group(1).replace("<\\/", "</"))


def floats(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4")


# --- the page's numbers --------------------------------------------------------------------


def test_both_reports_and_nothing_fetched_from_outside(page: Path) -> None:
    out = page.parent
    assert sorted(p.name for p in out.iterdir()) == ["figures", "index.json", "methods.html",
                                                      "methods.md", "report.html",
                                                      "report.md"]  # fmt: skip
    text = page.read_text()
    assert "Content-Security-Policy" in text and "default-src 'none'" in text
    # No element refers to anything outside the page (scripts aside: Plotly's bundle names its
    # web site in strings; what scripts load is checked in the browser).
    markup = re.sub(r"<script>.*?</script>", "", text, flags=re.S)
    assert not re.search(r'(src|href)="(https?:)?//', markup)
    assert "<link" not in markup
    assert "figures/" not in re.sub(r'data-figure="[^"]+"', "", text)


def test_figures_equal_the_curves_table(page: Path, store: Path) -> None:
    curves = analyze(store).curves.filter(pl.col("estimator") == "paper")
    figures = embedded(page, "figures-data")
    assert {f"fig5_curves_org--{m}.png" for m in ("small", "large")} <= set(figures)
    checked = 0
    for slug in ("org--small", "org--large"):
        for trace in figures[f"fig5_curves_{slug}.png"]["data"]:
            metric = next(m for m in METRICS.values() if m.title == trace["name"])
            # Hover: "<model> · <task><br>j = <j>: <component><br><metric> <value> <unit>".
            hover = [re.match(r".+ · (\w+)<br>j = (\d+): (.+)<br>.+ (-?[\d.]+) ", h).groups()  # type: ignore[union-attr]
                     for h in trace["customdata"]]  # fmt: skip
            task = hover[0][0]
            want = curves.filter((pl.col("model") == slug) & (pl.col("task") == task)).sort("j")
            assert trace["x"] == want["j"].to_list() == [int(h[1]) for h in hover]
            assert [h[2] for h in hover] == [str(c) for c in want["component"]]
            shown = np.array([float(h[3]) for h in hover])
            np.testing.assert_allclose(shown, want[metric.name] * metric.unit("paper").scale,
                                       atol=5e-4)  # fmt: skip
            z = (want[metric.name] - want[metric.name].mean()) / want[metric.name].std()
            np.testing.assert_allclose(trace["y"], z, rtol=1e-9, atol=1e-12)
            checked += 1
    assert checked == 2 * 2 * len(METRICS)


def test_explorer_equals_store_and_instance_scores(page: Path, store: Path) -> None:
    data = embedded(page, "explorer-data")
    scores = analyze(store).instance_scores.filter(pl.col("estimator") == "paper")
    st = Store(store)
    assert len(data["partitions"]) == 4
    for p in data["partitions"]:
        ids = p["instances"]
        assert len(ids) == EXPLORED and ids == sorted(ids)
        mine = scores.filter((pl.col("model") == p["model"]) & (pl.col("task") == p["task"]))
        want = mine.filter(pl.col("instance").is_in(ids)).sort("instance")
        assert p["gold"] == want["gold"].to_list() and p["pred"] == want["pred"].to_list()
        # Stratified: correct and wrong instances in the shares of the whole partition.
        share = mine["correct"].mean()
        assert abs(np.mean(np.array(p["gold"]) == np.array(p["pred"])) - share) <= 1.5 / len(ids)
        comps = (
            st.scan("components", [p["model"]], [p["task"]])
            .filter(pl.col("instance").is_in(ids))
            .sort("instance", "component", "option")
            .collect()
        )
        assert np.array_equal(floats(p["logits"]), comps["logit"].to_numpy())
        assert p["prompts"] == [f"Synthetic prompt of instance {i} of {p['task']}." for i in ids]
        assert (p["heads"] is not None) == (p["model"] == "org--small")
        if p["heads"] is not None:
            heads = (
                st.scan("heads", [p["model"]], [p["task"]])
                .filter(pl.col("instance").is_in(ids))
                .sort("instance", "component", "head", "option")
            )
            assert np.array_equal(floats(p["heads"]["logits"]), heads.collect()["logit"].to_numpy())
        assert (p["skips"] is not None) == ((p["model"], p["task"]) == ("org--large", "mnli"))


def table_shapes(markdown: str) -> list[tuple[str, list[int]]]:
    """Per Markdown table of ``markdown``: its header line and the cell count of every row
    (a pipe escaped as ``\\|`` is part of a cell, not a border)."""
    found: list[tuple[str, list[int]]] = []
    previous = ""
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = len(re.split(r"(?<!\\)\|", line.strip())) - 2
            if not previous.startswith("|"):
                found.append((line, []))
            found[-1][1].append(cells)
        previous = line
    return found


def assert_tables_parse(markdown: str) -> None:
    """Every table of ``markdown`` has as many cells in each row as in its header, and renders
    as one HTML table with that many columns in every row."""
    from markdown_it import MarkdownIt

    tables = table_shapes(markdown)
    assert tables
    for header, counts in tables:
        assert len(set(counts)) == 1, f"{header}: rows of {counts} cells"
    body = MarkdownIt("commonmark").enable("table").render(markdown)
    assert body.count("<table>") == len(tables)
    for (_, counts), html in zip(tables, body.split("<table>")[1:], strict=True):
        rows = re.findall(r"<tr>(.*?)</tr>", html.split("</table>")[0], re.S)
        assert len(rows) == len(counts) - 1  # the rule is no row
        assert {len(re.findall(r"<t[hd]", r)) for r in rows} == {counts[0]}


def test_tables_parse(page: Path) -> None:
    assert_tables_parse((page.parent / "report.md").read_text())


def test_demo_tables_parse() -> None:
    """Every table of the demo's report.md is well-formed (e.g. the skip table's header, whose
    |IE| / (|DE| + |IE|) holds pipes)."""
    report = DEMO_REPORT.with_name("report.md")
    if not report.is_file():
        pytest.skip(f"{report} not found: run `make demo` first")
    assert_tables_parse(report.read_text())


def test_cells_are_escaped() -> None:
    from layerdiv.analyze.markdown import TableShapeError, markdown_table

    text = markdown_table(["a", "|IE| / (|DE| + |IE|)"], [["x", "1\n2"]])
    assert text.splitlines()[0] == "| a | \\|IE\\| / (\\|DE\\| + \\|IE\\|) |"
    assert text.splitlines()[2] == "| x | 1 2 |"
    assert table_shapes(text) == [(text.splitlines()[0], [2, 2, 2])]
    with pytest.raises(TableShapeError, match="1 cells for 2 columns"):
        markdown_table(["a", "b"], [["x"]])


def test_sample_is_stratified_deterministic_and_bounded() -> None:
    correct = np.array([True] * 70 + [False] * 30)
    picked = stratified_sample(correct, 10)
    assert picked.tolist() == stratified_sample(correct, 10).tolist()
    assert len(picked) == 10 and correct[picked].sum() == 7
    assert stratified_sample(correct, None).tolist() == list(range(100))
    # A rare kind keeps at least one instance.
    rare = np.array([True] * 99 + [False])
    assert (~rare[stratified_sample(rare, 5)]).sum() == 1


def test_settle_junction() -> None:
    u = np.zeros((2, 4, 2))
    u[0, :, 0] = [1, 1, 1, 1]  # option 0 from the start
    u[1, :, 1] = [1, -3, 0, 5]  # 1, then 0 at junction 2 and 3, then 1 again at junction 4
    assert settle_junction(u).tolist() == [1, 4]


# --- bad input -------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def test_bad_format_and_empty_store_are_one_line(store: Path, page: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(page.parent, out)
    before = snapshot(out)
    result = run("report", "--store", str(store), "--out", str(out), "--format", "pdf")
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: unknown report format 'pdf': use md, html or md,html"
    ]
    (tmp_path / "empty").mkdir()
    result = run("report", "--store", str(tmp_path / "empty"), "--out", str(out), "--format",
                 "html")  # fmt: skip
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "is empty: run `layerdiv extract` first" in result.output
    result = run("report", "--store", str(store), "--out", str(out), "--explorer-instances", "0")
    assert result.exit_code == 2 and "--explorer-instances" in result.output
    assert snapshot(out) == before


def test_html_only_writes_one_page_and_the_methods_it_links(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "r"
    result = run("report", "--store", str(store), "--out", str(out), "--format", "html",
                 "--explorer-instances", "all", "--model", "org/small",
                 "--task", "boolq")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "methods.html", "report.html"]
    data = embedded(out / "report.html", "explorer-data")
    assert [len(p["instances"]) for p in data["partitions"]] == [N]


def test_version_2_store_says_prompt_not_stored(store: Path, tmp_path: Path) -> None:
    old = tmp_path / "v2"
    shutil.copytree(store, old)
    tables_as_version(old, 2)
    for path in old.glob("manifests/**/manifest.json"):
        manifest = json.loads(path.read_text())
        path.write_text(json.dumps({**manifest, "schema_version": 2}))
    assert {p.manifest.schema_version for p in Store(old).partitions} == {2}
    write_report(analyze(old), tmp_path / "r", "paper", str(old), "html", 5)
    data = embedded(tmp_path / "r" / "report.html", "explorer-data")
    assert {(p["schema_version"], p["prompts"]) for p in data["partitions"]} == {(2, None)}


# --- in a real browser -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (CHROMIUM and DRIVER):
        pytest.skip(NO_BROWSER)
    from tests.browser import chromium

    with chromium(CHROMIUM, DRIVER) as driver:
        yield driver


MARKS = (
    "return Array.from(document.querySelectorAll('div.plotly-figure')).map(d => "
    "[d.id || d.dataset.figure, d.querySelectorAll('.cartesianlayer .trace path, "
    ".heatmaplayer image').length])"
)
"""Per figure of the page: its id (or file name) and the data marks drawn in it (the SVG paths of
lines and bars, the images of heatmaps)."""

CHOOSE = (
    "const [id, value] = arguments; const s = document.getElementById(id);"
    "s.value = value; s.dispatchEvent(new Event('change'))"
)
"""Choose ``value`` in the select ``id`` as a user does (its change event fires)."""


def test_page_in_chromium(browser: Any, page: Path) -> None:
    from tests.browser import figure_problems, open_page, outside_requests, page_errors

    open_page(browser, page)
    assert page_errors(browser) == []
    # This store lacks what some analyses need, so the page has its notes (warning boxes);
    # everything else a reader would call broken is checked.
    assert [p for p in figure_problems(browser) if not p.startswith("warning box")] == []
    assert "<img" not in page.read_text()  # every figure has a spec: none is an image
    marks = dict(browser.execute_script(MARKS))
    figures = embedded(page, "figures-data")
    for name, spec in figures.items():  # a mark per trace at least
        assert marks[name] >= len(spec["data"]) > 0, name
    data = embedded(page, "explorer-data")["partitions"]
    parts = [f"{p['model_id']} · {p['task']}" for p in data]
    # the explorer opens on a partition with the most of heads and skips
    have = [bool(p.get("heads")) + bool(p.get("skips")) for p in data]
    assert have[0] == max(have) and have == sorted(have, reverse=True)
    browser.execute_script(CHOOSE, "ex-part", parts.index("org/small · boolq"))
    marks = dict(browser.execute_script(MARKS))
    assert marks["ex-waterfall"] > 0 and marks["ex-running"] > 0 and marks["ex-heads"] == 1
    skips = browser.find_element("id", "ex-skips")
    assert marks["ex-skips"] == 0 and "extract --skips" in skips.text
    assert skips.size["height"] < 60  # one line in place of the figure, not a blank area
    # Another instance redraws the waterfall.
    read = "return Array.from(document.getElementById('ex-waterfall').data[0].y)"
    first = browser.execute_script(read)
    browser.execute_script(CHOOSE, "ex-instance", "1")
    assert browser.execute_script(read) != first
    # The partition with skips draws them; the filter keeps only wrong instances.
    browser.execute_script(CHOOSE, "ex-part", parts.index("org/large · mnli"))
    browser.execute_script(CHOOSE, "ex-filter", "wrong")
    marks = dict(browser.execute_script(MARKS))
    assert marks["ex-skips"] >= 3 and marks["ex-heads"] == 0
    assert browser.find_element("id", "ex-skips").size["height"] >= 300  # the figure again
    labels = browser.execute_script(
        "return Array.from(document.getElementById('ex-instance').options).map(o => o.text)"
    )
    assert labels and all("wrong" in label for label in labels)
    # Search by instance index.
    wanted = embedded(page, "explorer-data")["partitions"][parts.index("org/large · mnli")]
    browser.execute_script(CHOOSE, "ex-search", str(wanted["instances"][3]))
    assert browser.execute_script("return document.getElementById('ex-instance').value") == "3"
    summary = browser.find_element("id", "ex-summary").text
    assert f"instance {wanted['instances'][3]}:" in summary
    # A click on a column header sorts the table by it.
    column = browser.execute_script(
        "const th = document.querySelectorAll('main table')[0].tHead.rows[0].cells[1];"
        "th.click(); return Array.from(th.closest('table').tBodies[0].rows)"
        ".map(r => parseFloat(r.cells[1].textContent))"
    )
    assert column == sorted(column) and len(column) > 1
    again = browser.execute_script(
        "const th = document.querySelectorAll('main table')[0].tHead.rows[0].cells[1];"
        "th.click(); return Array.from(th.closest('table').tBodies[0].rows)"
        ".map(r => parseFloat(r.cells[1].textContent))"
    )
    assert again == sorted(column, reverse=True)
    # The curves switch to relative depth.
    fig6 = "document.querySelector('[data-figure=\"fig6_depth.png\"]')"
    buttons = browser.find_elements(
        "css selector", '[data-figure="fig6_depth.png"] .updatemenu-button'
    )
    buttons[1].click()
    time.sleep(0.5)
    xs = browser.execute_script(f"return {fig6}.data[0].x")
    assert max(xs) == pytest.approx(1.0)
    assert page_errors(browser) == [] and outside_requests(browser) == []


def test_browser_checks_catch_errors_and_requests(browser: Any, tmp_path: Path) -> None:
    """The checks above can fail: a page that requests a URL and throws is caught by both."""
    from tests.browser import open_page, outside_requests, page_errors

    bad = tmp_path / "bad.html"
    bad.write_text(
        '<html><body><img src="http://127.0.0.1:9/x.png"><script>'
        "document.body.dataset.ready = 'true'; null.x;</script></body></html>"
    )
    open_page(browser, bad)
    time.sleep(0.5)
    assert outside_requests(browser) == ["http://127.0.0.1:9/x.png"]
    assert any("TypeError" in e for e in page_errors(browser))


def test_figure_checks_catch_what_a_reader_calls_broken(browser: Any, tmp_path: Path) -> None:
    """The checks of ``figure_problems`` can fail: a warning box, a legend that drops a series,
    an axis title over the tick labels and a placeholder with nothing drawn are each caught."""
    from layerdiv.analyze.html import render_page
    from tests.browser import figure_problems, open_page

    long = ["a long category label number one", "a long category label number two"]
    broken = {
        "data": [
            {"type": "scatter", "x": [1, 2], "y": long, "name": "first"},
            {"type": "scatter", "x": [1, 2], "y": long, "name": "second", "showlegend": False},
        ],
        "layout": {
            "yaxis": {"title": {"text": "a title over the ticks"}, "automargin": False},
            "margin": {"l": 60},
            "showlegend": True,
        },
    }
    empty: dict[str, Any] = {"data": [], "layout": {}}
    # Bars and points at text categories on an axis typed linear: placeholders drawn, no bar.
    groups = ["one", "two", "three"]
    linear = {
        "data": [
            {"type": "bar", "x": groups, "y": [1.0, None, 2.0], "name": "bars"},
            {"type": "scatter", "x": groups, "y": [1, 2, 3], "mode": "markers", "name": "pts"},
            {"type": "scatter", "x": [1, 2], "y": [None, None], "name": "none"},
        ],
        "layout": {"xaxis": {"type": "linear"}},
    }
    markdown = (
        "> a warning\n\n![x](figures/broken.png)\n\n![y](figures/empty.png)\n\n"
        "![z](figures/linear.png)\n"
    )
    bad = tmp_path / "bad.html"
    figures = {"broken.png": broken, "empty.png": empty, "linear.png": linear}
    bad.write_text(render_page(markdown, figures, None))
    open_page(browser, bad)
    found = figure_problems(browser)
    assert any(p.startswith("warning box: a warning") for p in found)
    assert "broken.png: 1 legend entries for 2 series" in found
    assert any(
        p.startswith('broken.png: axis title "a title over the ticks" overlaps') for p in found
    )
    assert "empty.png: a figure placeholder with no marks" in found
    assert 'linear.png: trace 0 (bar "bars"): 0 marks drawn for 2 values' in found
    assert 'linear.png: trace 1 (scatter "pts"): 0 marks drawn for 3 values' in found
    assert 'linear.png: trace 2 (scatter "none"): no values to draw' in found
    assert not any(p.startswith("broken.png: trace") for p in found)  # its points are drawn


def test_text_categories_are_a_category_axis() -> None:
    """Bars at text categories get a category axis in the interactive figure (a linear one
    would draw none of them); numbers keep the panel's scale."""
    from layerdiv.analyze import plots

    text = plots.Panel("p", [plots.Series("a", ["x", "y"], [1, 2], bar=True)])
    numbers = plots.Panel("q", [plots.Series("b", [1, 2], [1, 2])], yscale="log")
    layout = plots.to_plotly(plots.Figure("t", [text, numbers]))["layout"]
    assert layout["xaxis"]["type"] == "category" and layout["yaxis"]["type"] == "linear"
    assert layout["xaxis2"]["type"] == "linear" and layout["yaxis2"]["type"] == "log"


DEMO_REPORT = DEMO / "report" / "report.html"
"""The demo's page (``make demo``, or ``make test``'s quick demo: ``LAYERDIV_DEMO``)."""


def test_a_point_without_an_interval_has_no_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interval end that is null or NaN (too few units for an interval) draws no error bar,
    in the page's charts and in the PNG figures, rather than a bar of no length."""
    import matplotlib.axes

    from layerdiv.analyze import plots

    ends = ([0.5, None, float("nan")], [1.5, None, float("nan")])
    series = plots.Series("a", [1, 2, 3], [1.0, 2.0, 3.0], interval=ends)
    spec = plots.Figure("t", [plots.Panel("p", [series])])
    error = plots.to_plotly(spec)["data"][0]["error_y"]
    assert [list(error[k]) for k in ("array", "arrayminus")] == [[0.5, None, None]] * 2
    drawn, real = [], matplotlib.axes.Axes.errorbar

    def errorbar(self: Any, x: Any, y: Any, **kwargs: Any) -> Any:
        drawn.append((list(x), kwargs["yerr"]))
        return real(self, x, y, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", errorbar)
    plots.to_matplotlib(spec, tmp_path / "f.png")
    assert drawn == [([1], [[0.5], [0.5]])]


def test_demo_report_shows_its_findings(browser: Any) -> None:
    """The demo's page as a reader sees it: no warning box, every figure drawn with a complete
    legend and no axis title over another or over ticks, and the logit-lens figure with the
    last prompt token of the choice task extracted with ``--lens`` beside running text."""
    from tests.browser import figure_problems, open_page, page_errors

    if not DEMO_REPORT.is_file():
        pytest.skip(f"{DEMO_REPORT} not found: run `make demo` first")
    open_page(browser, DEMO_REPORT)
    assert page_errors(browser) == []
    assert figure_problems(browser) == []
    assert "<img" not in DEMO_REPORT.read_text()
    lens = embedded(DEMO_REPORT, "figures-data")["text_lens.png"]
    assert any(t["name"].endswith("last prompt token") for t in lens["data"])
