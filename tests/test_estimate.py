"""The traced predictor: real strategy code on fake tensors and a fake process group, one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdpbench.core.case import Case
from fsdpbench.predictors.memory_model import predict_memory
from fsdpbench.predictors.memory_model.allocator import Free, Malloc
from fsdpbench.predictors.traced import estimate


@pytest.mark.parametrize(
    "strategy,world,rank,peak,states",
    [
        ("ddp", 2, 0, 6886236, 2757716),
        ("zero1", 2, 1, 6196528, 2068008),
        ("zero2", 2, 0, 6541532, 1378900),
        ("zero3", 4, 0, 5335068, 689492),
        ("hsdp", 4, 0, 5852124, 1378900),
    ],
)
def test_traced_equals_the_measured_run(strategy, world, rank, peak, states):
    """Golden numbers from `fsdpbench run scenarios/quickstart.yaml` (gloo, CPU, tracker), to the byte."""
    case = Case(
        model="decoder-tiny",
        strategy=strategy,
        world_size=world,
        shard_size=2 if strategy == "hsdp" else None,
    )
    est = estimate(case, rank=rank)
    assert (est.peak_bytes, est.model_states_bytes) == (peak, states)
    assert est.params == 172352
    assert not dist.is_initialized()  # the fake process group is torn down


def test_traced_sees_the_gloo_reduce_scatter_copy():
    """decoder-small on 2 ranks peaks at the root's reduce-scatter, where gloo reduces a copy of the input."""
    case = Case(model="decoder-small", strategy="zero3", world_size=2, batch_size=1, seq_len=16)
    assert estimate(case).peak_bytes == 63459748  # measured
    assert estimate(case.replace(backend="nccl")).peak_bytes < 63459748


def test_traced_agrees_with_the_analytic_model_on_uneven_shards():
    """World 3 and a 509-token vocabulary: FSDP pads dim 0; traced and analytic model states agree exactly."""
    case = Case(
        model="decoder",
        model_args={"d_model": 72, "n_heads": 4, "vocab": 509},
        strategy="zero3",
        world_size=3,
        batch_size=2,
        seq_len=16,
    )
    for rank in (0, 2):
        est, pred = estimate(case, rank=rank), predict_memory(case, rank=rank)
        assert est.model_states_bytes == pred.resting_states_bytes
        assert abs(est.peak_bytes - pred.peak_bytes) / est.peak_bytes < 0.01


def test_any_world_size_without_processes():
    """64 fake ranks in this process; nothing allocated (the model is built on meta / as fake tensors)."""
    case = Case(model="decoder-tiny", strategy="zero3", world_size=64)
    est = estimate(case, rank=63)
    assert est.model_states_bytes == predict_memory(case, rank=63).resting_states_bytes
    assert est.world_size == 64 and est.method == "traced"


def test_mixed_is_not_traceable():
    with pytest.raises(ValueError, match="accounting"):
        estimate(Case(model="decoder-tiny", strategy="zero3", world_size=2, precision="mixed"))


def test_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="outside"):
        estimate(Case(model="decoder-tiny", strategy="zero3", world_size=2), rank=2)


# FSDP2 and DDP strategies × precision, optimizer state, offload, checkpointing, CUDA rules
FIRST_STEP_CASES = [
    Case(
        model="decoder-tiny", strategy="zero3", world_size=4, precision="bf16", optimizer="adamw", prefetch=1
    ),
    Case(model="decoder-tiny", strategy="zero2", world_size=2, precision="fp16", optimizer="sgd-momentum"),
    Case(
        model="mlp",
        strategy="hsdp",
        world_size=4,
        shard_size=2,
        precision="bf16-lowreduce",
        optimizer="adadelta",
    ),
    Case(
        model="decoder-tiny", strategy="zero3", world_size=8, activation_checkpointing=True, cpu_offload=True
    ),
    Case(
        model="decoder-tiny", strategy="zero3", world_size=8, precision="bf16", device="cuda", backend="nccl"
    ),
    # DistributedDataParallel's: the optimizer's state on zero gradients, no forward or backward
    Case(
        model="llama3-tiny",
        strategy="ddp",
        world_size=4,
        batch_size=2,
        seq_len=64,
        precision="bf16",
        optimizer_impl="foreach",
        max_norm=1.0,
        device="cuda",
        backend="nccl",
    ),
    Case(model="decoder-tiny", strategy="zero1", world_size=4, optimizer="adamw"),
    Case(
        model="decoder-tiny", strategy="zero1", world_size=8, precision="bf16", device="cuda", backend="nccl"
    ),
    Case(  # torchtitan's recipe: foreach update, clipping, the op policy
        model="llama3-tiny",
        strategy="zero3",
        world_size=8,
        batch_size=2,
        seq_len=64,
        precision="bf16",
        activation_checkpointing="op",
        optimizer_impl="foreach",
        max_norm=1.0,
        device="cuda",
        backend="nccl",
    ),
]


FIRST_AND_AGAIN = """
import contextlib
from fsdpbench.core.case import Case
import fsdpbench.predictors.traced as traced
case = Case.from_dict({case!r})
first, again = (traced.estimate(case, record_stream=True) for _ in range(2))
traced._strided_shard_flag_checked_once = contextlib.nullcontext
plain = traced.estimate(case, record_stream=True)
print(first.peak_bytes, again.peak_bytes, first.alloc_stream == again.alloc_stream == plain.alloc_stream)
"""


def test_a_trace_is_the_same_whether_or_not_it_is_the_processs_first():
    """The shortened first step clips the gradients as a real first step does: otherwise the tracked
    step's clipping was the first on these parameters in the process and allocated what a later step
    does not (on this case the first trace of a process peaked at 3,563,520 B, every later one at
    1,674,240 B), and ``predict`` answers from the first trace of its process. With and without the
    _StridedShard scan made once per op, the same stream, event for event. A fresh process: this one's
    earlier traces would have warmed what the first trace meets."""
    import os
    import subprocess
    import sys

    case = FIRST_STEP_CASES[-1].replace(model_args={"n_layers": 3})
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    code = FIRST_AND_AGAIN.format(case=case.to_dict())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["1674240", "1674240", "True"]


@pytest.mark.parametrize("case", FIRST_STEP_CASES, ids=lambda c: c.case_id)
def test_the_traces_shortcuts_change_no_byte(case, monkeypatch):
    """What makes a trace fast changes no byte of what the tracked step sees, nor its allocation stream,
    on the last rank too (uneven shards): the first-step shortcut of FSDP2 and DDP (FSDP2's lazy init
    and the optimizer's state on zero gradients, no forward or backward), the lazy chunks
    (rank_chunks.py), the sharding propagation's _StridedShard scan made once per op, the tracker's
    quick device queries (tracker.quick_device_queries: FSDP2's and the module tracker's) and the
    collector's larger young generation."""
    import contextlib

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    import fsdpbench.metrics.tracker as tracker
    import fsdpbench.predictors.traced as traced

    assert issubclass(tracker.fsdp2_tracker_class(), FSDPMemTracker)
    assert tracker.fsdp2_tracker_class() is not FSDPMemTracker
    assert tracker.module_tracker_class() is not MemTracker

    def figures(rank: int) -> tuple:
        e = estimate(case, rank=rank, record_stream=True)
        stream = e.alloc_stream
        names: dict[str, int] = {}  # keys renamed in order of allocation: what the allocator sees
        events = [
            (names.setdefault(ev.key, len(names)), ev.nbytes, ev.stream, ev.category)
            if isinstance(ev, Malloc)
            else ("free", names.get(ev.key), ev.recorded_on)
            if isinstance(ev, Free)
            else ev.label
            for ev in (*stream.resident, *stream.lazy, *stream.step)
        ]
        return e.peak_bytes, e.peak_by_category, e.states_by_category, e.model_states_bytes, events

    for rank in (0, case.world_size - 1):
        shortcut = figures(rank)
        with monkeypatch.context() as without:
            without.setattr(traced, "FIRST_STEP_SHORTCUT", False)
            without.setattr(traced, "rank_chunks_only", contextlib.nullcontext)
            without.setattr(traced, "_strided_shard_flag_checked_once", contextlib.nullcontext)
            without.setattr(tracker, "fsdp2_tracker_class", lambda: FSDPMemTracker)
            without.setattr(tracker, "module_tracker_class", lambda: MemTracker)
            without.setattr(traced, "YOUNG_GENERATION_OBJECTS", 700)
            full = figures(rank)
        assert shortcut == full
        assert shortcut[0] > 0


def test_a_foreach_step_on_dtensors_counts_each_optimizer_state_once(monkeypatch):
    """ZeRO-3 with torch's foreach AdamW, traced: at the optimizer step the tracker holds the two moments
    of the rank's shards, and not the global-shape fake tensors DTensor's sharding propagation makes for
    each foreach op (tracker.blind_to_sharding_propagation). Torch 2.11 propagates every foreach op again
    under a fake mode; counted, they made the step's optimizer state 27 × the sharded parameters."""
    import fsdpbench.strategies.optim as optim

    monkeypatch.setattr(
        optim, "build_optimizer", lambda params, case: torch.optim.AdamW(params, lr=case.lr, foreach=True)
    )
    # a CUDA target: the step counters are host tensors there, so the state is the two moments alone
    case = Case(
        model="decoder-small",
        strategy="zero3",
        world_size=8,
        batch_size=1,
        seq_len=8,
        device="cuda",
        backend="nccl",
    )
    peak = estimate(case).peak_by_category
    assert peak["optim"] == 2 * peak["params"]  # exp_avg and exp_avg_sq, fp32 like the fp32 parameters


def test_the_tracker_skips_only_the_sharding_propagation():
    """The propagation's own tensors are not counted; the same op run as the rank's work is."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from fsdpbench.metrics.tracker import blind_to_sharding_propagation

    original = ShardingPropagator._propagate_tensor_meta_non_cached
    blind = blind_to_sharding_propagation(MemTracker)

    def fake_propagation(self, op_schema):
        return torch.empty(1024, 1024)  # what a propagation allocates to learn a shape

    with FakeTensorMode(), torch.no_grad():
        try:
            ShardingPropagator._propagate_tensor_meta_non_cached = fake_propagation
            tracker = blind()
            with tracker:
                assert ShardingPropagator._propagate_tensor_meta_non_cached is not fake_propagation
                kept = ShardingPropagator._propagate_tensor_meta_non_cached(None, None)
                counted = torch.empty(256, 1024)
                peak = max(tracker.get_tracker_snapshot("peak")[counted.device]["Total"], 0)
            assert ShardingPropagator._propagate_tensor_meta_non_cached is fake_propagation  # put back
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = original
    assert kept.numel() == 1024 * 1024
    assert peak == 256 * 1024 * 4
