"""Numbers as text for people: bytes, relative errors, a byte unit for an axis, a case's compute
efficiency, throughput and harness overhead. Torch-free; the run summary, the report's tables and figures
and ``fsdpbench compare`` format with these."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from fsdpbench.core.schema import (
    ACHIEVED_TFLOPS,
    BARE_STEP_TIME,
    BYTE_UNITS,
    DEVICE,
    HARNESS_OVERHEAD_RATIO,
    MFU,
    THROUGHPUT_SAMPLES,
    THROUGHPUT_TOKENS,
)

# MFU compares with a GPU's datasheet peak; a CPU rank has none, and its FLOP/s say nothing of one
NOT_MEANINGFUL_ON_CPU = "not meaningful on CPU ranks"


def fmt_bytes(n: float | None) -> str:
    """'512 B', '1.50 MiB'; '—' for a missing value."""
    if n is None or n != n:
        return "—"
    for unit in BYTE_UNITS:
        if abs(n) < 1024 or unit == BYTE_UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def fmt_pct(err: Any) -> str:
    """A relative error as '+1.5%'; '—' for a missing value; one that rounds to zero is '0.0%' (never
    '-0.0%' or '+0.0%': no sign where the text shows no difference)."""
    if err is None or pd.isna(err):
        return "—"
    text = f"{err * 100:+.1f}%"
    return "0.0%" if text in ("+0.0%", "-0.0%") else text


def byte_unit(values: list[float] | pd.Series) -> tuple[str, float]:
    """('KiB'|'MiB'|'GiB'|'TiB', divisor) so that the largest value reads between 1 and 1024."""
    nums = pd.to_numeric(pd.Series(list(values), dtype="float64"), errors="coerce").abs().dropna()
    top = float(nums.max()) if len(nums) else 0.0
    for power in range(len(BYTE_UNITS) - 1, 1, -1):  # TiB, GiB, MiB
        if top >= 1024.0**power:
            return BYTE_UNITS[power], 1024.0**power
    return BYTE_UNITS[1], 1024.0


def _number(value: Any) -> float | None:
    try:
        return None if value is None or pd.isna(value) else float(value)
    except (TypeError, ValueError):
        return None


def fmt_compute(row: Mapping[str, Any]) -> str:
    """A case's MFU and achieved TFLOP/s (its slowest rank's): '41.2% MFU, 129.5 TFLOP/s'; on CPU ranks
    'not meaningful on CPU ranks'; '—' when not measured (no step time, or FLOPs not countable)."""
    if row.get(DEVICE) == "cpu":
        return NOT_MEANINGFUL_ON_CPU
    mfu, tflops = _number(row.get(MFU)), _number(row.get(ACHIEVED_TFLOPS))
    if tflops is None:
        return "—"
    return (f"{mfu:.1%} MFU, " if mfu is not None else "") + f"{tflops:.1f} TFLOP/s"


def fmt_throughput(row: Mapping[str, Any], *, tokens: bool = True) -> str:
    """'91.2 samples/s (2,918 tokens/s)'; '—' when the case has no throughput (not timed, or emulated)."""
    samples, per_token = _number(row.get(THROUGHPUT_SAMPLES)), _number(row.get(THROUGHPUT_TOKENS))
    if samples is None:
        return "—"
    shown = tokens and per_token is not None
    return f"{samples:.1f} samples/s" + (f" ({per_token:,.0f} tokens/s)" if shown else "")


def fmt_harness_overhead(row: Mapping[str, Any]) -> str:
    """The harness's own cost: mean measured step / mean bare step as '+3.1% (bare 20.4 ms)'; '—' without
    a bare loop (bare_steps: 0)."""
    ratio, bare = _number(row.get(HARNESS_OVERHEAD_RATIO)), _number(row.get(BARE_STEP_TIME))
    if ratio is None:
        return "—"
    return f"{ratio - 1:+.1%}" + (f" (bare {bare:.1f} ms)" if bare is not None else "")
