"""The environment a rank process of a case starts with, besides the launcher protocol (RANK, WORLD_SIZE,
…): how the libraries it loads must behave for that case, derived from the case's fields alone. Torch-free,
so that the orchestrator's launcher imports it without torch."""

from __future__ import annotations

from fsdpbench.core.case import Case

# What a CPU case's rank process starts with, so that it sees no GPU. Libraries that find one use it
# unasked: DCP's FileSystemWriter copies a CPU state dict through a CUDA stream whenever CUDA is available
# (torch/distributed/checkpoint/filesystem.py, _OverlappingCpuLoader), which made a CUDA context on GPU 0
# in every rank of a CPU checkpoint case on a GPU machine (device memory there, the context's host memory
# in the rank's RSS, its start-up in the save's time) and the driver's cache under $HOME/.nv. NVML's count
# answers torch.cuda.is_available() without starting the driver.
CPU_RANK_ENV = {"CUDA_VISIBLE_DEVICES": "", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"  # read by the caching allocator when CUDA first allocates


def process_env(case: Case) -> dict[str, str]:
    """The environment a rank process of ``case`` starts with besides the launcher protocol: how the
    libraries it loads must behave for this case, derived from the case's fields alone (its device, its
    ``alloc_conf``). Process configuration, not a message: fsdpbench's launcher gives it to each rank it
    starts; ``engine.worker.main`` (under an external launcher) sets it first thing. The rank never
    changes it."""
    env = dict(CPU_RANK_ENV) if case.device == "cpu" else {}
    if case.alloc_conf:
        env[ALLOC_CONF_ENV] = case.alloc_conf
    return env
