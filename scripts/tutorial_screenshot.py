"""The screenshot of the rendered tutorial's analysis section, docs/tutorial-page.png.

    python scripts/tutorial_screenshot.py [--site build/site] [--out docs/tutorial-page.png]

Run after ``make docs``. Needs a Chromium (``apt-get install -y chromium``), started headless and
offline; the part of the page from the heading "The analysis" on, 1,400 pixels tall, is kept.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from PIL import Image

WIDTH, HEIGHT = 1280, 1400
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
FLAGS += ["--disable-background-networking", "--hide-scrollbars"]
PROBE = (
    '<script>addEventListener("load", () => document.body.setAttribute("data-y", '
    'document.getElementById("the-analysis").getBoundingClientRect().top + scrollY))</script>'
)


def chromium(*args: str) -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("no chromium on PATH: apt-get install -y chromium")
    done = subprocess.run([exe, *FLAGS, *args], capture_output=True, text=True, check=True)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=Path("build/site"))
    parser.add_argument("--out", type=Path, default=Path("docs/tutorial-page.png"))
    args = parser.parse_args()
    page = (args.site / "tutorial" / "index.html").resolve()
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    try:
        dom = chromium(
            "--virtual-time-budget=3000",
            f"--window-size={WIDTH},{HEIGHT}",
            "--dump-dom",
            probe.as_uri(),
        )
    finally:
        probe.unlink()
    match = re.search(r'data-y="([0-9.]+)"', dom)
    if match is None:
        raise SystemExit(f"{page}: no heading 'The analysis' (id the-analysis)")
    top = int(float(match.group(1))) - 20
    with tempfile.TemporaryDirectory() as tmp:
        shot = Path(tmp) / "page.png"
        chromium(f"--window-size={WIDTH},{top + HEIGHT}", f"--screenshot={shot}", page.as_uri())
        Image.open(shot).crop((0, top, WIDTH, top + HEIGHT)).save(args.out, optimize=True)
    print(f"{args.out}: {WIDTH} x {HEIGHT} pixels from {page}, from y = {top}")


if __name__ == "__main__":
    main()
