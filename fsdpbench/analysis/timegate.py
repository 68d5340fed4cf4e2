"""The step-time verdict: a slowdown counts only when it is large enough AND unlikely to be noise.

Inputs are two samples of one case's step-time ratios to the in-process reference (one per block,
``fsdpbench.engine.reference``): the baseline's and the run's. The verdict needs both

- an **effect** above the minimum (the threshold's tolerance, 10% by default): the run's median
  over the baseline's median, minus one — so a tiny but consistent shift never fails a job; and
- **significance**: the one-sided Mann–Whitney U test (the rank-sum test Google Benchmark's
  ``compare.py`` uses over repetitions) gives p < ``ALPHA`` for "the run's ratios are larger",
  so a median pushed up by a few noisy blocks does not either.

A 95% bootstrap interval of the effect is reported beside them (percentile, seeded: the same
samples give the same interval). No SciPy: the test is a few lines (normal approximation with the
tie and continuity corrections, which is within 0.01 of the exact p at 10 + 10 samples).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05  # one-sided significance level of the test, per case and measurement (docs/ci.md: calibration)
CONFIDENCE = 0.95  # of the reported bootstrap interval
_BOOTSTRAP = 2000


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeVerdict:
    effect: float  # median(now) / median(base) - 1
    low: float  # bootstrap interval of the effect
    high: float
    p_value: float  # one-sided: now is slower
    n_base: int
    n_now: int
    regressed: bool

    def describe(self) -> str:
        return (
            f"effect {self.effect:+.1%} (95% CI {self.low:+.1%} … {self.high:+.1%}), "
            f"p={self.p_value:.2g} (Mann–Whitney, n={self.n_now} vs {self.n_base})"
        )


def mann_whitney_greater(now: list[float], base: list[float]) -> float:
    """One-sided p-value that ``now`` tends to be larger than ``base`` (U test, normal approximation)."""
    n1, n2 = len(now), len(base)
    if not n1 or not n2:
        return 1.0
    values = sorted((v, i < n1) for i, v in enumerate([*now, *base]))
    ranks = [0.0] * len(values)
    tie_term, i = 0.0, 0
    while i < len(values):  # average ranks over ties
        j = i
        while j + 1 < len(values) and values[j + 1][0] == values[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        tie_term += (j - i + 1) ** 3 - (j - i + 1)
        i = j + 1
    u = sum(r for r, (_, is_now) in zip(ranks, values) if is_now) - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if var <= 0:
        return 1.0 if u <= n1 * n2 / 2 else 0.0
    z = (u - n1 * n2 / 2 - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2))


def bootstrap_effect(now: list[float], base: list[float], *, seed: int = 0) -> tuple[float, float]:
    """Percentile interval (``CONFIDENCE``) of median(now)/median(base) - 1, resampling both."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(now, dtype=float), np.asarray(base, dtype=float)
    ma = np.median(rng.choice(a, size=(_BOOTSTRAP, len(a))), axis=1)
    mb = np.median(rng.choice(b, size=(_BOOTSTRAP, len(b))), axis=1)
    effects = ma / mb - 1
    tail = (1 - CONFIDENCE) / 2 * 100
    return float(np.percentile(effects, tail)), float(np.percentile(effects, 100 - tail))


def time_verdict(now: list[float], base: list[float], min_effect: float, alpha: float = ALPHA) -> TimeVerdict:
    """Regressed when the median slowed by more than ``min_effect`` and the U test says p < ``alpha``."""
    effect = statistics.median(now) / statistics.median(base) - 1
    low, high = bootstrap_effect(now, base)
    p = mann_whitney_greater(now, base)
    return TimeVerdict(
        effect=effect,
        low=low,
        high=high,
        p_value=p,
        n_base=len(base),
        n_now=len(now),
        regressed=effect > min_effect and p < alpha,
    )
