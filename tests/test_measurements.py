"""What a run measures, checked against numbers computed independently from the model's shapes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from fsdpbench.models import build_model
from fsdpbench.pipeline.runner import run_cases
from fsdpbench.store.results import RunStore
from tests.helpers import made_once, tiny_case

pytestmark = pytest.mark.slow

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
WORLD_SIZES = (2, 4)


@pytest.fixture(scope="module")
@made_once
def results(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    cases = [tiny_case(strategy=s, world_size=n) for n in WORLD_SIZES for s in STRATEGIES]
    store = RunStore(tmp_path_factory.mktemp("measure") / "run")
    frame = run_cases(cases, [], store, {"env": {}})
    assert set(frame["status"]) == {"ok"}, frame.loc[frame.status != "ok", "error"].tolist()
    frame.attrs["run_dir"] = store.run_dir
    return frame


def _shapes() -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in build_model("decoder-tiny", device="meta").parameters()]


def _expected_states(strategy: str, world_size: int, rank: int) -> dict[str, int]:
    """fp32 AdamW: params 4 B/elem, grads 4, exp_avg + exp_avg_sq 8, plus a 4-byte fp32 `step` per tensor."""
    shapes = _shapes()
    numel = [int(pd.Series(s).prod()) for s in shapes]
    full = sum(numel)
    if strategy in ("zero2", "zero3"):
        # FSDP2 shards dim-0 (every dim-0 of decoder-tiny divides 2 and 4: no padding)
        assert all(s[0] % world_size == 0 for s in shapes)
        local = full // world_size
        return {"params": 4 * local, "grads": 4 * local, "optim": 8 * local + 4 * len(shapes)}
    if strategy == "ddp":
        return {"params": 4 * full, "grads": 4 * full, "optim": 8 * full + 4 * len(shapes)}
    return {"params": 4 * full, "grads": 4 * full, "optim": None}  # zero1: whole tensors per rank


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_state_bytes_are_exact(results: pd.DataFrame, strategy: str, world_size: int) -> None:
    rows = results[(results.strategy == strategy) & (results.world_size == world_size)]
    assert sorted(rows["rank"]) == list(range(world_size))
    for row in rows.itertuples():
        expected = _expected_states(strategy, world_size, row.rank)
        for cat in ("params", "grads", "optim"):
            tracker = getattr(row, f"mem_tracker_states_{cat}_bytes")
            local = getattr(row, f"mem_local_{cat}_bytes")
            assert tracker == local, (cat, row.rank)  # the tracker sees exactly the local tensors
            if expected[cat] is not None:
                assert tracker == expected[cat], (cat, row.rank)
    if strategy == "zero1":
        # ZeroRedundancyOptimizer hands whole tensors to ranks: the optimizer state of all ranks
        # together is exactly DDP's, each rank holding a part of it
        ddp_optim = _expected_states("ddp", world_size, 0)["optim"]
        assert rows["mem_tracker_states_optim_bytes"].sum() == ddp_optim
        assert (rows["mem_tracker_states_optim_bytes"] < ddp_optim).all()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_zero3_model_states_are_one_nth_of_ddp(results: pd.DataFrame, world_size: int) -> None:
    at = results[results.world_size == world_size]
    ddp = at.loc[at.strategy == "ddp", "mem_tracker_model_states_bytes"].max()
    zero3 = at.loc[at.strategy == "zero3", "mem_tracker_model_states_bytes"]
    # the only difference from 1/N: each rank keeps a whole fp32 `step` scalar per tensor
    assert (abs(zero3 - ddp / world_size) <= 0.01 * ddp / world_size).all()


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_collective_bytes_match_the_analytic_volume(
    results: pd.DataFrame, strategy: str, world_size: int
) -> None:
    rows = results[(results.strategy == strategy) & (results.world_size == world_size)]
    for row in rows.itertuples():
        assert row.comm_total_bytes == pytest.approx(row.comm_pred_total_bytes, rel=0.02)
    params_bytes = 4 * sum(int(pd.Series(s).prod()) for s in _shapes())
    f = (world_size - 1) / world_size
    row = rows.iloc[0]
    if strategy == "ddp":
        assert row.comm_all_reduce_bytes == pytest.approx(2 * f * params_bytes, rel=0.02)
        assert row.comm_all_gather_count == 0
    else:  # all-gather in forward and again in backward, one reduce-scatter: 1.5x DDP
        assert row.comm_all_gather_bytes == pytest.approx(2 * f * params_bytes, rel=0.02)
        assert row.comm_reduce_scatter_bytes == pytest.approx(f * params_bytes, rel=0.02)
        assert row.comm_all_reduce_count == 0


def test_every_memory_figure_names_its_source_and_the_timeline_is_stored(results: pd.DataFrame) -> None:
    mem_cols = [c for c in results.columns if c.startswith("mem_")]
    assert mem_cols and all(
        c.split("_")[1] in ("tracker", "local", "alloc", "nvml", "rss", "placement") for c in mem_cols
    )
    assert (results["mem_rss_peak_bytes"] > 0).all()
    assert (results["mem_tracker_peak_bytes"] >= results["mem_tracker_model_states_bytes"] / 2).all()
    overlap = results["overlap_ratio"]
    assert ((overlap >= 0) & (overlap <= 1)).all()
    case = results.iloc[-1]
    timeline = pd.read_parquet(Path(results.attrs["run_dir"]) / "cases" / case.case_id / "timeline.parquet")
    assert set(timeline["rank"]) == set(range(case.world_size))
    assert {"setup", "warmup", "timed", "memory", "profile"} <= set(timeline["phase"])
    assert set(timeline["source"]) == {"rss"}  # CPU ranks: no NVML
    assert timeline.groupby("rank")["t_s"].is_monotonic_increasing.all()


def test_step_time_statistics_are_consistent(results: pd.DataFrame) -> None:
    for row in results.itertuples():
        times = sorted(row.step_times_ms)
        assert len(times) == row.timed_steps
        assert times[0] <= row.step_time_p10_ms <= row.step_time_ms <= row.step_time_p90_ms <= times[-1]
    slowest = results.groupby("case_id").agg(med=("step_time_ms", "max"), case=("case_step_time_ms", "first"))
    assert (slowest["med"] == slowest["case"]).all()
