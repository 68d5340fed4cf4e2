"""On a machine with a CUDA GPU: NVML against the real library, and one real rank per strategy on
``cuda`` (NCCL) with the allocator, NVML and tracker columns and the memory prediction beside them.

Skipped elsewhere, with the reason (``-m cuda`` selects exactly these). How close the prediction is
to the measurement on a GPU is checked against the H100 reference rows (tests of the memory model);
here the columns must exist and be ordered as the sources' definitions order them."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import CUDA_ONLY, REPO, repo_pythonpath, run_with_predictions, tiny_case

pytestmark = CUDA_ONLY

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp1_full")


def test_nvml_samples_the_real_device_and_sees_what_torch_reserved() -> None:
    from fsdpbench.metrics.nvml import nvml_sampler, nvml_status

    ok, reason = nvml_status()
    assert ok, reason
    sampler, reason = nvml_sampler(torch.cuda.current_device(), interval_s=0.01)
    assert sampler is not None, reason
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with sampler:
        time.sleep(0.2)
    assert len(sampler.samples) >= 2
    # NVML counts the whole device (context, workspaces, other processes): at least what torch holds
    assert sampler.peak_bytes >= torch.cuda.memory_reserved() >= block.numel()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_rank_on_cuda_measures_every_source_and_predicts_beside_it(strategy: str, tmp_path: Path) -> None:
    case = tiny_case(
        strategy=strategy, world_size=1, profile_steps=1, device="cuda", backend="nccl", timeout_s=180
    )
    row = run_with_predictions(case, tmp_path).iloc[0]
    assert (row["device"], row["backend"]) == ("cuda", "nccl")
    # live tensors ≤ what the allocator handed out ≤ what it reserved ≤ what the device has in use
    assert 0 < row["mem_tracker_peak_bytes"] <= row["mem_alloc_peak_allocated_bytes"]
    assert (
        row["mem_alloc_peak_allocated_bytes"]
        <= row["mem_alloc_peak_reserved_bytes"]
        <= row["mem_nvml_peak_bytes"]
    )
    assert row["mem_alloc_num_ooms"] == 0 and row["mem_nvml_samples"] > 0
    # the prediction for the same case stands beside the measurement (its accuracy is tested elsewhere)
    assert row["pred_peak_bytes"] > 0 and row["pred_model_states_bytes"] > 0
    for err in ("pred_peak_err", "pred_model_states_err"):
        assert math.isfinite(row[err]) and abs(row[err]) < 0.5, (err, row[err])
    assert math.isfinite(row["step_time_ms"]) and row["step_time_ms"] > 0


CPU_RANK_SAVES = """
import torch, torch.distributed.checkpoint as dcp
from fsdpbench.core.case import Case
from fsdpbench.engine.worker import resolve_device
resolve_device(Case(device="cpu", backend="gloo"), 0)
dcp.save({"w": torch.ones(4)}, storage_writer=dcp.FileSystemWriter("ckpt"), no_dist=True)
print(torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.is_initialized())
"""


def test_a_cpu_ranks_checkpoint_leaves_the_gpu_and_the_driver_alone(tmp_path: Path) -> None:
    """A CPU rank on a GPU machine: DCP's writer, which copies through a CUDA stream wherever CUDA is
    available, finds none, and the driver is never started (it writes its cache under $HOME/.nv)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": repo_pythonpath(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", CPU_RANK_SAVES],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "0", "False"]
    assert list(home.rglob("*")) == []
