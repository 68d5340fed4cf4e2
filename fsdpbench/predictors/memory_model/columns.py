"""The analytic prediction beside every measured row (``pred_*`` columns), called by the runner after
each case. Per rank (ZeRO-1's partition and FSDP's padding differ by rank); never raises for a strategy
or model it cannot predict — it returns no columns, or only the ones it could compute.

Errors are relative, (pred − measured) / measured, against the live-tensor tracker:
``pred_model_states_err`` vs ``mem_tracker_model_states_bytes`` (after optimizer.step, before zero_grad)
and ``pred_peak_err`` vs ``mem_tracker_peak_bytes``.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from fsdpbench.core.case import Case
from fsdpbench.core.numbers import is_number, relative_error
from fsdpbench.core.schema import (
    ERROR_COLUMNS,
    PRED_ACTIVATIONS,
    PRED_COMM_BUFFERS,
    PRED_DEVICE_PEAK,
    PRED_GRADS,
    PRED_HOST,
    PRED_MODEL_STATES,
    PRED_MODEL_STATES_ERR,
    PRED_OPTIM,
    PRED_PADDING,
    PRED_PARAMS,
    PRED_PARAMS_DEVICE,
    PRED_PARAMS_HOST,
    PRED_PEAK,
    PRED_PEAK_BY_CATEGORY,
    PRED_PEAK_ERR,
    PRED_PEAK_MOMENT,
    PRED_TEMP,
    PRED_UNSHARDED,
    RANK,
    VENDOR_MODEL_STATES,
    VENDOR_MODEL_STATES_ERR,
)

# the model's categories at the predicted peak, filed under each of the tracker's categories
# (schema.TRACKER_CATEGORIES, all of them) for pred_peak_<cat>_bytes;
# DDP buckets are where the tracker files them (temp: it first sees a bucket when backward writes into it),
# the optimizer update's temporaries (optim: allocated inside optimizer.step), unsharded gradients before
# their unit's post-backward (temp: FSDPMemTracker relabels them when post-backward starts), and the batch
# (activations: the tracker's "inputs" are module inputs it registers, which the batch slices are not), as
# are forward temporaries (the logits while the loss runs: anything made in forward is an activation to it)
# and what an engine's own step makes outside the torch optimizer's (neither backward nor optimizer state)
TRACKER_FILING = {
    "params": ("params", "padding"),
    "params_unsharded": ("params_unsharded",),
    "grads": ("grads",),
    "grads_unsharded": ("grads_unsharded",),
    "optim": ("optim", "optim_temp"),
    "activations": ("activations", "inputs", "fwd_temp", "step_temp"),
    "inputs": (),
    "temp": ("temp", "ddp_buckets", "grads_unsharded_in_bwd"),
    "all_gather": ("all_gather",),
    "reduce_scatter": ("reduce_scatter",),
    "buffers": (),
    "other": (),
}
# the model's temporaries, summed for pred_temp_bytes
TEMP_CATEGORIES = ("temp", "fwd_temp", "optim_temp", "step_temp")
PRED_COLUMNS = (
    PRED_PARAMS,
    PRED_GRADS,
    PRED_OPTIM,
    PRED_PADDING,
    PRED_MODEL_STATES,
    PRED_ACTIVATIONS,
    PRED_UNSHARDED,
    PRED_COMM_BUFFERS,
    PRED_TEMP,
    PRED_PEAK,
    PRED_PEAK_MOMENT,
    PRED_DEVICE_PEAK,
    PRED_MODEL_STATES_ERR,
    PRED_PEAK_ERR,
    PRED_HOST,
    PRED_PARAMS_HOST,
    PRED_PARAMS_DEVICE,
    *(PRED_PEAK_BY_CATEGORY.of(c) for c in TRACKER_FILING),
)


def vendor_columns(case: Case, rows: pd.DataFrame) -> dict[str, Any]:
    """ds_est_* columns: the strategy's ``vendor_model_states_bytes`` beside the tracker's model states."""
    from fsdpbench.strategies import get_strategy

    try:
        nbytes = get_strategy(case.strategy).vendor_model_states_bytes(case)
    except Exception:  # noqa: BLE001 — an estimator that cannot answer leaves the columns out
        return {}
    if nbytes is None:
        return {}
    values = {VENDOR_MODEL_STATES: nbytes}
    errors = [errors_against(values, rows, i) for i in range(len(rows))]
    return {
        VENDOR_MODEL_STATES: [nbytes] * len(rows),
        VENDOR_MODEL_STATES_ERR: [e[VENDOR_MODEL_STATES_ERR] for e in errors],
    }


def errors_against(predicted: dict[str, Any], rows: pd.DataFrame, i: int) -> dict[str, float | None]:
    """The error columns (schema.ERROR_COLUMNS) of these predicted values against row ``i``'s measurements."""
    return {
        err: relative_error(predicted[pred], _cell(rows, i, measured))
        for err, (pred, measured) in ERROR_COLUMNS.items()
        if pred in predicted
    }


def prediction_columns(case: Case, rows: pd.DataFrame) -> dict[str, Any]:
    """pred_* columns for a case's rows (one value per row)."""
    from fsdpbench.predictors.memory_model import predict_memory

    try:
        if case.precision not in _runnable_precisions():
            return {}
        ranks = [int(r) if is_number(r) else 0 for r in rows.get(RANK, pd.Series([0] * len(rows)))]
        preds = {r: predict_memory(case, rank=max(r, 0)) for r in set(ranks)}
    except Exception:  # noqa: BLE001 — an unknown plugin strategy or model: no prediction, never a failure
        return {}
    out: dict[str, list[Any]] = {c: [] for c in PRED_COLUMNS}
    for i, r in enumerate(ranks):
        p = preds[r]
        bd = p.peak_breakdown
        values: dict[str, Any] = {
            PRED_PARAMS: p.params_bytes,
            PRED_GRADS: p.grads_bytes,
            PRED_OPTIM: p.optim_bytes,
            PRED_PADDING: p.padding_bytes,
            PRED_MODEL_STATES: p.resting_states_bytes,
            PRED_ACTIVATIONS: (bd.get("activations", 0) + bd.get("inputs", 0)) if bd else None,
            PRED_UNSHARDED: (
                bd.get("params_unsharded", 0)
                + bd.get("grads_unsharded", 0)
                + bd.get("grads_unsharded_in_bwd", 0)
            )
            if bd
            else None,
            PRED_COMM_BUFFERS: (
                bd.get("all_gather", 0) + bd.get("reduce_scatter", 0) + bd.get("ddp_buckets", 0)
            )
            if bd
            else None,
            PRED_TEMP: sum(bd.get(c, 0) for c in TEMP_CATEGORIES) if bd else None,
            PRED_PEAK: p.peak_bytes,
            PRED_PEAK_MOMENT: p.peak_moment,
            PRED_DEVICE_PEAK: p.device_peak_bytes,
            # where the parameters live (CPU offload), beside mem_placement_params_{host,device}_bytes
            PRED_HOST: p.host_bytes,
            PRED_PARAMS_HOST: p.params_host_bytes,
            PRED_PARAMS_DEVICE: p.params_device_bytes,
        }
        values.update(errors_against(values, rows, i))
        filing = tracker_filing(p)
        for cat, ours in filing.items():
            values[PRED_PEAK_BY_CATEGORY.of(cat)] = sum(bd.get(c, 0) for c in ours) if bd else None
        for key, value in values.items():
            out[key].append(value)
    return {**out, **vendor_columns(case, rows)}


def tracker_filing(p: Any) -> dict[str, tuple[str, ...]]:
    """TRACKER_FILING for one prediction: FSDPMemTracker files a reduce-scatter input as such only when
    the collective runs; with one rank per shard group FSDP2 skips it and the buffer is a temporary."""
    if (p.shard_size or p.world_size) != 1:
        return TRACKER_FILING
    return {
        **TRACKER_FILING,
        "reduce_scatter": (),
        "temp": (*TRACKER_FILING["temp"], "reduce_scatter"),
    }


def _runnable_precisions() -> set[str]:
    from fsdpbench.predictors.memory_model.precision import PRECISIONS

    return {name for name, p in PRECISIONS.items() if p.runnable}


def _cell(rows: pd.DataFrame, i: int, column: str) -> float | None:
    if column not in rows.columns:
        return None
    value = rows[column].iloc[i]
    return float(value) if is_number(value) else None
