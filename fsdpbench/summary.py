"""The table printed at the end of a run: one row per case."""

from __future__ import annotations

import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text


def fmt_bytes(n: float | None) -> str:
    if n is None or n != n:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def row_mode(row: pd.Series) -> str:
    """'emulated' or 'real' (results written before emulation existed are real)."""
    mode = row.get("mode")
    return mode if isinstance(mode, str) else "real"


def case_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per case: the slowest rank's median step time (with that rank's p10–p90 and the step
    counts) and the largest rank's peak."""
    if frame.empty:
        return frame
    rows = []
    for case_id, g in frame.groupby("case_id", sort=False):
        first = g.iloc[0]
        times = g["step_time_ms"] if "step_time_ms" in g else pd.Series(dtype=float)
        slowest = g.loc[times.idxmax()] if times.notna().any() else first
        peak = g["mem_tracker_peak_bytes"].max() if "mem_tracker_peak_bytes" in g else None
        rows.append(
            {
                "case_id": case_id,
                "strategy": first["strategy"],
                "world_size": first["world_size"],
                "device": first["device"],
                "mode": row_mode(first),
                "ranks_run": len(g),
                "status": first.get("case_status"),
                "error": first.get("case_error"),
                # .get: a run whose every case was skipped has no step-time columns
                "step_time_ms": first.get("case_step_time_ms"),
                "p10_ms": slowest.get("step_time_p10_ms"),
                "p90_ms": slowest.get("step_time_p90_ms"),
                "steps": first.get("timed_steps"),
                "warmup": first.get("warmup_steps"),
                "peak_bytes": peak,
            }
        )
    return pd.DataFrame(rows)


def _ok(x: object) -> bool:
    return x is not None and x == x


def print_summary(frame: pd.DataFrame, console: Console) -> None:
    cases = case_table(frame)
    counts = {(int(r.steps), int(r.warmup)) for r in cases.itertuples() if _ok(r.steps) and _ok(r.warmup)}
    how = ""
    if len(counts) == 1:
        steps, warmup = next(iter(counts))
        how = f" of {steps} timed steps after {warmup} warm-up"
    table = Table(
        title=f"cases (step time: slowest rank's median{how}, p10–p90; "
        "peak: live tensors, tracker, largest rank)"
    )
    for col in ("case", "strategy", "ranks", "step time (p10–p90)", "peak / rank", "status"):
        table.add_column(col, justify="left" if col in ("case", "strategy", "status") else "right")
    for row in cases.itertuples():
        ms = row.step_time_ms
        status = row.status if row.status == "ok" else f"{row.status}: {str(row.error)[:60]}"
        spread = f" ({row.p10_ms:.0f}–{row.p90_ms:.0f})" if _ok(row.p10_ms) and _ok(row.p90_ms) else ""
        table.add_row(  # Text: an error message is never read as markup
            Text(str(row.case_id)),
            Text(str(row.strategy)),
            f"{row.world_size} {row.device}"
            if row.mode != "emulated"
            else f"{row.ranks_run} of {row.world_size} {row.device}, emulated",
            f"{ms:.1f} ms{spread}" if _ok(ms) else "—",
            fmt_bytes(row.peak_bytes if _ok(row.peak_bytes) else None),
            Text(str(status)),
        )
    console.print(table)
    if (cases["mode"] == "emulated").any():
        console.print(
            "emulated rows: each listed rank ran alone on one device with a fake process group; its step "
            "time is compute only (no communication), its peak has no NCCL buffers; no losses "
            "(docs/emulation.md)",
            highlight=False,
        )
