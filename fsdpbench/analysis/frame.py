"""Results rows → one row per case, and what is computed from it: prediction errors, step-time references,
memory at the peak by group. Torch-free; returns DataFrames and prints or draws nothing (the run summary,
the report and the regression gate read these).

    cases = case_frame(load_results(run_dir))     # one row per (run ×) case
    refs = time_references(cases)                 # which case each case's step time is compared with
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pandas as pd

from fsdpbench.analysis.checkpoint import checkpoint_case_columns
from fsdpbench.core.numbers import is_number, relative_error
from fsdpbench.core.schema import (
    CASE_ERROR,
    CASE_ID,
    CASE_STATUS,
    CASE_STEP_TIME,
    COLUMNS,
    ERROR,
    ERROR_COLUMNS,
    MODE,
    MODEL_CHECKABLE,
    MODEL_STEP_ERR,
    MODEL_STEP_TIME,
    N_RANKS_REPORTED,
    OK,
    PEAK_RANK,
    PEER_COLUMNS,
    PRED_ACTIVATIONS,
    PRED_COMM_BUFFERS,
    PRED_OPTIM,
    PRED_PADDING,
    PRED_PARAMS,
    PRED_PEAK,
    PRED_PEAK_BY_CATEGORY,
    PRED_TEMP,
    PRED_UNSHARDED,
    RANK,
    REAL,
    RUN,
    SLOWEST_RANK,
    STATUS,
    STEP_TIME,
    STRATEGY,
    TRACKER_PEAK,
    UNKNOWN,
    Agg,
    tracker_peak_column,
    undeclared,
)
from fsdpbench.strategies import REFERENCE_STRATEGY  # what other cases' step times are compared with

# ---- numbers ---------------------------------------------------------------------------------------------


def has_values(frame: pd.DataFrame, column: str) -> bool:
    return column in frame and pd.to_numeric(frame[column], errors="coerce").notna().any()


def numeric_column(frame: pd.DataFrame, name: str) -> pd.Series:
    """A numeric column with NaN as 0, or zeros when the column is absent."""
    if name not in frame:
        return pd.Series(0.0, index=frame.index)
    return pd.to_numeric(frame[name], errors="coerce").fillna(0.0).astype(float)


def case_mode(row: pd.Series | dict[str, Any]) -> str:
    """'emulated' or 'real' (results written before emulation existed are real)."""
    mode = row.get(MODE)
    return mode if isinstance(mode, str) else REAL


# ---- one row per case ------------------------------------------------------------------------------------


def case_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per run × case (per case when the rows have no ``run`` column).

    Each column becomes the case's value as its declaration says (``schema.Agg``): configuration from the
    first row; step time and what is computed from it (MFU, harness overhead) from the slowest rank (the
    case's step time when recorded); the step-time model from the rank it finds slowest; tracker categories
    and predictions from the rank with the largest tracker peak (so the categories add up to that peak);
    other memory the maximum over ranks; communication and overlap the mean over ranks; status and error
    the case's. Per-rank columns (lists, the rank's pid and phase) stay in the rows. A column that no
    declaration covers is kept as the first row's value with an ``UndeclaredColumnWarning`` (an error in
    the tests): nothing is dropped silently.
    """
    keys = [RUN, CASE_ID] if RUN in rows else [CASE_ID]
    if rows.empty:
        return pd.DataFrame(columns=[*keys, STATUS])
    _warn_undeclared(rows.columns)
    out = []
    for key, group in rows.groupby(keys, sort=False):
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        out.append(_case_row(row, group))
    return pd.DataFrame(out)


class UndeclaredColumnWarning(UserWarning):
    """A results column that fsdpbench/core/schema.py does not declare (kept as the first row's value)."""


def _warn_undeclared(columns: Any) -> None:
    missing = undeclared(columns)
    if missing:
        warnings.warn(
            "columns not declared in fsdpbench/core/schema.py (kept as the first row's value): "
            + ", ".join(missing),
            UndeclaredColumnWarning,
            stacklevel=3,
        )


def _case_row(row: dict[str, Any], group: pd.DataFrame) -> dict[str, Any]:
    first = group.iloc[0]
    ranks = group[group[RANK] >= 0] if RANK in group else group
    row[STATUS] = _case_status(group)
    row[ERROR] = _case_error(group)
    row[N_RANKS_REPORTED] = len(ranks)
    slow = _row_of_max(ranks, STEP_TIME)
    model_slow = _row_of_max(ranks, MODEL_STEP_TIME)
    peak = _row_of_max(ranks, TRACKER_PEAK)
    if slow is not None:
        row[SLOWEST_RANK] = int(slow[RANK]) if RANK in slow else 0
    if peak is not None:
        row[PEAK_RANK] = int(peak[RANK]) if RANK in peak else 0
    # the row each declared aggregation takes its value from; the first row's when no rank has the
    # figure it is chosen by (a column is never dropped for lack of a step time or a peak)
    source_row = {
        Agg.SAME: first,
        Agg.SLOWEST: slow if slow is not None else first,
        Agg.MODEL_SLOWEST: model_slow if model_slow is not None else first,
        Agg.PEAK_RANK: peak if peak is not None else first,
    }
    for col in group.columns:
        agg = COLUMNS[col].agg if col in COLUMNS else Agg.SAME
        if agg in source_row or agg in (Agg.MAX, Agg.MEAN):
            row[col] = _aggregate(agg, col, source_row, ranks)
    if slow is not None and is_number(row.get(CASE_STEP_TIME)):
        row[STEP_TIME] = row[CASE_STEP_TIME]  # the case's step time as recorded
    if model_slow is not None:
        row[MODEL_STEP_ERR] = _model_step_error(model_slow, row.get(STEP_TIME))
    row.update(checkpoint_case_columns(ranks))
    _add_errors(row)
    return row


def _aggregate(agg: Agg, col: str, source_row: dict[Agg, pd.Series], ranks: pd.DataFrame) -> Any:
    """A column's value for the case by its declared aggregation: a chosen rank's, the max or the mean."""
    if agg in source_row:
        return source_row[agg][col]
    return _rank_max(ranks[col]) if agg is Agg.MAX else _rank_mean(ranks[col])


def _model_step_error(model_slow: pd.Series, measured: Any) -> float:
    """The modelled step time's relative error, only where the model describes the measurement (not:
    CPU ranks beyond the cores, emulated)."""
    flag = model_slow.get(MODEL_CHECKABLE)
    checked = flag is None or pd.isna(flag) or bool(flag)
    if checked and is_number(measured) and measured:
        return (model_slow[MODEL_STEP_TIME] - measured) / measured
    return np.nan


def _row_of_max(ranks: pd.DataFrame, column: str) -> pd.Series | None:
    """The rank row with the largest value of a numeric column; None when no rank has one."""
    if column not in ranks:
        return None
    values = pd.to_numeric(ranks[column], errors="coerce")
    return ranks.loc[values.idxmax()] if values.notna().any() else None


def _case_status(group: pd.DataFrame) -> str:
    first = group.iloc[0]
    status = first.get(CASE_STATUS) if CASE_STATUS in group else None
    return status if isinstance(status, str) and status else first.get(STATUS, UNKNOWN)


def _case_error(group: pd.DataFrame) -> str:
    """The case's error, else the first rank's that has one, else ''."""
    error = group.iloc[0].get(CASE_ERROR) if CASE_ERROR in group else None
    if isinstance(error, str) and error:
        return error
    errors = [e for e in group.get(ERROR, pd.Series(dtype=str)) if isinstance(e, str) and e]
    return errors[0] if errors else ""


def _rank_max(values: pd.Series) -> Any:
    """A numeric column's maximum over ranks (NaN: none has one); for text the first rank's."""
    if not pd.api.types.is_numeric_dtype(values) and any(isinstance(v, str) for v in values):
        return _rank_mean(values)
    numbers = pd.to_numeric(values, errors="coerce")
    return numbers.max() if numbers.notna().any() else np.nan


def _rank_mean(values: pd.Series) -> Any:
    """A numeric column's mean over ranks; for text (comm_pattern, overlap_note) the first rank's."""
    if pd.api.types.is_numeric_dtype(values):
        numbers = pd.to_numeric(values, errors="coerce")
        return float(numbers.mean()) if numbers.notna().any() else np.nan
    texts = [v for v in values if isinstance(v, str) and v]
    return texts[0] if texts else ""


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
        timed = cases[(cases[STATUS] == OK) & case_step_times(cases).notna()]
        named = cases.index[cases[CASE_ID] == reference]
        if len(named):
            found = {i: named[-1] for i in timed.index if i != named[-1]}
        else:
            found = _peer_references(cases, timed, reference)
    return pd.Series([found.get(i) for i in cases.index], index=cases.index, dtype=object)


def _peer_references(cases: pd.DataFrame, timed: pd.DataFrame, strategy: str) -> dict[Any, Any]:
    """Index of each timed case → index of the timed case of ``strategy`` with the same PEER_COLUMNS."""
    keys = [c for c in PEER_COLUMNS if c in cases]
    peers = {i: tuple(str(cases.at[i, k]) for k in keys) for i in timed.index}
    candidates = sorted(timed.index[timed[STRATEGY] == strategy], key=lambda i: cases.at[i, CASE_ID])
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
    return cases[STRATEGY] == REFERENCE_STRATEGY


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
    "params": (PRED_PARAMS, PRED_PADDING),
    "grads": (),
    "optimizer state": (PRED_OPTIM,),
    "activations": (PRED_ACTIVATIONS,),
    "unsharded params/grads + comm buffers": (PRED_UNSHARDED, PRED_COMM_BUFFERS),
    "other": (PRED_TEMP,),
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
    predicted_peak = {
        g: [PRED_PEAK_BY_CATEGORY.of(c) for c in cols] for g, cols in BREAKDOWN_MEASURED.items()
    }
    if any(has_values(cases, c) for cols in predicted_peak.values() for c in cols):
        return measured, _grouped(cases, predicted_peak), None
    if not has_values(cases, PRED_PEAK):
        return measured, None, None
    predicted = _grouped(cases, BREAKDOWN_PREDICTED)
    predicted["grads"] = (numeric_column(cases, PRED_PEAK) - predicted.sum(axis=1)).clip(lower=0)
    predicted[numeric_column(cases, PRED_PEAK) == 0] = float("nan")  # no prediction for that case
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
