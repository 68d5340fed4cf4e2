"""Every prediction's layers nest as device memory does — tracked ≤ allocated ≤ reserved ≤ NVML — for
every strategy, precision and activation-checkpointing setting, on a CUDA target (on a CPU-only build the
trace applies CUDA's rules: predictors/cuda_standins.py). The traced layer is checked without cuBLAS's
workspaces, which only add to allocated memory: a stream that misses allocations cannot hide behind them."""

from __future__ import annotations

import itertools

import pytest

from fsdpbench.core.case import Case
from fsdpbench.core.precision import runnable_precisions
from fsdpbench.predictors.consistency import LayerFigures, layer_figures, violations
from fsdpbench.predictors.memory_model.alloc_stream import CudaRuntime
from fsdpbench.strategies import strategy_names

NO_WORKSPACES = CudaRuntime(0, "no cuBLAS workspaces: the strictest check of the stream itself")
TRACED_PRECISIONS = ("fp32", "bf16")
# what the traced predictor cannot trace, and why (each raises; test_untraceable_strategies_say_why)
UNTRACEABLE = {
    "ds_zero1": "LOCAL_RANK",  # DeepSpeed's engine wants its launcher's environment
    "ds_zero2": "LOCAL_RANK",
    "ds_zero3": "LOCAL_RANK",
    "fsdp1_hybrid": "local_scalar_dense",  # a data-dependent op on fake tensors
}


def grid_case(strategy: str, precision: str, ac: bool) -> Case:
    return Case(
        model="decoder-tiny",
        strategy=strategy,
        world_size=4,
        precision=precision,
        batch_size=2,
        seq_len=128,
        activation_checkpointing=ac,
        device="cuda",
        backend="nccl",
    )


def test_violations_name_each_broken_layer():
    broken = LayerFigures("traced", tracked=10, allocated=9, reserved=8, nvml=8)
    assert violations(broken) == [
        "traced: allocated 9 B < tracked 10 B",
        "traced: reserved 8 B < allocated 9 B",
    ]
    assert violations(LayerFigures("analytic", 1, 1, 2, 3)) == []


@pytest.mark.parametrize("strategy", strategy_names())
def test_analytic_layers_nest(strategy):
    found = []
    for precision, ac in itertools.product(runnable_precisions(), (False, True)):
        case = grid_case(strategy, precision, ac)
        if _unsupported(case):
            continue
        found += [f"{precision} ac={ac}: {v}" for v in violations(layer_figures(case, "analytic"))]
    assert found == []


@pytest.mark.parametrize("strategy", [s for s in strategy_names() if s not in UNTRACEABLE])
def test_traced_layers_nest(strategy):
    found = []
    for precision, ac in itertools.product(TRACED_PRECISIONS, (False, True)):
        figures = layer_figures(grid_case(strategy, precision, ac), "traced", runtime=NO_WORKSPACES)
        found += [f"{precision} ac={ac}: {v}" for v in violations(figures)]
    assert found == []


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_the_old_replicated_stream_breaks_the_order(monkeypatch, strategy):
    """The recorder as it was — only what the tracker registered after it attached, no DDP buckets —
    predicts less allocated memory than the live tensors."""
    import fsdpbench.predictors.traced_stream as traced_stream

    monkeypatch.setattr(traced_stream.StreamRecorder, "_register_known_storages", lambda self: None)
    monkeypatch.setattr(traced_stream, "ddp_bucket_mallocs", lambda model, device_type: [])
    figures = layer_figures(grid_case(strategy, "bf16", False), "traced", runtime=NO_WORKSPACES)
    assert any("allocated" in v and "< tracked" in v for v in violations(figures))


@pytest.mark.parametrize("strategy", sorted(UNTRACEABLE))
def test_untraceable_strategies_say_why(strategy):
    pytest.importorskip("deepspeed") if strategy.startswith("ds_") else None
    with pytest.raises(Exception, match=UNTRACEABLE[strategy]):
        layer_figures(grid_case(strategy, "fp32", False), "traced")


def _unsupported(case: Case) -> bool:
    from fsdpbench.strategies import get_strategy

    return get_strategy(case.strategy).check(case) is not None
