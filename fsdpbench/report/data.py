"""Load one or several run directories into frames for the report: rows, one row per case, timelines.

Every frame carries a ``run`` label (the run directory's ``<parent>/<name>``), so several runs can
be overlaid. A column that a run did not measure is absent; the figures check for it and say what is
missing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from fsdpbench.analysis.frame import case_frame
from fsdpbench.analysis.names import (  # noqa: F401 — the report names cases as every command does
    AXES,
    axis_text,
    axis_values,
    case_labels,
    declared_strategy,
    present,
    shard_label,
    varying_axes,
)
from fsdpbench.core.schema import OK, PHASE, RANK, RUN, STATUS


@dataclass(kw_only=True)
class RunData:
    """One run directory as the report sees it."""

    run: str
    run_dir: Path
    meta: dict[str, Any]
    results: pd.DataFrame
    timelines: pd.DataFrame


@dataclass(kw_only=True)
class ReportData:
    """Every run of a report: all rows, one row per case, memory timelines."""

    runs: list[RunData]
    results: pd.DataFrame
    cases: pd.DataFrame
    timelines: pd.DataFrame = field(default_factory=pd.DataFrame)


def run_label(run_dir: Path) -> str:
    run_dir = Path(run_dir).resolve()
    return shown_path(f"{run_dir.parent.name}/{run_dir.name}" if run_dir.parent.name else run_dir.name)


def shown_path(path: str | Path) -> str:
    """A path as the report shows it: a name in another encoding than UTF-8 (which the file system
    allows) with U+FFFD where it cannot be decoded, since frames and the HTML hold UTF-8 only."""
    return os.fsencode(str(path)).decode("utf-8", "replace")


def load_run(run_dir: str | Path, label: str | None = None) -> RunData:
    """Rows, run.json and timelines of one run directory; raises FileNotFoundError naming it."""
    from fsdpbench.store.results import RunStore, load_results

    run_dir = Path(run_dir)
    if not (run_dir / "run.json").exists() and not (run_dir / "results.parquet").exists():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no run.json or results.parquet)")
    label = label or run_label(run_dir)
    results = load_results(run_dir).copy()
    results.insert(0, RUN, label)
    meta = RunStore(run_dir).read_run_json()
    return RunData(
        run=label, run_dir=run_dir, meta=meta, results=results, timelines=load_timelines(run_dir, label)
    )


def load_timelines(run_dir: Path, label: str) -> pd.DataFrame:
    """cases/<case_id>/timeline.parquet of every case (columns case_id, rank, t_s, bytes, phase, source)."""
    from fsdpbench.store.results import read_parquet

    frames = []
    for path in sorted(Path(run_dir).glob("cases/*/timeline.parquet")):
        try:
            frame = read_parquet(path)
        except (OSError, ValueError):
            continue
        if frame.empty:
            continue
        if "case_id" not in frame:
            frame["case_id"] = path.parent.name
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=[RUN, "case_id", RANK, "t_s", "bytes", PHASE, "source"])
    out = pd.concat(frames, ignore_index=True)
    out.insert(0, RUN, label)
    return out


def load_runs(run_dirs: Sequence[str | Path]) -> ReportData:
    """Several run directories, labelled so that their cases can be told apart."""
    labels = [run_label(Path(d)) for d in run_dirs]
    if len(set(labels)) < len(labels):  # same parent/name twice: fall back to full paths
        labels = [shown_path(Path(d).resolve()) for d in run_dirs]
    runs = [load_run(d, label) for d, label in zip(run_dirs, labels)]
    results = pd.concat([r.results for r in runs], ignore_index=True) if runs else pd.DataFrame()
    timelines = [r.timelines for r in runs if not r.timelines.empty]
    return ReportData(
        runs=runs,
        results=results,
        cases=build_case_frame(results),
        timelines=pd.concat(timelines, ignore_index=True) if timelines else pd.DataFrame(),
    )


def build_case_frame(results: pd.DataFrame) -> pd.DataFrame:
    """One row per run × case (``analysis_frame.case_frame``), in the report's order, with its labels."""
    if results.empty:
        return pd.DataFrame(columns=[RUN, "case_id", STATUS, "label"])
    cases = case_frame(results if RUN in results else results.assign(run=RUN))
    cases["strategy_rank"] = cases["strategy"].map(strategy_rank)
    sort = [
        c
        for c in (RUN, "model", "world_size", "strategy_rank", "wrap", "prefetch", "precision")
        if c in cases
    ]
    cases = cases.sort_values(sort, kind="stable", na_position="last").reset_index(drop=True)
    modes = cases["mode"] if "mode" in cases else pd.Series("real", index=cases.index)
    emulated = cases["emulate_ranks"] if "emulate_ranks" in cases else pd.Series("", index=cases.index)
    cases["ranks_label"] = [
        ranks_label(r.world_size, r.device, r.backend, mode=m, emulated_ranks=e)
        for r, m, e in zip(cases.itertuples(), modes, emulated)
    ]
    cases["label"] = case_labels(cases)
    return cases


def rows_with(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """The rows where a numeric column has a value (none when the column is absent)."""
    if column not in frame:
        return frame.iloc[0:0]
    return frame[pd.to_numeric(frame[column], errors="coerce").notna()]


def strategy_rank(name: Any) -> int:
    """Where the strategy stands in the report's order: the registry's, unregistered plugins last."""
    from fsdpbench.strategies import registered

    order = list(registered())
    return order.index(name) if name in order else len(order)


def ranks_label(
    world_size: Any, device: Any, backend: Any, *, mode: Any = "real", emulated_ranks: Any = ""
) -> str:
    """'4 CPU ranks (gloo)' or '4 GPUs (NCCL)': a CPU rank is never called a GPU. Emulated: 'rank 0 of 4
    GPUs (NCCL), emulated on one device' — the others never ran."""
    n = int(world_size) if present(world_size) else 0
    backend_name = str(backend) if present(backend) else "?"
    if mode == "emulated":
        real = ranks_label(world_size, device, backend)
        return f"rank {emulated_ranks} of {real}, emulated on one {'GPU' if device == 'cuda' else 'CPU'}"
    if device == "cuda":
        return f"{n} GPU{'s' if n != 1 else ''} ({backend_name.upper()})"
    return f"{n} CPU rank{'s' if n != 1 else ''} ({backend_name})"


def ok_cases(cases: pd.DataFrame) -> pd.DataFrame:
    return cases[cases[STATUS] == OK] if STATUS in cases else cases
