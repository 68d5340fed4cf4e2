"""Start the ranks of one case in fresh processes, enforce its timeout, collect what they wrote.

Uses PyTorch's elastic multiprocessing (the machinery behind ``torchrun``) with a fork server
that has torch and fsdpbench imported once, so each case starts in well under a second.
The orchestrating process never joins a process group.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpbench.core.case import Case
from fsdpbench.core.rundir import (
    CHECKPOINT_DIR,
    RESERVE_GLOB,
    make_dirs,
    remove_torch_tmp,
    remove_tree,
    torch_cache_env,
)
from fsdpbench.core.schema import FAILED, OK, SKIPPED, TIMEOUT
from fsdpbench.engine.rank_result import NO_SPACE_EXIT, CaseOutcome, RankResult, rank_file
from fsdpbench.hosttuning import baton
from fsdpbench.hosttuning.threads import GLOO_LOOP_IDLE_ENV, PIN_ENV, gloo_loop_idle_wanted
from fsdpbench.pipeline.interrupts import launcher_signal
from fsdpbench.pipeline.lifeline import ORCHESTRATOR_PID_ENV, held_by_a_live_rank, pid_alive

# the lifeline first: a fork server that outlived a killed orchestrator would keep its ranks alive
_PRELOAD = [
    "fsdpbench.pipeline._forkserver_lifeline",
    "fsdpbench.pipeline._forkserver_scratch",  # before torch: the cache directory its import makes
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    # ZeRO-1's ZeroRedundancyOptimizer and checkpointing import them: their TorchScript-compiled
    # functional optimizers took ~0.13 s in every such rank (2-core CPU)
    "torch.distributed.optim",
    "torch.distributed.checkpoint",
    "fsdpbench.engine.worker",
    # what a rank and the traced predictor import after their steps: not paid again in every process
    "pandas",
    "pyarrow.parquet",
    "torch.distributed._tools.fsdp2_mem_tracker",
    "torch.utils.flop_counter",
    "fsdpbench.strategies",
    "fsdpbench.models.decoder",
    "fsdpbench.metrics.fsdp1_tracker",
    "fsdpbench.metrics.comm",
    "fsdpbench.metrics.bandwidth",
    "fsdpbench.metrics.overlap",
    "fsdpbench.predictors.traced_columns",
    "fsdpbench.pipeline._forkserver_heap",  # last: freezes what the preloads created
]
_POLL_S = 0.05
_TWIN_GRACE_S = 5.0
_LIVE_RANK_WAIT_S = 10.0
_preload_set = False


class CaseDirInUse(RuntimeError):
    """A case directory still has live rank processes (of another, or a killed, run): never deleted."""


def start_forkserver() -> None:
    """Start the fork server now (``run``/``compare``, from cli.py before anything else is imported): its
    preloads (torch and fsdpbench's worker: ~2 s on 2 cores) then overlap the orchestrator's own imports
    and scenario checks (~2 s) instead of following them at the first case. What the orchestrator does
    to ``sys.path`` later still reaches the ranks (a plugin's directory, ``run --allow-plugins``): every
    launch hands its child the launching process's ``sys.path`` (multiprocessing's preparation data). If
    the orchestrator exits first (a malformed scenario: exit 2), the server dies with it (its first
    preload, ``_forkserver_lifeline``)."""
    from multiprocessing import forkserver

    forkserver_context()
    forkserver.ensure_running()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (a process group's MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forkserver_context() -> Any:
    """multiprocessing's fork server, torch and the worker preloaded in it: a case's ranks, the gloo probe's
    processes and the traced predictor's start from it in milliseconds instead of importing torch each
    (a second per process on a 2-core machine). Its children ignore SIGINT (``_forkserver_lifeline``)."""
    global _preload_set
    if not _preload_set:
        multiprocessing.set_forkserver_preload(_PRELOAD)
        # a failed rank is reported once, by us, with its error; the launcher's own log would repeat it
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        _preload_set = True
    return multiprocessing.get_context("forkserver")


def launch_case(
    case: Case, case_dir: Path, *, together: bool = False, twin: Case | None = None
) -> CaseOutcome:
    """Run one case on ``case.world_size`` local processes (an emulated case: its ``emulate_ranks``, one
    process at a time, or all at once with ``together``, competing for the cores as a real run's ranks
    do); never raises for a rank's failure. ``twin``: the case's compute twin
    (pipeline/compute_twin.py), started beside a real case's ranks, taking turns with them step by step
    (hosttuning/baton.py); its ranks write into ``<case dir>/compute_twin`` and its failure is not the
    case's."""
    from fsdpbench.pipeline.scenario import check_devices

    shortfall = check_devices(case)  # a Case built in code, not from a scenario, is checked here too
    if shortfall:
        return CaseOutcome(status=SKIPPED, error=shortfall)

    forkserver_context()
    _clear_case_dir(case_dir)
    # a real case starts all its ranks together; an emulated one each of its ranks alone, one at a time
    groups = [[r] for r in case.emulate_ranks] if case.emulate else [list(range(case.world_size))]
    if case.emulate and together:
        groups = [list(case.emulate_ranks)]
    try:  # interrupted too: the case is not stored, and what it left is not kept
        return _case_outcome(
            [_launch_group(case, case_dir, group, None if case.emulate else twin) for group in groups]
        )
    finally:
        remove_leftovers(case, case_dir)


def _case_outcome(launched: list[GroupOutcome]) -> CaseOutcome:
    """The case's outcome from its groups': the first failure's status, every failure's error."""
    failed = [g for g in launched if g.status != OK]
    ranks = [r for g in launched for r in g.ranks]
    return CaseOutcome(
        status=failed[0].status if failed else OK,
        error="; ".join(g.error for g in failed),
        ranks=ranks,
        wall_s=sum(g.wall_s for g in launched),
        spawn_s=_spawn_s(ranks),
        pids=sorted(pid for g in launched for pid in g.pids),
        exit_codes={r: code for g in launched for r, code in g.exit_codes.items()},
    )


@dataclass(kw_only=True, slots=True)
class GroupOutcome:
    """What one group of a case's ranks, started together, ended with."""

    status: str
    error: str  # "" when OK
    ranks: list[RankResult]
    pids: list[int]
    wall_s: float
    exit_codes: dict[int, int | None]  # by the case's rank number


def _launch_group(case: Case, case_dir: Path, group: list[int], twin: Case | None = None) -> GroupOutcome:
    """Start the ranks in ``group`` together (and ``twin``'s ranks beside them, taking turns), wait for
    them (timeout), read what they wrote."""
    baton_store = baton.serve() if twin is not None else None
    envs = _rank_envs(case, case_dir, group)
    args = {i: (case.to_json(), str(case_dir)) for i in range(len(group))}
    if baton_store is not None and twin is not None:
        _add_twin(case, twin, case_dir, envs, args, baton_store.port)
    log_dir = case_dir / "elastic" / (f"rank{group[0]}" if case.emulate else "")
    t0 = time.perf_counter()
    pc = _start_processes(case, envs, args, log_dir)
    pids = sorted(pc.pids().values())
    result: Any = None
    own_exits: dict[int, int] = {}
    try:
        result, own_exits = _wait(pc, case.timeout_s, len(group))
    except _signal_exception() as exc:  # a signal in the instant before the handlers were restored
        raise launcher_signal(exc) from None
    finally:
        if result is None:  # timeout or interrupt: stop the ranks now
            pc.close(timeout=5)
        del baton_store  # the case's ranks are gone: nobody waits for a turn
        _remove_error_files(pc)
    wall = time.perf_counter() - t0
    # the launcher numbers a group's processes 0..len-1 (a twin's after them); results name the case's ranks
    exitcodes = {group[i]: code for i, code in _exitcodes(pc).items() if i < len(group)}

    ranks = [RankResult.read(case_dir / rank_file(r), r) for r in group]
    for rank in ranks:
        rank.exit_code = exitcodes.get(rank.rank)
    status, error = _group_status(case, ranks, result, own_exits, exitcodes, len(group))
    for rank in ranks:
        if not rank.ended:
            rank.status = status
    return GroupOutcome(status=status, error=error, ranks=ranks, pids=pids, wall_s=wall, exit_codes=exitcodes)


def _rank_envs(case: Case, case_dir: Path, group: list[int]) -> dict[int, dict[str, str]]:
    """The environment of each launcher process of ``group`` (numbered 0..len-1): the process group's
    rendezvous and what the rank needs to know of the orchestrator and the host."""
    n, port = case.world_size, free_port()
    # an emulated rank has the machine to itself: on a GPU, cuda:0; on the CPU, the threads a real rank
    # of this case would get here (so its compute time is one real rank's)
    local_world = len(group) if case.device == "cuda" or not case.emulate else n
    return {
        i: {
            "RANK": str(r),
            "LOCAL_RANK": str(i),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(local_world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": case.case_id,
            ORCHESTRATOR_PID_ENV: str(os.getpid()),
            # CPU ranks bind their compute threads to cores of their own (hosttuning/threads.py)
            PIN_ENV: "1" if case.device == "cpu" else "0",
            GLOO_LOOP_IDLE_ENV: "1" if case.device == "cpu" and gloo_loop_idle_wanted() else "0",
            **torch_cache_env(case_dir),
        }
        for i, r in enumerate(group)
    }


def _start_processes(case: Case, envs: dict[int, dict[str, str]], args: dict[int, Any], log_dir: Path) -> Any:
    """The launcher's process context of the group, started from the fork server; a signal while it
    starts them is the launcher's interrupt, and the sweep's own handlers are back afterwards."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from fsdpbench.pipeline.rank_process import rank_entry

    handlers = _signal_handlers()
    try:
        return start_processes(
            name=case.case_id,
            entrypoint=rank_entry,
            args=args,
            envs=envs,
            logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
            start_method="forkserver",
        )
    except _signal_exception() as exc:  # the launcher's handlers caught a signal while it started ranks
        raise launcher_signal(exc) from None
    finally:
        _restore_signal_handlers(handlers)  # Ctrl-C stays a KeyboardInterrupt that the sweep handles


def _group_status(
    case: Case,
    ranks: list[RankResult],
    result: Any,
    own_exits: dict[int, int],
    exitcodes: dict[int, int | None],
    n_ranks: int,
) -> tuple[str, str]:
    """(status, error) of a group: timed out (no result), failed, or OK."""
    if result is None:
        return TIMEOUT, f"timed out after {case.timeout_s:g} s; " + _phase_summary(ranks)
    if any(r < n_ranks for r in result.failures):  # a twin process's end is not the case's
        self_exited = {**own_exits, **{r: f.exitcode for r, f in result.failures.items()}}
        return _failure(ranks, self_exited, exitcodes)
    return OK, ""


def _add_twin(
    case: Case, twin: Case, case_dir: Path, envs: dict[int, dict[str, str]], args: dict[int, Any], port: int
) -> None:
    """The compute twin's ranks as launcher processes after the case's, all of them taking turns
    through the baton store at ``port``; the twin's own process group (a 1-rank twin's is real) on a
    port of its own."""
    limit = case.timeout_s / 4  # a turn not given by then: the turns are over, the case goes on alone
    for env in envs.values():
        env.update(baton.baton_env(port, baton.CASE, case.world_size, case.steps, limit))
    twin_dir = case_dir / baton.TWIN_DIR
    make_dirs(twin_dir, case_dir)  # a link planted there is replaced, never written through
    first, twin_port = len(envs), free_port()
    for r in range(twin.world_size):
        envs[first + r] = {
            **envs[r],
            "MASTER_PORT": str(twin_port),
            "TORCHELASTIC_RUN_ID": f"{case.case_id}-twin",
            **baton.baton_env(port, baton.TWIN, case.world_size, case.steps, limit),
            **torch_cache_env(twin_dir),
        }
        args[first + r] = (twin.to_json(), str(twin_dir))


def remove_leftovers(case: Case, case_dir: Path) -> None:
    """What a case's ranks leave that is no result, once they are gone: their temporary directory
    (``rundir.torch_cache_env``), a rank's disk reserve (``worker.RankRecorder``), and the checkpoint
    unless the case keeps it, whole or partial (a rank killed in a save, or a full disk, leaves it
    partial)."""
    kept = case.checkpoint == "none" or case.keep_checkpoints
    leftovers = [] if kept else [(case_dir / CHECKPOINT_DIR, case_dir)]
    for directory in (case_dir, case_dir / baton.TWIN_DIR):
        leftovers += [(reserve, directory) for reserve in directory.glob(RESERVE_GLOB)]
    for path, root in leftovers:
        with contextlib.suppress(OSError):  # not there, or a link on the way: nothing of ours to remove
            remove_tree(path, root)
    for directory in (case_dir, case_dir / baton.TWIN_DIR):
        with contextlib.suppress(OSError):
            remove_torch_tmp(directory)


def _remove_error_files(pc: Any) -> None:
    """torch's process starter gives every rank an error file in the system's temporary directory
    (``pytorch-errorfile-*.pickle``), which a rank that failed leaves there: removed once read."""
    for path in getattr(getattr(pc, "_pc", None), "error_files", None) or []:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _wait(pc: Any, timeout_s: float, n_ranks: int) -> tuple[Any, dict[int, int]]:
    """Poll the ranks until all finish, one fails, or the timeout; also return the exit codes seen
    before the launcher closed anything: those ranks ended on their own, whatever the signal. The
    processes after the first ``n_ranks`` (a compute twin's) are killed once the case's ranks have
    all ended well and they have had ``_TWIN_GRACE_S`` more: their results come before the case's end."""
    procs = getattr(getattr(pc, "_pc", None), "processes", None) or []
    own_exits: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    ranks_done_at: float | None = None
    while True:
        for r, proc in enumerate(procs):
            if r not in own_exits and proc.exitcode is not None:
                own_exits[r] = proc.exitcode
        if ranks_done_at is None and all(own_exits.get(r) == 0 for r in range(min(n_ranks, len(procs)))):
            ranks_done_at = time.monotonic()
        if ranks_done_at is not None and time.monotonic() - ranks_done_at > _TWIN_GRACE_S:
            for proc in procs[n_ranks:]:
                if proc.exitcode is None:
                    proc.kill()
        try:
            result = pc.wait(timeout=0)  # on a failure, this closes (SIGTERMs) the other ranks
        except ValueError:
            # a failed rank's error file that is not JSON: empty, where the disk was full when the rank
            # wrote it (torch's launcher reads it after closing the ranks). The ranks that exited with a
            # code of their own, not the launcher's signal, are the failures
            for r, proc in enumerate(procs):
                if proc.exitcode not in (None, 0) and proc.exitcode > 0:
                    own_exits.setdefault(r, proc.exitcode)
            codes = {r: code for r, code in own_exits.items() if code != 0}
            codes = codes or {r: p.exitcode for r, p in enumerate(procs) if p.exitcode} or {0: 1}
            return _Failed(codes), own_exits
        if result is not None or time.monotonic() >= deadline:
            return result, own_exits
        time.sleep(_POLL_S)


@dataclass
class _Failed:
    """What the launcher's result says of a failure, where it could not say it itself."""

    codes: dict[int, int]

    @property
    def failures(self) -> dict[int, Any]:
        return {r: _Exited(code) for r, code in self.codes.items()}


@dataclass
class _Exited:
    exitcode: int


def _signal_handlers() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    }


def _restore_signal_handlers(handlers: dict[int, Any]) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _signal_exception() -> type[BaseException]:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return SignalException


def _clear_case_dir(case_dir: Path) -> None:
    """An empty case directory; what an earlier attempt left is deleted, unless a rank of it lives."""
    if case_dir.is_symlink():
        raise CaseDirInUse(f"{case_dir} is a symbolic link; refusing to delete through it")
    if case_dir.exists():
        # whether a rank lives is the lock its ranks hold, not a pid read back from a rank file (which
        # may name any process: reused since, or written by a stranger)
        deadline = time.monotonic() + _LIVE_RANK_WAIT_S
        live = held_by_a_live_rank(case_dir)
        while live and time.monotonic() < deadline:  # ranks of a killed orchestrator die within moments
            time.sleep(0.2)
            live = held_by_a_live_rank(case_dir)
        if live:
            raise CaseDirInUse(
                f"{case_dir} is in use by a live rank process (pids in its rank files: "
                f"{_live_rank_pids(case_dir) or 'none alive'}); not deleted"
            )
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)


def _live_rank_pids(case_dir: Path) -> list[int]:
    """The pids the rank files of ``case_dir`` name that are alive: the message's detail only."""
    pids = []
    for path in case_dir.glob("rank*.json"):
        number = path.stem.removeprefix("rank")  # not a column: the file name's prefix
        pid = (RankResult.read(path, int(number)).pid or 0) if number.isdigit() else 0
        if pid > 0 and pid != os.getpid() and pid_alive(pid):
            pids.append(pid)
    return sorted(pids)


def collect_case(case: Case, case_dir: Path) -> CaseOutcome:
    """The outcome of a case whose ranks ran elsewhere (torchrun/srun across nodes, writing into
    ``case_dir``): read their rank files; a rank that wrote nothing or stopped early is a failure."""
    ranks = [
        RankResult.read(case_dir / rank_file(r), r)
        for r in (case.emulate_ranks if case.emulate else range(case.world_size))
    ]
    bad = [r for r in ranks if r.status != OK]
    status: str
    if not bad:
        status, error = OK, ""
    else:
        failed = [r for r in bad if r.failed_itself]
        first = min(failed, key=lambda r: r.failed_at or 0) if failed else bad[0]
        status = str(first.status) if first.failed_itself else FAILED
        error = first.where()
    wall = max((r.wall_s or 0.0 for r in ranks), default=0.0)
    return CaseOutcome(status=status, error=error, ranks=ranks, wall_s=wall, spawn_s=_spawn_s(ranks))


def _phase_summary(ranks: list[RankResult]) -> str:
    return "ranks stopped in phase: " + ", ".join(f"{r.rank}:{r.phase or '?'}" for r in ranks)


def _exitcodes(pc: Any) -> dict[int, int | None]:
    """Every rank process's exit code (negative: killed by that signal)."""
    procs = getattr(getattr(pc, "_pc", None), "processes", None) or []
    return {i: p.exitcode for i, p in enumerate(procs)}


def _failure(
    ranks: list[RankResult], self_exited: dict[int, int | None], exitcodes: dict[int, int | None]
) -> tuple[str, str]:
    """Name the root cause: a rank that died on its own without a Python error (a signal, os._exit,
    the OOM killer), else the rank whose error came first (the others usually fail because it left).
    A rank the launcher stopped after the first failure (SIGTERM, then SIGKILL) is never the cause."""
    silent = [
        f"rank {ranks[r].rank} in phase {ranks[r].phase}: no space left on device, not even for its rank file"
        if code == NO_SPACE_EXIT
        else f"rank {ranks[r].rank} {_exit_text(code)} in phase {ranks[r].phase} without a Python exception"
        for r, code in sorted(self_exited.items())
        if not ranks[r].ended and code not in (0, None)
    ]
    failed = sorted((r for r in ranks if r.failed_itself), key=lambda r: r.failed_at or 0)
    recorded = [r.where() for r in failed]
    if silent:
        return FAILED, "; ".join(silent + [f"then {m}" for m in recorded[:1]])
    if failed:
        others = f" (then {len(failed) - 1} more rank(s) failed)" if len(failed) > 1 else ""
        return str(failed[0].status), recorded[0] + others
    text = ", ".join(f"rank {r}: {_exit_text(c)}" for r, c in sorted(exitcodes.items()))
    return FAILED, f"rank process died ({text}); " + _phase_summary(ranks)


def _exit_text(code: int | None) -> str:
    """'exit 9', or for a negative code the signal: 'killed by SIGKILL (signal 9)'."""
    if code is None or code >= 0:
        return f"exit {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "signal"
    hint = " (an external kill or the kernel's OOM killer)" if -code == signal.SIGKILL else ""
    return f"killed by {name} (signal {-code}){hint}"


def _spawn_s(ranks: list[RankResult]) -> float:
    return max((r.setup.init_pg_s if r.setup else 0.0 for r in ranks), default=0.0)
