"""Which device a case runs on, and what happens on a machine whose GPUs are fewer than its ranks.

These run on any machine: where the behaviour depends on CUDA being present, its presence is faked
(``torch.cuda.is_available``/``device_count``, ``torch._C._get_accelerator``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fsdpbench.core.case import Case
from fsdpbench.engine.worker import resolve_device
from fsdpbench.pipeline.launch import launch_case
from fsdpbench.pipeline.scenario import check_devices, parse_scenario, resolve_backend
from tests.helpers import CPU, tiny_case

# what a skip for too few GPUs adds where there is at least one
EMULATE_HINT = "; run --emulate measures its ranks one at a time on one GPU here"


@pytest.fixture
def one_gpu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process believes it has CUDA with one GPU (nothing is ever run on it here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_more_cuda_ranks_than_gpus_are_skipped_whatever_the_backend(one_gpu_visible, backend: str) -> None:
    assert check_devices(Case(device="cuda", backend=backend, world_size=1)) is None
    reason = check_devices(Case(device="cuda", backend=backend, world_size=2))
    assert reason == "needs 2 GPUs (one per rank, device cuda), 1 visible" + EMULATE_HINT


def test_cpu_ranks_never_need_a_gpu(one_gpu_visible) -> None:
    assert check_devices(Case(world_size=8, **CPU)) is None
    assert check_devices(Case(world_size=1, device="cpu", backend="nccl")) == "backend nccl needs device cuda"


def test_no_cuda_means_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (
        check_devices(Case(device="cuda", backend="nccl"))
        == "needs 1 GPU (one per rank, device cuda), 0 visible"  # no GPU: nothing to emulate on
    )


def test_a_scenario_on_one_gpu_skips_the_two_rank_gloo_case_with_its_reason(one_gpu_visible) -> None:
    s = parse_scenario(
        "name: q\ndefaults: {device: cuda, backend: gloo}\nsweep: {world_size: [1, 2]}", source="q.yaml"
    )
    assert [c.world_size for c in s.cases] == [1]
    assert [(k.case.world_size, k.reason) for k in s.skipped] == [
        (2, "needs 2 GPUs (one per rank, device cuda), 1 visible" + EMULATE_HINT)
    ]


def test_auto_resolves_by_what_the_machine_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend("auto", "auto") == ("cuda", "nccl")
    assert resolve_backend("cpu", "auto") == ("cpu", "gloo")
    assert resolve_backend("cuda", "gloo") == ("cuda", "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend("auto", "auto") == ("cpu", "gloo")


def test_a_case_built_in_code_is_skipped_by_launch_before_any_process_starts(
    one_gpu_visible, tmp_path: Path
) -> None:
    case = tiny_case(device="cuda", backend="gloo", world_size=2)
    outcome = launch_case(case, tmp_path / case.case_id)
    assert (outcome.status, outcome.error) == (
        "skipped",
        "needs 2 GPUs (one per rank, device cuda), 1 visible" + EMULATE_HINT,
    )
    assert outcome.ranks == [] and not (tmp_path / case.case_id).exists()


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_fsdp2_shards_on_the_case_device_even_where_the_accelerator_is_cuda(
    strategy: str, one_rank_gloo_group, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fully_shard without a mesh builds one on torch's current accelerator: on a GPU machine a
    `device: cpu` case would shard onto cuda:<rank>. The strategy names its mesh, so the accelerator
    (faked here as CUDA) does not matter."""
    from torch.distributed.tensor import DTensor

    from fsdpbench.models import build_model
    from fsdpbench.models.wrap import get_wrap_units
    from fsdpbench.strategies import ApplyContext, get_strategy

    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    case = tiny_case(strategy=strategy, world_size=1)
    model = build_model(case.model, device="cpu")
    ctx = ApplyContext(
        case=case, device=torch.device("cpu"), rank=0, world_size=1, units=get_wrap_units(model, case)
    )
    model = get_strategy(strategy).apply(model, ctx)
    params = list(model.parameters())
    assert params and all(isinstance(p, DTensor) for p in params)
    assert {p.device_mesh.device_type for p in params} == {"cpu"}
    assert {p.to_local().device.type for p in params} == {"cpu"}


def test_the_traced_predictor_keeps_a_cpu_case_on_cpu_where_the_accelerator_is_cuda(monkeypatch) -> None:
    """On the H100, `predict --method traced --device cpu` crashed (FakeTensor device propagation,
    cuda:0 vs cpu): the strategy's fully_shard took the accelerator's mesh. Same golden as on CPU."""
    from fsdpbench.predictors.traced import estimate

    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    est = estimate(Case(model="decoder-tiny", strategy="zero3", world_size=4, **CPU), rank=0)
    assert (est.peak_bytes, est.model_states_bytes) == (5347356, 689492)


def test_a_cpu_cases_rank_hides_the_machines_gpus_from_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before anything in the rank can ask for a GPU (DCP's writer made a CUDA context on GPU 0 in every
    rank of a CPU checkpoint case). On a GPU machine, test_on_cuda.py checks what this does to torch and
    the driver; a CUDA case's rank keeps its GPUs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    assert resolve_device(Case(**CPU), 0) == torch.device("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"  # torch asks NVML, not the driver
