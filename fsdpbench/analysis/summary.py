"""The table printed at the end of a run: one row per case."""

from __future__ import annotations

from typing import Any

import pandas as pd
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from fsdpbench.analysis.frame import case_frame, case_mode, has_values
from fsdpbench.core.formatting import fmt_bytes, fmt_compute, fmt_harness_overhead, fmt_throughput
from fsdpbench.core.schema import (
    CASE_ID,
    CASE_STEP_TIME,
    DEVICE,
    EMULATED,
    ERROR,
    HARNESS_OVERHEAD_RATIO,
    MODE,
    N_RANKS_REPORTED,
    OK,
    STATUS,
    STEP_TIME,
    STEP_TIME_P10,
    STEP_TIME_P90,
    STRATEGY,
    TIMED_STEPS,
    TRACKER_PEAK,
    WARMUP_STEPS,
    WORLD_SIZE,
)


def case_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per case (``analysis.frame.case_frame``): the slowest rank's median step time (with that
    rank's p10–p90 and the step counts), throughput, MFU (GPU), harness overhead (with a bare loop) and the
    largest rank's peak."""
    if frame.empty:
        return frame
    cases = case_frame(frame)
    return pd.DataFrame(
        {
            CASE_ID: cases[CASE_ID],
            STRATEGY: cases[STRATEGY],
            WORLD_SIZE: cases[WORLD_SIZE],
            DEVICE: cases[DEVICE],
            MODE: [case_mode(r) for _, r in cases.iterrows()],
            "ranks_run": cases[N_RANKS_REPORTED],
            STATUS: cases[STATUS],
            ERROR: cases[ERROR],
            # a run whose every case was skipped has no step-time columns
            **{
                name: cases[col] if col in cases else None
                for name, col in (
                    (STEP_TIME, CASE_STEP_TIME),
                    ("p10_ms", STEP_TIME_P10),
                    ("p90_ms", STEP_TIME_P90),
                    ("steps", TIMED_STEPS),
                    ("warmup", WARMUP_STEPS),
                    ("peak_bytes", TRACKER_PEAK),
                )
            },
            "throughput": [fmt_throughput(r, tokens=False) for _, r in cases.iterrows()],
            "compute": [fmt_compute(r) for _, r in cases.iterrows()],
            "harness_overhead": [fmt_harness_overhead(r) for _, r in cases.iterrows()],
            "has_bare_loop": has_values(cases, HARNESS_OVERHEAD_RATIO),
        }
    )


def _ok(x: object) -> bool:
    return x is not None and x == x


def _cells(row: Any, *, gpu: bool, bare: bool) -> list[Text | str]:
    """One case's cells, in the summary's column order."""
    ms = row.step_time_ms
    status = row.status if row.status == OK else f"{row.status}: {str(row.error)[:60]}"
    spread = f" ({row.p10_ms:.0f}–{row.p90_ms:.0f})" if _ok(row.p10_ms) and _ok(row.p90_ms) else ""
    return [  # Text: an error message is never read as markup
        Text(str(row.case_id)),
        Text(str(row.strategy)),
        f"{row.world_size} {row.device}"
        if row.mode != EMULATED
        else f"{row.ranks_run} of {row.world_size} {row.device}, emulated",
        f"{ms:.1f} ms{spread}" if _ok(ms) else "—",
        row.throughput,
        *([row.compute] if gpu else []),
        *([row.harness_overhead] if bare else []),
        fmt_bytes(row.peak_bytes if _ok(row.peak_bytes) else None),
        Text(str(status)),
    ]


def _print_stacked(console: Console, title: str, columns: list[str], rows: list[list[Text | str]]) -> None:
    """The summary for a console narrower than its table: each case's id on a line of its own (whole,
    to find its directory), then its cells as ``heading value`` pairs, each pair kept on one line."""
    console.print(title, highlight=False)
    for cells in rows:
        console.print(Text(str(cells[0]), style="bold"), highlight=False, overflow="ignore", crop=False)
        pairs = [f"{heading} {cell}" for heading, cell in zip(columns[1:], cells[1:], strict=True)]
        line = Text("  ")
        for pair in pairs:
            if len(line) > 2 and len(line) + 3 + len(pair) > console.width:
                console.print(line, highlight=False)
                line = Text("  ")
            line.append(("" if len(line) == 2 else " · ") + pair)
        console.print(line, highlight=False)


def print_summary(frame: pd.DataFrame, console: Console) -> None:
    cases = case_summary(frame)
    counts = {(int(r.steps), int(r.warmup)) for r in cases.itertuples() if _ok(r.steps) and _ok(r.warmup)}
    how = ""
    if len(counts) == 1:
        steps, warmup = next(iter(counts))
        how = f" of {steps} timed steps after {warmup} warm-up"
    title = (
        f"cases (step time: slowest rank's median{how}, p10–p90; peak: live tensors, tracker, largest rank)"
    )
    gpu = (cases[DEVICE] != "cpu").any()
    bare = bool(cases["has_bare_loop"].any())
    columns = ["case", "strategy", "ranks", "step time (p10–p90)", "throughput"]
    columns += ["MFU (TFLOP/s)"] if gpu else []  # on CPU ranks not meaningful: said once below the table
    columns += ["harness overhead"] if bare else []  # only with a bare loop (bare_steps)
    columns += ["peak / rank", STATUS]
    rows = [_cells(row, gpu=gpu, bare=bare) for row in cases.itertuples()]
    table = Table(title=title)
    for col in columns:
        # a cell never wraps: a case id cut or folded cannot be found among the run's directories
        table.add_column(
            col, justify="left" if col in ("case", "strategy", STATUS) else "right", no_wrap=True
        )
    for cells in rows:
        table.add_row(*cells)
    natural = Measurement.get(console, console.options.update_width(10**6), table).maximum
    if natural <= console.width:
        console.print(table)
    else:  # narrower than the table (80 columns, piped or logged): one block per case, nothing cut
        _print_stacked(console, title, columns, rows)
    if (cases[DEVICE] == "cpu").any():
        console.print(
            "MFU and achieved TFLOP/s: not meaningful on CPU ranks (no datasheet peak)", highlight=False
        )
    if bare:
        console.print(
            "harness overhead: mean timed step / mean bare-loop step − 1 (the harness's own per-step cost)",
            highlight=False,
        )
    if (cases[MODE] == EMULATED).any():
        console.print(
            "emulated rows: each listed rank ran alone on one device with a fake process group; its step "
            "time is compute only (no communication), its peak has no NCCL buffers; no losses "
            "(docs/emulation.md)",
            highlight=False,
        )
