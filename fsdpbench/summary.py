"""The table printed at the end of a run: one row per case."""

from __future__ import annotations

import pandas as pd
from rich.console import Console
from rich.table import Table


def fmt_bytes(n: float | None) -> str:
    if n is None or n != n:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def case_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per case: the slowest rank's median step time and the largest rank's peak."""
    if frame.empty:
        return frame
    g = frame.groupby("case_id", sort=False)
    out = g.agg(
        strategy=("strategy", "first"), world_size=("world_size", "first"), device=("device", "first"),
        status=("case_status", "first"), error=("case_error", "first"),
        step_time_ms=("case_step_time_ms", "first"),
        peak_bytes=("mem_tracker_peak_bytes", "max") if "mem_tracker_peak_bytes" in frame else ("status", "size"),
    )  # fmt: skip
    if "mem_tracker_peak_bytes" not in frame:
        out["peak_bytes"] = None
    return out.reset_index()


def print_summary(frame: pd.DataFrame, console: Console) -> None:
    table = Table(title="cases (step time: slowest rank's median; peak: live tensors, tracker, largest rank)")
    for col in ("case", "strategy", "ranks", "step time", "peak / rank", "status"):
        table.add_column(col, justify="right" if col in ("ranks", "step time", "peak / rank") else "left")
    for row in case_table(frame).itertuples():
        ms = row.step_time_ms
        status = row.status if row.status == "ok" else f"{row.status}: {str(row.error)[:60]}"
        table.add_row(
            row.case_id, row.strategy, f"{row.world_size} {row.device}",
            f"{ms:.1f} ms" if ms == ms and ms is not None else "—", fmt_bytes(row.peak_bytes), status,
        )  # fmt: skip
    console.print(table)
