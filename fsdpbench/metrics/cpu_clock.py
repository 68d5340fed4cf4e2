"""CPU time of a rank's work, and how busy the rest of the machine is: the clocks of the CI time gate.

**Work CPU time** (``WorkClock``) is the CPU time of every thread of this process except gloo's TCP
loop threads. The loop thread spins: when it cannot take a pair's lock at once (a gloo worker thread
holds it to post a send or a receive) it skips the pair until the next tick, and the level-triggered
epoll hands the same event straight back (gloo/transport/tcp/pair.cc, ``Pair::handleEvents``). How
long it spins depends on whether the lock's holder has a core, so on the machine's load, and it
grows with the number of collectives in a step. On this project's 2-core VM the loop threads' CPU was
0.4 ms of a 10 ms reference step (one all-reduce) but 2-10 ms of a ZeRO-1 or ZeRO-3 step of 21-27 ms
(41 broadcasts, or an all-gather and a reduce-scatter per block), and it moved by half between runs:
the ratio of a step's process CPU time to the reference's moved by 14% where the ratio of their work
CPU time moved by 4% (docs/ci.md). Everything else the rank runs (its main thread's compute, gloo's
worker threads that copy and reduce, intra-op threads) is work and stays in.

**Machine load** (``MachineLoad``): the busy CPU time of the whole machine (``/proc/stat``: user,
nice, system, irq, softirq), against this process's own, over the same interval. The gate compares
step times only where the rest of the machine left its ranks the share of cores its error rates were
measured with (docs/ci.md).

Both are Linux facilities; elsewhere the work clock is the process's CPU time and the machine load is
unknown (None).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

GLOO_LOOP_THREAD = "gloo_tcp_loop"  # the name gloo's TCP transport gives its event-loop thread (loop.cc)
_PROC_STAT = "/proc/stat"
_BUSY_FIELDS = slice(1, 8)  # user nice system idle iowait irq softirq: the fields read below
_IDLE, _IOWAIT = 3, 4  # positions within those fields (0-based) that are not busy


def threads_named(name: str) -> list[int]:
    """The ids of this process's threads called ``name``."""
    found = []
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    found.append(int(tid))
        except OSError:  # the thread has ended
            continue
    return found


def thread_cpu_s(tid: int) -> float:
    """CPU time of thread ``tid`` of this process, in s (its per-thread CPU clock, Linux's clock id)."""
    return time.clock_gettime(((~tid) << 3) | 6)  # MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)


class WorkClock:
    """CPU time of this process less its gloo loop threads' (module docstring), in s.

    The loop threads are found by name when the clock is made: make it once the process groups exist
    (each group has its own loop). ``loops`` says how many it leaves out."""

    def __init__(self) -> None:
        self.loops = threads_named(GLOO_LOOP_THREAD)

    def __call__(self) -> float:
        return time.process_time() - self.spin()

    def spin(self) -> float:
        """CPU time of the loop threads left out, in s."""
        spin = 0.0
        for tid in self.loops:
            try:
                spin += thread_cpu_s(tid)
            except OSError:  # the loop ended (its group was destroyed): its CPU left the process's too
                continue
        return spin


@dataclass(frozen=True, slots=True)
class LoadReading:
    """One reading of the machine's and this process's CPU time, with the wall clock."""

    wall_s: float
    machine_busy_s: float | None  # every core's busy time; None where /proc/stat is not readable
    own_s: float


class MachineLoad:
    """How busy the machine was between two readings, in shares of its cores."""

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def read(self) -> LoadReading:
        return LoadReading(time.perf_counter(), self._machine_busy_s(), time.process_time())

    def _machine_busy_s(self) -> float | None:
        try:
            with open(_PROC_STAT) as f:
                fields = f.readline().split()
        except OSError:
            return None
        if not fields or fields[0] != "cpu":
            return None
        values = [int(x) for x in fields[_BUSY_FIELDS]]
        return (sum(values) - values[_IDLE] - values[_IOWAIT]) / self._tick

    def shares(self, start: LoadReading, end: LoadReading) -> tuple[float | None, float]:
        """(the machine's busy share of its cores, this process's share) from ``start`` to ``end``."""
        capacity = max(end.wall_s - start.wall_s, 1e-9) * self.cores
        own = (end.own_s - start.own_s) / capacity
        if start.machine_busy_s is None or end.machine_busy_s is None:
            return None, own
        return (end.machine_busy_s - start.machine_busy_s) / capacity, own
