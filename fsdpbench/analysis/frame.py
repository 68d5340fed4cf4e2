"""Results rows → one row per case, and what is computed from it: prediction errors, step-time references,
memory at the peak by group. Torch-free; returns DataFrames and prints or draws nothing (the run summary,
the report and the regression gate read these).

    cases = case_frame(load_results(run_dir))     # one row per (run ×) case
    refs = time_references(cases)                 # which case each case's step time is compared with
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from fsdpbench.schema import (
    CASE_STEP_TIME,
    COMM_PREFIX,
    CONFIG_COLUMNS,
    ERROR_COLUMNS,
    MEMORY_PREFIX,
    MODEL_CHECKABLE,
    OK,
    OVERLAP_PREFIX,
    PEER_COLUMNS,
    PREDICTED_PREFIX,
    STEP_MODEL_COLUMNS,
    STEP_TIME,
    STEP_TIME_SPREAD_COLUMNS,
    TRACED_PREFIX,
    TRACKER_PEAK,
    TRACKER_PEAK_COLUMNS,
    VENDOR_ESTIMATE_PREFIX,
    tracker_peak_column,
)
from fsdpbench.strategies import REFERENCE_STRATEGY  # what other cases' step times are compared with

# per case, the first rank's value: besides the configuration, the id before --map-strategy renamed the
# case, and the lists every rank holds alike (global losses, step-time samples against the reference)
FIRST_RANK_COLUMNS = (*CONFIG_COLUMNS, "run_case_id", "losses", "step_time_ref_ratios")


# ---- numbers ---------------------------------------------------------------------------------------------


def is_number(value: Any) -> bool:
    """A value that reads as a number and is not NaN (None, text and NaN are not)."""
    try:
        return not math.isnan(float(value))
    except (TypeError, ValueError):
        return False


def number(value: Any) -> float | None:
    """``value`` as a float, or None when it is not a number."""
    return float(value) if is_number(value) else None


def relative_error(pred: Any, measured: Any) -> float | None:
    """(pred − measured) / measured; None when either is missing, not a number, or measured is 0."""
    if pred is None or not is_number(pred) or not is_number(measured) or not float(measured):
        return None
    return (pred - float(measured)) / float(measured)


def has_values(frame: pd.DataFrame, column: str) -> bool:
    return column in frame and pd.to_numeric(frame[column], errors="coerce").notna().any()


def numeric_column(frame: pd.DataFrame, name: str) -> pd.Series:
    """A numeric column with NaN as 0, or zeros when the column is absent."""
    if name not in frame:
        return pd.Series(0.0, index=frame.index)
    return pd.to_numeric(frame[name], errors="coerce").fillna(0.0).astype(float)


def case_mode(row: pd.Series | dict[str, Any]) -> str:
    """'emulated' or 'real' (results written before emulation existed are real)."""
    mode = row.get("mode")
    return mode if isinstance(mode, str) else "real"


# ---- one row per case ------------------------------------------------------------------------------------


def case_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per run × case (per case when the rows have no ``run`` column).

    Configuration, status and error from the first rank; step time from the slowest rank (the case's
    step time when recorded), the step-time model from the rank it finds slowest; memory by tracker
    category from the rank with the largest tracker peak (so the categories add up to that peak), other
    memory columns the maximum over ranks; communication and overlap the mean over ranks; predictions of
    the rank with the largest peak, and their errors against it where the rows have none.
    """
    keys = ["run", "case_id"] if "run" in rows else ["case_id"]
    if rows.empty:
        return pd.DataFrame(columns=[*keys, "status"])
    out = []
    for key, group in rows.groupby(keys, sort=False):
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        out.append(_case_row(row, group))
    return pd.DataFrame(out)


def _case_row(row: dict[str, Any], group: pd.DataFrame) -> dict[str, Any]:
    first = group.iloc[0]
    for col in FIRST_RANK_COLUMNS:
        if col in group:
            row[col] = first[col]
    row["status"] = _case_status(group)
    row["error"] = _case_error(group)
    ranks = group[group["rank"] >= 0] if "rank" in group else group
    row["n_ranks_reported"] = len(ranks)
    _add_time(row, ranks)
    _add_step_model(row, ranks)
    _add_memory(row, ranks)
    pred_row = ranks.loc[ranks["rank"] == row["peak_rank"]].iloc[0] if "peak_rank" in row else first
    for col in group.columns:
        if col.startswith((COMM_PREFIX, OVERLAP_PREFIX)):
            row[col] = _rank_mean(ranks[col])
        elif col.startswith((PREDICTED_PREFIX, TRACED_PREFIX, VENDOR_ESTIMATE_PREFIX)):
            row[col] = pred_row[col]
    _add_errors(row)
    return row


def _case_status(group: pd.DataFrame) -> str:
    first = group.iloc[0]
    status = first.get("case_status") if "case_status" in group else None
    return status if isinstance(status, str) and status else first.get("status", "unknown")


def _case_error(group: pd.DataFrame) -> str:
    """The case's error, else the first rank's that has one, else ''."""
    error = group.iloc[0].get("case_error") if "case_error" in group else None
    if isinstance(error, str) and error:
        return error
    errors = [e for e in group.get("error", pd.Series(dtype=str)) if isinstance(e, str) and e]
    return errors[0] if errors else ""


def _rank_mean(values: pd.Series) -> Any:
    """A numeric column's mean over ranks; for text (comm_pattern, overlap_note) the first rank's."""
    if pd.api.types.is_numeric_dtype(values):
        numbers = pd.to_numeric(values, errors="coerce")
        return float(numbers.mean()) if numbers.notna().any() else np.nan
    texts = [v for v in values if isinstance(v, str) and v]
    return texts[0] if texts else ""


def _add_time(row: dict[str, Any], ranks: pd.DataFrame) -> None:
    """Step time of the slowest rank with its p10/p90 spread (the case's step time is that rank's median)."""
    if STEP_TIME not in ranks or ranks[STEP_TIME].isna().all():
        return
    slow = ranks.loc[ranks[STEP_TIME].idxmax()]
    case_time = row.get(CASE_STEP_TIME)
    row[STEP_TIME] = case_time if is_number(case_time) else slow[STEP_TIME]
    for col in STEP_TIME_SPREAD_COLUMNS:
        if col in slow:
            row[col] = slow[col]
    row["slowest_rank"] = int(slow["rank"]) if "rank" in slow else 0


def _add_step_model(row: dict[str, Any], ranks: pd.DataFrame) -> None:
    """The modelled figures of the rank the model finds slowest (as the measured step time is the
    slowest rank's), and model_step_err = (modelled − measured) / measured."""
    if "model_step_time_ms" not in ranks or ranks["model_step_time_ms"].isna().all():
        return
    slow = ranks.loc[pd.to_numeric(ranks["model_step_time_ms"], errors="coerce").idxmax()]
    for col in STEP_MODEL_COLUMNS:
        if col in slow:
            row[col] = slow[col]
    measured = row.get(STEP_TIME)
    # an error only where the model describes the measurement (not: CPU ranks beyond the cores, emulated)
    flag = slow.get(MODEL_CHECKABLE)
    checked = flag is None or pd.isna(flag) or bool(flag)
    row["model_step_err"] = (
        (slow["model_step_time_ms"] - measured) / measured
        if checked and is_number(measured) and measured
        else np.nan
    )


def _add_memory(row: dict[str, Any], ranks: pd.DataFrame) -> None:
    if TRACKER_PEAK in ranks and ranks[TRACKER_PEAK].notna().any():
        peak = ranks.loc[pd.to_numeric(ranks[TRACKER_PEAK], errors="coerce").idxmax()]
        for col in TRACKER_PEAK_COLUMNS:
            if col in peak:
                row[col] = peak[col]
        row["peak_rank"] = int(peak["rank"]) if "rank" in peak else 0
    for col in ranks.columns:
        if col.startswith(MEMORY_PREFIX) and col not in TRACKER_PEAK_COLUMNS:
            values = pd.to_numeric(ranks[col], errors="coerce")
            row[col] = values.max() if values.notna().any() else np.nan


def _add_errors(row: dict[str, Any]) -> None:
    """The error columns the rows lack, from the predicted and measured columns beside them."""
    for err_col, (pred_col, meas_col) in ERROR_COLUMNS.items():
        if is_number(row.get(err_col)):
            continue
        err = relative_error(row.get(pred_col), row.get(meas_col))
        if err is not None:
            row[err_col] = err


def rank_maxima(rows: pd.DataFrame, columns: list[str] | tuple[str, ...]) -> pd.DataFrame:
    """Per case id, the largest value over ranks of each of these columns that the rows have."""
    present = [c for c in columns if c in rows]
    return rows.groupby("case_id", sort=False)[present].max() if present else pd.DataFrame()


# ---- step time against the reference case -------------------------------------------------------------


def time_references(cases: pd.DataFrame, reference: str = REFERENCE_STRATEGY) -> pd.Series:
    """For each case (a case_frame), the index of the case its step time is compared with, else None.

    The reference is the case whose id is ``reference`` (a calibration case), else the finished, timed
    case of the strategy ``reference`` with the same PEER_COLUMNS (the last by case id when several).
    A case is never its own reference; only finished, timed cases get one.
    """
    found: dict[Any, Any] = {}
    if not cases.empty:
        timed = cases[(cases["status"] == OK) & case_step_times(cases).notna()]
        named = cases.index[cases["case_id"] == reference]
        if len(named):
            found = {i: named[-1] for i in timed.index if i != named[-1]}
        else:
            found = _peer_references(cases, timed, reference)
    return pd.Series([found.get(i) for i in cases.index], index=cases.index, dtype=object)


def _peer_references(cases: pd.DataFrame, timed: pd.DataFrame, strategy: str) -> dict[Any, Any]:
    """Index of each timed case → index of the timed case of ``strategy`` with the same PEER_COLUMNS."""
    keys = [c for c in PEER_COLUMNS if c in cases]
    peers = {i: tuple(str(cases.at[i, k]) for k in keys) for i in timed.index}
    candidates = sorted(timed.index[timed["strategy"] == strategy], key=lambda i: cases.at[i, "case_id"])
    by_peers = {peers[i]: i for i in candidates}
    return {i: by_peers[key] for i, key in peers.items() if key in by_peers and by_peers[key] != i}


def case_step_times(cases: pd.DataFrame) -> pd.Series:
    """Each case's step time: the recorded case step time, else the slowest rank's (NaN: not timed)."""
    recorded = pd.to_numeric(cases.get(CASE_STEP_TIME, pd.Series(np.nan, index=cases.index)), errors="coerce")
    slowest = pd.to_numeric(cases.get(STEP_TIME, pd.Series(np.nan, index=cases.index)), errors="coerce")
    return recorded.fillna(slowest).astype(float)


def speedups(cases: pd.DataFrame) -> pd.Series:
    """Each case's speed relative to its reference case: reference step time / step time (NaN: none)."""
    times = case_step_times(cases)
    base = [times[j] if j is not None else np.nan for j in time_references(cases)]
    return pd.Series(base, index=cases.index, dtype="float64") / times


def is_reference_strategy(cases: pd.DataFrame) -> pd.Series:
    """The cases of the strategy that other cases' step times are compared with."""
    return cases["strategy"] == REFERENCE_STRATEGY


# ---- memory at the peak, by group ----------------------------------------------------------------------

# measured tracker categories at the peak, grouped for the breakdown
BREAKDOWN_MEASURED = {
    "params": ("params",),
    "grads": ("grads",),
    "optimizer state": ("optim",),
    "activations": ("activations", "inputs"),
    "unsharded params/grads + comm buffers": (
        "params_unsharded",
        "grads_unsharded",
        "all_gather",
        "reduce_scatter",
    ),
    "other": ("temp", "buffers", "other"),
}
# the analytic model's terms, grouped the same way; its grads term is the resting value, so the gradients
# present at the peak are what the predicted peak leaves (see breakdown_frames)
BREAKDOWN_PREDICTED = {
    "params": ("pred_params_bytes", "pred_padding_bytes"),
    "grads": (),
    "optimizer state": ("pred_optim_bytes",),
    "activations": ("pred_activations_bytes",),
    "unsharded params/grads + comm buffers": ("pred_unsharded_bytes", "pred_comm_buffers_bytes"),
    "other": ("pred_temp_bytes",),
}
GRADS_AT_PEAK_NOTE = (
    "predicted grads at the peak = predicted peak − the other predicted terms "
    "(pred_grads_bytes is the resting value after optimizer.step)"
)


def breakdown_frames(cases: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame | None, str | None]:
    """Memory at the peak by group: measured (tracker), predicted (None without pred_*), how grads were got.

    pred_peak_<category>_bytes columns (the tracker's categories at the predicted peak) are used as they
    are when the memory model writes them; otherwise the predicted grads at the peak are derived.
    """
    measured = _grouped(
        cases, {g: [tracker_peak_column(c) for c in cols] for g, cols in BREAKDOWN_MEASURED.items()}
    )
    predicted_peak = {g: [f"pred_peak_{c}_bytes" for c in cols] for g, cols in BREAKDOWN_MEASURED.items()}
    if any(has_values(cases, c) for cols in predicted_peak.values() for c in cols):
        return measured, _grouped(cases, predicted_peak), None
    if not has_values(cases, "pred_peak_bytes"):
        return measured, None, None
    predicted = _grouped(cases, BREAKDOWN_PREDICTED)
    predicted["grads"] = (numeric_column(cases, "pred_peak_bytes") - predicted.sum(axis=1)).clip(lower=0)
    predicted[numeric_column(cases, "pred_peak_bytes") == 0] = float("nan")  # no prediction for that case
    return measured, predicted, GRADS_AT_PEAK_NOTE


def _grouped(cases: pd.DataFrame, groups: dict[str, Any]) -> pd.DataFrame:
    """One column per group: the sum of its columns (NaN and absent columns as 0)."""
    return pd.DataFrame(
        {
            g: sum((numeric_column(cases, c) for c in cols), pd.Series(0.0, index=cases.index))
            for g, cols in groups.items()
        },
        index=cases.index,
    )
