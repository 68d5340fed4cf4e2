"""The host tuning of CPU ranks (a case's ``host_tuning``, ``core.case.HOST_TUNINGS``): compute threads
bound to cores of their own (``pin``), and gloo's loop threads under SCHED_IDLE beside that
(``pin-idle-loops``); what this machine and torch can apply (``host_tuning_unsupported``). Nothing here
is applied unless a case asks: by default ranks run as the machine runs them."""

from __future__ import annotations

import os
import time
from functools import cache

from fsdpbench.core.case import NO_HOST_TUNING, PIN, PIN_IDLE_LOOPS, Case
from fsdpbench.metrics.cpu_clock import GLOO_LOOP_THREAD
from fsdpbench.metrics.cpu_clock import threads_named as _threads_named

LOOP_NAMING_WAIT_S = 2.0  # at most, for a group's new loop thread to run and name itself (a loaded machine)


def pins(tuning: str) -> bool:
    """Whether ``tuning`` binds a CPU rank's compute threads to cores of its own."""
    return tuning in (PIN, PIN_IDLE_LOOPS)


def idles_loops(tuning: str) -> bool:
    """Whether ``tuning`` puts a CPU rank's gloo loop threads under SCHED_IDLE (and binds gloo's threads)."""
    return tuning == PIN_IDLE_LOOPS


def check_host_tuning(case: Case) -> str | None:
    """Why ``case``'s host tuning cannot be applied here (one line), or None: it tunes CPU ranks only,
    and only where this platform and torch offer what it needs."""
    if case.host_tuning == NO_HOST_TUNING:
        return None
    if case.device != "cpu":
        return f"host_tuning {case.host_tuning} tunes CPU ranks; a {case.device} case runs with none"
    return host_tuning_unsupported(case.host_tuning)


def host_tuning_unsupported(tuning: str) -> str | None:
    """Why this platform or torch cannot apply ``tuning`` to a CPU rank (one line), or None."""
    if tuning == NO_HOST_TUNING:
        return None
    if not hasattr(os, "sched_setaffinity"):
        return f"host_tuning {tuning}: binding threads to cores needs os.sched_setaffinity (Linux)"
    if not idles_loops(tuning):
        return None
    if not hasattr(os, "SCHED_IDLE"):
        return f"host_tuning {tuning}: this platform has no SCHED_IDLE scheduling policy"
    if not gloo_names_its_loop():
        import torch

        return (
            f"host_tuning {tuning}: the gloo of torch {torch.__version__} does not name its TCP loop thread "
            f"{GLOO_LOOP_THREAD!r}, so it cannot be told from gloo's other threads (use pin or none)"
        )
    return None


@cache
def gloo_names_its_loop() -> bool:
    """Whether this torch's gloo names its TCP loop thread ``GLOO_LOOP_THREAD`` (torch 2.13 does, 2.11 not):
    a gloo device made here, alone (no process group, nothing connected), starts its loop thread, which
    names itself when it first runs; the device and its thread end before this returns."""
    from torch.distributed import ProcessGroupGloo

    before = set(_threads_named(GLOO_LOOP_THREAD))
    device = ProcessGroupGloo.create_device(hostname="127.0.0.1")
    try:
        deadline = time.monotonic() + LOOP_NAMING_WAIT_S
        while not set(_threads_named(GLOO_LOOP_THREAD)) - before and time.monotonic() < deadline:
            time.sleep(0.001)
        return bool(set(_threads_named(GLOO_LOOP_THREAD)) - before)
    finally:
        del device  # its destructor stops and joins the loop thread


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
    next. On this project's 2-core VM, quickstart's and ci's 2-rank cases, 6 benchmark runs each way:
    floating, the probe's in-context α 452-598 µs, quickstart's zero3 measured 31-40 ms,
    4-10 of 12 cases with steps spread over 20 % (p10-p90); bound, α 244-341 µs, zero3 25-33 ms (one run
    54 ms, the 1-rank cases slow too), 1-7 of 12 (docs/step-time-model.md).

    Only with gloo's loops under SCHED_IDLE (``idle_gloo_loops``: the tuning pin-idle-loops): a loop thread
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


def idle_gloo_loops() -> int:
    """Put every gloo TCP loop thread of this process under ``SCHED_IDLE``; returns how many. Call it once
    the process's groups exist: each group has its own. RuntimeError where a group's loop thread cannot be
    found by its name (``gloo_names_its_loop``: a check before the run refuses such a torch): a rank
    never measures with fewer loops idled than its tuning says.

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

    What it costs on a busy machine: under SCHED_IDLE the loop gets a core only when no other thread of
    the machine wants one (weight 3 against 1024), so beside other work its collectives starve. With two
    busy loops of another process on the same 2 cores, the 689 KB all-reduce after 2 ms of compute took
    63-66 ms against 3.1-3.7 ms with gloo's loop as it is (analysis/gloo_loop_spin.py). An unprivileged
    thread cannot leave SCHED_IDLE again. Hence opt-in, a case's own tuning, never the default."""
    # a loop thread names itself when it first runs: until then it bears its creator's name. A group of
    # several ranks connects through its loop before it exists; a group of one may not have run it yet
    expected, deadline = _gloo_groups(), time.monotonic() + LOOP_NAMING_WAIT_S
    while len(loops := _threads_named(GLOO_LOOP_THREAD)) < expected and time.monotonic() < deadline:
        time.sleep(0.001)
    if len(loops) < expected:
        raise RuntimeError(
            f"host tuning: {len(loops)} thread(s) named {GLOO_LOOP_THREAD!r} for {expected} gloo group(s); "
            "gloo's loop threads cannot be put under SCHED_IDLE"
        )
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
