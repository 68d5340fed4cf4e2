"""DDP's gradient buckets in a traced allocation stream: once. On fake tensors the reducer cannot rebuild
its buckets, so the trace keeps the one bucket DDP was built with and the tracker counts it from
backward's first write; the allocator holds the rebuilt buckets from before the step instead, as a run
does from its second step. The stream carries the one bucket as the tracker's sighting only; a replay
skips it. Counted twice, DDP's and ZeRO-1's allocated peak came out one fp32 copy of the parameters high
wherever the peak falls after backward began, and contradicted the analytic model."""

from __future__ import annotations

import pytest

from fsdpbench.core.case import Case
from fsdpbench.predictors.consistency import disagreements, layer_figures
from fsdpbench.predictors.memory_model.alloc_stream import (
    DDP_BUCKET,
    UNREBUILT_BUCKET,
    CudaRuntime,
)
from fsdpbench.predictors.memory_model.allocator import Malloc
from fsdpbench.predictors.traced import estimate

# two llama-7b blocks, a short sequence: the peak is the optimizer step, after backward wrote the buckets
CASE = dict(
    model="llama-7b",
    model_args={"n_layers": 2},
    world_size=8,
    precision="fp32",
    batch_size=1,
    seq_len=64,
    device="cuda",
    backend="nccl",
)


def test_the_traced_bucket_is_the_trackers_and_the_rebuilt_ones_the_allocators():
    stream = estimate(Case(strategy="ddp", **CASE), record_stream=True).alloc_stream
    traced = [e for e in stream.step if isinstance(e, Malloc) and e.category == UNREBUILT_BUCKET]
    rebuilt = [m for m in stream.resident if m.category == DDP_BUCKET]
    params_bytes = 4 * (2 * 32000 * 4096 + 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096)
    assert [m.nbytes for m in traced] == [params_bytes]  # one bucket of every parameter, fp32
    assert sum(m.nbytes for m in rebuilt) == params_bytes and len(rebuilt) > 1  # 25 MiB caps
    replayed = {ev.key.split(":", 1)[-1] for ev in stream.run_events(CudaRuntime()) if isinstance(ev, Malloc)}
    assert traced[0].key not in replayed and all(m.key in replayed for m in rebuilt)


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_replicated_layers_agree_with_the_analytic_model(monkeypatch, strategy):
    import fsdpbench.predictors.traced_stream as traced_stream

    case = Case(strategy=strategy, **CASE)
    analytic = layer_figures(case, "analytic")
    assert disagreements(analytic, layer_figures(case, "traced")) == []
    # the stream as it was: the traced bucket allocated on top of the rebuilt ones
    monkeypatch.setattr(traced_stream.StreamRecorder, "_unrebuilt_bucket_keys", lambda self: set())
    found = disagreements(analytic, layer_figures(case, "traced"))
    assert len(found) == 1 and found[0].startswith("allocated peak: analytic")


@pytest.mark.parametrize("rebuild", [False, True])
def test_only_a_trace_names_the_bucket(rebuild):
    """The all-reduce hook names DDP's bucket for a trace (fake tensors: the bucket is never rebuilt); an
    emulated rank's real buckets are rebuilt after the first step, and a reference to the first one would
    keep its memory alive: there the hook keeps none."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from fsdpbench.engine.fake_pg import buckets_seen, fake_pg_compat, init_fake_process_group, patch_ddp

    init_fake_process_group(0, 2)
    try:
        with fake_pg_compat("gloo"):
            model = patch_ddp(DistributedDataParallel(torch.nn.Linear(8, 8)), 2, rebuild_buckets=rebuild)
            model(torch.ones(2, 8)).sum().backward()
        assert len(buckets_seen(model)) == (0 if rebuild else 1)
    finally:
        dist.destroy_process_group()
