"""Resident set size (RSS) of this process: current value, a background sampler, and the OS peak."""

from __future__ import annotations

import os
import sys

from fsdpbench.metrics.sampler import BackgroundSampler

STATM_PATH = "/proc/self/statm"


def _ru_maxrss_bytes() -> int:
    """ru_maxrss of this process in bytes (Linux reports KiB, macOS bytes)."""
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def read_rss_bytes(statm_path: str = STATM_PATH) -> int:
    """Current RSS from /proc/self/statm; without /proc, the peak RSS from ``resource``."""
    try:
        with open(statm_path, "rb") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        # No /proc (macOS): only the high-water mark is available, which is >= current RSS.
        return _ru_maxrss_bytes()


def rss_sampler(interval_s: float = 0.01) -> BackgroundSampler:
    """A (not yet started) sampler of this process's RSS, source "rss"."""
    return BackgroundSampler(read_rss_bytes, interval_s=interval_s, name="rss")


def peak_rss_bytes() -> int:
    """Peak RSS of this process since it started (ru_maxrss), in bytes."""
    return _ru_maxrss_bytes()
