"""The per-case analyzer, the step-time reference rule and the schema they read (fsdpbench.analysis.frame)."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from fsdpbench.analysis.frame import (
    case_frame,
    case_step_times,
    rank_maxima,
    relative_error,
    speedups,
    time_references,
)
from fsdpbench.core.formatting import byte_unit, fmt_bytes, fmt_pct
from fsdpbench.core.schema import ERROR_COLUMNS, TRACKER_CATEGORIES, TRACKER_PEAK_COLUMNS, tracker_peak_column


def rank_row(case_id: str, rank: int, **kw) -> dict:
    row = dict(case_id=case_id, rank=rank, strategy="zero3", world_size=2, model="m", status="ok")
    return {**row, **kw}


RANK0 = dict(mem_rss_peak_bytes=9, pred_peak_bytes=90, comm_total_bytes=10.0, step_time_ms=5.0)
RANK1 = dict(mem_rss_peak_bytes=7, pred_peak_bytes=132, comm_total_bytes=20.0, step_time_ms=7.0)
VENDOR = dict(mem_tracker_model_states_bytes=100, ds_est_model_states_bytes=110)


def test_case_frame_takes_categories_from_the_largest_rank_and_other_memory_as_the_maximum():
    rows = pd.DataFrame(
        [
            rank_row("a", 0, mem_tracker_peak_bytes=100, mem_tracker_peak_params_bytes=60, **RANK0),
            rank_row("a", 1, mem_tracker_peak_bytes=120, mem_tracker_peak_params_bytes=50, **RANK1, **VENDOR),
        ]
    )
    (case,) = case_frame(rows).to_dict("records")
    assert (
        case["peak_rank"] == 1 and case["mem_tracker_peak_params_bytes"] == 50
    )  # the peak rank's categories
    assert case["mem_rss_peak_bytes"] == 9  # other memory: the largest over ranks
    assert case["comm_total_bytes"] == 15.0  # communication: the mean over ranks
    assert case["pred_peak_bytes"] == 132 and case["pred_peak_err"] == pytest.approx(0.1)  # the peak rank's
    assert case["ds_est_model_states_bytes"] == 110 and case["ds_est_model_states_err"] == pytest.approx(0.1)
    assert case["step_time_ms"] == 7.0 and case["slowest_rank"] == 1
    assert case["status"] == "ok" and case["n_ranks_reported"] == 2
    assert rank_maxima(rows, ["mem_tracker_peak_params_bytes", "absent"]).loc["a"].to_dict() == {
        "mem_tracker_peak_params_bytes": 60
    }


def test_case_frame_status_and_error_fall_back_to_the_ranks():
    rows = pd.DataFrame([rank_row("a", 0, status="failed", error="boom"), rank_row("a", 1, error="")])
    (case,) = case_frame(rows).to_dict("records")
    assert case["status"] == "failed" and case["error"] == "boom"
    named = rows.assign(case_status="oom", case_error="out of memory")
    assert case_frame(named).iloc[0][["status", "error"]].tolist() == ["oom", "out of memory"]


def cases(*specs: tuple[str, str, float | None], **config) -> pd.DataFrame:
    """A case frame: (case_id, strategy, step time) per case, with the same configuration."""
    rows = [
        dict(case_id=c, strategy=s, status="ok", step_time_ms=t, world_size=2, **config) for c, s, t in specs
    ]
    return pd.DataFrame(rows)


def test_time_reference_is_the_peer_case_of_the_reference_strategy():
    frame = cases(("z", "zero3", 30.0), ("d2", "ddp", 10.0), ("d1", "ddp", 20.0), ("u", "zero2", None))
    frame.loc[4] = dict(case_id="x", strategy="zero3", status="ok", step_time_ms=5.0, world_size=4)
    refs = time_references(frame)
    # the last ddp case by id (d2), never a case's own; untimed and lonely cases have none
    assert refs.tolist() == [1, None, 1, None, None]
    assert speedups(frame).round(3).tolist()[:3] == [0.333, pytest.approx(float("nan"), nan_ok=True), 0.5]


def test_time_reference_may_be_a_named_case():
    frame = cases(("z", "zero3", 30.0), ("calib", "ddp", 10.0), ("d", "ddp", 20.0))
    assert time_references(frame, "calib").tolist() == [1, None, 1]


def test_case_step_time_prefers_the_recorded_one():
    frame = pd.DataFrame({"case_step_time_ms": [1.0, None], "step_time_ms": [2.0, 3.0]})
    assert case_step_times(frame).tolist() == [1.0, 3.0]


def test_relative_error_and_formatting():
    assert relative_error(110, 100) == pytest.approx(0.1)
    assert relative_error(None, 100) is None and relative_error(1, 0) is None
    assert relative_error(float("nan"), 100) is None and relative_error(1, "x") is None
    assert fmt_bytes(512) == "512 B" and fmt_bytes(3 * 2**20) == "3.00 MiB" and fmt_bytes(None) == "—"
    assert fmt_pct(0.015) == "+1.5%" and fmt_pct(float("nan")) == "—"
    assert fmt_pct(-1e-9) == fmt_pct(0.0) == fmt_pct(4e-4) == "0.0%" and fmt_pct(-0.0006) == "-0.1%"
    assert byte_unit([3 * 2**30]) == ("GiB", 2.0**30) and byte_unit([]) == ("KiB", 1024.0)


def test_every_tracker_category_is_named_once_in_the_schema():
    from analysis.check_model import MEASURED_GROUPS
    from fsdpbench.metrics.tracker import CATEGORY_NAMES
    from fsdpbench.predictors.memory_model.columns import TRACKER_FILING

    assert len(set(TRACKER_CATEGORIES)) == len(TRACKER_CATEGORIES) == 12
    assert set(CATEGORY_NAMES.values()) == set(TRACKER_CATEGORIES)
    assert set(TRACKER_FILING) == set(TRACKER_CATEGORIES)
    assert {c for cats in MEASURED_GROUPS.values() for c in cats} <= set(TRACKER_CATEGORIES)
    assert TRACKER_PEAK_COLUMNS[1:] == tuple(tracker_peak_column(c) for c in TRACKER_CATEGORIES)
    assert all(pred.startswith(("pred_", "traced_", "ds_est_")) for pred, _ in ERROR_COLUMNS.values())


def test_the_analysis_side_is_torch_free():
    code = (
        "import sys, fsdpbench.core.schema, fsdpbench.analysis.frame, fsdpbench.core.formatting, "
        "fsdpbench.analysis.summary, "
        "fsdpbench.analysis.regress; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
