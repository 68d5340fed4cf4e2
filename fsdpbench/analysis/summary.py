"""The table printed at the end of a run: one row per case."""

from __future__ import annotations

import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fsdpbench.analysis.frame import case_frame, case_mode
from fsdpbench.formatting import fmt_bytes
from fsdpbench.schema import (
    CASE_STEP_TIME,
    CKPT_CASE_BYTES,
    CKPT_CASE_SAVE_S,
    CKPT_RANK0_HOST_PEAK,
    CKPT_ROUND_TRIP_OK,
    OK,
    STEP_TIME,
    TRACKER_PEAK,
)


def case_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per case (``analysis_frame.case_frame``): the slowest rank's median step time (with that
    rank's p10–p90 and the step counts) and the largest rank's peak."""
    if frame.empty:
        return frame
    cases = case_frame(frame)
    return pd.DataFrame(
        {
            "case_id": cases["case_id"],
            "strategy": cases["strategy"],
            "world_size": cases["world_size"],
            "device": cases["device"],
            "mode": [case_mode(r) for _, r in cases.iterrows()],
            "ranks_run": cases["n_ranks_reported"],
            "status": cases["status"],
            "error": cases["error"],
            # a run whose every case was skipped has no step-time columns
            **{
                name: cases[col] if col in cases else None
                for name, col in (
                    (STEP_TIME, CASE_STEP_TIME),
                    ("p10_ms", "step_time_p10_ms"),
                    ("p90_ms", "step_time_p90_ms"),
                    ("steps", "timed_steps"),
                    ("warmup", "warmup_steps"),
                    ("peak_bytes", TRACKER_PEAK),
                    ("ckpt_bytes", CKPT_CASE_BYTES),
                    ("ckpt_rank0_host_peak", CKPT_RANK0_HOST_PEAK),
                    ("ckpt_save_s", CKPT_CASE_SAVE_S),
                    ("ckpt_round_trip_ok", CKPT_ROUND_TRIP_OK),
                )
            },
        }
    )


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
        status = row.status if row.status == OK else f"{row.status}: {str(row.error)[:60]}"
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
