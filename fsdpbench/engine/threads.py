"""How many torch intra-op threads one CPU rank gets: the worker sets them, and whatever must run as the
run's ranks do (the gloo probe, the compute twin) sets the same."""

from __future__ import annotations

import os

PIN_ENV = "FSDPBENCH_PIN_THREADS"  # "1": the launcher asks each CPU rank to bind its compute threads


def rank_threads(world_size: int) -> int:
    """The intra-op threads of a CPU rank when ``world_size`` ranks share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, world_size))


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
