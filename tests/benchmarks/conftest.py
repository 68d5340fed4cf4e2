"""pytest-benchmark set-up for fsdpbench's step benchmarks (see docs/ci.md).

Every saved benchmark (``--benchmark-autosave``/``--benchmark-json``) carries, next to
pytest-benchmark's own machine info, the torch version, distributed backend and device the steps
ran on, so a number is never separated from where it came from, and ``--benchmark-compare`` warns
when they differ. (The commit is in pytest-benchmark's own ``commit_info``; putting it in
``machine_info`` would make every comparison across commits warn about a different machine.)
"""

from __future__ import annotations

import pytest

BACKEND, DEVICE = "gloo", "cpu"  # the benchmarks run one rank on the CPU (test_step_benchmarks.py)
# one intra-op thread: with more, a busy machine (other processes on the same cores) makes OpenMP
# wait for descheduled threads and a 10 ms step took 1 s; fsdpbench's own ranks get cores/ranks threads
TORCH_THREADS = 1


def pytest_benchmark_update_machine_info(config, machine_info):
    import torch

    from fsdpbench.store.env import device_name

    machine_info["torch_version"] = torch.__version__
    machine_info["torch_threads"] = TORCH_THREADS
    machine_info["fsdpbench_backend"] = BACKEND
    machine_info["fsdpbench_device"] = DEVICE
    machine_info["fsdpbench_device_name"] = device_name(DEVICE)


@pytest.fixture(scope="session")
def torch_threads() -> int:
    """Intra-op threads the step benchmarks run with (also in machine_info)."""
    return TORCH_THREADS
