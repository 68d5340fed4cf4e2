"""NVML device memory: is NVML usable, which NVML device a rank uses, and a background sampler.

NVML sees the whole device: CUDA context, NCCL buffers and other processes
included, which the CUDA caching allocator does not. ``pynvml`` (package
``nvidia-ml-py``) is imported inside the functions, never at module import, so
this module imports fine on machines without it.

NVML numbers devices in PCI bus order. A CUDA index in ``CUDA_VISIBLE_DEVICES``
is taken as an NVML index, which holds when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or
the GPUs are all the same model (CUDA's default FASTEST_FIRST order then falls
back to PCI order); UUID entries (``GPU-…``/``MIG-…``) are matched exactly.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from fsdpbench.core.schema import DEVICE_NAME
from fsdpbench.metrics.sampler import BackgroundSampler

NVML_ERROR_DRIVER_NOT_LOADED = 9  # values of pynvml's NVML_ERROR_* constants
NVML_ERROR_LIBRARY_NOT_FOUND = 12


def _open_nvml() -> tuple[ModuleType | None, str]:
    """pynvml imported and NVML initialised (the caller then owes a _shutdown), or None and why not."""
    try:
        import pynvml
    except ImportError as exc:
        return None, f"pynvml is not installed (pip install nvidia-ml-py): {exc}"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError, or OSError from a broken install
        return None, _describe_nvml_error(pynvml, exc)
    return pynvml, ""


def _as_str(value: bytes | str) -> str:
    """NVML strings come back as bytes in old pynvml and str in new."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe_nvml_error(pynvml: ModuleType, exc: BaseException) -> str:
    """A human reason for an NVML failure, naming the missing library or driver."""
    code = getattr(exc, "value", None)
    library_missing = getattr(pynvml, "NVML_ERROR_LIBRARY_NOT_FOUND", NVML_ERROR_LIBRARY_NOT_FOUND)
    driver_missing = getattr(pynvml, "NVML_ERROR_DRIVER_NOT_LOADED", NVML_ERROR_DRIVER_NOT_LOADED)
    if code == library_missing or type(exc).__name__ == "NVMLError_LibraryNotFound":
        return f"NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver installed ({exc})"
    if code == driver_missing or type(exc).__name__ == "NVMLError_DriverNotLoaded":
        return f"NVIDIA driver is installed but not loaded ({exc})"
    return f"NVML error: {type(exc).__name__}: {exc}"


def _shutdown(pynvml: ModuleType) -> None:
    """nvmlShutdown, ignoring errors (NVML reference-counts init/shutdown pairs)."""
    try:
        pynvml.nvmlShutdown()
    except Exception:
        pass


def nvml_status() -> tuple[bool, str]:
    """Whether NVML can report device memory here, and a human reason either way."""
    pynvml, reason = _open_nvml()
    if pynvml is None:
        return False, reason
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        if count == 0:
            return False, "NVML is loaded but sees no NVIDIA device"
        driver = _as_str(pynvml.nvmlSystemGetDriverVersion())
        return True, f"NVML sees {count} device(s), driver {driver}"
    except Exception as exc:
        return False, _describe_nvml_error(pynvml, exc)
    finally:
        _shutdown(pynvml)


def visible_device_entries(cuda_visible_devices: str | None) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES as CUDA reads them; None when it is unset."""
    if cuda_visible_devices is None:
        return None
    entries: list[str] = []
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        # CUDA stops at the first entry it cannot parse (or a negative index).
        if entry.startswith(("GPU-", "MIG-")):
            entries.append(entry)
        elif entry.isdigit():
            entries.append(entry)
        else:
            break
    return entries


def _find_by_uuid(pynvml: ModuleType, uuid: str) -> tuple[int, Any]:
    """NVML index of the GPU whose UUID (or one of whose MIG devices' UUID) starts with ``uuid``."""
    matches: list[tuple[int, Any]] = []
    old_style_mig = uuid.startswith("MIG-GPU-")  # MIG-GPU-<uuid>/<gi>/<ci>, drivers < 470
    wanted_gpu = uuid[len("MIG-") :].split("/")[0] if old_style_mig else uuid
    for index in range(int(pynvml.nvmlDeviceGetCount())):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        if wanted_gpu.startswith("GPU-"):
            if _as_str(pynvml.nvmlDeviceGetUUID(handle)).startswith(wanted_gpu):
                matches.append((index, handle))
            continue
        try:  # MIG-<uuid>: look through the MIG devices of this GPU
            max_mig = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        except Exception:
            continue
        for mig_index in range(max_mig):
            try:
                mig_handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
            except Exception:
                continue  # unpopulated MIG slot
            if _as_str(pynvml.nvmlDeviceGetUUID(mig_handle)).startswith(uuid):
                matches.append((index, mig_handle))
    if len(matches) != 1:
        found = "no" if not matches else f"{len(matches)}"
        raise ValueError(f"CUDA_VISIBLE_DEVICES entry {uuid!r} matches {found} NVML device(s)")
    return matches[0]


def _resolve(pynvml: ModuleType | None, local_rank: int) -> tuple[int, Any]:
    """(NVML index, handle or None) of the device ``local_rank`` uses; UUIDs need NVML initialised."""
    # process plumbing: which GPUs the launcher gave this process (CUDA reads the same), read to find the
    # one it measures, not a switch of what is measured
    entries = visible_device_entries(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if entries is None:
        index = local_rank
    else:
        if not 0 <= local_rank < len(entries):
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} exposes "
                f"{len(entries)} device(s); local rank {local_rank} has none"
            )
        entry = entries[local_rank]
        if entry.startswith(("GPU-", "MIG-")):
            if pynvml is None:
                raise ValueError(f"resolving UUID {entry!r} needs pynvml")
            return _find_by_uuid(pynvml, entry)
        index = int(entry)
    handle = pynvml.nvmlDeviceGetHandleByIndex(index) if pynvml is not None else None
    return index, handle


def resolve_nvml_index(local_rank: int) -> int:
    """NVML index of the GPU the process with this local rank uses (MIG: its parent GPU)."""
    entries = visible_device_entries(os.environ.get("CUDA_VISIBLE_DEVICES"))  # as in _resolve
    needs_nvml = entries is not None and any(e.startswith(("GPU-", "MIG-")) for e in entries)
    if not needs_nvml:
        return _resolve(None, local_rank)[0]
    pynvml, reason = _open_nvml()
    if pynvml is None:
        raise ValueError(reason)
    try:
        return _resolve(pynvml, local_rank)[0]
    finally:
        _shutdown(pynvml)


def read_nvml_raw(handle: Any) -> dict[str, Any]:
    """Raw NVML fields of one device: memory (v1; reserved/used from v2 when given), name, driver."""
    import pynvml

    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    raw: dict[str, Any] = {
        "total_bytes": int(mem.total),
        "free_bytes": int(mem.free),
        "used_bytes": int(mem.used),  # v1: total - free, driver-reserved memory included
    }
    version = getattr(pynvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            mem2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            raw["reserved_bytes"] = int(mem2.reserved)
            raw["used_v2_bytes"] = int(mem2.used)  # v2: reserved memory excluded
        except Exception:
            pass  # old driver without nvmlDeviceGetMemoryInfo_v2
    raw[DEVICE_NAME] = _as_str(pynvml.nvmlDeviceGetName(handle))
    raw["driver_version"] = _as_str(pynvml.nvmlSystemGetDriverVersion())
    return raw


def device_total_bytes(local_rank: int) -> int:
    """The total memory of the GPU of ``local_rank``, from NVML (no CUDA context is created)."""
    pynvml, reason = _open_nvml()
    if pynvml is None:
        raise ValueError(reason)
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(_resolve(pynvml, local_rank)[1]).total)
    finally:
        _shutdown(pynvml)


def nvml_sampler(local_rank: int, interval_s: float = 0.01) -> tuple[BackgroundSampler | None, str]:
    """A (not started) sampler of NVML used bytes of this rank's GPU, source "nvml"; or (None, reason)."""
    pynvml, reason = _open_nvml()
    if pynvml is None:
        return None, reason
    try:
        index, handle = _resolve(pynvml, local_rank)
    except Exception as exc:
        _shutdown(pynvml)
        return None, f"cannot find the NVML device of local rank {local_rank}: {exc}"

    def read_used_bytes() -> int:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)

    sampler = BackgroundSampler(
        read_used_bytes, interval_s=interval_s, name="nvml", close_fn=lambda: _shutdown(pynvml)
    )
    return sampler, f"NVML device {index}"
