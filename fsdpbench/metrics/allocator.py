"""Peaks of PyTorch's CUDA caching allocator; empty on CPU devices."""

from __future__ import annotations

import torch

from fsdpbench.core.schema import ALLOC_OOMS, ALLOC_PEAK_ALLOCATED, ALLOC_PEAK_RESERVED, ALLOC_RETRIES


def _cuda_device(device: torch.device | str | int) -> torch.device | None:
    """The CUDA device ``device`` names, or None when it is not a usable CUDA device."""
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return dev


def cuda_allocator_stats(device: torch.device | str | int) -> dict[str, int]:
    """Allocated/reserved peaks, retries and OOMs since reset_cuda_peaks, as their columns; {} on a CPU
    device."""
    dev = _cuda_device(device)
    if dev is None:
        return {}
    stats = torch.cuda.memory_stats(dev)
    return {
        ALLOC_PEAK_ALLOCATED: int(torch.cuda.max_memory_allocated(dev)),
        ALLOC_PEAK_RESERVED: int(torch.cuda.max_memory_reserved(dev)),
        ALLOC_RETRIES: int(stats.get("num_alloc_retries", 0)),
        ALLOC_OOMS: int(stats.get("num_ooms", 0)),
    }


def reset_cuda_peaks(device: torch.device | str | int) -> None:
    """Start a new window on a CUDA device (peaks and retry/OOM counters); no-op on CPU."""
    dev = _cuda_device(device)
    # before CUDA's first use in this process there is no window to reset (peaks are 0), and torch 2.11
    # raises "Invalid device argument" for it (seen on an H200)
    if dev is not None and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats(dev)
        # num_alloc_retries / num_ooms are "accumulated" stats, not peaks.
        torch.cuda.reset_accumulated_memory_stats(dev)
