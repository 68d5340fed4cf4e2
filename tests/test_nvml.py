"""NVML helpers against a fake ``pynvml`` module (no GPU or driver needed)."""

from __future__ import annotations

import subprocess
import sys
import types
from dataclasses import dataclass, field

import pytest

from fsdpbench.metrics import nvml
from tests.helpers import wait_until

NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_GPU_IS_LOST = 15


@dataclass
class FakeGpu:
    uuid: str
    used: list[int] = field(default_factory=lambda: [1000])
    total: int = 80 * 2**30
    reserved: int = 512 * 2**20
    mig_uuids: list[str | None] = field(default_factory=list)
    reads: int = 0


def make_fake_pynvml(gpus, *, init_error=None, with_v2=True, fail_after=None):
    """A module with the parts of pynvml's API that fsdpbench uses."""
    fake = types.ModuleType("pynvml")
    fake.NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    fake.NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(value)
            self.value = value

        def __str__(self):
            return {12: "NVML Shared Library Not Found", 9: "Driver Not Loaded"}.get(
                self.value, f"NVML error {self.value}"
            )

    class NVMLError_LibraryNotFound(NVMLError):
        def __init__(self):
            super().__init__(NVML_ERROR_LIBRARY_NOT_FOUND)

    class NVMLError_DriverNotLoaded(NVMLError):
        def __init__(self):
            super().__init__(NVML_ERROR_DRIVER_NOT_LOADED)

    fake.NVMLError = NVMLError
    fake.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    fake.NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    fake.state = {"init": 0, "shutdown": 0}

    def nvmlInit():
        if init_error is not None:
            raise init_error(fake)
        fake.state["init"] += 1

    def nvmlShutdown():
        fake.state["shutdown"] += 1

    handles = {("gpu", i): gpu for i, gpu in enumerate(gpus)}

    def nvmlDeviceGetCount():
        return len(gpus)

    def nvmlDeviceGetHandleByIndex(i):
        if not 0 <= i < len(gpus):
            raise NVMLError(2)
        return ("gpu", i)

    def nvmlDeviceGetUUID(handle):
        if handle[0] == "mig":
            return gpus[handle[1]].mig_uuids[handle[2]].encode()  # old pynvml: bytes
        return handles[handle].uuid

    def nvmlDeviceGetMaxMigDeviceCount(handle):
        return len(handles[handle].mig_uuids)

    def nvmlDeviceGetMigDeviceHandleByIndex(handle, j):
        if handles[handle].mig_uuids[j] is None:
            raise NVMLError(6)  # NOT_FOUND: unpopulated slot
        return ("mig", handle[1], j)

    def nvmlDeviceGetMemoryInfo(handle, version=None):
        gpu = gpus[handle[1]]
        if version is not None:
            if not with_v2:
                raise NVMLError(13)  # FUNCTION_NOT_FOUND
            used = gpu.used[min(gpu.reads, len(gpu.used) - 1)]
            return types.SimpleNamespace(
                total=gpu.total, reserved=gpu.reserved, free=gpu.total - used - gpu.reserved, used=used
            )
        if fail_after is not None and gpu.reads >= fail_after:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        used = gpu.used[min(gpu.reads, len(gpu.used) - 1)]
        gpu.reads += 1
        return types.SimpleNamespace(total=gpu.total, free=gpu.total - used, used=used)

    for fn in (
        nvmlInit,
        nvmlShutdown,
        nvmlDeviceGetCount,
        nvmlDeviceGetHandleByIndex,
        nvmlDeviceGetUUID,
        nvmlDeviceGetMaxMigDeviceCount,
        nvmlDeviceGetMigDeviceHandleByIndex,
        nvmlDeviceGetMemoryInfo,
    ):
        setattr(fake, fn.__name__, fn)
    fake.nvmlDeviceGetName = lambda handle: "NVIDIA H100 80GB HBM3"
    fake.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    if with_v2:
        fake.nvmlMemory_v2 = 0x02000028
    return fake


GPU_UUIDS = [
    "GPU-aaaaaaaa-0000-0000-0000-000000000000",
    "GPU-bbbbbbbb-1111-1111-1111-111111111111",
    "GPU-cccccccc-2222-2222-2222-222222222222",
    "GPU-dddddddd-3333-3333-3333-333333333333",
]


@pytest.fixture
def four_gpus(monkeypatch):
    gpus = [FakeGpu(uuid=u) for u in GPU_UUIDS]
    fake = make_fake_pynvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake, gpus


def test_sampler_peak_is_max_of_scripted_used(four_gpus, monkeypatch):
    fake, gpus = four_gpus
    script = [3_000, 9_000, 4_000, 12_500, 7_000, 6_000]
    gpus[2].used = script
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    sampler, reason = nvml.nvml_sampler(local_rank=0, interval_s=0.001)
    assert sampler is not None and reason == "NVML device 2"
    with sampler:
        wait_until(lambda: gpus[2].reads > len(script) + 2)
    assert sampler.peak_bytes == 12_500
    assert [s.bytes for s in sampler.samples][: len(script)] == script
    assert sampler.name == "nvml" and set(sampler.to_frame()["source"]) == {"nvml"}
    assert gpus[3].reads == 0  # the other rank's GPU was never read
    assert fake.state["shutdown"] == fake.state["init"]  # stop() released NVML


def test_sampler_phase_tagging(four_gpus):
    fake, gpus = four_gpus
    gpus[0].used = [100, 400, 250, 900, 300]
    sampler, _ = nvml.nvml_sampler(local_rank=0)
    sampler.set_phase("forward")
    sampler.sample_now()
    sampler.sample_now()
    sampler.set_phase("backward")
    sampler.sample_now()
    sampler.sample_now()
    sampler.set_phase("optimizer")
    sampler.sample_now()
    assert sampler.peak_bytes_by_phase() == {"forward": 400, "backward": 900, "optimizer": 300}
    assert [s.phase for s in sampler.samples] == ["forward"] * 2 + ["backward"] * 2 + ["optimizer"]


def test_sampler_survives_a_lost_gpu(monkeypatch):
    gpus = [FakeGpu(uuid=GPU_UUIDS[0], used=[10, 20, 30])]
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_pynvml(gpus, fail_after=3))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sampler, _ = nvml.nvml_sampler(0, interval_s=0.001)
    with sampler:
        wait_until(lambda: sampler.error_count >= 3)
    assert sampler.peak_bytes == 30
    assert "NVML error 15" in sampler.errors[0]


def test_visible_devices_indices(four_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert nvml.resolve_nvml_index(1) == 3
    assert nvml.resolve_nvml_index(0) == 2
    with pytest.raises(ValueError, match="exposes 2 device"):
        nvml.resolve_nvml_index(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml.resolve_nvml_index(3) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 1, 0 ,bogus,3")  # CUDA stops at "bogus"
    assert [nvml.resolve_nvml_index(r) for r in (0, 1)] == [1, 0]
    with pytest.raises(ValueError):
        nvml.resolve_nvml_index(2)


def test_visible_devices_uuids(four_gpus, monkeypatch):
    fake, _ = four_gpus
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{GPU_UUIDS[3]},{GPU_UUIDS[1]}")
    assert nvml.resolve_nvml_index(0) == 3
    assert nvml.resolve_nvml_index(1) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cccccccc,GPU-aaaa")  # unique prefixes
    assert [nvml.resolve_nvml_index(r) for r in (0, 1)] == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffffffff")
    with pytest.raises(ValueError, match="matches no NVML device"):
        nvml.resolve_nvml_index(0)
    assert fake.state["shutdown"] == fake.state["init"]


def test_visible_devices_mig_uuid(monkeypatch):
    gpus = [
        FakeGpu(uuid=GPU_UUIDS[0]),
        FakeGpu(uuid=GPU_UUIDS[1], used=[777], mig_uuids=[None, "MIG-11112222-3333-4444-5555-666677778888"]),
    ]
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_pynvml(gpus))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-11112222-3333-4444-5555-666677778888")
    assert nvml.resolve_nvml_index(0) == 1  # the parent GPU
    sampler, reason = nvml.nvml_sampler(0)
    sampler.sample_now()
    assert reason == "NVML device 1" and sampler.peak_bytes == 777


def test_library_not_found(monkeypatch):
    fake = make_fake_pynvml([], init_error=lambda m: m.NVMLError_LibraryNotFound())
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    ok, reason = nvml.nvml_status()
    assert ok is False
    assert "library" in reason.lower() and "libnvidia-ml" in reason
    sampler, why = nvml.nvml_sampler(0)
    assert sampler is None and why == reason


def test_driver_not_loaded_and_no_device(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "pynvml", make_fake_pynvml([], init_error=lambda m: m.NVMLError_DriverNotLoaded())
    )
    ok, reason = nvml.nvml_status()
    assert not ok and "driver" in reason.lower() and "not loaded" in reason
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_pynvml([]))
    ok, reason = nvml.nvml_status()
    assert not ok and "no NVIDIA device" in reason


def test_status_available(four_gpus):
    ok, reason = nvml.nvml_status()
    assert ok and reason == "NVML sees 4 device(s), driver 550.54.15"


def test_pynvml_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    ok, reason = nvml.nvml_status()
    assert not ok and "pynvml is not installed" in reason
    sampler, why = nvml.nvml_sampler(1)
    assert sampler is None and why == reason
    assert nvml.resolve_nvml_index(1) == 3  # index form needs no NVML
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", GPU_UUIDS[0])
    with pytest.raises(ValueError, match="pynvml"):
        nvml.resolve_nvml_index(0)


def test_module_import_does_not_import_pynvml():
    code = "import sys, fsdpbench.metrics.nvml; assert 'pynvml' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_read_raw_with_and_without_v2(four_gpus, monkeypatch):
    fake, gpus = four_gpus
    gpus[0].used = [5 * 2**30]
    raw = nvml.read_nvml_raw(fake.nvmlDeviceGetHandleByIndex(0))
    assert raw["total_bytes"] == 80 * 2**30
    assert raw["used_bytes"] == 5 * 2**30
    assert raw["free_bytes"] == 75 * 2**30
    assert raw["reserved_bytes"] == 512 * 2**20
    assert raw["device_name"] == "NVIDIA H100 80GB HBM3"
    assert raw["driver_version"] == "550.54.15"
    old = make_fake_pynvml([FakeGpu(uuid=GPU_UUIDS[0])], with_v2=False)
    monkeypatch.setitem(sys.modules, "pynvml", old)
    raw = nvml.read_nvml_raw(old.nvmlDeviceGetHandleByIndex(0))
    assert "reserved_bytes" not in raw and raw["used_bytes"] == 1000
