"""The gate trial harness's parts that need no machine: conditions, rates with their intervals, the table.

The benchmark itself (``test_gate_trials.py``) runs the trials; these functions turn its records into
rates and the Markdown that docs/ci.md shows, and are unit-tested (tests/test_gate_trials.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdpbench.analysis.timegate import incomplete_beta

CONFIDENCE = 0.95
DOCS_BEGIN = "<!-- gate-trials: begin (written by tests/benchmarks/test_gate_trials.py) -->"
DOCS_END = "<!-- gate-trials: end -->"


@dataclass(frozen=True, slots=True)
class Condition:
    """One condition of the trials: what runs (the plugin's share of extra work, 0 for unchanged code),
    and the load beside the whole re-run (none, one busy core, or one that starts and stops)."""

    name: str
    extra: float  # 0, 0.10 or 0.20: the plugin's extra work per step
    load: str  # idle | busy | intermittent
    label: str
    target: str  # what the issue asks of its rate

    @property
    def unchanged(self) -> bool:
        return self.extra == 0


CONDITIONS = (
    Condition("a", 0.0, "idle", "unchanged, idle", "false alarms ≤ 1/20"),
    Condition("b", 0.0, "busy", "unchanged, one core busy", "false alarms ≤ 1/20"),
    Condition("c", 0.0, "intermittent", "unchanged, load starting and stopping", "false alarms ≤ 1/20"),
    Condition("d10", 0.10, "idle", "+10% work, idle", "reported"),
    Condition("d20", 0.20, "idle", "+20% work, idle", "detected ≥ 19/20"),
    Condition("d10b", 0.10, "busy", "+10% work, one core busy", "reported"),
    Condition("d20b", 0.20, "busy", "+20% work, one core busy", "detected ≥ 17/20"),
)


def beta_quantile(q: float, a: float, b: float) -> float:
    """The ``q`` quantile of the Beta(a, b) distribution, by bisection of its regularized CDF."""
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if incomplete_beta(a, b, mid) < q else (lo, mid)
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The exact (Clopper–Pearson) interval of a binomial rate, ``k`` events in ``n`` trials."""
    tail = (1 - confidence) / 2
    low = 0.0 if k == 0 else beta_quantile(tail, k, n - k + 1)
    high = 1.0 if k == n else beta_quantile(1 - tail, k + 1, n - k)
    return low, high


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval of a binomial rate."""
    z = {0.95: 1.959964, 0.90: 1.644854, 0.99: 2.575829}[confidence]
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def alarmed(record: dict) -> bool:
    """Whether a trial's gate failed (exit 1): a false alarm for unchanged code, a detection for a plugin."""
    return record["exit_code"] == 1


def rate_rows(records: list[dict]) -> list[dict]:
    """Per condition: trials, alarms, the rate and its intervals, the launches' other load and effects."""
    rows = []
    for cond in CONDITIONS:
        mine = [r for r in records if r["condition"] == cond.name]
        if not mine:
            continue
        k, n = sum(alarmed(r) for r in mine), len(mine)
        effects = sorted(r["effect"] for r in mine if r.get("effect") is not None)
        loads = sorted(r["other_load"] for r in mine if r.get("other_load") is not None)
        rows.append(
            {
                "condition": cond,
                "alarms": k,
                "trials": n,
                "clopper_pearson": clopper_pearson(k, n),
                "wilson": wilson(k, n),
                "not_judged": sum(r.get("verdict") == "not compared" for r in mine),
                "relaunched": sum(r.get("launches", 1) > 1 for r in mine),
                "effect_median": effects[len(effects) // 2] if effects else None,
                "effect_range": (effects[0], effects[-1]) if effects else None,
                "load_range": (loads[0], loads[-1]) if loads else None,
                "exit_2": sum(r["exit_code"] == 2 for r in mine),
            }
        )
    return rows


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1%}"


def markdown(records: list[dict], header: str) -> str:
    """The rates as docs/ci.md shows them: one row per condition, then ``header`` (command, machine)."""
    lines = [
        header,
        "",
        "| condition | gate failed | rate (95% Clopper–Pearson; Wilson) | target | re-launched | "
        "time not judged | effect: median (range) | other load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rate_rows(records):
        cond, k, n = row["condition"], row["alarms"], row["trials"]
        cp, wl = row["clopper_pearson"], row["wilson"]
        eff = row["effect_range"] or (None, None)
        load = row["load_range"]
        lines.append(
            f"| ({cond.name}) {cond.label} | {k}/{n} | {k / n:.0%} ({cp[0]:.0%}–{cp[1]:.0%}; "
            f"{wl[0]:.0%}–{wl[1]:.0%}) | {cond.target} | {row['relaunched']} | {row['not_judged']} | "
            f"{_pct(row['effect_median'])} ({_pct(eff[0])} … {_pct(eff[1])})"
            f" | {'—' if load is None else f'{load[0]:.0%}–{load[1]:.0%}'} |"
        )
    return "\n".join(lines) + "\n"


def replace_between_markers(text: str, block: str) -> str:
    """``text`` with the part between ``DOCS_BEGIN`` and ``DOCS_END`` replaced by ``block``."""
    start, end = text.index(DOCS_BEGIN) + len(DOCS_BEGIN), text.index(DOCS_END)
    return text[:start] + "\n" + block + text[end:]
