"""Where a number came from: versions, backends, devices, and why CUDA or NVML is unusable."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

from fsdpbench.core.schema import COMMIT, HOSTNAME, TORCH_VERSION

# git, read-only in the install's checkout: no optional lock taken (``git status`` otherwise refreshes
# the index, creating .git/index.lock and rewriting .git/index there), and no fsmonitor hook run
GIT_READ_ONLY = ("git", "--no-optional-locks", "-c", "core.fsmonitor=false")


@lru_cache(maxsize=1)
def project_commit() -> str:
    """The git commit of the fsdpbench checkout (with '+dirty' if modified), or 'unknown'."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            [*GIT_READ_ONLY, "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=5,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
        ).stdout.strip()

    try:
        sha = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")  # not a column: git status
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cuda_status() -> tuple[bool, str]:
    """(usable, reason) for CUDA through torch."""
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} is a CPU-only build"
        return False, "torch has CUDA but no GPU/driver is visible"
    return True, f"{torch.cuda.device_count()} GPU(s), CUDA {torch.version.cuda}"


def device_name(device: str) -> str:
    """What a rank ran on, in words; a CPU is never called a GPU."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return f"CPU: {cpu_name()} ({os.cpu_count()} cores)"


def collect_env() -> dict[str, Any]:
    """Everything a result needs to say where it came from."""
    import torch
    import torch.distributed as dist

    from fsdpbench import __version__
    from fsdpbench.metrics.nvml import nvml_status

    cuda_ok, cuda_why = cuda_status()
    nvml_ok, nvml_why = nvml_status()
    return {
        "fsdpbench_version": __version__,
        COMMIT: project_commit(),
        TORCH_VERSION: torch.__version__,
        "python_version": platform.python_version(),
        HOSTNAME: socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "backends": {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
        },
        "cuda_available": cuda_ok,
        "cuda_reason": cuda_why,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda_ok else [],
        "nvml_available": nvml_ok,
        "nvml_reason": nvml_why,
    }
