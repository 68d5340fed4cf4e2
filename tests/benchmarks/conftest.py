"""pytest-benchmark set-up for fsdpbench's step benchmarks (see docs/ci.md).

Every saved benchmark (``--benchmark-autosave``/``--benchmark-json``) carries, next to
pytest-benchmark's own machine info, the torch version, distributed backend and device the steps
ran on, so a number is never separated from where it came from, and ``--benchmark-compare`` warns
when they differ. (The commit is in pytest-benchmark's own ``commit_info``; putting it in
``machine_info`` would make every comparison across commits warn about a different machine.)
"""

from __future__ import annotations

BACKEND, DEVICE = "gloo", "cpu"  # the benchmarks run one rank on the CPU (test_step_benchmarks.py)


def pytest_benchmark_update_machine_info(config, machine_info):
    import torch

    from fsdpbench.env import device_name

    machine_info["torch_version"] = torch.__version__
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["fsdpbench_backend"] = BACKEND
    machine_info["fsdpbench_device"] = DEVICE
    machine_info["fsdpbench_device_name"] = device_name(DEVICE)
