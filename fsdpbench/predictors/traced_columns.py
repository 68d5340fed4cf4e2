"""Traced predictions beside a run's measurements: the runner traces each case's ranks in a child process
(``trace_ranks``) and adds ``traced_*`` columns to their rows (``traced_columns``); a CUDA case also gets
its allocation stream replayed through the caching allocator model (``device_fit.py``)."""

from __future__ import annotations

from typing import Any

from fsdpbench.core.case import Case
from fsdpbench.core.schema import (
    RANK,
    TRACED_MODEL_STATES,
    TRACED_MODEL_STATES_ERR,
    TRACED_PEAK,
    TRACED_PEAK_ERR,
    TRACED_WALL_S,
    TRACKER_MODEL_STATES,
    TRACKER_PEAK,
    WALL_S,
)
from fsdpbench.predictors.traced import estimate

TRACED_COLUMNS = (
    TRACED_PEAK,
    TRACED_MODEL_STATES,
    TRACED_PEAK_ERR,
    TRACED_MODEL_STATES_ERR,
    TRACED_WALL_S,
)


def trace_ranks(case_dict: dict[str, Any], ranks: list[int]) -> dict[int, dict[str, Any]]:
    """``estimate`` for each rank of a case (run in a child process by the runner: picklable in and out);
    a CUDA case also gets its allocation stream (as JSON) and the allocator model's figures for it."""
    case = Case.from_dict(case_dict)
    out: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        cuda = case.device == "cuda"
        est = estimate(case, rank=rank, record_stream=cuda)
        out[rank] = {"peak": est.peak_bytes, "states": est.model_states_bytes, WALL_S: est.wall_s}
        if cuda and est.alloc_stream is not None:
            from fsdpbench.predictors.device_fit import DeviceModel

            model = DeviceModel.for_case(case, rank=rank, fsdpbench_run=True)
            memory = model.replayed(case, est.alloc_stream, est.peak_bytes)
            out[rank]["device_memory"] = memory.to_dict()
            out[rank]["alloc_stream"] = est.alloc_stream.to_json()
    return out


def traced_columns(traced: dict[int, dict[str, Any]], rows: Any) -> dict[str, list[Any]]:
    """traced_* columns for a case's rows, with the relative error against the same rank's tracker; on a
    CUDA case, the allocator model's peaks and predicted NVML beside the allocator's and NVML's."""
    from fsdpbench.core import schema
    from fsdpbench.predictors.memory_model.columns import relative_error

    device = any("device_memory" in t for t in traced.values())
    columns = (*TRACED_COLUMNS, *(schema.ALLOCATOR_PREDICTION_COLUMNS if device else ()))
    out: dict[str, list[Any]] = {c: [] for c in columns}
    for _, row in rows.iterrows():
        t = traced.get(int(row[RANK]))
        peak, states = (t["peak"], t["states"]) if t else (None, None)
        out[TRACED_PEAK].append(peak)
        out[TRACED_MODEL_STATES].append(states)
        out[TRACED_PEAK_ERR].append(relative_error(peak, row.get(TRACKER_PEAK)))
        out[TRACED_MODEL_STATES_ERR].append(relative_error(states, row.get(TRACKER_MODEL_STATES)))
        out[TRACED_WALL_S].append(t[WALL_S] if t else None)
        if device:
            for name, value in _allocator_cells((t or {}).get("device_memory"), row).items():
                out[name].append(value)
    return out


def _allocator_cells(memory: dict[str, Any] | None, row: Any) -> dict[str, Any]:
    """One row's allocator/NVML predictions (None where this rank was not traced) and their errors."""
    from fsdpbench.core import schema
    from fsdpbench.predictors.memory_model.columns import relative_error

    m = memory or {}
    cells = {
        schema.TRACED_ALLOC_ALLOCATED: m.get("allocated_peak_bytes"),
        schema.TRACED_ALLOC_RESERVED: m.get("reserved_peak_bytes"),
        schema.TRACED_ALLOC_FRAGMENTATION: m.get("fragmentation"),
        schema.TRACED_NVML: m.get("nvml_peak_bytes"),
        schema.TRACED_NVML_CONTEXT: m.get("context_bytes"),
        schema.TRACED_NVML_NCCL: m.get("nccl_bytes"),
    }
    for err, (pred, measured) in schema.ERROR_COLUMNS.items():
        if err in schema.ALLOCATOR_PREDICTION_COLUMNS:
            cells[err] = relative_error(cells[pred], row.get(measured))
    return cells
