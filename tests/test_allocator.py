"""CUDA allocator statistics."""

import torch

from fsdpbench.metrics.allocator import cuda_allocator_stats, reset_cuda_peaks
from tests.helpers import requires_cuda


def test_cpu_device_gives_empty_dict():
    assert cuda_allocator_stats(torch.device("cpu")) == {}
    assert cuda_allocator_stats("cpu") == {}
    reset_cuda_peaks("cpu")  # no-op, must not raise


def test_no_cuda_gives_empty_dict(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_allocator_stats("cuda:0") == {}  # no CUDA: nothing to report
    reset_cuda_peaks("cuda:0")  # no-op, must not raise


@requires_cuda
def test_cuda_stats_on_the_real_allocator():
    reset_cuda_peaks(0)
    x = torch.empty(1 << 20, device="cuda:0")
    stats = cuda_allocator_stats(0)
    assert stats["mem_alloc_peak_allocated_bytes"] >= x.numel() * 4
    assert stats["mem_alloc_peak_reserved_bytes"] >= stats["mem_alloc_peak_allocated_bytes"]
    assert stats["mem_alloc_num_ooms"] == 0
