"""How many torch intra-op threads one CPU rank gets: the worker sets them, and whatever must run as the
run's ranks do (the gloo probe, the compute twin) sets the same."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

PIN_ENV = "FSDPBENCH_PIN_THREADS"  # "1": the launcher asks each CPU rank to bind its compute threads
# gloo's loop threads under SCHED_IDLE (``idle_gloo_loops``), and a pinned rank's default-group gloo threads
# on its own cores (``bind_to_rank_cores``), for CPU ranks and the gloo probe: "1" always,
# "0" never, unset or "auto" when the machine is idle as the run starts (``gloo_loop_policy``); the
# launcher passes the orchestrator's decision on to every rank as "1" or "0"
GLOO_LOOP_IDLE_ENV = "FSDPBENCH_GLOO_LOOP_IDLE"
GLOO_LOOP_SETTINGS = ("auto", "0", "1")
# "auto": other work using more than this many cores as the run starts keeps gloo's loop as it is. Not
# a fitted number: an idle machine uses a few hundredths of a core (this project's VM: 0.00-0.05), one
# busy process a whole core; under SCHED_IDLE the loop would starve beside that process
BUSY_CORES_LIMIT = 0.25
BUSY_SAMPLE_S = 0.2  # how long "auto" watches the machine's CPU time (/proc/stat)


@dataclass(frozen=True)
class LoopPolicy:
    """Whether CPU ranks put gloo's loop threads under SCHED_IDLE, and why (for the run's record)."""

    idle: bool
    reason: str


def gloo_loop_setting() -> str:
    """The user's ``GLOO_LOOP_IDLE_ENV``: "auto" (also when unset or empty), "0" or "1"; anything else
    a ValueError naming it, so that a typo does not measure something else without a word."""
    value = os.environ.get(GLOO_LOOP_IDLE_ENV, "").strip() or "auto"
    if value not in GLOO_LOOP_SETTINGS:
        raise ValueError(f"environment variable {GLOO_LOOP_IDLE_ENV}={value!r}: expected auto, 0 or 1")
    return value


def loop_state(idle: bool) -> str:
    """How a policy reads in every record of it (idle: a pinned rank binds its gloo threads to its cores
    too, ``bind_to_rank_cores``; its ``gloo_threads_bound`` says how many)."""
    return "under SCHED_IDLE, on each pinned rank's own cores" if idle else "as gloo leaves them"


_auto_policy: list[LoopPolicy] = []  # "auto" decides once per process: every case of a run the same


def gloo_loop_policy(
    busy: Callable[[float], float | None] | None = None, *, anew: bool = False
) -> LoopPolicy:
    """This run's policy for gloo's loop threads on CPU ranks (``GLOO_LOOP_IDLE_ENV``). With "auto",
    the first call (or one with ``anew``: a run starting) watches the machine for ``BUSY_SAMPLE_S``
    (``busy``: cores in use over that time, default ``busy_cores``); later calls keep that decision."""
    setting = gloo_loop_setting()
    if setting != "auto":
        return LoopPolicy(setting == "1", f"{loop_state(setting == '1')} ({GLOO_LOOP_IDLE_ENV}={setting})")
    if anew:
        _auto_policy.clear()
    if not _auto_policy:
        used = (busy or busy_cores)(BUSY_SAMPLE_S)
        load = f"other work kept {used or 0:.2f} of {os.cpu_count() or 1} cores busy as the run started"
        if used is None:
            decided = LoopPolicy(False, f"{loop_state(False)} (auto: no /proc/stat to tell an idle machine)")
        elif used <= BUSY_CORES_LIMIT:
            decided = LoopPolicy(True, f"{loop_state(True)} (auto: {load})")
        else:
            decided = LoopPolicy(
                False,
                f"{loop_state(False)} (auto: {load}, over {BUSY_CORES_LIMIT:g}; under SCHED_IDLE the loop "
                "would starve beside that work)",
            )
        _auto_policy.append(decided)
    return _auto_policy[0]


def follow_gloo_loop_policy(idle: bool, whose: str) -> LoopPolicy:
    """Re-launches of an earlier run's cases (``regress --repeat``) take that run's policy, not the
    machine's now, so that their samples pool with the run's; a setting of 0 or 1 still wins."""
    if gloo_loop_setting() != "auto":
        return gloo_loop_policy()
    _auto_policy[:] = [LoopPolicy(idle, f"{loop_state(idle)} (auto: as in {whose})")]
    return _auto_policy[0]


def gloo_loop_idle_wanted() -> bool:
    """Whether this run's CPU ranks put gloo's loop threads under SCHED_IDLE (``gloo_loop_policy``)."""
    return gloo_loop_policy().idle


def busy_cores(sample_s: float) -> float | None:
    """How many of the machine's cores *other* work kept busy (user, system, interrupts, stolen) over
    the next ``sample_s`` seconds: /proc/stat's busy time less this process's and its descendants'
    (the fork server importing torch as the run starts is the run's own, not other work); None where
    there is no /proc/stat (not Linux)."""
    split = busy_split(sample_s)
    return None if split is None else max(0.0, split[0] - split[1])


def busy_split(sample_s: float) -> tuple[float, float] | None:
    """(cores the machine kept busy, cores this process and its descendants did) over the next
    ``sample_s`` seconds, from /proc/stat and /proc/<pid>/stat; None without /proc/stat."""

    def machine() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = sum(fields[3:5])  # idle, iowait
        return sum(fields[:8]) - idle, sum(fields[:8])  # guest time is in user already

    tree = _own_tree()  # before the sample: its reads below are then a few files, next to /proc/stat's
    before, own_before = machine(), _ticks(tree)
    time.sleep(sample_s)
    after, own_after = machine(), _ticks(tree)
    if before is None or after is None or after[1] <= before[1]:
        return None
    cores, elapsed = os.cpu_count() or 1, after[1] - before[1]  # both in the kernel's USER_HZ ticks
    own = sum(own_after.get(pid, ticks) - ticks for pid, ticks in own_before.items())
    return (after[0] - before[0]) / elapsed * cores, max(0, own) / elapsed * cores


def _own_tree() -> list[int]:
    """This process and its live descendants."""
    parent = {}
    for entry in os.scandir("/proc"):
        stat = _stat_fields(entry.name) if entry.name.isdigit() else None
        if stat is not None:
            parent[int(entry.name)] = int(stat[1])
    mine, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        mine.append(pid)
        todo.extend(child for child, up in parent.items() if up == pid and child not in mine)
    return mine


def _ticks(pids: list[int]) -> dict[int, int]:
    """User + system ticks so far of each of ``pids`` still alive (all its threads)."""
    found = {}
    for pid in pids:
        stat = _stat_fields(str(pid))
        if stat is not None:
            found[pid] = int(stat[11]) + int(stat[12])
    return found


def _stat_fields(pid: str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (which may hold spaces): state, ppid, …"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:  # the process has ended
        return None
    return text[text.rindex(")") + 2 :].split()


def idle_spin_s(probe_s: float = 0.05) -> float:
    """How long this process's idle intra-op threads keep a core busy after a parallel region, in s.

    libgomp's worker threads spin (GOMP_SPINCOUNT, 300,000 pause loops by default) before they sleep:
    8.7 ms of CPU after each parallel region on this project's 2-core VM. A process that runs next on
    the same cores, while they spin, loses a core for that long: measured here as the CPU this process
    uses while its main thread sleeps ``probe_s`` right after a parallel region. 0 with one thread."""
    import resource
    import time

    import torch

    if torch.get_num_threads() < 2:
        return 0.0
    torch.ones(1 << 20).add_(1.0)  # large enough for ATen to run it as a parallel region
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(probe_s)
    after = resource.getrusage(resource.RUSAGE_SELF)
    used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return max(0.0, min(used, probe_s))


def rank_cores(local_rank: int, local_world_size: int) -> list[int]:
    """The cores of CPU rank ``local_rank``: its own ``rank_threads`` of this process's allowed cores,
    in order ([] where the ranks outnumber the cores: they share them, nothing to pin)."""
    allowed = sorted(os.sched_getaffinity(0))
    per_rank = len(allowed) // max(1, local_world_size)
    if per_rank < 1 or local_rank >= local_world_size:
        return []
    return allowed[local_rank * per_rank : (local_rank + 1) * per_rank]


def pin_compute_threads(cores: list[int]) -> list[int]:
    """Bind this process's compute threads one per core: the calling (main) thread to ``cores[0]``
    and the intra-op (OpenMP) threads, started here by a parallel region, to the others; returns
    the thread ids pinned. Threads started later (the samplers', a fresh gloo group's) inherit the
    main thread's core; threads already running (gloo's, when the group came first) keep theirs.

    Why: left to the scheduler, a rank's two intra-op threads on a 2-core VM share one core for
    whole steps now and then (the other core busy with another process, or left there by wake-up
    affinity), and every parallel region then waits for the descheduled one: the same 1-rank step
    measured 25 ms in one process and 38-48 ms in another, steps interleaved, with the scheduler
    placing the threads; bound, 16 of 16 pairs agreed within 5 % (docs/step-time-model.md)."""
    import threading

    import torch

    if not cores or len(cores) < torch.get_num_threads():
        return []
    before = set(os.listdir("/proc/self/task"))
    torch.ones(1 << 20).add_(1.0)  # a parallel region: libgomp starts its worker threads now
    workers = sorted(int(t) for t in set(os.listdir("/proc/self/task")) - before)
    main = threading.get_native_id()
    os.sched_setaffinity(main, {cores[0]})
    pinned = [main]
    for tid, core in zip(workers, cores[1:]):
        try:
            os.sched_setaffinity(tid, {core})
            pinned.append(tid)
        except OSError:  # not a thread of ours any more (a helper that came and went)
            continue
    return pinned


def bind_to_rank_cores(cores: list[int]) -> int:
    """Bind every thread of this process that may run beyond ``cores`` (a pinned rank's own cores) to
    them; returns how many. Those are the threads made before ``pin_compute_threads`` narrowed the main
    thread: the default process group's gloo threads (its TCP loop and its workers), which otherwise
    float over every core; the threads made later inherit the main thread's core already.

    Why: floating, the scheduler places them anew in every process, beside the rank's own compute or
    beside its peer's, and a collective's time follows that placement from one set of processes to the
    next. On this project's 2-core VM, quickstart's and ci's 2-rank cases, 6 benchmark runs each way
    (2026-11-26): floating, the probe's in-context α 452-598 µs, quickstart's zero3 measured 31-40 ms,
    4-10 of 12 cases with steps spread over 20 % (p10-p90); bound, α 244-341 µs, zero3 25-33 ms (one run
    54 ms, the 1-rank cases slow too), 1-7 of 12 (docs/step-time-model.md).

    Only with gloo's loops under SCHED_IDLE (``idle_gloo_loops``; the caller's choice): a loop thread
    left as gloo has it spins while the worker thread it waits for needs a core, and bound to the same
    core that spin starves it: quickstart's 2-rank zero3 measured 51-56 ms so against 25-33 ms.
    Where the ranks outnumber the cores nothing is pinned (``rank_cores``: []), nor bound."""
    wanted = set(cores)
    if not wanted:
        return 0
    bound = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            if not os.sched_getaffinity(int(tid)) <= wanted:
                os.sched_setaffinity(int(tid), wanted)
                bound += 1
        except OSError:  # the thread has ended
            continue
    return bound


GLOO_LOOP_THREAD = "gloo_tcp_loop"  # the name gloo's TCP transport gives its event-loop thread (loop.cc)
LOOP_NAMING_WAIT_S = 2.0  # at most, for a group's new loop thread to run and name itself (a loaded machine)


def idle_gloo_loops() -> int:
    """Put every gloo TCP loop thread of this process under ``SCHED_IDLE``; returns how many (0 where
    the platform has no such policy). Call it once the process's groups exist: each group has its own.
    Where (``gloo_loop_policy``): on a machine with nothing else running, by default; see the last paragraph.

    Why: the loop thread spins. When it cannot take a pair's lock at once (a gloo worker thread holds it
    to post a send or a receive) it skips the pair "until the next tick", and the level-triggered epoll
    hands the same event straight back (gloo/transport/tcp/pair.cc, ``Pair::handleEvents``). If the
    lock's holder was preempted, or waits for the core the loop spins on, the spin lasts until the
    scheduler ends the loop's slice: a collective's ~1 ms "slow mode" on CPU ranks. Two gloo processes
    on this project's 2-core VM, bursts of 8 queued 44 KB broadcasts after 2 ms of compute: in the slow
    bursts the loop thread ran 5-17 ms while a worker thread waited as long for a core, and its samples
    were epoll_wait and pthread_mutex_trylock only. Under SCHED_IDLE any other thread of the machine
    that wakes preempts the spin; the loop still gets every core nothing else wants, which is where
    its real work (reading the sockets) runs, since a rank waiting for a collective sleeps. Per
    collective, 3 process pairs each way: median 77-97 µs (p90 94-334) against 84-367 µs (p90
    285-1264); docs/step-time-model.md has the effect on the cases.

    Why only on an idle machine: under SCHED_IDLE the loop gets a core only when no other thread of the
    machine wants one (weight 3 against 1024), so beside other work its collectives starve. With two busy
    loops of another process on the same 2 cores, the 689 KB all-reduce after 2 ms of compute took
    63-66 ms against 3.1-3.7 ms with gloo's loop as it is (analysis/gloo_loop_spin.py). An unprivileged
    thread cannot leave SCHED_IDLE again, so a rank cannot undo it when the machine gets busy: "auto"
    decides as the run starts, and other work that starts later slows the run's collectives."""
    if not hasattr(os, "SCHED_IDLE"):
        return 0
    # a loop thread names itself when it first runs: until then it bears its creator's name. A group of
    # several ranks connects through its loop before it exists; a group of one may not have run it yet
    expected, deadline = _gloo_groups(), time.monotonic() + LOOP_NAMING_WAIT_S
    while len(loops := _threads_named(GLOO_LOOP_THREAD)) < expected and time.monotonic() < deadline:
        time.sleep(0.001)
    idled = 0
    for tid in loops:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            idled += 1
        except OSError:  # the thread has ended
            continue
    return idled


def _gloo_groups() -> int:
    """How many gloo process groups this process has: each makes its own device, so its own loop."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    from torch.distributed.distributed_c10d import _world  # private: the only list of every group

    return sum("gloo" in str(dist.get_backend(group)) for group in list(_world.pg_map))


def _threads_named(name: str) -> list[int]:
    """The ids of this process's threads called ``name``."""
    found = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    found.append(int(tid))
        except OSError:  # the thread has ended
            continue
    return found
