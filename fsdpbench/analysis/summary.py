"""The table printed at the end of a run: one row per case."""

from __future__ import annotations

from typing import Any

import pandas as pd
from rich import box
from rich.console import Console, JustifyMethod
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from fsdpbench.analysis.frame import case_frame, case_mode, has_values
from fsdpbench.analysis.names import case_labels, id_tail
from fsdpbench.core.formatting import fmt_bytes, fmt_compute, fmt_harness_overhead, fmt_throughput
from fsdpbench.core.schema import (
    ACHIEVED_TFLOPS,
    CASE_ID,
    CASE_STEP_TIME,
    DEVICE,
    EMULATED,
    ERROR,
    HARNESS_OVERHEAD_RATIO,
    MFU,
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
from fsdpbench.metrics.timing import starved_note


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
            "starved": [starved_note(r) for _, r in cases.iterrows()],
            "throughput": [fmt_throughput(r, tokens=False) for _, r in cases.iterrows()],
            "compute": [_compute_cell(r) for _, r in cases.iterrows()],
            "harness_overhead": [fmt_harness_overhead(r) for _, r in cases.iterrows()],
            "has_bare_loop": has_values(cases, HARNESS_OVERHEAD_RATIO),
        }
    )


def _compute_cell(row: Any) -> str:
    """MFU and achieved TFLOP/s in the summary's few columns: '41.2% (129.5)'; the long form where one is
    missing (core.formatting.fmt_compute)."""
    mfu, tflops = row.get(MFU), row.get(ACHIEVED_TFLOPS)
    if _ok(mfu) and _ok(tflops) and row.get(DEVICE) != "cpu":
        return f"{mfu:.1%} ({tflops:.1f})"
    return fmt_compute(row)


def _ok(x: object) -> bool:
    return x is not None and x == x


def _cells(row: Any, name: str, columns: list[str]) -> list[Text | str]:
    """One case's cells, in the order of ``columns``."""
    ms = row.step_time_ms
    status = row.status if row.status == OK else f"{row.status}: {str(row.error)[:60]}"
    status += f" ({row.starved})" if row.starved else ""
    spread = f" ({row.p10_ms:.0f}–{row.p90_ms:.0f})" if _ok(row.p10_ms) and _ok(row.p90_ms) else ""
    cells: dict[str, Text | str] = {  # Text: an error message is never read as markup
        "case": Text(name),
        "ranks": f"{row.world_size} {row.device}"
        if row.mode != EMULATED
        else f"{row.ranks_run} of {row.world_size} {row.device}, emulated",
        "step ms (p10–p90)": f"{ms:.1f}{spread}" if _ok(ms) else "—",
        "samples/s": row.throughput.removesuffix(" samples/s"),
        "MFU (TFLOP/s)": row.compute,
        "MFU": row.compute.split(" (")[0],
        "harness overhead": row.harness_overhead,
        "peak / rank": fmt_bytes(row.peak_bytes if _ok(row.peak_bytes) else None),
        STATUS: Text(str(status)),
        "id": Text(id_tail(row.case_id)),
    }
    return [cells[c] for c in columns]


# heading → (justify, may wrap): the case's name, its ranks, its status and the harness overhead wrap at
# spaces when the console is narrow; a number never wraps
_COLUMNS: dict[str, tuple[JustifyMethod, bool]] = {
    "case": ("left", True),
    "ranks": ("left", True),
    "step ms (p10–p90)": ("right", False),
    "samples/s": ("right", False),
    "MFU (TFLOP/s)": ("right", False),
    "MFU": ("right", False),
    "harness overhead": ("right", True),
    "peak / rank": ("right", False),
    STATUS: ("left", True),
    "id": ("left", False),
}
# what a narrow console leaves out, in turn, before the wrapping columns wrap: the throughput (the step
# time says it: global batch / step time), then the achieved TFLOP/s beside the MFU
_NARROWER = ({"samples/s"}, {"samples/s", "MFU (TFLOP/s)"})


def summary_table(frame: pd.DataFrame, width: int = 10**6) -> Table:
    """The run's cases as one table at most ``width`` columns wide: each case named by what tells it
    from the others (analysis.names), its id's hash (its directory, ``cases/<case_id>/``) last."""
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
    columns = ["case", "ranks", "step ms (p10–p90)", "samples/s"]
    columns += ["MFU (TFLOP/s)"] if gpu else []  # on CPU ranks not meaningful: said once below the table
    columns += ["harness overhead"] if bare else []  # only with a bare loop (bare_steps)
    columns += ["peak / rank", STATUS, "id"]
    names = case_labels(case_frame(frame))  # the same cases in the same order as case_summary's
    rows = [(row, name) for row, name in zip(cases.itertuples(), names, strict=True)]
    table = _table(title, columns, rows)
    for left_out in _NARROWER:
        if _natural_width(table) <= width:
            break
        shown = [c for c in columns if c not in left_out]
        table = _table(title, _with_mfu(shown, gpu, left_out), rows)
    return table


def _with_mfu(columns: list[str], gpu: bool, left_out: set[str]) -> list[str]:
    """The MFU alone where its TFLOP/s were left out (on GPUs)."""
    if not gpu or "MFU (TFLOP/s)" not in left_out:
        return columns
    at = columns.index("peak / rank")
    return [*columns[:at], "MFU", *columns[at:]]


def _table(title: str, columns: list[str], rows: list[tuple[Any, str]]) -> Table:
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True
    )
    for col in columns:
        justify, wraps = _COLUMNS[col]
        words = [len(w) for row, name in rows for w in str(_cells(row, name, [col])[0]).split()]
        # a wrapping column breaks between words, never inside one (a case's name stays readable)
        table.add_column(col, justify=justify, no_wrap=not wraps, min_width=max(words, default=1))
    for row, name in rows:
        table.add_row(*_cells(row, name, columns))
    return table


def _natural_width(table: Table) -> int:
    console = Console(width=10**6)
    return Measurement.get(console, console.options, table).maximum


def print_summary(frame: pd.DataFrame, console: Console) -> None:
    cases = case_summary(frame)
    console.print(summary_table(frame, console.width))
    bare = bool(cases["has_bare_loop"].any())
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
