"""Render a report.html in headless Chromium and save a screenshot, to check the page reads well
offline (networking is switched off, so anything external would be missing from the picture).

    .venv/bin/python benchmarks/render_report.py autoplan_out/report.html --out report.png
    .venv/bin/python benchmarks/render_report.py autoplan_out/report.html --height 6000

Needs a ``chromium`` (Debian: ``apt-get install -y chromium``) or ``--browser PATH``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser(explicit: str | None) -> str:
    if explicit:
        return explicit
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("render_report: no chromium found: apt-get install -y chromium, or pass --browser PATH")


def screenshot(html: Path, out: Path, width: int, height: int, browser: str, timeout_s: float = 120.0) -> Path:
    out = out.resolve()
    with tempfile.TemporaryDirectory(prefix="render-report-") as profile:
        command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                   "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                   f"--user-data-dir={profile}", f"--screenshot={out}", f"--window-size={width},{height}",
                   html.resolve().as_uri()]
        result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0 or not out.is_file():
        raise SystemExit(f"render_report: chromium failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html", type=Path, help="the report.html to render")
    parser.add_argument("--out", type=Path, default=None, help="screenshot PNG (default: <html>.png beside it)")
    parser.add_argument("--width", type=int, default=1200)
    parser.add_argument("--height", type=int, default=3000)
    parser.add_argument("--browser", default=None, help="chromium binary (default: first of " + ", ".join(BROWSERS) + ")")
    args = parser.parse_args(argv)
    if not args.html.is_file():
        raise SystemExit(f"render_report: no file {args.html}")
    out = args.out or args.html.with_suffix(".png")
    path = screenshot(args.html, out, args.width, args.height, find_browser(args.browser))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
