"""algbw/busbw per collective kind by nccl-tests' conventions, on synthetic traces with exact answers."""

from __future__ import annotations

import pytest

from fsdpbench.metrics.bandwidth import bandwidth_by_kind, bus_factor
from fsdpbench.metrics.comm import collective_records
from tests.helpers import trace_event
from tests.test_comm import gloo_trace, nccl_trace


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == 7 / 8
    assert bus_factor("broadcast", 8) == 1.0  # the busiest link carries S (not the per-rank mean)
    assert bus_factor("all_reduce", 1) is None and bus_factor("other", 8) is None


def test_nccl_rates_come_from_the_kernels():
    trace = nccl_trace()
    trace["traceEvents"] += [  # one kernel per collective; the kind from its args or else its name
        trace_event("ncclDevKernel_AllGather_RING_LL", 15, 4, tid=7, cat="kernel"),
        trace_event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 25, 8, tid=8, cat="kernel"),
        trace_event("ncclDevKernel_Broadcast_RING_LL", 35, 2, tid=7, cat="kernel"),
    ]
    got = bandwidth_by_kind(collective_records(trace), trace, backend="nccl", steps=2)
    # all-reduce: S = 4000 B in the 50 µs kernel → 0.08 GB/s; busbw ×2·3/4
    assert got["comm_all_reduce_time_ms"] == pytest.approx(50e-3 / 2)
    assert got["comm_all_reduce_algbw_gbs"] == pytest.approx(4000 / 50e-6 / 1e9)
    assert got["comm_all_reduce_busbw_gbs"] == pytest.approx(4000 / 50e-6 / 1e9 * 1.5)
    # all-gather: S = 1000 bf16 = 2000 B in 4 µs; reduce-scatter: 4000 B in 8 µs; (N-1)/N = 3/4
    assert got["comm_all_gather_algbw_gbs"] == pytest.approx(2000 / 4e-6 / 1e9)
    assert got["comm_all_gather_busbw_gbs"] == pytest.approx(2000 / 4e-6 / 1e9 * 0.75)
    assert got["comm_reduce_scatter_busbw_gbs"] == pytest.approx(4000 / 8e-6 / 1e9 * 0.75)
    # broadcast: 128 B in 2 µs, busbw = algbw
    assert (
        got["comm_broadcast_busbw_gbs"] == got["comm_broadcast_algbw_gbs"] == pytest.approx(128 / 2e-6 / 1e9)
    )


def test_gloo_rates_come_from_the_gloo_work_each_call_ran():
    trace = gloo_trace()
    got = bandwidth_by_kind(collective_records(trace), trace, backend="gloo")
    # DDP's all-reduce: 16640 fp32 in its 2000 µs gloo:all_reduce
    assert got["comm_all_reduce_algbw_gbs"] == pytest.approx(16640 * 4 / 2000e-6 / 1e9)
    assert got["comm_all_reduce_busbw_gbs"] == pytest.approx(16640 * 4 / 2000e-6 / 1e9 * 1.0)  # 2(N-1)/N = 1
    # all-gathers: 2 × 4160 fp32 + 4160 doubles in 3 × 50 µs
    assert got["comm_all_gather_time_ms"] == pytest.approx(0.150)
    assert got["comm_all_gather_algbw_gbs"] == pytest.approx((2 * 4160 * 4 + 4160 * 8) / 150e-6 / 1e9)
    # the reduce-scatter's time is the full all-reduce gloo ran for it; busbw by the reduce-scatter rule
    assert got["comm_reduce_scatter_busbw_gbs"] == pytest.approx(4160 * 2 / 50e-6 / 1e9 * 0.5)


def test_one_rank_has_no_bandwidth():
    trace = gloo_trace(world_size=1)
    records = [r for r in collective_records(trace) if r.kind == "all_reduce"]
    assert records and all(r.group_size == 1 for r in records)
    assert not any(k.startswith("comm_all_reduce") for k in bandwidth_by_kind(records, trace, backend="gloo"))
