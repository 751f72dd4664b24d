"""Benchmark of the HTML report (a script, not a test): page size and time against the Markdown
report at paper scale, the demo's page size, and screenshots of the demo's page.

On the paper-scale synthetic store of ``bench_analyze.py`` (16 models x 8 tasks x 2,000
instances, synthesised once into ``--store``), times in fresh processes, one after the other in
this run, ``layerdiv report --format md`` (Markdown and every PNG figure) and ``layerdiv report
--format html`` (the page with its explorer, 200 instances per partition by default), and prints
their wall time, peak memory and ratio, and the size of the page and of each part of it (Plotly's
bundle, the figures' data, the explorer's data).

    python benchmarks/bench_report_html.py [--store DIR] [--models 16] [--tasks 8]
        [--instances 2000] [--explorer-instances 200]
        [--demo layerdiv-demo/report/report.html] [--screenshots docs]

With ``--demo PAGE`` it also prints the size (and parts) of that page (``make demo`` writes
it); with ``--screenshots DIR`` it opens that page in headless Chromium and saves
``report-html-curves.png`` (the Fig. 5 curves), ``report-html-explorer.png`` (the explorer) and
``report-html-running-text.png`` (the running-text future effects) into DIR.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from paper_store import ensure_store, parse_store_args, store_parser, timed


def parts(page: Path) -> str:
    """The page's size and the size of its embedded parts, in MB (10^6 bytes)."""
    text = page.read_text()
    sizes = {"total": len(text.encode())}
    for name in ("figures-data", "explorer-data"):
        found = re.search(f'<script type="application/json" id="{name}">(.*?)</script>', text, re.S)
        sizes[name] = len(found.group(1).encode()) if found else 0
    bundle = max((m.group(1) for m in re.finditer(r"<script>(.*?)</script>", text, re.S)), key=len)
    sizes["plotly.js"] = len(bundle.encode())
    return ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items())


def browser_check(page: Path) -> str:
    """Open ``page`` in headless Chromium: seconds until every figure is drawn, figures drawn,
    console errors and requests that left the page."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from browser import chromium, open_page, outside_requests, page_errors

    with chromium() as browser:
        start = time.perf_counter()
        open_page(browser, page, timeout=600)
        seconds = time.perf_counter() - start
        drawn = browser.execute_script(
            "return Array.from(document.querySelectorAll('div.plotly-figure'))"
            ".filter(d => d.querySelector('.cartesianlayer .trace path, .heatmaplayer image'))"
            ".length"
        )
        errors, requests = page_errors(browser), outside_requests(browser)
    return (f"opened in headless Chromium and drawn in {seconds:.1f} s: {drawn} figures with "
            f"marks, {len(errors)} console errors, {len(requests)} outside requests")  # fmt: skip


def screenshots(page: Path, folder: Path) -> None:
    """The curves and the explorer of ``page`` as PNGs in ``folder``."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from browser import chromium, open_page, page_errors

    with chromium() as browser:
        open_page(browser, page)
        if page_errors(browser):
            raise SystemExit(f"{page}: console errors {page_errors(browser)}")
        browser.execute_script(
            "document.querySelector('[data-figure^=\"fig5_curves\"]').scrollIntoView()"
        )
        time.sleep(1)
        browser.save_screenshot(str(folder / "report-html-curves.png"))
        browser.execute_script(
            "const f = document.getElementById('ex-filter'); f.value = 'late';"
            "f.dispatchEvent(new Event('change'));"
            "document.getElementById('explorer').scrollIntoView()"
        )
        browser.set_window_size(1400, 1900)
        time.sleep(1)
        browser.save_screenshot(str(folder / "report-html-explorer.png"))
        browser.set_window_size(1400, 1100)
        browser.execute_script(
            "document.querySelector('[id^=\"running-text-future-effects\"]').scrollIntoView()"
        )
        time.sleep(1)
        browser.save_screenshot(str(folder / "report-html-running-text.png"))
    names = ("curves", "explorer", "running-text")
    print(f"screenshots: {', '.join(str(folder / f'report-html-{n}.png') for n in names)}")


def main() -> None:
    parser = store_parser(__doc__)
    parser.add_argument("--explorer-instances", default="200")
    parser.add_argument("--demo", type=Path, help="the demo's report.html: print its size")
    parser.add_argument("--screenshots", type=Path, help="folder for screenshots of --demo")
    parser.add_argument("--skip-scale", action="store_true", help="only --demo/--screenshots")
    args = parse_store_args(parser)
    if args.quick:
        args.explorer_instances = "10"
    if args.demo:
        print(f"demo page {args.demo}: {parts(args.demo)}")
        print(f"demo page {browser_check(args.demo)}")
        if args.screenshots:
            screenshots(args.demo, args.screenshots)
    if args.skip_scale:
        return
    rows = ensure_store(args.store, args.models, args.tasks, args.instances)
    print(f"store {args.store}: {args.models} models x {args.tasks} tasks x {args.instances:,} "
          f"instances, {rows:,} component-option rows")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for fmt in ("md", "html"):
            runs[fmt] = timed(
                f"report --format {fmt}",
                ["report", "--store", str(args.store), "--out", f"{tmp}/{fmt}", "--format", fmt,
                 "--explorer-instances", args.explorer_instances],
            )  # fmt: skip
        for label, wall, peak in runs.values():
            print(f"{label:<22} {wall:7.1f} s   peak RSS {peak:6.0f} MiB")
        print(f"html / md time: {runs['html'][1] / runs['md'][1]:.2f}")
        page = Path(tmp) / "html" / "report.html"
        print(f"paper-scale page ({args.explorer_instances} explorer instances per partition): "
              f"{parts(page)}")  # fmt: skip
        if args.quick and not Path("/usr/bin/chromium").is_file():
            print("no Chromium (make browser installs it): the page was not opened")
        else:
            print(f"paper-scale page {browser_check(page)}")


if __name__ == "__main__":
    main()
