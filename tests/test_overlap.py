"""Overlap (HTA definition) on synthetic intervals and traces with known answers."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from fsdpbench.metrics.overlap import analyze_trace, classify_trace_events, overlap_stats
from fsdpbench.metrics.trace import Trace, intersection_length, merge_intervals, subtract_intervals
from tests.helpers import trace_event


def test_merge_sorts_joins_and_drops_empty():
    got = merge_intervals([(5, 7), (1, 3), (2, 4), (10, 10), (8, 6), (7, 9)])
    assert got == [(1.0, 4.0), (5.0, 9.0)]  # (7,9) touches (5,7); (10,10) and (8,6) are empty


def test_merge_nested():
    assert merge_intervals([(0, 100), (10, 20), (30, 40), (99, 100)]) == [(0.0, 100.0)]


def test_intersection_length_unsorted_and_overlapping():
    compute = [(8, 12), (3, 6), (2, 4)]  # merges to (2,6), (8,12)
    assert intersection_length([(0, 10)], compute) == 6.0
    assert intersection_length(compute, [(0, 10)]) == 6.0
    assert intersection_length([(0, 1)], [(1, 2)]) == 0.0
    # duplicated comm intervals (e.g. two streams) are counted once
    assert intersection_length([(0, 10), (0, 10), (5, 15)], [(12, 20)]) == 3.0


def test_subtract():
    assert subtract_intervals([(0, 10), (20, 30)], [(2, 4), (8, 22), (29, 40)]) == [
        (0.0, 2.0),
        (4.0, 8.0),
        (22.0, 29.0),
    ]


def test_overlap_stats_exact():
    stats = overlap_stats(comm=[(20, 30), (0, 10)], compute=[(5, 25)])
    assert stats == {
        "comm_us": 20.0,
        "compute_us": 20.0,
        "overlap_us": 10.0,
        "exposed_comm_us": 10.0,
        "overlap_ratio": 0.5,
        "note": "",
    }


def test_overlap_stats_fully_hidden_and_fully_exposed():
    assert overlap_stats([(2, 4)], [(0, 10)])["overlap_ratio"] == 1.0
    exposed = overlap_stats([(0, 4)], [(4, 10)])
    assert exposed["overlap_ratio"] == 0.0 and exposed["exposed_comm_us"] == 4.0


def test_no_comm_gives_zero_ratio_and_says_so():
    stats = overlap_stats([], [(0, 10)])
    assert stats["overlap_ratio"] == 0.0 and not math.isnan(stats["overlap_ratio"])
    assert stats["comm_us"] == 0.0 and "no communication" in stats["note"]


def gpu_trace():
    """Compute kernels on stream 7, NCCL kernels on stream 20, plus events that must be ignored."""
    events = [
        trace_event("sm90_xmma_gemm_bf16", 0, 100, 7, cat="kernel", pid=0),
        trace_event("elementwise_kernel", 100, 100, 7, cat="kernel", pid=0),
        trace_event("sm90_xmma_gemm_bf16", 300, 100, 7, cat="kernel", pid=0),
        trace_event(
            "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
            50,
            100,
            20,
            cat="kernel",
            pid=0,
        ),
        trace_event("ncclKernel_ReduceScatter_RING_LL_Sum_bfloat16", 350, 100, 20, cat="kernel", pid=0),
        trace_event("Memcpy DtoD (Device -> Device)", 150, 200, 21, cat="gpu_memcpy", pid=0),
        trace_event("nccl:all_gather", 40, 500, 1, cat="cpu_op"),  # CPU side: not a kernel
        trace_event("aten::mm", 0, 1000, 1, cat="cpu_op"),
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 20, "args": {"name": "stream 20"}},
    ]
    return {"traceEvents": events, "distributedInfo": {"backend": "nccl", "rank": 3}}


def test_gpu_trace_known_ratio():
    comm, compute = classify_trace_events(gpu_trace(), "nccl")
    assert sorted(comm) == [(50.0, 150.0), (350.0, 450.0)]
    assert len(compute) == 3
    stats = overlap_stats(comm, compute)
    # comm 200 us; overlapped: [50,150] fully (compute 0-200), [350,400] -> 150
    assert (stats["comm_us"], stats["compute_us"], stats["overlap_us"]) == (200.0, 300.0, 150.0)
    assert stats["overlap_ratio"] == 0.75 and stats["exposed_comm_us"] == 50.0


def cpu_trace():
    """Main thread 100, gloo worker threads 201/202, as torch 2.13 records them for gloo."""
    events = [
        # wrapper: the blocking wait happens inside it, so it must not count as compute
        trace_event("autograd::engine::evaluate_function: AddmmBackward0", 0, 400, 100),
        trace_event("aten::addmm", 0, 100, 100, **{"Input Dims": [[64], [8, 64], [64, 64]]}),
        trace_event("aten::mm", 10, 40, 100),  # nested in addmm
        trace_event(
            "c10d::allreduce_",
            100,
            10,
            100,
            **{
                "Input Dims": [[[16640]], [], [], [], [], []],
                "Input type": ["TensorList", "", "", "", "Scalar", "Scalar"],
            },
        ),
        trace_event("aten::clone", 102, 6, 100),  # gloo's staging copy inside the c10d op: not compute
        trace_event("aten::mm", 150, 100, 100),
        trace_event("FSDP::post_backward_reduce (1)", 90, 300, 100, cat="user_annotation"),
        trace_event(
            "gloo:all_reduce",
            100,
            100,
            201,
            cat="user_annotation",
            **{"Input Dims": [[16640]], "Input type": ["float"]},
        ),
        trace_event("aten::copy_", 110, 10, 201),  # work on the gloo thread is communication
        trace_event("gloo:all_gather", 300, 50, 202, cat="user_annotation"),
        trace_event("aten::view", 305, 1, 202),
        {
            "ph": "M",
            "name": "thread_name",
            "pid": 1,
            "tid": 201,
            "args": {"name": "thread 201 (pt_gloo_runloop)"},
        },
    ]
    return {"traceEvents": events, "distributedInfo": {"backend": "gloo", "rank": 1, "world_size": 2}}


def test_cpu_trace_classification():
    comm, compute = classify_trace_events(cpu_trace(), "gloo")
    assert merge_intervals(comm) == [(100.0, 200.0), (300.0, 350.0)]
    assert merge_intervals(compute) == [(0.0, 100.0), (150.0, 250.0)]
    stats = overlap_stats(comm, compute)
    assert stats["comm_us"] == 150.0 and stats["compute_us"] == 200.0
    assert stats["overlap_us"] == 50.0  # [150, 200]; the clone at 102-108 is excluded
    assert stats["overlap_ratio"] == 50.0 / 150.0 and stats["exposed_comm_us"] == 100.0


def test_analyze_trace_json_and_gz_auto_backend(tmp_path):
    plain = tmp_path / "rank1.json"
    plain.write_text(json.dumps(cpu_trace()))
    packed = tmp_path / "rank3.json.gz"
    with gzip.open(packed, "wt") as f:
        json.dump(gpu_trace(), f)
    cpu = analyze_trace(plain)
    assert cpu["backend"] == "gloo" and cpu["rank"] == 1 and cpu["overlap_us"] == 50.0
    gpu = analyze_trace(packed)
    assert gpu["backend"] == "nccl" and gpu["rank"] == 3 and gpu["overlap_ratio"] == 0.75
    assert Trace.load(packed).info["rank"] == 3


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="allowed"):
        classify_trace_events({"traceEvents": []}, "mpi")


def test_a_trace_is_read_once_and_every_analysis_reads_the_same_object(tmp_path, monkeypatch):
    from fsdpbench.metrics import comm

    path = tmp_path / "rank1.json"
    path.write_text(json.dumps(cpu_trace()))
    trace = Trace.load(path)
    reads = []
    read_records = comm._read_records
    monkeypatch.setattr(comm, "_read_records", lambda *a: reads.append(a) or read_records(*a))
    frame = comm.collectives_from_trace(trace, group_size=2)
    records = comm.collective_records(trace, group_size=2)
    assert len(reads) == 1 and int(frame["count"].sum()) == len(records)  # the collectives read once
    # the overlap of the object is the overlap of the file
    assert analyze_trace(trace) == analyze_trace(path)
    assert trace.host_comm == [(100.0, 200.0), (300.0, 350.0)] and len(trace.host_ops) == 1
