"""Start the ranks of one case in fresh processes, enforce its timeout, collect what they wrote.

Uses PyTorch's elastic multiprocessing (the machinery behind ``torchrun``) with a fork server
that has torch and fsdpbench imported once, so each case starts in well under a second.
The orchestrating process never joins a process group.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import shutil
import signal
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

    status: str  # ok | failed | timeout | oom | skipped (this machine lacks the case's devices: nothing started)
    error: str = ""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    spawn_s: float = 0.0  # from launch to the last rank's process group being ready
    pids: list[int] = field(default_factory=list)  # the rank processes (all gone when launch_case returns)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_case(case: Case, case_dir: Path) -> CaseOutcome:
    """Run one case on ``case.world_size`` local processes (an emulated case: its ``emulate_ranks``, one
    process at a time); never raises for a rank's failure."""
    from fsdpbench.scenario import check_devices

    shortfall = check_devices(case)  # a Case built in code, not from a scenario, is checked here too
    if shortfall:
        return CaseOutcome(status="skipped", error=shortfall)

    global _preload_set
    if not _preload_set:
        multiprocessing.set_forkserver_preload(_PRELOAD)
        # a failed rank is reported once, by us, with its error; the launcher's own log would repeat it
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        _preload_set = True

    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    # a real case starts all its ranks together; an emulated one each of its ranks alone, one at a time
    groups = [[r] for r in case.emulate_ranks] if case.emulate else [list(range(case.world_size))]
    ranks: list[dict[str, Any]] = []
    status, errors, pids, wall = "ok", [], [], 0.0
    for group in groups:
        g_status, g_error, g_ranks, g_pids, g_wall = _launch_group(case, case_dir, group)
        ranks += g_ranks
        pids += g_pids
        wall += g_wall
        if g_status != "ok":
            status = g_status if status == "ok" else status
            errors.append(g_error)
    return CaseOutcome(status=status, error="; ".join(errors), ranks=ranks, wall_s=wall, spawn_s=_spawn_s(ranks),
                       pids=sorted(pids))  # fmt: skip


def _launch_group(case: Case, case_dir: Path, group: list[int]) -> tuple[str, str, list[dict[str, Any]], list[int], float]:
    """Start the ranks in ``group`` together, wait for them (timeout), read what they wrote."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from fsdpbench.worker import rank_entry

    n, port = case.world_size, free_port()
    # an emulated rank has the machine to itself: on a GPU, cuda:0; on the CPU, the threads a real rank
    # of this case would get here (so its compute time is one real rank's)
    local_world = len(group) if case.device == "cuda" or not case.emulate else n
    envs = {
        i: {
            "RANK": str(r), "LOCAL_RANK": str(i), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(local_world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": case.case_id,
        }
        for i, r in enumerate(group)
    }  # fmt: skip
    args = {i: (case.to_json(), str(case_dir)) for i in range(len(group))}
    t0 = time.perf_counter()
    pc = start_processes(
        name=case.case_id, entrypoint=rank_entry, args=args, envs=envs,
        logs_specs=DefaultLogsSpecs(log_dir=str(case_dir / "elastic" / (f"rank{group[0]}" if case.emulate else ""))),
        start_method="forkserver",
    )  # fmt: skip
    result = None
    pids = sorted(pc.pids().values())
    try:
        result = pc.wait(timeout=case.timeout_s, period=0.05)
    finally:
        if result is None:
            pc.close(timeout=5)
    wall = time.perf_counter() - t0
    exitcodes = _exitcodes(pc)

    ranks = [_read_rank(case_dir, r) for r in group]
    if result is None:
        status = "timeout"
        error = f"timed out after {case.timeout_s:g} s; " + _phase_summary(ranks)
    elif result.is_failed():
        status, error = _failure(ranks, result, exitcodes)
    else:
        status, error = "ok", ""
    for rank in ranks:
        if rank.get("status") in (None, "running"):
            rank["status"] = status
    return status, error, ranks, pids, wall


def collect_case(case: Case, case_dir: Path) -> CaseOutcome:
    """The outcome of a case whose ranks ran elsewhere (torchrun/srun across nodes, writing into
    ``case_dir``): read their rank files; a rank that wrote nothing or stopped early is a failure."""
    ranks = [_read_rank(case_dir, r) for r in (case.emulate_ranks if case.emulate else range(case.world_size))]
    bad = [r for r in ranks if r.get("status") != "ok"]
    if not bad:
        status, error = "ok", ""
    else:
        failed = [r for r in bad if r.get("status") in ("failed", "oom")]
        first = min(failed, key=lambda r: r.get("failed_at", 0)) if failed else bad[0]
        status = first.get("status") if first.get("status") in ("failed", "oom") else "failed"
        error = f"rank {first['rank']} in {first.get('phase')}: {first.get('error') or 'no result written'}"
    wall = max((r.get("wall_s") or 0.0 for r in ranks), default=0.0)
    return CaseOutcome(status=status, error=error, ranks=ranks, wall_s=wall, spawn_s=_spawn_s(ranks))


def _read_rank(case_dir: Path, rank: int) -> dict[str, Any]:
    path = case_dir / f"rank{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"rank": rank, "status": None, "phase": "start", "error": "no result written"}


def _phase_summary(ranks: list[dict[str, Any]]) -> str:
    return "ranks stopped in phase: " + ", ".join(f"{r['rank']}:{r.get('phase', '?')}" for r in ranks)


def _exitcodes(pc: Any) -> dict[int, int | None]:
    """Every rank process's exit code (negative: killed by that signal)."""
    procs = getattr(getattr(pc, "_pc", None), "processes", None) or []
    return {i: p.exitcode for i, p in enumerate(procs)}


def _failure(ranks: list[dict[str, Any]], result: Any, exitcodes: dict[int, int | None]) -> tuple[str, str]:
    """Name the root cause: a rank that died without a Python error (signal, os._exit, OOM killer),
    else the rank whose error came first (the others usually fail because it left)."""
    killed_by_launcher = (-signal.SIGTERM, -signal.SIGKILL)
    codes = {**{r: f.exitcode for r, f in result.failures.items()}, **exitcodes}
    silent = [
        f"rank {ranks[r]['rank']} died in phase {ranks[r].get('phase')} (exit {code}) without a Python exception"
        for r, code in sorted(codes.items())
        if ranks[r].get("status") in (None, "running") and code not in (0, None, *killed_by_launcher)
    ]
    failed = sorted((r for r in ranks if r.get("status") in ("failed", "oom")), key=lambda r: r.get("failed_at", 0))
    recorded = [f"rank {r['rank']} in {r.get('phase')}: {r['error']}" for r in failed]
    if silent:
        return "failed", "; ".join(silent + [f"then {m}" for m in recorded[:1]])
    if failed:
        others = f" (then {len(failed) - 1} more rank(s) failed)" if len(failed) > 1 else ""
        return failed[0]["status"], recorded[0] + others
    text = ", ".join(f"rank {r}: exit {c}" for r, c in sorted(codes.items()))
    return "failed", f"rank process died ({text}); " + _phase_summary(ranks)


def _spawn_s(ranks: list[dict[str, Any]]) -> float:
    return max((r.get("init_pg_s", 0.0) for r in ranks), default=0.0)
