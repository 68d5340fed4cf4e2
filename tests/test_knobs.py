"""The knobs as axes: activation checkpointing, compile, CPU offload — each changes what it should
(and only that), or the case is skipped with the reason."""

from __future__ import annotations

import getpass
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from fsdpbench.core.case import Case
from fsdpbench.engine.knobs import (
    apply_activation_checkpointing,
    apply_compile,
    check_knobs,
    normalize_knobs,
    state_placement_bytes,
)
from fsdpbench.models import build_model, make_global_batch, resolve_model
from fsdpbench.models.decoder import TransformerBlock
from fsdpbench.pipeline.scenario import build_case
from fsdpbench.strategies import get_strategy
from tests.helpers import global_losses, run, tiny_case


# ---- case rules ----------------------------------------------------------------------------------
def test_cpu_offload_is_skipped_where_no_strategy_can_offload() -> None:
    for name in ("ddp", "zero1"):
        _, reason = build_case({"strategy": name, "cpu_offload": True})
        assert "cpu_offload applies to FSDP strategies" in reason and name in reason
    for name in ("zero2", "zero3", "hsdp"):
        assert check_knobs(Case(strategy=name, cpu_offload=True), get_strategy(name)) is None


def test_fsdp1_knobs_are_reset_on_strategies_that_ignore_them() -> None:
    case = Case(strategy="zero3", backward_prefetch="post", forward_prefetch=True, limit_all_gathers=False)
    normal = normalize_knobs(case, get_strategy("zero3"))
    assert (normal.backward_prefetch, normal.forward_prefetch, normal.limit_all_gathers) == (
        "pre",
        False,
        True,
    )
    assert normalize_knobs(case.replace(strategy="fsdp1_full"), get_strategy("fsdp1_full")) == case.replace(
        strategy="fsdp1_full"
    )


def test_a_model_from_a_missing_extra_is_skipped_with_the_install_command(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    _, reason = build_case({"model": "hf-llama-tiny", "strategy": "zero3"})
    assert reason == "model 'hf-llama-tiny' needs transformers: pip install 'fsdpbench[hf]'"


# ---- the transforms, in one process ----------------------------------------------------------------
def _loss_and_grads(model: torch.nn.Module, case: Case) -> tuple[float, list[torch.Tensor]]:
    mdef, _ = resolve_model(case.model, case.model_args)
    x, y = make_global_batch(case.model, case.model_args, 4, case.seq_len, 0, 0)
    loss = mdef.loss(model(x), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _model(case: Case) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(case.model, case.model_args)


def test_activation_checkpointing_wraps_each_block_and_keeps_the_maths() -> None:
    case = Case(model="decoder-tiny", seq_len=32, activation_checkpointing=True)
    plain, ac = _model(case), apply_activation_checkpointing(_model(case), case)
    wrapped = [m for m in ac.modules() if type(m).__name__ == "CheckpointWrapper"]
    assert len(wrapped) == 2 and all(
        isinstance(w._checkpoint_wrapped_module, TransformerBlock) for w in wrapped
    )
    loss_plain, grads_plain = _loss_and_grads(plain, case)
    loss_ac, grads_ac = _loss_and_grads(ac, case)
    assert loss_ac == loss_plain
    for a, b in zip(grads_ac, grads_plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _peak_activation_bytes(case: Case) -> int:
    model = apply_activation_checkpointing(_model(case), case)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        _loss_and_grads(model, case)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return sum(v for k, v in peak.items() if getattr(k, "value", k) == "Activation")


def test_activation_checkpointing_lowers_the_activation_term() -> None:
    case = Case(model="decoder-tiny", seq_len=64)
    plain = _peak_activation_bytes(case)
    ac = _peak_activation_bytes(case.replace(activation_checkpointing=True))
    # two blocks keep only their inputs (4 × 64 × 64 fp32 each) instead of every intermediate
    assert ac < plain / 2


def test_compile_marks_every_outermost_block() -> None:
    case = Case(model="decoder-tiny", compile=True, activation_checkpointing=True)
    model = apply_compile(apply_activation_checkpointing(_model(case), case), case)
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    assert len(blocks) == 2 and all(b._compiled_call_impl is not None for b in blocks)
    assert apply_compile(_model(case), case.replace(compile=False))._compiled_call_impl is None


# ---- the axes on 2 ranks ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "fsdp1_full"])
def test_activation_checkpointing_on_two_ranks(strategy: str, tmp_path: Path) -> None:
    base = run(tiny_case(strategy=strategy, world_size=2, seq_len=64), tmp_path)
    ac = run(tiny_case(strategy=strategy, world_size=2, seq_len=64, activation_checkpointing=True), tmp_path)
    assert base.status == ac.status == "ok", base.error + ac.error
    assert global_losses(ac) == pytest.approx(global_losses(base), rel=1e-6)
    act = [o.ranks[0].memory.peak["activations"] for o in (base, ac)]
    assert act[1] < act[0] / 2


@pytest.mark.slow
def test_compile_on_two_ranks_trains_the_same_and_records_the_compile_step(tmp_path: Path) -> None:
    small = dict(model="mlp-tiny", world_size=2, warmup_steps=2, steps=1, profile_steps=0)
    eager = run(tiny_case(strategy="zero3", **small), tmp_path)
    system_cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"  # inductor's default
    before = sorted(system_cache.rglob("*")) if system_cache.exists() else []
    case = tiny_case(strategy="zero3", compile=True, timeout_s=300, **small)
    compiled = run(case, tmp_path)
    assert eager.status == compiled.status == "ok", compiled.error
    # the compile caches are the case's, under its directory; nothing is added to the system's
    assert any((tmp_path / case.case_id / "torch_cache" / "inductor").rglob("*"))
    assert (sorted(system_cache.rglob("*")) if system_cache.exists() else []) == before
    assert global_losses(compiled) == pytest.approx(global_losses(eager), rel=1e-5)
    rank = compiled.ranks[0]
    assert len(rank.warmup.times_ms) == 2 and rank.to_columns()["first_step_ms"] == rank.warmup.times_ms[0]


@pytest.mark.slow
def test_cpu_offload_on_two_ranks_trains_the_same(tmp_path: Path) -> None:
    cases = [
        tiny_case(strategy="zero3", world_size=2, model="mlp-tiny", cpu_offload=o) for o in (False, True)
    ]
    base, off = (run(c, tmp_path) for c in cases)
    assert base.status == off.status == "ok", off.error
    assert global_losses(off) == pytest.approx(global_losses(base), rel=1e-6)
    # on a CPU run host and device are one memory: the tracker sees the same bytes either way
    assert off.ranks[0].memory.states_local == base.ranks[0].memory.states_local
    # ... and the run records where the strategy keeps the parameters, as the memory model predicts
    from fsdpbench.predictors.memory_model import predict_memory

    for case, outcome in zip(cases, (base, off)):
        for rank in outcome.ranks:
            got = {k: rank.placement[f"mem_placement_params_{k}_bytes"] for k in ("host", "device")}
            pred = predict_memory(case, rank=rank.rank)
            assert got == {"host": pred.params_host_bytes, "device": pred.params_device_bytes}
    assert off.ranks[0].placement["mem_placement_params_host_bytes"] > 0
    assert base.ranks[0].placement["mem_placement_params_host_bytes"] == 0


def _placement_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from fsdpbench.engine.parallel import build_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name, offload in (("zero3", False), ("zero3", True), ("fsdp1_full", False), ("ddp", False)):
        case = Case(model="mlp-tiny", strategy=name, world_size=world, cpu_offload=offload)
        parallel = build_parallel(case, torch.device("cpu"), rank)
        results[f"{name}-offload{offload}"] = state_placement_bytes(parallel.model)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.slow
def test_cpu_offload_moves_the_sharded_parameters_to_the_host(tmp_path: Path) -> None:
    from torch.multiprocessing import start_processes

    from fsdpbench.pipeline.launch import free_port

    out = tmp_path / "placement.json"
    start_processes(_placement_rank, args=(2, free_port(), str(out)), nprocs=2, start_method="forkserver")
    got = json.loads(out.read_text())
    psi = sum(p.numel() for p in build_model("mlp-tiny").parameters())
    assert psi == 64 * 64 * 2 + 64 * 2 + 650
    sharded = got["zero3-offloadFalse"]["mem_placement_params_device_bytes"]
    assert sharded >= psi * 4 // 2 and got["zero3-offloadFalse"]["mem_placement_params_host_bytes"] == 0
    assert got["zero3-offloadTrue"] == {
        "mem_placement_params_host_bytes": sharded,
        "mem_placement_params_device_bytes": 0,
    }
    assert got["fsdp1_full-offloadFalse"]["mem_placement_params_host_bytes"] == 0
    assert got["ddp-offloadFalse"] == {
        "mem_placement_params_host_bytes": 0,
        "mem_placement_params_device_bytes": psi * 4,
    }
