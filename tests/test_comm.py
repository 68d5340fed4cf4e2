"""Communication volume: synthetic traces with exact answers, the analytic model, and a real gloo run."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

from fsdpbench.metrics.comm import (
    KINDS,
    analytic_comm_bytes,
    collective_records,
    collectives_from_trace,
    sent_bytes_per_rank,
)
from fsdpbench.metrics.overlap import analyze_trace
from fsdpbench.pipeline.launch import free_port
from fsdpbench.strategies import get_strategy
from fsdpbench.strategies.base import Sharding
from tests.helpers import trace_event


def by_kind(frame):
    return {row.kind: row for row in frame.itertuples()}


def gloo_trace(world_size=2):
    """What torch 2.13 records for DDP + ZeRO + FSDP2 collectives on gloo (shapes from a real run)."""
    tl = ["TensorList", "", "", "", "Scalar", "Scalar"]
    events = [
        # DDP bucket all-reduce; the dtype is only on the gloo:* event
        trace_event("c10d::allreduce_", 0, 30, dims=[[[16640]], [], [], [], [], []], types=tl),
        trace_event(
            "gloo:all_reduce", 5, 2000, tid=2, cat="user_annotation", dims=[[16640]], types=["float"]
        ),
        # ZeRO broadcasts of fp16 params: 2 × (64×64) + 2 × 64
        *[
            trace_event(
                "c10d::broadcast_",
                3000 + 10 * i,
                5,
                dims=[[shape], [], [], [], [], []],
                types=["TensorList", "", "Scalar", "Scalar", "Scalar", "Scalar"],
            )
            for i, shape in enumerate([[64, 64], [64], [64, 64], [64]])
        ],
        *[
            trace_event(
                "gloo:broadcast",
                3001 + 10 * i,
                8,
                tid=2 + i % 2,
                cat="user_annotation",
                dims=[shape],
                types=["c10::Half"],
            )
            for i, shape in enumerate([[64, 64], [64], [64, 64], [64]])
        ],
        # FSDP2: all-gather (output 4160, input 2080) twice, reduce-scatter once (bf16)
        trace_event(
            "c10d::_allgather_base_",
            4000,
            10,
            dims=[[4160], [2080], [], [], []],
            types=["float", "float", "", "Scalar", "Scalar"],
        ),
        trace_event(
            "c10d::_allgather_base_",
            4100,
            10,
            dims=[[4160], [2080], [], [], []],
            types=["float", "float", "", "Scalar", "Scalar"],
        ),
        trace_event(
            "gloo:all_gather", 4001, 50, tid=2, cat="user_annotation", dims=[[2080]], types=["float"]
        ),
        trace_event(
            "gloo:all_gather", 4101, 50, tid=3, cat="user_annotation", dims=[[2080]], types=["float"]
        ),
        trace_event(
            "c10d::_reduce_scatter_base_",
            4200,
            10,
            dims=[[2080], [4160], [], [], [], []],
            types=["c10::BFloat16", "c10::BFloat16", "", "", "Scalar", "Scalar"],
        ),
        trace_event(
            "gloo:all_reduce", 4201, 50, tid=2, cat="user_annotation", dims=[[4160]], types=["c10::BFloat16"]
        ),
        # FSDP1 on gloo: list all-gather, output not recorded
        trace_event(
            "c10d::allgather_",
            5000,
            10,
            dims=[[], [[2080]], [], [], []],
            types=["", "TensorList", "", "Scalar", "Scalar"],
        ),
        trace_event(
            "gloo:all_gather", 5001, 50, tid=2, cat="user_annotation", dims=[[2080]], types=["double"]
        ),
        trace_event(
            "c10d::barrier",
            6000,
            10,
            dims=[[1], [], [], [], []],
            types=["unsigned char", "", "ScalarList", "Scalar", "Scalar"],
        ),
        trace_event("gloo:barrier", 6001, 5, tid=3, cat="user_annotation"),
        trace_event("aten::mm", 7000, 10),  # not a collective
    ]
    return {
        "traceEvents": events,
        "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": world_size},
    }


def test_gloo_trace_exact_counts_and_bytes():
    got = by_kind(collectives_from_trace(gloo_trace()))
    assert list(collectives_from_trace(gloo_trace()).columns[:4]) == [
        "kind",
        "count",
        "payload_bytes",
        "sent_bytes",
    ]
    assert (got["all_reduce"].count, got["all_reduce"].payload_bytes) == (1, 16640 * 4)
    assert got["all_reduce"].sent_bytes == 16640 * 4  # 2(N-1)/N = 1 at N=2
    assert got["broadcast"].count == 4
    assert got["broadcast"].payload_bytes == (2 * 4096 + 2 * 64) * 2  # fp16 from gloo:broadcast
    assert got["broadcast"].sent_bytes == (2 * 4096 + 2 * 64)
    # 2 × fp32 _allgather_base_ of 4160 + 1 × list all_gather of 2 × 2080 doubles
    assert got["all_gather"].count == 3
    assert got["all_gather"].payload_bytes == 2 * 4160 * 4 + 4160 * 8
    assert got["all_gather"].sent_bytes == (2 * 4160 * 4 + 4160 * 8) / 2
    assert got["reduce_scatter"].count == 1 and got["reduce_scatter"].payload_bytes == 4160 * 2
    assert got["reduce_scatter"].sent_bytes == 4160
    # gloo runs the reduce-scatter as an all-reduce of the full input
    assert got["reduce_scatter"].backend_sent_bytes == 2 * 4160
    assert (got["other"].count, got["other"].payload_bytes) == (1, 0)


def test_steps_divides_and_group_size_override():
    two = by_kind(collectives_from_trace(gloo_trace(), steps=2))
    assert two["all_gather"].count == 1.5 and two["all_reduce"].sent_bytes == 16640 * 4 / 2
    # N=4 for the ops whose dims do not say it (all-reduce, broadcast, list all-gather) ...
    four = by_kind(collectives_from_trace(gloo_trace(), group_size=4))
    assert four["all_reduce"].sent_bytes == 2 * 3 / 4 * 16640 * 4
    # ... while _allgather_base_'s dims still say N=2: 2 × 4160 fp32 + 4 × 2080 doubles
    assert four["all_gather"].payload_bytes == 2 * 4160 * 4 + 4 * 2080 * 8
    assert four["all_gather"].sent_bytes == 2 * 4160 * 4 / 2 + 3 / 4 * 4 * 2080 * 8


def test_group_size_from_dims():
    trace = {
        "traceEvents": [
            trace_event("c10d::_allgather_base_", 0, 1, dims=[[400], [100]], types=["float", "float"]),
            trace_event("c10d::_reduce_scatter_base_", 10, 1, dims=[[100], [800]], types=["float", "float"]),
        ],
        "distributedInfo": {"world_size": 2},
    }
    records = collective_records(trace)
    assert [(r.kind, r.group_size, r.payload_bytes) for r in records] == [
        ("all_gather", 4, 1600),
        ("reduce_scatter", 8, 3200),
    ]
    assert records[0].sent_bytes == 1200 and records[1].sent_bytes == 2800


def test_nested_c10d_op_counted_once():
    trace = {
        "traceEvents": [
            trace_event("c10d::allreduce_coalesced_", 0, 100, dims=[[[10], [20]]], types=["TensorList"]),
            trace_event("c10d::allreduce_", 10, 5, dims=[[[10]]], types=["TensorList"]),
            trace_event(
                "gloo:all_reduce",
                11,
                5,
                tid=2,
                cat="user_annotation",
                dims=[[10], [20]],
                types=["double", "double"],
            ),
        ],
        "distributedInfo": {"world_size": 2},
    }
    (record,) = collective_records(trace)
    assert record.name == "c10d::allreduce_coalesced_" and record.payload_bytes == 30 * 8


def test_trace_without_shapes_is_an_error():
    trace = {"traceEvents": [trace_event("c10d::allreduce_", 0, 5)], "distributedInfo": {"world_size": 2}}
    with pytest.raises(ValueError, match="record_shapes=True"):
        collectives_from_trace(trace)


def nccl_trace():
    """record_param_comms as ProcessGroupNCCL writes them; the kernel carries a copy of the args."""

    def rpc(ts, coll, n_in, n_out, dtype, group):
        return trace_event(
            "record_param_comms",
            ts,
            5,
            **{
                "Collective name": coll,
                "dtype": dtype,
                "In msg nelems": n_in,
                "Out msg nelems": n_out,
                "Group size": group,
                "Process Group Name": "0",
            },
        )

    events = [
        rpc(0, "allreduce", 1000, 1000, "Float", 4),
        rpc(10, "_allgather_base", 250, 1000, "BFloat16", 4),
        rpc(20, "_reduce_scatter_base", 1000, 250, "Float", 4),
        rpc(30, "broadcast", 64, 64, "Half", 4),
        rpc(40, "wait", 0, 0, "Float", 4),
        trace_event(
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
            5,
            50,
            tid=7,
            cat="kernel",
            **{
                "Collective name": "allreduce",
                "dtype": "Float",
                "In msg nelems": 1000,
                "Out msg nelems": 1000,
                "Group size": 4,
            },
        ),
        trace_event("c10d::allreduce_", 0, 8, dims=[[[1000]]], types=["TensorList"]),  # ignored here
    ]
    return {"traceEvents": events, "distributedInfo": {"backend": "nccl", "world_size": 4}}


def test_nccl_trace_exact():
    got = by_kind(collectives_from_trace(nccl_trace()))
    assert got["all_reduce"].count == 1 and got["all_reduce"].sent_bytes == 2 * 3 / 4 * 4000
    assert got["all_gather"].payload_bytes == 2000 and got["all_gather"].sent_bytes == 1500
    assert got["reduce_scatter"].payload_bytes == 4000 and got["reduce_scatter"].sent_bytes == 3000
    assert got["reduce_scatter"].backend_sent_bytes == 3000  # NCCL has a real reduce-scatter
    assert got["broadcast"].payload_bytes == 128 and got["broadcast"].sent_bytes == 96
    assert got["other"].count == 0  # "wait" is not a collective


def test_sent_bytes_convention():
    assert sent_bytes_per_rank("all_reduce", 800, 8) == 1400
    assert sent_bytes_per_rank("all_gather", 800, 8) == 700
    assert sent_bytes_per_rank("reduce_scatter", 800, 8) == 700
    assert sent_bytes_per_rank("broadcast", 800, 8) == 700
    assert sent_bytes_per_rank("all_reduce", 800, 1) == 0


def _sharding(strategy: str) -> Sharding:
    return get_strategy(strategy).sharding


def test_analytic_comm_bytes():
    p, n = 1000, 4
    assert analytic_comm_bytes(_sharding("ddp"), p, n) == {**dict.fromkeys(KINDS, 0.0), "all_reduce": 1500.0}
    zero1 = analytic_comm_bytes(_sharding("zero1"), p, n)
    assert (zero1["all_reduce"], zero1["broadcast"]) == (1500.0, 750.0)
    zero2 = analytic_comm_bytes(_sharding("zero2"), p, n)
    assert (zero2["all_gather"], zero2["reduce_scatter"]) == (750.0, 750.0)
    zero3 = analytic_comm_bytes(_sharding("zero3"), p, n)
    assert (zero3["all_gather"], zero3["reduce_scatter"]) == (1500.0, 750.0)
    assert sum(zero3.values()) == 1.5 * sum(analytic_comm_bytes(_sharding("ddp"), p, n).values())
    mixed = analytic_comm_bytes(_sharding("zero3"), 500, n, grad_bytes_total=1000)  # bf16 params, fp32 grads
    assert (mixed["all_gather"], mixed["reduce_scatter"]) == (750.0, 750.0)
    hsdp = analytic_comm_bytes(_sharding("hsdp"), 1000, 8, shard_size=4)
    assert (hsdp["all_gather"], hsdp["reduce_scatter"], hsdp["all_reduce"]) == (1500.0, 750.0, 250.0)
    with pytest.raises(ValueError, match="shard_size"):
        analytic_comm_bytes(_sharding("hsdp"), p, 8, shard_size=3)


def test_a_sharding_declares_only_collectives_it_can_run():
    with pytest.raises(ValueError, match="grad_reduction must be one of"):
        Sharding(params=False, grads=False, optim=False, grad_reduction="all_to_all")


def test_the_comm_pattern_label_is_derived_from_the_declaration():
    expected = {
        "ddp": "ddp",
        "zero1": "zero1",
        "zero2": "zero2",
        "zero3": "zero3",
        "hsdp": "hsdp",
        "fsdp1_full": "zero3",
        "fsdp1_grad_op": "zero2",
        "fsdp1_no_shard": "ddp",
        "fsdp1_hybrid": "hsdp",
        "ds_zero1": "zero1",
        "ds_zero2": "zero1",
        "ds_zero3": "zero3",
    }
    assert {name: _sharding(name).comm_pattern() for name in expected} == expected


# -- a real 2-rank gloo run --------------------------------------------------------------
WORLD_SIZE = 2
LAYERS, WIDTH = 4, 64  # 4 × (64·64 + 64) = 16640 fp32 parameters, divisible by 2: no padding
STRATEGIES = ("ddp", "zero1", "zero3")  # zero3 = FSDP2 fully_shard per layer + root


def _profile_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Per rank: DDP, ZeRO-1 (DDP + ZeroRedundancyOptimizer), FSDP2; 2 warm-up steps, 1 profiled."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for strategy in STRATEGIES:
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
            if strategy in ("ddp", "zero1"):
                model = DistributedDataParallel(model)
            else:
                for layer in model:
                    fully_shard(layer)
                fully_shard(model)
            if strategy == "zero1":
                opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.01)
            else:
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
            batch = torch.randn(8, WIDTH)
            for _ in range(2):
                _train_step(model, opt, batch)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                _train_step(model, opt, batch)
            prof.export_chrome_trace(os.path.join(out_dir, f"{strategy}_rank{rank}.json"))
            # DDP's reducer and FSDP's hooks sit in reference cycles, holding the group: collected here, while
            # the group and the interpreter are alive, so the interpreter's teardown destroys nothing of the
            # group's (once, a rank aborted after its last profiled step: SIGABRT, "terminate called without
            # an active exception", which is what a C++ thread still joinable at its destruction does)
            del model, opt, prof
            gc.collect()
        dist.barrier()  # no rank tears the group down while a peer still has a collective in flight
    finally:
        dist.destroy_process_group()


def _train_step(model, opt, batch) -> None:
    model(batch).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.slow
def test_real_gloo_run_matches_analytic(tmp_path: Path):
    from torch.multiprocessing import start_processes

    from fsdpbench.pipeline.launch import forkserver_context

    forkserver_context()  # the ranks fork from fsdpbench's fork server, torch already imported in it
    args = (WORLD_SIZE, free_port(), str(tmp_path))
    start_processes(_profile_rank, args=args, nprocs=WORLD_SIZE, start_method="forkserver")
    param_bytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    assert param_bytes == 66560
    for strategy in STRATEGIES:
        expected = analytic_comm_bytes(_sharding(strategy), param_bytes, WORLD_SIZE)
        for rank in range(WORLD_SIZE):
            path = tmp_path / f"{strategy}_rank{rank}.json"
            frame = collectives_from_trace(json.loads(path.read_text()))
            measured = dict(zip(frame["kind"], frame["sent_bytes"]))
            for kind in KINDS:
                assert measured[kind] == pytest.approx(expected[kind], rel=0.02, abs=1.0), (
                    strategy,
                    rank,
                    kind,
                    measured,
                    expected,
                )
            counts = dict(zip(frame["kind"], frame["count"]))
            if strategy == "ddp":
                assert counts["all_reduce"] == 1  # one bucket
            elif strategy == "zero1":  # DDP's bucket + one broadcast per parameter tensor
                assert (counts["all_reduce"], counts["broadcast"]) == (1, 2 * LAYERS)
            else:  # per layer: all-gather in forward and in backward, one reduce-scatter
                assert (counts["all_gather"], counts["reduce_scatter"]) == (2 * LAYERS, LAYERS)
            overlap = analyze_trace(path)
            assert overlap["backend"] == "gloo" and overlap["comm_us"] > 0
            assert overlap["n_comm_intervals"] == sum(counts.values())  # one gloo:* per collective
            assert 0.0 <= overlap["overlap_ratio"] <= 1.0
