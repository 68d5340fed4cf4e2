"""The MLP's activation profile on a GPU: what the worker's step keeps there (engine/step.rank_batch
copies the rank's rows to the device; the global batch stays in host memory) and CUDA's 512-byte
storage blocks, while the CPU's figures stay those the CPU tracker measures."""

from __future__ import annotations

import torch

from fsdpbench.core.case import Case
from fsdpbench.engine.step import rank_batch
from fsdpbench.models import resolve_model
from fsdpbench.predictors.memory_model.activations import FP32, Shape, get_activation_profile
from fsdpbench.predictors.memory_model.kernels import storage_bytes

MLP_TINY = resolve_model("mlp-tiny")[1]  # width 64, depth 2, 10 classes


def profile(case: Case):
    shape = Shape(
        batch=case.batch_size,
        seq_len=case.seq_len,
        global_batch=case.global_batch_size,
        mode=FP32,
        device=case.device,
    )
    return get_activation_profile("mlp", MLP_TINY, shape)


def mlp(device: str) -> Case:
    return Case(
        model="mlp-tiny",
        strategy="ddp",
        world_size=4,
        batch_size=3,
        device=device,
        backend="nccl" if device == "cuda" else "gloo",
    )


def test_on_a_gpu_the_batch_is_the_ranks_copy():
    """Off the CPU, rank_batch's ``.to(device)`` makes the rank's rows new tensors (meta stands in for
    cuda: a copy, not a view); each is one 512-byte-rounded CUDA storage."""
    case = mlp("cuda")
    x, y = rank_batch(case, rank=1, step=0, device=torch.device("meta"))
    kept = [t.untyped_storage().nbytes() for t in (x, y)]
    assert kept == [3 * 64 * 4, 3 * 8]  # the rank's rows only
    assert profile(case).inputs_bytes == sum(storage_bytes(n, "cuda") for n in kept) == 1024 + 512


def test_on_the_cpu_the_batch_is_views_of_the_global_one():
    case = mlp("cpu")
    x, y = rank_batch(case, rank=1, step=0, device=torch.device("cpu"))
    kept = [t.untyped_storage().nbytes() for t in (x, y)]
    assert kept == [12 * 64 * 4, 12 * 8]  # the global batch of 4 ranks × 3 rows stays alive
    assert profile(case).inputs_bytes == sum(kept)


def test_every_saved_tensor_is_a_cuda_block():
    """batch 3 × width 64 fp32 = 768 B: one 1024 B storage on a GPU, 768 B on the CPU."""
    cuda, cpu = profile(mlp("cuda")), profile(mlp("cpu"))
    assert [s.saved_bytes for s in cuda.stages] == [
        1024,
        1024,
        512 + 2 * 512,
    ]  # ReLU outputs; log-softmax, 2 scalars
    assert [s.saved_bytes for s in cpu.stages] == [768, 768, 3 * 10 * 4 + 8]
