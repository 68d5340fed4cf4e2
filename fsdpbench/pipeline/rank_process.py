"""The process of one rank that ``launch`` starts: its output in the case directory, its life tied to
the orchestrator's, the host tuning the launcher asked for, then the worker."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from fsdpbench.core.case import Case
from fsdpbench.core.rundir import open_log, use_torch_cache
from fsdpbench.engine.worker import run_rank
from fsdpbench.hosttuning.baton import TWIN, env_role
from fsdpbench.hosttuning.hooks import HostHooks


def rank_entry(case_json: str, out_dir: str) -> None:
    """Entry point for launch.py: stdout/stderr go to the case directory, results to rank{R}.json."""
    from fsdpbench.pipeline.lifeline import die_with_parent, hold_while_alive, watch_orchestrator

    die_with_parent()  # the fork server is the parent; it dies with the orchestrator
    watch_orchestrator()
    hold_while_alive(Path(out_dir))  # a --resume does not clear this directory while this rank lives
    use_torch_cache(Path(out_dir))  # torch's caches and TMPDIR in the case directory
    rank = int(os.environ["RANK"])
    # no link planted at the log is written through (the case directory is fresh: appending is writing)
    log = os.fdopen(open_log(Path(out_dir) / f"rank{rank}.log", Path(out_dir)), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    try:
        run_rank(Case.from_dict(json.loads(case_json)), Path(out_dir), HostHooks.from_env(rank))
    except BaseException:
        if twin_rank():  # recorded in its rank file; a failing twin must not stop the case's ranks
            traceback.print_exc()
            return
        raise


def twin_rank() -> bool:
    """Whether this process is a rank of a case's compute twin, started beside the case's ranks."""
    return env_role() == TWIN
