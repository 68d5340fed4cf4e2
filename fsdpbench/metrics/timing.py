"""Step times of one rank: each timed step's wall and CPU time, its median and spread.

A case's step time is the slowest rank's median (``results.build_rows``).

Starved steps. A CPU rank's step is CPU work: its threads run the kernels and gloo's collectives. Wall
time its process's CPU time does not cover is time no thread of it ran: it waited for a core (the
machine busy with other work, or its threads at a scheduler policy that yields to everything else), or
for a peer that did. A rank's fair share of the cores is min(1, cpus ÷ world_size): one core per rank
where the machine has as many, less where the case's own ranks outnumber its cores (4 ranks on 2 cores
take turns: 0.5 each, by the case's own shape, not starvation). Where the timed steps' CPU time is under
``STARVED_CPU_SHARE`` of the rank's fair share of their wall time, the step time measures the machine
more than the strategy: the case says so wherever its step time is shown and wins or loses no step-time
comparison. On a GPU rank the host waits for the device by design, so the share says nothing there and
no GPU case is called starved.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fsdpbench.core.schema import (
    CPUS,
    DEVICE,
    STEP_CPU_SHARE,
    STEP_TIME,
    STEP_TIME_MEAN,
    STEP_TIME_P10,
    STEP_TIME_P90,
    STEP_TIME_STD,
    WORLD_SIZE,
)

# half its fair share of the wall time without a thread of the process on a core: an unloaded CPU rank's
# steps are compute and gloo's own threads, over its fair share of a core per wall second
STARVED_CPU_SHARE = 0.5


@dataclass(kw_only=True, slots=True)
class StepTimes:
    """Wall milliseconds of a rank's timed steps, device-synchronised before and after each, and the
    process's CPU milliseconds over each (empty in files from before it was recorded)."""

    times_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)

    def extend(self, other: StepTimes) -> None:
        self.times_ms += other.times_ms
        self.cpu_ms += other.cpu_ms

    COLUMNS: ClassVar[tuple[str, ...]] = (
        STEP_TIME,  # the median
        STEP_TIME_P10,
        STEP_TIME_P90,
        STEP_TIME_MEAN,
        STEP_TIME_STD,
    )

    def to_columns(self) -> dict[str, float]:
        """step_time_ms (the median), its p10, p90, mean and standard deviation, and the steps' CPU
        share where their CPU time was recorded; {} without steps."""
        times = self.times_ms
        if not times:
            return {}
        q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
        std = statistics.stdev(times) if len(times) > 1 else 0.0
        out = dict(zip(self.COLUMNS, (statistics.median(times), q[0], q[-1], statistics.fmean(times), std)))
        if len(self.cpu_ms) == len(times) and sum(times) > 0:
            out[STEP_CPU_SHARE] = sum(self.cpu_ms) / sum(times)
        return out


def cpu_share(row: Mapping[str, Any]) -> float | None:
    """The row's timed steps' CPU share; None where not recorded or on a GPU rank (not meaningful)."""
    share = row.get(STEP_CPU_SHARE)
    if share is None or share != share or str(row.get(DEVICE, "cpu")) != "cpu":
        return None
    return float(share)


def fair_share(row: Mapping[str, Any]) -> float:
    """The row's rank's fair share of the cores, min(1, cpus ÷ world_size); 1 where either is unknown."""
    cpus, world = row.get(CPUS), row.get(WORLD_SIZE)
    try:
        cpus, world = int(cpus), int(world)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # not recorded (None, NaN in a frame)
        return 1.0
    return min(1.0, cpus / world) if cpus > 0 and world > 0 else 1.0


def starved_below(row: Mapping[str, Any]) -> float:
    """The CPU share under which the row's timed steps count as starved."""
    return STARVED_CPU_SHARE * fair_share(row)


def starved(row: Mapping[str, Any]) -> bool:
    """Whether the row's (a rank's or a case's) timed steps were starved of CPU (module docstring)."""
    share = cpu_share(row)
    return share is not None and share < starved_below(row)


def starved_note(row: Mapping[str, Any]) -> str:
    """'starved: CPU 12% of wall' for a starved row; '' otherwise."""
    share = cpu_share(row)
    return f"starved: CPU {share:.0%} of wall" if starved(row) and share is not None else ""
