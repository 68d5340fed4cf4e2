"""Resident set size (RSS) of this process: current value, a background sampler, and the OS peak."""

from __future__ import annotations

import os
import sys

from fsdpbench.metrics.sampler import BackgroundSampler

STATM_PATH = "/proc/self/statm"
STATUS_PATH = "/proc/self/status"
CLEAR_REFS_PATH = "/proc/self/clear_refs"


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


def read_anon_rss_bytes(statm_path: str = STATM_PATH) -> int:
    """Current anonymous RSS (statm's resident minus its shared, file-backed pages): the memory this
    process allocated, without the code and files it maps, whose pages fault in on first use (a code
    path run for the first time grows RSS by its pages though nothing was allocated). Without /proc,
    ``read_rss_bytes``'s fallback."""
    try:
        with open(statm_path, "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _ru_maxrss_bytes()


def read_status_bytes(status_path: str = STATUS_PATH) -> dict[str, int]:
    """The kernel's memory counters of this process from /proc/self/status (``VmHWM``, ``VmRSS``,
    ``RssAnon``, ``RssFile``, ``RssShmem``, ...), in bytes; {} without /proc."""
    out: dict[str, int] = {}
    try:
        with open(status_path, "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == b"kB":
                    out[key.decode()] = int(parts[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def reset_peak_rss(clear_refs_path: str = CLEAR_REFS_PATH) -> bool:
    """Reset the kernel's RSS high-water mark (``VmHWM``) of this process to its current RSS (Linux >= 4.0:
    "5" to /proc/self/clear_refs). The kernel updates the mark before it unmaps pages, so it holds a
    transient that a sampler between two reads would miss. False where it cannot be reset."""
    try:
        with open(clear_refs_path, "w") as f:
            f.write("5")
        return "VmHWM" in read_status_bytes()
    except OSError:
        return False


def rss_sampler(interval_s: float = 0.01) -> BackgroundSampler:
    """A (not yet started) sampler of this process's RSS, source "rss"."""
    return BackgroundSampler(read_rss_bytes, interval_s=interval_s, name="rss")


def peak_rss_bytes() -> int:
    """Peak RSS of this process since it started (ru_maxrss), in bytes."""
    return _ru_maxrss_bytes()


def fix_mmap_threshold(threshold: int = 128 * 1024) -> bool:
    """Fix glibc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``), which turns its dynamic adjustment off:
    from then on every allocation over ``threshold`` is a mapping of its own, returned to the system when
    freed, so RSS rises and falls with it. Left dynamic, glibc raises the threshold each time a mapped
    block is freed (up to 32 MiB), after which large blocks come from the heap and a freed one stays there,
    resident, to serve a later allocation unseen by RSS. False where there is no mallopt (not glibc)."""
    import ctypes
    import ctypes.util

    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    m_mmap_threshold = -3
    return bool(libc.mallopt(m_mmap_threshold, threshold))


def trim_heap() -> None:
    """Return glibc's free heap pages to the system (``malloc_trim(0)``); nothing elsewhere."""
    import ctypes
    import ctypes.util

    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
