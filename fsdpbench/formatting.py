"""Numbers as text for people: bytes, relative errors, a byte unit for an axis. Torch-free; the run
summary, the report's tables and figures and ``fsdpbench compare`` format with these."""

from __future__ import annotations

from typing import Any

import pandas as pd

from fsdpbench.schema import BYTE_UNITS


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
    """A relative error as '+1.5%'; '—' for a missing value."""
    return "—" if err is None or pd.isna(err) else f"{err * 100:+.1f}%"


def byte_unit(values: list[float] | pd.Series) -> tuple[str, float]:
    """('KiB'|'MiB'|'GiB'|'TiB', divisor) so that the largest value reads between 1 and 1024."""
    nums = pd.to_numeric(pd.Series(list(values), dtype="float64"), errors="coerce").abs().dropna()
    top = float(nums.max()) if len(nums) else 0.0
    for power in range(len(BYTE_UNITS) - 1, 1, -1):  # TiB, GiB, MiB
        if top >= 1024.0**power:
            return BYTE_UNITS[power], 1024.0**power
    return BYTE_UNITS[1], 1024.0
