"""``fsdpbench regress RUN_DIR --baseline B``: gate a run against a baseline; exit 1 on a regression.

    fsdpbench regress RUN_DIR --write-baseline baselines/ci.json   # record (commit the file)
    fsdpbench regress RUN_DIR --baseline baselines/ci.json         # gate: exit 0 pass, 1 regression
        [--threshold step_time_ratio=50%:warn] [--time-gate warn] [--strict] [--repeat K]
        [--map-strategy mypkg.fsdp:MyZero3=zero3] [--markdown comment.md] [--json regress.json]

Exit codes: 0 passed, 1 regression (each failing case and metric is named), 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from fsdpbench.analysis.names import id_tail
from fsdpbench.core.markup import escape
from fsdpbench.core.schema import (
    BYTES,
    CASE_ID,
    COLUMNS,
    COMMIT,
    DEVICE_NAME,
    HARNESS_OVERHEAD_RATIO,
    HOSTNAME,
    LOSSES,
    MS,
    OK,
    STATUS,
    STEP_TIME_REF_RATIOS,
    TORCH_VERSION,
)
from fsdpbench.strategies import REFERENCE_STRATEGY

MAX_REPEAT = 100  # re-launches of one suspect case: each is a whole case's run
REPEAT = 2  # re-launches of a suspect case by default: the rule whose error rates docs/ci.md gives
if TYPE_CHECKING:
    from fsdpbench.analysis.regress import DifferenceReport, MetricDifference

_VERDICT_STYLE = {
    OK: "green",
    "improved": "cyan",
    "new": "cyan",
    "warn": "yellow",
    "not compared": "dim",
    "not comparable": "dim",  # analysis.regress.NOT_COMPARABLE
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory written by fsdpbench run (results.parquet)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--baseline", metavar="PATH", help="baseline JSON to compare against")
    mode.add_argument(
        "--write-baseline", metavar="PATH", help="write the run as a baseline JSON, compare nothing"
    )
    parser.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="METRIC=TOL[:GATE]",
        help="tolerance (0.01 or 1%%) and gate (fail|warn|off) of a metric or a kind "
        "(memory, comm, time, loss); overrides the baseline's (repeatable)",
    )
    parser.add_argument(
        "--time-gate",
        choices=("fail", "warn", "off"),
        help="make every time metric fail, only warn, or skip (noisy machines: warn)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="also fail when a deterministic metric (memory, comm, loss) improved beyond "
        "its tolerance: the baseline is stale and must be re-written",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=REPEAT,
        metavar="K",
        help="re-launch a case whose step time looks regressed K more times and judge it "
        f"again on its launches, before failing (asv-style; default {REPEAT}, the gate's error rates were "
        f"measured with it: docs/ci.md; 0: judge the first launch alone; at most {MAX_REPEAT})",
    )
    parser.add_argument(
        "--allow-plugins",
        action="store_true",
        help="with --repeat: re-launch cases of plugin strategies (module:Class, their code runs; the "
        "current directory is searched last); a --map-strategy naming one allows it too "
        "(also: FSDPBENCH_ALLOW_PLUGINS=1)",
    )
    parser.add_argument(
        "--map-strategy",
        action="append",
        default=[],
        metavar="RUN=BASELINE",
        help="match the run's cases of strategy RUN with the baseline's cases of BASELINE, "
        "e.g. mypkg.fsdp:MyZero3=zero3 (repeatable)",
    )
    parser.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="with --write-baseline: also take the step-time samples of these runs of the same "
        "scenario (pooled per case), so the baseline's distribution spans several "
        "moments of the machine, not one (repeatable)",
    )
    parser.add_argument(
        "--time-reference",
        default=REFERENCE_STRATEGY,
        metavar="STRATEGY|CASE_ID",
        help="with --write-baseline: step times are stored as ratios to this strategy's case "
        "with the same model, batch and world size, or to this one calibration case "
        f"(default: {REFERENCE_STRATEGY})",
    )
    parser.add_argument(
        "--markdown",
        metavar="PATH",
        help="also write the table as Markdown ('-': print it instead of the terminal table)",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write every compared metric as JSON ('-': stdout)"
    )


def main(args: argparse.Namespace) -> int:
    from fsdpbench.analysis.regress import BaselineError
    from fsdpbench.commands.running import check_output_path, print_write_error

    err = Console(stderr=True, soft_wrap=True)  # an error is one line, never wrapped
    try:
        for flag, value in (("--write-baseline", args.write_baseline), ("--json", args.json)):
            if value and value != "-":
                check_output_path(value, flag)
        if args.markdown and args.markdown != "-":
            check_output_path(args.markdown, "--markdown")
        return _write(args, err) if args.write_baseline else _gate(args, err)
    except (BaselineError, ValueError) as exc:  # its input or output is unusable: 2, never 1
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    except OSError as exc:
        print_write_error(err, exc)
        return 2


def _load_run(run_dir: str) -> tuple[Any, dict[str, Any]]:
    """The run's rows and run.json, checked: every case's configuration columns as a scenario's case
    (``case_from_row``), since regress rebuilds cases from them (--map-strategy) and launches them
    (--repeat)."""
    from fsdpbench.analysis.regress import BaselineError
    from fsdpbench.pipeline.scenario import ScenarioError, case_from_row
    from fsdpbench.store.results import ResultsFileError, RunStore, load_results

    try:  # an unusable run is exit 2 (its input), never 1 (a regression)
        frame = load_results(run_dir)
        meta = RunStore(run_dir).read_run_json()
        source = str(Path(run_dir) / "results.parquet")
        for _, row in frame.drop_duplicates("case_id").iterrows():
            case_from_row(row, source=source)
    except (ResultsFileError, ScenarioError) as exc:
        raise BaselineError(str(exc)) from None
    if frame.empty:
        raise BaselineError(
            f"{run_dir}: no results (results.parquet or cases/*.parquet); run fsdpbench run first"
        )
    return frame, meta


def _threshold_args(items: list[str]) -> dict[str, Any]:
    from fsdpbench.analysis.regress import parse_threshold

    return dict(parse_threshold(item) for item in items)


def _write(args: argparse.Namespace, err: Console) -> int:
    from fsdpbench.analysis.regress import build_baseline, write_baseline

    frame, meta = _load_run(args.run_dir)
    pooled = [_load_run(run_dir)[0] for run_dir in args.pool]
    baseline = build_baseline(
        frame,
        meta,
        thresholds=_threshold_args(args.threshold),
        time_reference=args.time_reference,
        pool=pooled,
    )
    write_baseline(args.write_baseline, baseline)
    n_metrics = sum(len(c["metrics"]) for c in baseline["cases"].values())
    prov = baseline["provenance"]
    print(
        f"wrote {args.write_baseline}: {len(baseline['cases'])} cases, {n_metrics} metrics "
        f"(commit {prov[COMMIT]}, torch {prov[TORCH_VERSION]}, {prov[DEVICE_NAME]}, "
        f"host {prov[HOSTNAME]})"
    )
    no_ref = [
        cid
        for cid, c in baseline["cases"].items()
        if c[STATUS] == OK
        and "step_time_ratio" not in c["metrics"]
        and "time_reference" not in c
        and c["strategy"] != args.time_reference
        and cid != args.time_reference
    ]
    for cid in no_ref:
        err.print(
            f"[yellow]note:[/] {escape(cid)}: no {escape(args.time_reference)} case with the same model, "
            "batch and world size in the run, so its step time is gated only on the same machine",
            highlight=False,
        )
    return 0


def _gate(args: argparse.Namespace, err: Console) -> int:
    from fsdpbench.analysis.regress import (
        BaselineError,
        apply_strategy_map,
        check_compared,
        compare,
        load_baseline,
    )
    from fsdpbench.commands.arguments import check_count

    check_count("--repeat", args.repeat, 0, MAX_REPEAT)
    baseline = load_baseline(args.baseline)
    frame, _ = _load_run(args.run_dir)
    mapping = {}
    for item in args.map_strategy:
        run, sep, base = item.partition("=")
        if not sep or not run or not base:
            raise BaselineError(f"--map-strategy {item!r}: expected RUN_STRATEGY=BASELINE_STRATEGY")
        mapping[run] = base
    run_frame, frame = frame, apply_strategy_map(frame, mapping)
    gates = {"time": args.time_gate} if args.time_gate else {}

    def judge(frame: Any) -> Any:
        return compare(
            baseline, frame, thresholds=_threshold_args(args.threshold), gates=gates, strict=args.strict
        )

    result = judge(frame)
    if args.repeat:
        from fsdpbench.pipeline.remeasure import remeasure
        from fsdpbench.pipeline.scenario import plugins_allowed

        result = remeasure(
            result,
            frame,
            run_frame,
            args.repeat,
            Path(args.run_dir) / "remeasured",
            judge,
            log=lambda line: err.print(escape(line), highlight=False),
            # a plugin typed on this command line (--map-strategy mod:Class=zero3) is the user's act for
            # that plugin only: another that the run's files name is not
            allow_plugins=plugins_allowed(args.allow_plugins or None)
            or frozenset(run for run in mapping if ":" in run),
        )
    check_compared(result, args.baseline)

    out = Console()  # the terminal's width, 80 columns in a CI log
    names = case_names(run_frame)
    if args.markdown == "-":  # the Markdown is the table (CI logs, job summaries)
        _emit("-", render_markdown(result, baseline, args.baseline, args.run_dir))
        out.print(escape(verdict_line(result, names, out.width)), highlight=False, soft_wrap=True)
    else:
        # the verdict first, then only what changed: every row is in --markdown and --json
        out.print(escape(verdict_line(result, names, out.width)), highlight=False, soft_wrap=True)
        changed = changed_rows(result)
        if changed:
            out.print(build_table(result, args.baseline, args.run_dir, changed, names))
        unchanged = len(result.differences) - len(changed)
        if unchanged:
            out.print(
                f"{unchanged} metric(s) unchanged and within tolerance, not shown "
                "(--markdown FILE or --json FILE lists every one)",
                highlight=False,
            )
        for note in result.notes:
            out.print(f"note: {escape(note)}", highlight=False)
        if args.markdown:
            _emit(args.markdown, render_markdown(result, baseline, args.baseline, args.run_dir))
    if args.json:
        _emit(
            args.json, json.dumps(to_json(result, args.baseline, args.run_dir), indent=1, default=str) + "\n"
        )
    return 0 if result.passed else 1


def _emit(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)


# ---- formatting ------------------------------------------------------------------------------------


def fmt_value(metric: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, str):
        return value
    unit = COLUMNS[metric].unit if metric in COLUMNS else None  # step_time_ratio is the gate's, not a column
    if unit == BYTES:
        return f"{int(value):,} B"
    if unit == MS:
        return f"{value:.2f} ms"
    if metric in ("step_time_ratio", STEP_TIME_REF_RATIOS, HARNESS_OVERHEAD_RATIO):
        return f"{value:.3f}×"
    if metric == LOSSES:
        return f"{value:.6f}"
    return str(value)


def fmt_change(metric: str, change: Any) -> str:
    if change is None or (isinstance(change, float) and math.isnan(change)):
        return ""
    if math.isinf(change):
        return "+∞ (was 0)"
    if metric == LOSSES:
        return f"{change:.1e}"
    return f"{change:+.2%}"


def _json_value(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def _cells(row: MetricDifference, names: Mapping[str, str] | None = None) -> list[str]:
    tol = (
        ""
        if row.tolerance is None or row.tolerance != row.tolerance
        else (f"{row.tolerance:.0e}" if row.metric == LOSSES else f"{row.tolerance:.0%}")
    )
    verdict = row.verdict + (" ✗" if row.fails else "")
    case = case_name(row, names)
    if row.mode == "emulated":
        case += " [emulated]"
    return [
        case,
        row.metric,
        fmt_value(row.metric, row.baseline),
        fmt_value(row.metric, row.now),
        fmt_change(row.metric, row.change),
        f"{tol} {row.gate or ''}".strip(),
        verdict,
        row.note or "",
    ]


_HEADERS = ["case", "metric", "baseline", "now", "change", "tolerance", "verdict", "note"]


def case_name(row: MetricDifference, names: Mapping[str, str] | None) -> str:
    """The case as a person tells it from the others (``analysis.names``) with its id's hash, or its id
    where the run has no name for it (a baseline case the run lacks)."""
    name = (names or {}).get(row.run_case_id)
    if name is None:
        case = row.case_id
        return case if row.run_case_id == row.case_id else f"{case} (ran as {row.run_case_id})"
    return f"{name} ({id_tail(row.run_case_id)})"


def case_names(frame: Any) -> dict[str, str]:
    """Each case of the run, by its id, named by what tells it from the run's other cases."""
    from fsdpbench.analysis.frame import case_frame
    from fsdpbench.analysis.names import case_labels

    cases = case_frame(frame)
    return dict(zip(cases[CASE_ID], case_labels(cases), strict=True))


def changed_rows(result: DifferenceReport) -> list[MetricDifference]:
    """The rows a person must see: every verdict but ok, and an ok metric that moved (within tolerance)."""
    return [
        r
        for r in result.differences
        if r.verdict != OK or r.fails or (r.change is not None and r.change == r.change and r.change != 0)
    ]


def build_table(
    result: DifferenceReport,
    baseline_path: str,
    run_dir: str,
    rows: list[MetricDifference] | None = None,
    names: Mapping[str, str] | None = None,
) -> Table:
    """The differences (``rows``, or all of them) as a table whose cells fold to the console's width."""
    table = Table(title=escape(f"regress {run_dir} against {baseline_path} (memory: largest rank)"))
    for h in _HEADERS:
        table.add_column(
            h, overflow="fold", justify="right" if h in ("baseline", "now", "change") else "left"
        )
    previous = None
    for row in result.differences if rows is None else rows:
        cells = _cells(row, names)
        if cells[0] == previous:
            cells[0] = ""  # the case id once per group
        else:
            previous = cells[0]
            if table.row_count:
                table.add_section()
        table.add_row(*map(escape, cells), style="red" if row.fails else _VERDICT_STYLE.get(row.verdict))
    return table


def verdict_line(
    result: DifferenceReport, names: Mapping[str, str] | None = None, width: int | None = None
) -> str:
    """Per failure a line ``REGRESSION <case> <metric>: <verdict> (…)`` and one with the case's id
    (``case <case_id>``: its directory); then PASS/FAIL. With ``width``, each line wrapped to it."""
    lines = []
    for r in result.failures:
        change = f", {fmt_change(r.metric, r.change)}" if r.change is not None else ""
        lines += _wrap(
            f"REGRESSION {case_name(r, names) if names else r.case_id} {r.metric}: {r.verdict} "
            f"({fmt_value(r.metric, r.baseline)} → {fmt_value(r.metric, r.now)}{change}"
            f"{', ' + r.note if r.note else ''})",
            width,
        )
        if names and r.run_case_id in names:
            ran_as = f" (ran as {r.run_case_id})" if r.run_case_id != r.case_id else ""
            lines += _wrap(f"  case {r.case_id}{ran_as}", width)
    summary = ", ".join(f"{n} {v}" for v, n in result.verdict_counts().items())
    unjudged = sum(
        r.metric == STEP_TIME_REF_RATIOS and r.verdict == "not compared" for r in result.differences
    )
    time_not_judged = (
        f"; step time not judged in {unjudged} case(s): the machine was busier than the gate is rated for "
        "(memory, communication and losses gated)"
        if unjudged
        else ""
    )
    lines += _wrap(
        ("FAIL" if not result.passed else "PASS")
        + f": {len(result.differences)} compared ({summary}){time_not_judged}",
        width,
    )
    return "\n".join(lines)


def _wrap(text: str, width: int | None) -> list[str]:
    """``text`` in lines of at most ``width`` columns (continuations indented by four), or whole."""
    if width is None or len(text) <= width:
        return [text]
    import textwrap

    return textwrap.wrap(text, width, subsequent_indent="    ", break_on_hyphens=False)


def render_markdown(
    result: DifferenceReport, baseline: dict[str, Any], baseline_path: str, run_dir: str
) -> str:
    """A pull-request comment: the verdict, failures and warnings first, every metric folded below."""
    prov = baseline.get("provenance", {})
    head = "### ❌ fsdpbench regress: FAIL" if not result.passed else "### ✅ fsdpbench regress: PASS"
    lines = [
        head,
        "",
        f"Run `{run_dir}` against `{baseline_path}` (baseline commit {prov.get(COMMIT)}, "
        f"torch {prov.get(TORCH_VERSION)}, {prov.get(DEVICE_NAME)}). Memory: largest rank of each case.",
        "",
    ]
    lines += [f"> {note}" for note in result.notes] + ([""] if result.notes else [])

    def table(differences: list[MetricDifference]) -> list[str]:
        rows = ["| " + " | ".join(_HEADERS) + " |", "|" + "---|" * len(_HEADERS)]
        rows += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |" for r in differences]
        return rows

    notable = result.notable()
    if notable:
        lines += table(notable) + [""]
    lines += [
        f"<details><summary>every compared metric ({len(result.differences)})</summary>",
        "",
        *table(result.differences),
        "",
        "</details>",
        "",
    ]
    return "\n".join(lines)


def to_json(result: DifferenceReport, baseline_path: str, run_dir: str) -> dict[str, Any]:
    """The report as JSON: every difference a record of its fields; NaN as null, an infinite change as
    "inf"."""
    records = [{k: _json_value(v) for k, v in dataclasses.asdict(d).items()} for d in result.differences]
    for r in records:
        if isinstance(r.get("change"), float) and math.isinf(r["change"]):
            r["change"] = "inf"
    return {
        "passed": result.passed,
        "baseline": baseline_path,
        "run_dir": run_dir,
        "machine_matches": result.machine_matches,
        "notes": result.notes,
        "records": records,
    }
