"""The process of one rank that ``launch`` starts: its output in the case directory, its life tied to
the orchestrator's, the host tuning its case asks for, then the worker. What the launcher tells it comes
as arguments (``rank_entry``); its environment holds only the launcher protocol (RANK, WORLD_SIZE, …)
and the libraries' process configuration (``engine.worker.process_env``, a compiled case's caches)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

from fsdpbench.core.case import Case
from fsdpbench.engine.worker import run_rank
from fsdpbench.hosttuning.baton import TWIN, spec_role
from fsdpbench.hosttuning.hooks import HostHooks


def rank_entry(case_json: str, out_dir: str, baton_spec: str, orchestrator_pid: int) -> None:
    """Entry point for launch.py: stdout/stderr go to the case directory, results to rank{R}.json.
    ``baton_spec``: this rank's turns with a compute twin ("" for none: ``hosttuning.baton.baton_spec``);
    ``orchestrator_pid``: the process whose end ends this one."""
    from fsdpbench.pipeline.lifeline import die_with_parent, hold_while_alive, watch_orchestrator

    die_with_parent()  # the fork server is the parent; it dies with the orchestrator
    watch_orchestrator(orchestrator_pid)
    hold_while_alive(Path(out_dir))  # a --resume does not clear this directory while this rank lives
    if os.environ.get("TMPDIR"):  # a compiled case's (launch.compile_cache_env): made, and read anew,
        Path(os.environ["TMPDIR"]).mkdir(parents=True, exist_ok=True)
        tempfile.tempdir = None  # as the fork server cached the system's before the launcher set it
    rank = int(os.environ["RANK"])  # the launcher protocol, as under torchrun
    log = open(Path(out_dir) / f"rank{rank}.log", "w")  # noqa: SIM115 — lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    case = Case.from_dict(json.loads(case_json))
    try:
        run_rank(case, Path(out_dir), HostHooks.for_case(case, baton_spec, rank))
    except BaseException:
        if spec_role(baton_spec) == TWIN:  # recorded in its rank file; a failing twin must not stop the case
            traceback.print_exc()
            return
        raise
