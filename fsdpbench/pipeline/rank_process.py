"""The process of one rank that ``launch`` starts: its output in the case directory, its life tied to
the orchestrator's, the host tuning its case asks for, then the worker. What the launcher tells it comes
as arguments (``rank_entry``); its environment holds only the launcher protocol (RANK, WORLD_SIZE, …)
and the libraries' process configuration (``engine.process_env``; torch's caches in the case directory,
``core.rundir.torch_cache_env``)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from fsdpbench.core.case import Case
from fsdpbench.core.rundir import open_log, use_torch_cache
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
    use_torch_cache(Path(out_dir))  # torch's caches and TMPDIR in the case directory
    rank = int(os.environ["RANK"])  # the launcher protocol, as under torchrun
    # no link planted at the log is written through (the case directory is fresh: appending is writing)
    log = os.fdopen(open_log(Path(out_dir) / f"rank{rank}.log", Path(out_dir)), "w")
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
