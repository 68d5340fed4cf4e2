"""The report in a real headless browser (Debian's chromium): loads offline, no console errors, every
figure draws.

Chromium is installed by .ci/run (or by hand: apt-get install chromium); the tests never install
anything, and skip with that reason where it is absent. The screenshot goes to the run directory
(report.png) and, when FSDPBENCH_SCREENSHOT_DIR is set, is copied there for review.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fsdpbench.report import write_report
from fsdpbench.report.synthetic import FAIL_ERROR, write_synthetic_run

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # no network at all
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=15000",
]
CONSOLE_LINE = re.compile(r":CONSOLE(?::\d+)?\]\s*(.*)")


def _find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


@pytest.fixture(scope="session")
def chromium() -> str:
    # tests never change the machine: .ci/run installs chromium; here an absent one is a skip
    path = _find_chromium()
    if path is None:
        pytest.skip(
            "no headless browser for the report test: chromium is not installed "
            "(.ci/run installs it; by hand: apt-get install chromium)"
        )
    return path


@pytest.fixture(scope="session")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = write_synthetic_run(tmp_path_factory.mktemp("browser") / "synthetic")
    return write_report([run_dir])


def _run_chromium(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


class _FigureScan(HTMLParser):
    """Which figure divs contain a drawn plotly graph (an <svg class="main-svg">)."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: dict[str, bool] = {}
        self._stack: list[str | None] = []  # figure key of each open div, or None
        self.attrs: dict[str, dict[str, str | None]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag in ("html", "body"):
            self.attrs[tag] = a
        if tag == "div":
            key = a.get("data-figure")
            if key:
                self.figures[key] = False
            self._stack.append(key)
        if tag == "svg" and "main-svg" in (a.get("class") or "").split():
            for key in reversed(self._stack):
                if key:
                    self.figures[key] = True
                    break

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self._stack:
            self._stack.pop()


def test_report_loads_offline_without_console_errors_and_draws_every_figure(chromium, report, tmp_path):
    page = report.read_text()
    expected = int(re.search(r'data-figures-expected="(\d+)"', page).group(1))
    assert expected >= 10

    proc = _run_chromium(chromium, tmp_path / "profile", "--dump-dom", report.resolve().as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [m.group(1) for m in map(CONSOLE_LINE.search, proc.stderr.splitlines()) if m]
    assert console == [], f"console messages from the page: {console}"

    scan = _FigureScan()
    scan.feed(proc.stdout)
    assert "data-js-errors" not in scan.attrs.get("html", {}), scan.attrs["html"]["data-js-errors"]
    assert scan.attrs.get("body", {}).get("data-figures-rendered") == str(expected)
    assert len(scan.figures) == expected
    undrawn = [key for key, drawn in scan.figures.items() if not drawn]
    assert undrawn == [], f"figures without a plotly svg: {undrawn}"
    assert FAIL_ERROR in proc.stdout  # the case table rendered with the failed case

    shot = report.parent / "report.png"
    proc = _run_chromium(
        chromium,
        tmp_path / "profile2",
        f"--screenshot={shot}",
        "--window-size=1400,4000",
        report.resolve().as_uri(),
    )
    assert proc.returncode == 0 and shot.exists() and shot.stat().st_size > 50_000, proc.stderr[-2000:]
    review = os.environ.get("FSDPBENCH_SCREENSHOT_DIR")
    if review:
        Path(review).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(review) / "report.png")
    print(f"screenshot: {shot}")


def test_page_errors_are_caught_by_the_check(chromium, report, tmp_path):
    """The check would fail on a broken page: a script error is recorded and no figure is drawn."""
    broken = tmp_path / "broken.html"
    broken.write_text(report.read_text().replace("Plotly.newPlot(", "Plotly.noSuchFunction("))
    proc = _run_chromium(chromium, tmp_path / "profile", "--dump-dom", broken.as_uri())
    scan = _FigureScan()
    scan.feed(proc.stdout)
    assert "noSuchFunction" in (scan.attrs.get("html", {}).get("data-js-errors") or "")
    assert "data-figures-rendered" not in scan.attrs.get("body", {})
    assert not any(scan.figures.values())
