"""The step-time verdict: a slowdown counts only when it is large enough AND unlikely to be noise.

Inputs are the step-time ratios of one case to the in-process reference (one per block,
``fsdpbench.engine.reference``), grouped by **launch** (one launch: the case's rank processes, from
start to end): the baseline's launches and the run's (its first, and those ``regress --repeat``
added). Most of the noise is *between* launches (the machine's state in that minute, where the
scheduler put the threads), not between the blocks of one launch, so the blocks of several launches
are not independent samples, and a test that pooled them as if they were would find any small
shift between two minutes significant. The unit of the test is therefore the launch:

- each launch gives one value, the log of its blocks' median ratio;
- the **effect** is the ratio of the run's and the baseline's geometric means of those medians, minus
  one; it must exceed the minimum (the threshold's tolerance, 10% by default), so a tiny but
  consistent shift never fails a job;
- **significance**: a one-sided two-sample t test on the launch values (the between-launch variance
  pooled from both sides, ``launches - 2`` degrees of freedom) gives p < ``ALPHA`` for "the run is
  slower"; the 95% interval of the effect is the t interval.

With one launch on each side there is no between-launch variance to estimate. The verdict then falls
back to the blocks (``level`` "blocks": the one-sided Mann–Whitney U test, which Google Benchmark's
``compare.py`` uses over repetitions, and a bootstrap interval), and says so; ``regress --repeat``
then re-launches a case that looks slower, after which its verdict is on launches.

No SciPy: the U test is the normal approximation with tie and continuity corrections (within 0.01 of
the exact p at 10 + 10 samples); Student's t distribution comes from the regularized incomplete beta
function (a continued fraction, Numerical Recipes' ``betacf``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05  # one-sided significance level of the test, per case and measurement (docs/ci.md: calibration)
CONFIDENCE = 0.95  # of the reported interval
# the largest share of the machine's cores that other processes may keep busy while a case's samples are
# taken for its step time to be judged: the gate's error rates were measured with one of two cores busy
# (docs/ci.md, the gate trials); beyond, it reports the time as not compared
MAX_OTHER_LOAD = 0.6
_BOOTSTRAP = 2000


LAUNCHES, BLOCKS = "launches", "blocks"  # what a verdict's test compared (module docstring)
_CF_ITERATIONS, _CF_EPS = 300, 1e-14


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeVerdict:
    effect: float  # the run's typical ratio over the baseline's, minus one
    low: float  # CONFIDENCE interval of the effect
    high: float
    p_value: float  # one-sided: now is slower
    n_base: int  # launches (level launches) or blocks (level blocks)
    n_now: int
    regressed: bool
    level: str = LAUNCHES

    def describe(self) -> str:
        test = (
            f"t test on launch medians, {self.n_now} launch(es) vs {self.n_base}"
            if self.level == LAUNCHES
            else f"Mann–Whitney over blocks, n={self.n_now} vs {self.n_base}: one launch each, "
            "run-to-run variance unknown"
        )
        return (
            f"effect {self.effect:+.1%} (95% CI {self.low:+.1%} … {self.high:+.1%}), "
            f"p={self.p_value:.2g} ({test})"
        )


def as_launches(samples: list) -> list[list[float]]:
    """Samples grouped by launch: a list of lists as it is, a flat list (one launch's blocks) as one."""
    if samples and all(isinstance(x, list) for x in samples):
        return [list(map(float, launch)) for launch in samples if len(launch)]
    return [list(map(float, samples))] if len(samples) else []


def flat(samples: list) -> list[float]:
    """Every block's sample, whatever launch it came from."""
    return [x for launch in as_launches(samples) for x in launch]


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, _CF_ITERATIONS + 1):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < _CF_EPS:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return tail if t > 0 else 1.0 - tail


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile (0.5 < q < 1) of Student's t with ``df`` degrees of freedom, by bisection."""
    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_sf(mid, df) > 1 - q else (lo, mid)
    return (lo + hi) / 2


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


def launch_verdict(
    now: list[list[float]], base: list[list[float]], min_effect: float, alpha: float = ALPHA
) -> TimeVerdict:
    """The t test on launch medians (module docstring); needs at least three launches in all."""
    x_now = [math.log(statistics.median(launch)) for launch in now]
    x_base = [math.log(statistics.median(launch)) for launch in base]
    diff = statistics.fmean(x_now) - statistics.fmean(x_base)
    df = len(x_now) + len(x_base) - 2
    squares = sum((x - statistics.fmean(x_now)) ** 2 for x in x_now)
    squares += sum((x - statistics.fmean(x_base)) ** 2 for x in x_base)
    se = math.sqrt(squares / df * (1 / len(x_now) + 1 / len(x_base)))
    if se > 0:
        p = t_sf(diff / se, df)
        half = t_quantile(1 - (1 - CONFIDENCE) / 2, df) * se
    else:  # every launch alike on each side: the difference is exact
        p, half = (0.0 if diff > 0 else 1.0), 0.0
    effect = math.exp(diff) - 1
    return TimeVerdict(
        effect=effect,
        low=math.exp(diff - half) - 1,
        high=math.exp(diff + half) - 1,
        p_value=p,
        n_base=len(x_base),
        n_now=len(x_now),
        regressed=effect > min_effect and p < alpha,
        level=LAUNCHES,
    )


def block_verdict(
    now: list[float], base: list[float], min_effect: float, alpha: float = ALPHA
) -> TimeVerdict:
    """The blocks of one launch against another's: the median's effect, the U test, a bootstrap interval."""
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
        level=BLOCKS,
    )


def time_verdict(now: list, base: list, min_effect: float, alpha: float = ALPHA) -> TimeVerdict:
    """Regressed when the run is slower by more than ``min_effect`` and the test says p < ``alpha``: on
    launches where there are three or more in all, else on the blocks (``now`` and ``base``: samples by
    launch, or one launch's flat list)."""
    now_launches, base_launches = as_launches(now), as_launches(base)
    if len(now_launches) + len(base_launches) >= 3:
        return launch_verdict(now_launches, base_launches, min_effect, alpha)
    return block_verdict(flat(now), flat(base), min_effect, alpha)
