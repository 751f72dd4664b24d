"""Headless Chromium (Debian's ``chromium`` with ``chromium-driver``) driven by Selenium, for the
HTML report's browser tests and its screenshots (``benchmarks/bench_report_html.py``). Nothing is
downloaded: the system browser and driver are used, and the browser is kept off the network."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
)


@contextmanager
def chromium(
    binary: str = "/usr/bin/chromium", driver: str = "/usr/bin/chromedriver"
) -> Iterator[Any]:
    """A Selenium Chrome driver on ``binary`` with a fresh profile; console messages and the
    DevTools network log are recorded (:func:`page_errors`, :func:`outside_requests`)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="layerdiv-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = binary
        for flag in (*FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        browser = webdriver.Chrome(service=Service(driver), options=options)
        try:
            yield browser
        finally:
            browser.quit()


def open_page(browser: Any, page: Path, timeout: float = 60) -> None:
    """Load ``page`` and wait until its script has drawn everything (``body[data-ready]``)."""
    browser.get(page.resolve().as_uri())
    end = time.monotonic() + timeout
    while not browser.execute_script("return document.body.dataset.ready === 'true'"):
        if time.monotonic() > end:
            raise TimeoutError(f"{page} did not finish drawing in {timeout} s")
        time.sleep(0.1)


def page_errors(browser: Any) -> list[str]:
    """Console messages of level warning or error since the last call."""
    return [e["message"] for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def outside_requests(browser: Any) -> list[str]:
    """URLs of every request since the last call that went to the network (any http, https, ws
    or ftp URL, whoever asked) or that a page from disk made for anything but itself or a data:
    URL (the browser's own chrome:// pages aside)."""
    found = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] != "Network.requestWillBeSent":
            continue
        url, document = (
            message["params"]["request"]["url"],
            message["params"].get("documentURL", ""),
        )
        network = url.startswith(("http:", "https:", "ws:", "wss:", "ftp:"))
        if network or (document.startswith("file:") and not url.startswith(("file:", "data:"))):
            found.append(url)
    return found


PROBLEMS = r"""
const found = [];
const box = (e) => e.getBoundingClientRect();
const finite = (v) => v !== null && v !== undefined && v !== '' && Number.isFinite(Number(v));
const present = (v) => v !== null && v !== undefined && !(typeof v === 'number' && isNaN(v));
const meet = (a, b) => a.width > 0 && b.width > 0 && a.left < b.right - 1 && b.left < a.right - 1
  && a.top < b.bottom - 1 && b.top < a.bottom - 1;
document.querySelectorAll('main blockquote').forEach((q) =>
  found.push('warning box: ' + q.textContent.trim().slice(0, 80)));
document.querySelectorAll('div.plotly-figure[data-figure]').forEach((div) => {
  const name = div.dataset.figure;
  const marks = div.querySelectorAll('.cartesianlayer .trace path, .heatmaplayer image').length;
  if (!marks) found.push(name + ': a figure placeholder with no marks');
  const groups = {};
  div.querySelectorAll('.cartesianlayer .trace, .heatmaplayer .hm').forEach((g) => {
    const cd = g.__data__;
    if (cd && cd[0] && cd[0].trace) groups[cd[0].trace.index] = g;
  });
  (div._fullData || []).filter((t) => t.visible === true).forEach((t) => {
    const g = groups[t.index];
    const drawn = (selector) => (g ? Array.from(g.querySelectorAll(selector)) : [])
      .filter((p) => { const d = p.getAttribute('d'); return d && d !== 'M0,0Z'; }).length;
    let want, got;
    if (t.type === 'heatmap') {  // its cells are one image, placed from their edges
      want = t.z.flat().filter(finite).length;
      const cd = g && g.__data__[0];
      const image = g && g.querySelector('image');
      const placed = cd && cd.x && cd.y && cd.x.every(finite) && cd.y.every(finite);
      got = image && image.href.baseVal && placed ? want : 0;
    } else {
      const [value, where] = t.orientation === 'h' ? [t.x, t.y] : [t.y, t.x];
      want = value.filter((v, i) => present(v) && present(where[i])).length;
      if (t.type === 'bar') got = drawn('.point path');
      else if ((t.mode || '').includes('markers')) got = drawn('path.point');
      else got = want > 1 && drawn('path.js-line') ? want : 0;  // a line: its path
    }
    const label = `${name}: trace ${t.index} (${t.type} "${t.name || ''}")`;
    if (!want) found.push(`${label}: no values to draw`);
    else if (got < want) found.push(`${label}: ${got} marks drawn for ${want} values`);
  });
  const named = new Set((div.data || []).filter((t) => t.name).map((t) => t.name));
  const entries = div.querySelectorAll('.legend .traces').length;
  if (entries < named.size)
    found.push(`${name}: ${entries} legend entries for ${named.size} series`);
  const titles = Array.from(div.querySelectorAll('.g-xtitle text, .g-ytitle text'));
  const ticks = Array.from(div.querySelectorAll('.xtick text, .ytick text'));
  titles.forEach((t, i) => {
    titles.slice(i + 1).forEach((u) => { if (meet(box(t), box(u)))
      found.push(`${name}: axis titles "${t.textContent}" and "${u.textContent}" overlap`); });
    ticks.forEach((u) => { if (meet(box(t), box(u)))
      found.push(`${name}: axis title "${t.textContent}" overlaps tick ${u.textContent}`); });
  });
});
return found;
"""
"""What a reader of the report would call broken, one line each: a warning box, a figure
placeholder with no marks drawn, a series or heatmap with no values, one with fewer marks drawn
than it has values (the bars, the markers, a line's path, a heatmap's cells placed on its axes:
e.g. text categories on a linear axis draw nothing), a legend with fewer entries than the
figure's named series, an axis title whose bounding box meets another axis title or a tick label."""


def figure_problems(browser: Any) -> list[str]:
    """:data:`PROBLEMS` of the page open in ``browser``."""
    return list(browser.execute_script(PROBLEMS))
