"""``fsdpbench compare``: run strategies side by side for one model and world size, without a YAML file.

    fsdpbench compare --model decoder-tiny --world-size 4                 # ddp, zero2, zero3
    fsdpbench compare --model decoder-small --world-size 2 --strategies ddp,zero1,zero3 --precision bf16
        [--batch-size 4] [--seq-len 64] [--steps 5] [--set wrap=size] [--out DIR] [--no-report]

The cases are built and run by the same code as ``fsdpbench run`` (an equivalent scenario is kept in
run.json, so ``fsdpbench run`` can repeat it); results go to DIR (default reports/compare/<timestamp>),
then a table prints memory by category (measured / predicted), step time, communication and overlap
per strategy, with the winner of each metric, and the HTML report is written.
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from fsdpbench.commands import running
from fsdpbench.core.markup import escape
from fsdpbench.core.schema import ERROR, FAILED, OK, OOM, STATUS, TIMEOUT
from fsdpbench.pipeline.interrupts import signals_as_interrupts

DEFAULT_STRATEGIES = "ddp,zero2,zero3"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdpbench.core.case import OPTIMIZERS, PRECISIONS, WRAPS

    parser.add_argument(
        "--model",
        default="decoder-tiny",
        help="model preset, or your own factory package.module:build (default: decoder-tiny)",
    )
    running.add_model_args_argument(parser)
    parser.add_argument("--world-size", type=int, required=True, help="ranks (CPU processes or GPUs)")
    running.add_strategies_argument(parser, "--strategies", DEFAULT_STRATEGIES)
    parser.add_argument("--precision", choices=PRECISIONS, help="mixed precision (default: fp32)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, help="optimizer (default: adamw)")
    parser.add_argument("--wrap", choices=WRAPS, help="FSDP wrap granularity (default: block)")
    parser.add_argument("--batch-size", type=int, help="per-rank batch (default: 4)")
    parser.add_argument("--seq-len", type=int, help="sequence length (default: 64)")
    parser.add_argument("--steps", type=int, help="timed steps (default: 5)")
    parser.add_argument("--warmup-steps", type=int, help="warm-up steps (default: 2)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other case field, e.g. --set prefetch=1 (repeatable)",
    )
    parser.add_argument("--out", help="run directory (default: reports/compare/<timestamp>)")
    parser.add_argument("--no-report", action="store_true", help="do not write report.html")
    running.add_oversubscribe_argument(parser)
    parser.add_argument(
        "--traced",
        action="store_true",
        help="also run the traced memory predictor for every case (traced_* columns)",
    )
    running.add_link_argument(parser)


def build_scenario_text(args: argparse.Namespace) -> str:
    """The scenario YAML equivalent to these arguments (what run.json keeps)."""
    defaults: dict[str, Any] = {"model": args.model, "world_size": args.world_size}
    if args.model_args:
        defaults["model_args"] = running.parse_model_args(args.model_args, args.model)
    for name in ("precision", "optimizer", "wrap", "batch_size", "seq_len", "steps", "warmup_steps"):
        value = getattr(args, name)
        if value is not None:
            defaults[name] = value
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    spec = {
        "name": "compare",
        "description": f"{', '.join(strategies)} side by side: {args.model} on {args.world_size} ranks",
        "defaults": defaults,
        "sweep": {"strategy": strategies},
    }
    return yaml.safe_dump(spec, sort_keys=False)


def _check_args(args: argparse.Namespace) -> str | None:
    from fsdpbench.models import model_names
    from fsdpbench.strategies import strategy_names

    if ":" in args.model:  # an own model typed here is explicit, as a plugin strategy is
        from fsdpbench.pipeline.scenario import enable_plugin_imports

        enable_plugin_imports()
    elif args.model not in model_names():
        return f"--model {args.model}: unknown model; allowed: {', '.join(model_names())}, or module:factory"
    if args.world_size < 1:
        return f"--world-size {args.world_size}: must be ≥ 1"
    try:
        running.parse_model_args(args.model_args, args.model)
    except ValueError as exc:  # a ScenarioError naming the flag and the argument
        return str(exc)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies:
        return f"--strategies {args.strategies!r}: give at least one, e.g. {DEFAULT_STRATEGIES}"
    for s in strategies:
        if ":" not in s and s not in strategy_names():
            allowed = ", ".join(strategy_names())
            return f"--strategies: unknown strategy {s!r}; allowed: {allowed}, or module:Class"
    return None


def main(args: argparse.Namespace) -> int:
    from fsdpbench.pipeline.runner import default_run_dir, now_iso, run_cases
    from fsdpbench.pipeline.scenario import ScenarioError, enable_plugin_imports, parse_scenario
    from fsdpbench.predictors.comm_model import LinkError
    from fsdpbench.store.results import RunStore

    err = Console(stderr=True, soft_wrap=True)
    t0 = time.perf_counter()
    problem = _check_args(args)
    try:
        link = running.link_spec(args.link)
    except LinkError as exc:
        problem = problem or str(exc)
    if problem:
        err.print(f"[red]error:[/] {escape(str(problem))}", highlight=False)
        return 2
    text = build_scenario_text(args)
    try:
        overrides = running.parse_overrides(args.set)
        running.validate_overrides(overrides)
        # a module:Class typed on this command line is the user's explicit act: allowed, cwd searched last
        plugins = ":" in args.model or any(":" in s for s in args.strategies.split(","))
        if plugins:
            enable_plugin_imports()
        scenario = parse_scenario(
            text,
            source="fsdpbench compare",
            overrides=overrides,
            allow_plugins=plugins or None,
            allow_oversubscribe=args.allow_oversubscribe,
        )
    except ScenarioError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        return 2

    try:
        run_dir = running.check_output_path(args.out, "--out", directory=True) if args.out else None
    except ValueError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    run_dir = run_dir or default_run_dir("compare")
    store = RunStore(run_dir)
    meta = running.run_header(scenario, path=None, text=text, overrides=overrides, started=now_iso())
    err.print(
        f"[bold]compare[/]: {len(scenario.cases)} cases, {len(scenario.skipped)} skipped "
        f"→ {escape(str(run_dir))}",
        highlight=False,
    )
    running.print_thread_policy(err, scenario.cases)
    running.print_skipped(err, scenario)
    try:
        with (
            signals_as_interrupts(),
            running.case_progress(err, len(scenario.cases), scenario.cases) as (
                on_start,
                on_done,
            ),
        ):
            run_cases(
                scenario.cases,
                scenario.skipped,
                store,
                meta,
                on_start=on_start,
                on_done=on_done,
                traced=args.traced,
                link=link,
            )
    except KeyboardInterrupt as exc:
        err.print(
            f"[yellow]interrupted[/]: finished cases are stored in {escape(str(run_dir))} "
            "(run.json says interrupted)",
            highlight=False,
        )
        return 128 + getattr(exc, "signum", signal.SIGINT)
    out = Console()  # the terminal's width; COLUMNS, or 80 when piped
    cases = print_compare(run_dir, out)
    if not args.no_report:
        from fsdpbench.report import write_report

        print(f"report:  {write_report([run_dir])}")
    print(f"results: {run_dir / 'results.parquet'}  ({time.perf_counter() - t0:.1f} s)")
    failed = cases[STATUS].isin([FAILED, TIMEOUT, OOM]).sum() if STATUS in cases else 0
    return 1 if failed else 0


def build_compare_table(cases: Any) -> Table:
    """Strategies side by side (columns), one metric per row, the winner of each metric marked."""
    from fsdpbench.core.markup import escape
    from fsdpbench.report.panel import describe_ranks
    from fsdpbench.report.tables import compare_rows

    labels = cases["label"].tolist()
    title = f"{cases['model'].iloc[0]} on {cases['ranks_label'].iloc[0]} — {describe_ranks(cases)}"
    table = Table(
        title=title,
        caption="memory: tracker (live tensors), largest rank, memory-tracked step; "
        "cells: measured, then predicted (error); step time: slowest rank's median (p10–p90); "
        "★ = best",
        caption_justify="left",
    )
    table.add_column("metric")
    for label in labels:
        table.add_column(escape(label), justify="right")
    table.add_column("winner")
    for row in compare_rows(cases):
        cells = []
        for label in labels:
            measured, *predicted = row.text.get(label, "—").split(" / ")  # predicted on a second line
            first = f"[bold green]{escape(measured)} ★[/]" if label in row.winners else escape(measured)
            cells.append("\n".join([first, *map(escape, predicted)]))
        n_values = sum(v is not None for v in row.values.values())
        winner = ", ".join(row.winners) if row.winners else ("tie" if row.better and n_values > 1 else "")
        table.add_row(escape(row.metric.replace(": measured / predicted", "")), *cells, escape(winner))
    return table


def print_compare(run_dir: Path, console: Console) -> Any:
    """Print the side-by-side table of a compare run directory; return its case frame."""
    from fsdpbench.report.data import load_runs

    cases = load_runs([run_dir]).cases
    if cases.empty:
        console.print("no cases ran")
        return cases
    console.print(build_compare_table(cases))
    for _, r in cases[cases[STATUS] != OK].iterrows():
        console.print(
            f"[red]{escape(str(r['label']))}: {r[STATUS]}[/] — {escape(str(r[ERROR])[:300])}",
            highlight=False,
        )
    return cases
