"""Start the ranks of one case in fresh processes, enforce its timeout, collect what they wrote.

Uses PyTorch's elastic multiprocessing (the machinery behind ``torchrun``) with a fork server
that has torch and fsdpbench imported once, so each case starts in well under a second.
The orchestrating process never joins a process group.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpbench.case import Case

_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "fsdpbench.worker"]
_preload_set = False


@dataclass(kw_only=True)
class CaseOutcome:
    """What happened to one case: its status, error, and every rank's recorded results."""

    status: str  # ok | failed | timeout | oom
    error: str = ""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    spawn_s: float = 0.0  # from launch to the last rank's process group being ready


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_case(case: Case, case_dir: Path) -> CaseOutcome:
    """Run one case on ``case.world_size`` local processes; never raises for a rank's failure."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from fsdpbench.worker import rank_entry

    global _preload_set
    if not _preload_set:
        multiprocessing.set_forkserver_preload(_PRELOAD)
        _preload_set = True

    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    n, port = case.world_size, free_port()
    envs = {
        r: {
            "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": case.case_id,
        }
        for r in range(n)
    }  # fmt: skip
    args = {r: (case.to_json(), str(case_dir)) for r in range(n)}
    t0 = time.perf_counter()
    pc = start_processes(
        name=case.case_id, entrypoint=rank_entry, args=args, envs=envs,
        logs_specs=DefaultLogsSpecs(log_dir=str(case_dir / "elastic")), start_method="forkserver",
    )  # fmt: skip
    result = None
    try:
        result = pc.wait(timeout=case.timeout_s, period=0.05)
    finally:
        if result is None:
            pc.close(timeout=5)
    wall = time.perf_counter() - t0

    ranks = [_read_rank(case_dir, r) for r in range(n)]
    if result is None:
        status = "timeout"
        error = f"timed out after {case.timeout_s:g} s; " + _phase_summary(ranks)
    elif result.is_failed():
        status, error = _failure(ranks, result)
    else:
        status, error = "ok", ""
    for rank in ranks:
        if rank.get("status") in (None, "running"):
            rank["status"] = status
    return CaseOutcome(status=status, error=error, ranks=ranks, wall_s=wall, spawn_s=_spawn_s(ranks))


def _read_rank(case_dir: Path, rank: int) -> dict[str, Any]:
    path = case_dir / f"rank{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"rank": rank, "status": None, "phase": "start", "error": "no result written"}


def _phase_summary(ranks: list[dict[str, Any]]) -> str:
    return "ranks stopped in phase: " + ", ".join(f"{r['rank']}:{r.get('phase', '?')}" for r in ranks)


def _failure(ranks: list[dict[str, Any]], result: Any) -> tuple[str, str]:
    """The first rank that recorded an error names the failure; else the launcher's exit codes."""
    for rank in ranks:
        if rank.get("status") in ("failed", "oom"):
            return rank["status"], f"rank {rank['rank']} in {rank.get('phase')}: {rank['error']}"
    codes = ", ".join(f"rank {r}: exit {f.exitcode}" for r, f in sorted(result.failures.items()))
    return "failed", f"rank process died ({codes}); " + _phase_summary(ranks)


def _spawn_s(ranks: list[dict[str, Any]]) -> float:
    return max((r.get("init_pg_s", 0.0) for r in ranks), default=0.0)
