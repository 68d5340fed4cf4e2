"""Step times of one rank: each timed step's wall time, its median and spread.

A case's step time is the slowest rank's median (``results.build_rows``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import ClassVar

from fsdpbench.core.schema import STEP_TIME, STEP_TIME_MEAN, STEP_TIME_P10, STEP_TIME_P90, STEP_TIME_STD


@dataclass(kw_only=True, slots=True)
class StepTimes:
    """Wall milliseconds of a rank's timed steps, device-synchronised before and after each."""

    times_ms: list[float] = field(default_factory=list)

    COLUMNS: ClassVar[tuple[str, ...]] = (
        STEP_TIME,  # the median
        STEP_TIME_P10,
        STEP_TIME_P90,
        STEP_TIME_MEAN,
        STEP_TIME_STD,
    )

    def to_columns(self) -> dict[str, float]:
        """step_time_ms (the median), its p10, p90, mean and standard deviation; {} without steps."""
        times = self.times_ms
        if not times:
            return {}
        q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
        std = statistics.stdev(times) if len(times) > 1 else 0.0
        return dict(zip(self.COLUMNS, (statistics.median(times), q[0], q[-1], statistics.fmean(times), std)))
