"""What the verbs that run cases (``run``, ``compare``) share: --link and --set, plugin imports, the
header of run.json, and the progress lines printed as cases start and finish; also the strategy-list
option that ``compare`` and ``predict`` both take."""

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
from fsdpbench.core.schema import CASE_STEP_TIME, OK, SKIPPED

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


def print_skipped(console: Console, scenario: Any) -> None:
    for s in scenario.skipped:
        console.print(f"  skipped {s.case.case_id}: {escape(s.reason)}", style="yellow", highlight=False)


def outcome_line(case: Any, outcome: Any, rows: Any) -> str:
    """One finished case as a line of console markup: status, case id, step time, first error line."""
    colour = "green" if outcome.status == OK else "red"
    ms = rows[CASE_STEP_TIME].iloc[0] if CASE_STEP_TIME in rows else None
    return (
        f"  [{colour}]{outcome.status:7}[/] {case.case_id}"
        + (f"  {ms:.1f} ms/step" if ms is not None and ms == ms else "")
        + (f"  — {escape(outcome.error.splitlines()[0][:160])}" if outcome.error else "")
    )


def _ranks_text(case: Any) -> str:
    if case.emulate:
        return f"rank {','.join(map(str, case.emulate_ranks))} of {case.world_size}, emulated"
    return f"{case.world_size} {case.device} ranks"


@contextmanager
def case_progress(console: Console, n_cases: int) -> Iterator[tuple[OnStart, OnDone]]:
    """A progress bar over the cases; yields run_cases' (on_start, on_done), which move it and print
    each finished case's line above it.

    The bar is live on a terminal only, and leaves when the cases are done (the finished cases' lines
    stay): piped or logged output cannot redraw, and its one frame, printed at the end, would name the
    last case as if it still ran. There each finished case's line is the progress."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not console.is_terminal:

        def print_done(case: Any, outcome: Any, rows: Any) -> None:
            console.print(outcome_line(case, outcome, rows), highlight=False)

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
            progress.update(task, description=f"{case.case_id} ({_ranks_text(case)})")

        def on_done(case: Any, outcome: Any, rows: Any) -> None:
            progress.console.print(outcome_line(case, outcome, rows), highlight=False)
            progress.advance(task)

        yield on_start, on_done
