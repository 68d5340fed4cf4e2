"""The HTML report of one or more runs: ``write_report([run_dir])`` → ``run_dir/report.html``.

data.py          run directories → frames (rows, one row per case, timelines), each with a ``run`` label
figures.py       memory figures;  figures_perf.py  time, communication, sweep figures
figure_checkpoint.py   the checkpoint phase: time and rank 0's host peak per method
tables.py        strategies side by side, every case, the verdict
page.py          the self-contained HTML page (plotly.js embedded once, no network)
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from fsdpbench.report.data import ReportData, load_runs
from fsdpbench.report.panel import Panel


def build_panels(data: ReportData) -> list[Panel]:
    """Every figure of the report, in page order (absent data gives a panel with the reason)."""
    from fsdpbench.report.figure_checkpoint import build_checkpoint_panel
    from fsdpbench.report.figures import (
        build_memory_breakdown_panel,
        build_memory_scaling_panel,
        build_memory_timeline_panel,
    )
    from fsdpbench.report.figures_perf import (
        build_comm_bytes_panel,
        build_overlap_panel,
        build_speedup_panel,
        build_step_time_panel,
        build_sweep_panels,
        build_tradeoff_panel,
    )

    cases = data.cases
    return [
        build_memory_scaling_panel(cases),
        build_tradeoff_panel(cases),
        build_memory_breakdown_panel(cases),
        build_memory_timeline_panel(cases, data.timelines),
        build_step_time_panel(cases),
        build_speedup_panel(cases),
        build_comm_bytes_panel(cases),
        build_overlap_panel(cases),
        *build_sweep_panels(cases),
        build_checkpoint_panel(cases),
    ]


def default_report_path(run_dirs: list[Path]) -> Path:
    """RUN_DIR/report.html for one run; reports/overlay/<timestamp>/report.html for several."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "report.html"
    return Path("reports") / "overlay" / datetime.now().strftime("%Y%m%d-%H%M%S") / "report.html"


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write the self-contained HTML report of these runs; return its path."""
    import plotly.offline

    from fsdpbench.report.page import render_page
    from fsdpbench.store.results import atomic_write_bytes

    if not run_dirs:
        raise ValueError("write_report: give at least one run directory")
    run_dirs = [Path(d) for d in run_dirs]
    data = load_runs(run_dirs)
    page = render_page(data, build_panels(data), plotly.offline.get_plotlyjs())
    out = Path(out) if out else default_report_path(run_dirs)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, page.encode("utf-8"))
    return out
