"""``fsdpbench report RUN_DIR [RUN_DIR ...] [--out FILE]``: write the self-contained HTML report.

    fsdpbench report reports/quickstart/20260101-120000             # → that dir's report.html
    fsdpbench report runs/a runs/b --out a-vs-b.html                 # several runs overlaid

The page embeds plotly.js once and needs no network: open it from file://.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from fsdpbench.core.markup import escape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="HTML file to write (default: RUN_DIR/report.html for one run, "
        "reports/overlay/<timestamp>/report.html for several)",
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directory written by fsdpbench run"
    )


def main(args: argparse.Namespace) -> int:
    from fsdpbench.report import write_report

    err = Console(stderr=True, soft_wrap=True)
    run_dirs = [Path(d) for d in args.run_dirs]
    for run_dir in run_dirs:
        if not (run_dir / "run.json").exists() and not (run_dir / "results.parquet").exists():
            err.print(
                f"[red]error:[/] {escape(str(run_dir))}: not a run directory (no run.json or "
                "results.parquet); give a directory written by fsdpbench run or fsdpbench compare",
                highlight=False,
            )
            return 2
    from fsdpbench.commands.running import check_output_path, print_write_error
    from fsdpbench.store.results import ResultsFileError

    try:
        out = check_output_path(args.out, "--out") if args.out else None
        path = write_report(run_dirs, out)
    except (ResultsFileError, ValueError) as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    except OSError as exc:
        print_write_error(err, exc)
        return 2
    from fsdpbench.report.data import shown_path

    print(f"report:  {shown_path(path)}")
    return 0
