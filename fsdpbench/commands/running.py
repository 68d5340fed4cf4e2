"""What the verbs that run cases (``run``, ``compare``) share: --link and --set, plugin imports, the
header of run.json, and the progress lines printed as cases start and finish; also the strategy-list
and ``--model-args`` options that ``compare`` and ``predict`` both take."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from fsdpbench.core.markup import escape
from fsdpbench.core.schema import CASE_STEP_TIME, OK, SKIPPED, STEP_TIME
from fsdpbench.metrics.timing import starved_note

# run_cases' callbacks: on_start(case, index) and on_done(case, outcome, rows)
OnStart = Callable[[Any, int], None]
OnDone = Callable[[Any, Any, Any], None]


def add_link_argument(parser: argparse.ArgumentParser) -> None:
    """--link: the link of the modelled step time."""
    from fsdpbench.predictors.comm_model import AUTO, link_choices

    parser.add_argument(
        "--link",
        default=AUTO,
        metavar="LINK",
        help="link of the modelled step time (model_* columns: measured compute + α–β "
        f"communication): {link_choices()}, or none (default: {AUTO}: gloo, probed "
        "once per run, for gloo cases; nvlink4 for nccl cases)",
    )


def check_output_path(text: str, flag: str, *, directory: bool = False) -> Path:
    """An output path a command will write (a file, or with ``directory`` a directory), checked before
    any work: not an existing directory (file) or file (directory), not under a file, its nearest
    existing parent writable, the name UTF-8. ValueError names the option and the path."""
    try:  # pyarrow and the HTML report encode paths as UTF-8: refused now, not after the cases ran
        os.fsencode(text).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {text!r}: the path is not valid UTF-8; choose a UTF-8 name") from None
    path = Path(text)
    if directory and path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {text}: exists and is not a directory")
    if not directory and path.is_dir():
        raise ValueError(f"{flag} {text}: is a directory; give a file path")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {text}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {text}: {parent} is not writable")
    return path


def print_write_error(console: Console, exc: OSError) -> None:
    """The one line of a write that failed (the path checks passed, the write did not)."""
    console.print(
        f"[red]error:[/] cannot write {escape(str(exc.filename or exc))}: {escape(exc.strerror or str(exc))}",
        highlight=False,
    )


def add_oversubscribe_argument(parser: argparse.ArgumentParser) -> None:
    """--allow-oversubscribe, for every command that starts CPU ranks (run, compare)."""
    from fsdpbench.pipeline.scenario import CPU_RANKS_PER_CORE

    parser.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help=f"run more than {CPU_RANKS_PER_CORE} CPU ranks per core",
    )


def add_strategies_argument(parser: argparse.ArgumentParser, flag: str, default: str) -> None:
    """The comma-separated strategy list (compare's --strategies, predict's --strategy)."""
    parser.add_argument(flag, default=default, help=f"comma-separated strategies (default: {default})")


def link_spec(value: str) -> str | None:
    """The --link value checked (LinkError names what is wrong); None for 'none'."""
    from fsdpbench.predictors.comm_model import validate_link_spec

    return None if value == "none" else validate_link_spec(value)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """--set FIELD=VALUE items as a dict, each value read as YAML."""
    from fsdpbench.core.safe_yaml import YamlInputError, load_yaml
    from fsdpbench.pipeline.scenario import ScenarioError

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ScenarioError(f"--set {item!r}: expected FIELD=VALUE")
        try:
            out[key.strip()] = load_yaml(value)
        except YamlInputError as exc:
            raise ScenarioError(f"--set {item!r}: {exc}") from None
    return out


MODEL_ARGS_FLAG = "--model-args"
STRATEGY_ARGS_FLAG = "--strategy-args"


def add_model_args_argument(parser: argparse.ArgumentParser) -> None:
    _add_mapping_argument(
        parser,
        MODEL_ARGS_FLAG,
        "the model's arguments, as a scenario's model_args, e.g. d_model=4096,n_layers=32,n_kv_heads=8 "
        "(values read as YAML scalars; the names each model takes: docs/scenarios.md)",
    )


def add_strategy_args_argument(parser: argparse.ArgumentParser) -> None:
    _add_mapping_argument(
        parser,
        STRATEGY_ARGS_FLAG,
        "the strategy's arguments, as a scenario's strategy_args, e.g. reshard_after_forward=2 "
        "(values read as YAML scalars; what each strategy reads: docs/scenarios.md)",
    )


def _add_mapping_argument(parser: argparse.ArgumentParser, flag: str, help_text: str) -> None:
    parser.add_argument(flag, metavar="NAME=VALUE,…", help=help_text)


def _case_mapping(text: str | None, flag: str, field: str) -> dict[str, Any]:
    """``flag NAME=VALUE,…`` as the case's mapping ``field``, checked by the case schema's type check: a
    ScenarioError names the flag and the argument."""
    from pydantic import ValidationError

    from fsdpbench.core.safe_yaml import YamlInputError, load_yaml
    from fsdpbench.pipeline.scenario import CaseFields, ScenarioError

    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ScenarioError(f"{flag} {item.strip()!r}: expected NAME=VALUE")
        try:
            out[key] = load_yaml(value.strip())
        except YamlInputError as exc:
            raise ScenarioError(f"{flag} {key}: {exc}") from None
    try:
        CaseFields.model_validate({field: out})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"][1:]) or field
        raise ScenarioError(f"{flag} {where}: {err['msg'].removeprefix('Value error, ')}") from None
    return out


def parse_model_args(text: str | None, model: str) -> dict[str, Any]:
    """``--model-args NAME=VALUE,…`` for ``model``, checked as a scenario's ``model_args`` are (the case
    schema's type check, then the model's own): a ScenarioError names the flag and the argument."""
    from fsdpbench.models import check_model_args
    from fsdpbench.pipeline.scenario import ScenarioError

    out = _case_mapping(text, MODEL_ARGS_FLAG, "model_args")
    problem = check_model_args(model, out)
    if problem:
        raise ScenarioError(f"{MODEL_ARGS_FLAG}: {problem}")
    return out


def parse_strategy_args(text: str | None) -> dict[str, Any]:
    """``--strategy-args NAME=VALUE,…``, checked as a scenario's ``strategy_args`` are by the case schema
    (each strategy checks its own when the case is built)."""
    return _case_mapping(text, STRATEGY_ARGS_FLAG, "strategy_args")


def validate_overrides(overrides: dict[str, Any]) -> None:
    """Each --set field is a case field and its value valid for it (ScenarioError names which not)."""
    from pydantic import ValidationError

    from fsdpbench.pipeline.scenario import CaseFields, ScenarioError

    for key, value in overrides.items():
        if key not in CaseFields.model_fields:
            raise ScenarioError(f"--set {key}: unknown field; allowed: {', '.join(CaseFields.model_fields)}")
        try:
            CaseFields.model_validate({key: value})
        except ValidationError as exc:
            raise ScenarioError(f"--set {key}: {exc.errors()[0]['msg']}") from None


def run_header(
    scenario: Any, *, path: str | None, text: str, overrides: dict[str, Any], started: str
) -> dict[str, Any]:
    """run.json's description of what was run, when, from where and on what."""
    from fsdpbench.store.env import collect_env

    return {
        "scenario": {
            "name": scenario.name,
            "description": scenario.description,
            "path": path,
            "text": text,
            "overrides": overrides,
        },
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "env": collect_env(),
        "started": started,
        SKIPPED: [{"case_id": s.case.case_id, "reason": s.reason} for s in scenario.skipped],
    }


def scenario_names(scenario: Any) -> dict[str, str]:
    """Every case of the scenario, run or skipped, named by what tells it from the others."""
    from fsdpbench.analysis.names import case_names

    return case_names([*scenario.cases, *(s.case for s in scenario.skipped)])


def print_thread_policy(console: Console, cases: Any) -> None:
    """What the cases' host tuning does to gloo's threads, in the scheduler's words: one line per tuning
    among the gloo cases (a run of NCCL ranks has no gloo threads, and no line)."""
    from fsdpbench.core.case import GLOO_THREADS

    tunings = dict.fromkeys(c.host_tuning for c in cases if c.backend == "gloo")
    for tuning in tunings:
        console.print(f"  host_tuning {tuning}: {GLOO_THREADS[tuning]}", highlight=False, soft_wrap=False)


def print_skipped(console: Console, scenario: Any) -> None:
    names = scenario_names(scenario) if scenario.skipped else {}
    for s in scenario.skipped:
        name = names.get(s.case.case_id, s.case.case_id)
        text = f"  skipped {escape(name)}: {escape(s.reason)}"
        console.print(text, style="yellow", highlight=False, soft_wrap=False)


def outcome_line(case: Any, outcome: Any, rows: Any, name: str | None = None) -> str:
    """One finished case as a line of console markup: status, its name (what tells it from the other
    cases: analysis.names) with its id's hash (its directory), step time, first error line."""
    from fsdpbench.analysis.names import id_tail

    colour = "green" if outcome.status == OK else "red"
    ms = rows[CASE_STEP_TIME].iloc[0] if CASE_STEP_TIME in rows else None
    # the slowest rank's row: the one whose steps make the case's step time
    note = ""
    if STEP_TIME in rows and rows[STEP_TIME].notna().any():
        note = starved_note(rows.loc[rows[STEP_TIME].astype(float).idxmax()])
    return (
        f"  [{colour}]{outcome.status:7}[/] "
        + (f"{escape(name)} [dim]{id_tail(case.case_id)}[/]" if name else case.case_id)
        + (f"  {ms:.1f} ms/step" if ms is not None and ms == ms else "")
        + (f"  [yellow]{note}: not compared[/]" if note else "")
        + (f"  — {escape(outcome.error.splitlines()[0][:160])}" if outcome.error else "")
    )


def _ranks_text(case: Any) -> str:
    if case.emulate:
        return f"rank {','.join(map(str, case.emulate_ranks))} of {case.world_size}, emulated"
    return f"{case.world_size} {case.device} ranks"


@contextmanager
def case_progress(console: Console, n_cases: int, cases: Any = ()) -> Iterator[tuple[OnStart, OnDone]]:
    """A progress bar over the cases; yields run_cases' (on_start, on_done), which move it and print
    each finished case's line above it, each case named by what tells it from the others (``cases``:
    the sweep's cases).

    The bar is live on a terminal only, and leaves when the cases are done (the finished cases' lines
    stay): piped or logged output cannot redraw, and its one frame, printed at the end, would name the
    last case as if it still ran. There each finished case's line is the progress."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fsdpbench.analysis.names import case_names

    names = case_names(cases)
    if not console.is_terminal:

        def print_done(case: Any, outcome: Any, rows: Any) -> None:
            line = outcome_line(case, outcome, rows, names.get(case.case_id))
            console.print(line, highlight=False, soft_wrap=False)

        yield (lambda case, index: None), print_done
        return
    progress = Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with progress:
        task = progress.add_task("cases", total=n_cases)

        def on_start(case: Any, index: int) -> None:
            name = names.get(case.case_id, case.case_id)
            progress.update(task, description=f"{name} ({_ranks_text(case)})")

        def on_done(case: Any, outcome: Any, rows: Any) -> None:
            progress.console.print(
                outcome_line(case, outcome, rows, names.get(case.case_id)), highlight=False
            )
            progress.advance(task)

        yield on_start, on_done
