"""``fsdpbench run SCENARIO``: run every case of a scenario and write results and the report."""

from __future__ import annotations

import argparse
import shlex
import signal
from pathlib import Path
from typing import Any

from rich.console import Console

from fsdpbench.commands.running import (
    add_link_argument,
    add_oversubscribe_argument,
    case_progress,
    check_output_path,
    link_spec,
    parse_overrides,
    print_skipped,
    print_thread_policy,
    print_write_error,
    run_header,
    scenario_names,
    validate_overrides,
)
from fsdpbench.core.markup import escape
from fsdpbench.core.schema import FAILED, OOM, STATUS, TIMEOUT
from fsdpbench.pipeline.interrupts import signals_as_interrupts
from fsdpbench.pipeline.scenario import ScenarioError, enable_plugin_imports, load_scenario


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario YAML file (see scenarios/)")
    parser.add_argument("--out", help="run directory (default: reports/<scenario>/<timestamp>)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="run only the cases missing from --out (default: the latest run of this scenario)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a case field for every case, e.g. --set steps=10 (repeatable)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="list the cases (and skipped ones), run nothing"
    )
    parser.add_argument("--no-report", action="store_true", help="do not write report.html")
    parser.add_argument(
        "--traced",
        action="store_true",
        help="also run the traced memory predictor for every case and rank (traced_* columns "
        "beside the analytic pred_*; seconds per case)",
    )
    add_link_argument(parser)
    parser.add_argument(
        "--emulate",
        action="store_true",
        help="emulate every case: its rank 0 (or --set emulate_ranks=all / [0,3]) alone on one device "
        "with a fake process group of the case's world size; real allocations, compute-only "
        "step time, no losses (see docs/emulation.md)",
    )
    parser.add_argument(
        "--export-cases",
        metavar="DIR",
        help="write one JSON file per case (for torchrun/srun across nodes), run nothing",
    )
    parser.add_argument(
        "--allow-plugins",
        action="store_true",
        help="let the scenario name plugin strategies (module:Class): importing one runs its "
        "code; the current directory is searched last (also: FSDPBENCH_ALLOW_PLUGINS=1)",
    )
    add_oversubscribe_argument(parser)
    parser.add_argument(
        "--collect",
        action="store_true",
        help="launch nothing: build results from rank files that external launchers wrote "
        "into --out/cases/<case_id>/",
    )


def main(args: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)
    with signals_as_interrupts():
        try:
            return _main(args, console)
        except KeyboardInterrupt as exc:  # before the sweep started: nothing to keep
            console.print(f"[yellow]interrupted[/] ({escape(str(exc) or 'Ctrl-C')})", highlight=False)
            return 128 + getattr(exc, "signum", signal.SIGINT)


def _main(args: argparse.Namespace, console: Console) -> int:
    from fsdpbench.predictors.comm_model import LinkError

    try:
        link = link_spec(args.link)
        overrides, scenario = _load_scenario(args)
    except (LinkError, ScenarioError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    if args.dry_run:
        return _print_dry_run(scenario)
    if args.export_cases:
        return _export_cases_or_refuse(args, scenario, console)
    if args.collect and not args.out:
        console.print("[red]error:[/] --collect needs --out RUN_DIR (where the ranks wrote cases/<case_id>/)")
        return 2
    try:
        run_dir = _run_dir(args, scenario.name)
    except ValueError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    return _run(args, console, scenario, overrides, run_dir, link)


def _run(
    args: argparse.Namespace,
    console: Console,
    scenario: Any,
    overrides: dict[str, Any],
    run_dir: Path,
    link: str | None,
) -> int:
    """Run the scenario's cases into ``run_dir`` (resumed: the missing ones), then summarise and report."""
    from fsdpbench.core.rundir import RunDirError
    from fsdpbench.pipeline.runner import run_cases
    from fsdpbench.store.results import ResultsFileError, RunStore

    store = RunStore(run_dir)
    resume_hint = f"fsdpbench run {shlex.quote(args.scenario)} --out {shlex.quote(str(run_dir))} --resume"
    try:
        meta = store.read_run_json() if args.resume else {}
    except (OSError, ValueError) as exc:  # ResultsFileError names the file and the field
        console.print(f"[red]error:[/] cannot resume: {escape(str(exc))}", highlight=False)
        return 2
    _update_run_meta(meta, scenario, overrides)
    n_todo = len(scenario.cases) - (
        len(store.completed_ids() & {c.case_id for c in scenario.cases}) if args.resume else 0
    )
    console.print(
        f"[bold]{escape(scenario.name)}[/]: {len(scenario.cases)} cases ({n_todo} to run), "
        f"{len(scenario.skipped)} skipped → {escape(str(run_dir))}",
        highlight=False,
    )
    print_thread_policy(console, scenario.cases)
    print_skipped(console, scenario)
    try:
        with case_progress(console, n_todo, scenario.cases) as (on_start, on_done):
            frame = run_cases(
                scenario.cases,
                scenario.skipped,
                store,
                meta,
                resume=args.resume,
                collect=args.collect,
                on_start=on_start,
                on_done=on_done,
                traced=args.traced or scenario.traced,
                link=link,
            )
    except (RunDirError, ResultsFileError) as exc:  # a file in RUN_DIR that is not this run's
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    except OSError as exc:  # a full disk or an unwritable --out: the stored cases stay; resume works
        where = exc.filename or run_dir
        console.print(
            f"[red]error:[/] cannot write {escape(str(where))}: {escape(exc.strerror or str(exc))}; "
            f"finished cases are kept; after fixing it continue with: {escape(resume_hint)}",
            highlight=False,
        )
        return 1
    except KeyboardInterrupt as exc:
        # the last line says how to go on; the exit code is the shell's for that signal (130: Ctrl-C)
        console.print(
            f"[yellow]interrupted[/]: finished cases are stored in {escape(str(run_dir))}; "
            f"continue with: {escape(resume_hint)}",
            highlight=False,
        )
        return 128 + getattr(exc, "signum", signal.SIGINT)
    return _finish(args, console, scenario, frame, run_dir, resume_hint)


def _finish(
    args: argparse.Namespace, console: Console, scenario: Any, frame: Any, run_dir: Path, resume_hint: str
) -> int:
    """The summary, the report and the exit code: 1 when a case failed or was not run."""
    from fsdpbench.analysis.summary import print_summary

    print_summary(frame, Console())
    if not args.no_report:
        _write_report(run_dir, console)
    print(f"results: {run_dir / 'results.parquet'}")
    failed = frame[frame[STATUS].isin([FAILED, TIMEOUT, OOM])]["case_id"].nunique()
    not_run = {c.case_id for c in scenario.cases} - set(frame["case_id"])
    if not_run:  # held by live ranks of another run, or no space left to store them (a warning named each)
        console.print(
            f"[yellow]{len(not_run)} case(s) not run or not stored[/] (see the warnings above); "
            f"continue with: {escape(resume_hint)}",
            highlight=False,
        )
    return 1 if failed or not_run else 0


def _export_cases_or_refuse(args: argparse.Namespace, scenario: Any, console: Console) -> int:
    """``--export-cases DIR``: the case files, or exit 2 with the reason."""
    try:
        return _export_cases(scenario, check_output_path(args.export_cases, "--export-cases", directory=True))
    except ValueError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    except OSError as exc:
        print_write_error(console, exc)
        return 2


def _load_scenario(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """The --set overrides and the scenario they apply to (ScenarioError names what is wrong)."""
    overrides = parse_overrides(args.set)
    if args.emulate:
        overrides["emulate"] = True
    validate_overrides(overrides)
    if args.allow_plugins:
        enable_plugin_imports()
    scenario = load_scenario(
        args.scenario,
        overrides=overrides,
        allow_plugins=args.allow_plugins or None,  # None: the environment variable decides
        allow_oversubscribe=args.allow_oversubscribe,
    )
    return overrides, scenario


def _run_dir(args: argparse.Namespace, scenario_name: str) -> Path:
    from fsdpbench.pipeline.runner import default_run_dir, latest_run_dir

    if args.out:
        return check_output_path(args.out, "--out", directory=True)
    if args.resume:
        return latest_run_dir(scenario_name) or default_run_dir(scenario_name)
    return default_run_dir(scenario_name)


def _update_run_meta(meta: dict[str, Any], scenario: Any, overrides: dict[str, Any]) -> None:
    """run.json's content before the cases: this run's header over what a resumed run stored."""
    from fsdpbench.pipeline.runner import now_iso

    meta.update(
        run_header(
            scenario,
            path=str(scenario.path),
            text=scenario.text,
            overrides=overrides,
            started=meta.get("started") or now_iso(),
        )
    )
    emulated = [c for c in scenario.cases if c.emulate]
    if emulated:
        from fsdpbench.engine.emulate import EMULATION_LIMITS

        meta["emulation"] = {"cases": [c.case_id for c in emulated], "cannot_see": EMULATION_LIMITS}


def _print_dry_run(scenario: Any) -> int:
    console = Console()
    console.print(
        f"[bold]{escape(scenario.name)}[/]: {len(scenario.cases)} cases, {len(scenario.skipped)} skipped"
    )
    names = scenario_names(scenario)
    for case in scenario.cases:
        console.print(f"  {escape(names[case.case_id])}  [dim]{case.case_id}[/]", highlight=False)
    print_skipped(console, scenario)
    return 0


def _export_cases(scenario: Any, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for case in scenario.cases:
        (out / f"{case.case_id}.json").write_text(case.to_json(indent=2))
    print(f"wrote {len(scenario.cases)} case files to {out}")
    for case in scenario.cases[:1]:
        print(
            "run each on every node, e.g.:\n"
            f"  torchrun --nnodes NODES --nproc_per_node GPUS_PER_NODE --rdzv_backend c10d "
            f"--rdzv_endpoint HOST:29500 -m fsdpbench.engine.worker --case {out / case.case_id}.json "
            f"--out RUN_DIR/cases/{case.case_id}\n"
            f"then: fsdpbench run {scenario.path} --out RUN_DIR --collect"
        )
    return 0


def _write_report(run_dir: Path, console: Console) -> None:
    from fsdpbench.report import write_report

    try:
        path = write_report([run_dir])
    except Exception as exc:  # noqa: BLE001 — the results are stored; a report bug must not hide them
        console.print(
            f"[red]report failed[/]: {escape(str(exc))} (results are in {escape(str(run_dir))})",
            highlight=False,
        )
        return
    print(f"report:  {path}")
