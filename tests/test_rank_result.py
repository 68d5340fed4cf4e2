"""A rank's typed record: what the worker writes to rank{R}.json reads back to the same record, and
its columns are what results.parquet holds; the precision table and the case's resolved fields."""

from __future__ import annotations

import json

import pytest
import torch

from fsdpbench.core.case import PRECISIONS, Case
from fsdpbench.core.precision import get_precision
from fsdpbench.core.schema import TRACKER_CATEGORIES
from fsdpbench.engine.rank_result import Harness, RankResult, Setup
from fsdpbench.metrics.timing import StepTimes
from fsdpbench.metrics.tracker import TrackedMemory


def _finished_rank() -> RankResult:
    return RankResult(
        rank=1,
        pid=42,
        status="ok",
        phase="done",
        setup=Setup(params=10, n_units=3, mode="real", threads=2, init_pg_s=0.5, setup_s=1.0, samplers={}),
        warmup=StepTimes(times_ms=[30.0, 20.0]),
        timed=StepTimes(times_ms=[10.0, 14.0, 12.0]),
        losses=[2.0, 1.5],
        memory=TrackedMemory(
            peak={"params": 400, "activations": 100, "total": 500},
            states_tracker={"params": 400, "grads": 400, "optim": 800},
            states_local={"params": 400, "grads": 400, "optim": 800},
        ),
        placement={"mem_placement_params_host_bytes": 0},
        profiled={"comm_pattern": "zero3"},
        sampled={"mem_rss_peak_bytes": 1 << 20},
        harness=Harness(bare_step_time_ms=11.0, leftovers=""),
        paired={"step_ms": [1.0], "ref_ms": [2.0], "step_cpu_ms": [3.0], "ref_cpu_ms": [4.0]},
        steps_total=7,
        steps_wall_s=0.2,
        wall_s=3.0,
    )


def test_a_rank_record_reads_back_from_its_json() -> None:
    result = _finished_rank()
    data = json.loads(json.dumps(result.to_json()))
    assert RankResult.from_json(data) == result
    assert data["first_step_ms"] == 30.0 and data["step_time_ms"] == 12.0  # what runner/launch/tests read
    assert data["memory"]["peak"]["total"] == 500 and data["profiled"]["comm_pattern"] == "zero3"
    assert data["harness"] == {"bare_step_time_ms": 11.0, "leftovers": ""} and "allocator" not in data


def test_a_rank_record_becomes_its_columns() -> None:
    data = {**_finished_rank().to_json(), "exit_code": 0}  # the launcher adds the exit code
    row = RankResult.from_json(data).to_columns()
    assert (row["rank"], row["status"], row["exit_code"]) == (1, "ok", 0)
    assert (row["params"], row["n_units"], row["threads"]) == (10, 3, 2)
    assert row["step_time_ms"] == 12.0 and row["first_step_ms"] == 30.0
    assert row["step_time_p10_ms"] == pytest.approx(10.4)
    assert row["step_times_ms"] == [10.0, 14.0, 12.0] and row["warmup_times_ms"] == [30.0, 20.0]
    assert row["paired_ref_cpu_ms"] == [4.0]
    assert row["mem_tracker_peak_bytes"] == 500 and row["mem_tracker_peak_activations_bytes"] == 100
    assert row["mem_tracker_peak_grads_bytes"] is None
    assert row["mem_tracker_model_states_bytes"] == 1600 and row["mem_local_optim_bytes"] == 800
    assert row["comm_pattern"] == "zero3" and row["steps_wall_s"] == 0.2
    assert row["mem_placement_params_host_bytes"] == 0 and row["mem_rss_peak_bytes"] == 1 << 20
    assert (row["bare_step_time_ms"], row["harness_leftovers"]) == (11.0, "")


def test_a_rank_that_never_wrote_has_every_column_empty() -> None:
    row = RankResult.missing(3).to_columns()
    assert (row["rank"], row["status"], row["phase"]) == (3, None, "start")
    assert row["params"] is None and row["step_time_ms"] is None and row["step_times_ms"] == []
    assert all(row[f"mem_tracker_peak_{c}_bytes"] is None for c in TRACKER_CATEGORIES)
    assert "mem_tracker_model_states_bytes" not in row


def test_precisions_carry_their_dtypes() -> None:
    assert PRECISIONS == ("fp32", "bf16", "fp16", "bf16-lowreduce", "fp16-lowreduce")
    assert not get_precision("fp32").casts and get_precision("fp32").torch_dtypes() == (
        torch.float32,
        torch.float32,
    )
    assert get_precision("bf16").torch_dtypes() == (torch.bfloat16, torch.float32)
    assert get_precision("fp16-lowreduce").torch_dtypes() == (torch.float16, torch.float16)
    assert get_precision("bf16-lowreduce").reduces_low and not get_precision("bf16").reduces_low
    assert Case(precision="fp16").precision_spec is get_precision("fp16")
    with pytest.raises(KeyError, match="fp8"):
        _ = Case(precision="fp8").precision_spec


def test_the_hsdp_shard_group_defaults_to_two() -> None:
    assert Case(world_size=8).shard_group_size == 2
    assert Case(world_size=1).shard_group_size == 1
    assert Case(world_size=8, shard_size=4).shard_group_size == 4
