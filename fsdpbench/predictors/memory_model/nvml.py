"""What NVML reports beyond the caching allocator's reserved memory, as a sum of named terms, each for
something the process loads and each with its source: predicted NVML used = reserved + Σ terms.

NVML's ``used`` is the whole device's: every process on it, the driver's context of each, the kernels
each has loaded and what the libraries allocate outside the caching allocator. cuBLAS's workspaces are
*not* among them: torch takes them from the caching allocator (CublasHandlePool.cpp), so they are in
``reserved`` (``alloc_stream.CudaRuntime``). The terms:

- ``cuda_context``: the driver's context and the kernels a training step loads (torch's, cuBLAS's and
  cuBLASLt's handles and modules, CUDA's lazy module loading): a MEASUREMENT — NVML peak − reserved peak of
  a lean process (fake process group, so no NCCL) on the reference H100, less its cuDNN term: the
  emulated ddp bf16 rank of ``../shared/reference/gpu-h100-2026-11-27`` (1,307,377,664 B, the first case
  of that run, before any other process held the device; a plain FSDP2 process measured 1.30–1.32 GB).
- ``cudnn``: cuDNN's kernels, loaded by a step that runs cuDNN (SDPA in bf16/fp16 on sm90 is cuDNN
  attention, ``kernels.py``): 16 MiB, the bf16 − fp32 difference of the one-rank runs of
  ``../shared/reference/gpu-h100/single_gpu_decoder-base_results.parquet`` (ddp: 16 MiB, zero3: 14 MiB).
- ``nccl_library``: what creating an NCCL communicator loads (NCCL's kernels, its device-side
  communicator and work queue): 591,396,864 B, the one-rank NCCL ddp bf16 run (gpu_step_time) less the
  emulated ddp bf16 rank, the same case on the same machine without NCCL. Per process: none with the fake
  process group (emulated ranks, traces), none with gloo.
- ``nccl_buffers``: per communicator and channel, one ring connection's buffers at NCCL's documented
  defaults — Simple ``NCCL_BUFFSIZE`` = 4 MiB, LL 512 KiB (``NCCL_LL_LINES_PER_THREAD ×
  NCCL_LL_MAX_NTHREADS × NCCL_STEPS × 16 B`` = 8·512·8·16) and LL128 4.6875 MiB
  (``NCCL_LL128_ELEMS_PER_THREAD × NCCL_LL128_MAX_NTHREADS × NCCL_STEPS × 8 B`` = 120·640·8·8), NCCL 2.x
  src/include/device.h; channels 16, an ASSUMPTION (an NVLink node; NCCL opens up to 32). One communicator
  for FSDP/DDP, two for HSDP; none on one rank (no peer).
- ``profiler`` and ``samplers``: what fsdpbench's own runs add (``torch.profiler``'s CUPTI buffers; the
  NVML and RSS sampler threads): 0 B, MEASURED — the emulated ddp bf16 rank above ran both and lies
  inside the lean processes' 1.30–1.32 GB band (their share is below that band's 0.02 GB width).
- ``other_processes``: another process holding a context on the same device, which NVML counts too;
  none in a plain job. (``run --traced`` on CUDA traced each case in a process that kept a CUDA context
  while the later cases ran — 0.55–0.70 GB in the reference run — and now ends it before the next case.)

``predict`` answers for a plain training job (no profiler, no samplers); a ``--calibration`` file written
by ``fsdpbench check`` replaces the measured terms with the user's machine's (``Calibration``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

from fsdpbench.core.formats import CALIBRATION, FORMAT_VERSION
from fsdpbench.core.numbers import MiB
from fsdpbench.core.readback import read_json

NCCL_SIMPLE_BUFFSIZE = 4 * MiB  # NCCL_BUFFSIZE's documented default
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16  # 512 KiB
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8  # 4.6875 MiB
NCCL_PROTOCOL_BYTES = NCCL_SIMPLE_BUFFSIZE + NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE
NCCL_ASSUMED_CHANNELS = 16
MAX_CALIBRATION_BYTES = 64 * 1024  # six fields
CUDNN_DTYPES = ("bfloat16", "float16")  # compute dtypes whose SDPA is cuDNN attention on sm90


@dataclass(frozen=True, slots=True)
class Calibration:
    """The measured terms of one machine (bytes) and where they were measured."""

    cuda_context_bytes: int
    cudnn_bytes: int
    nccl_library_bytes: int
    profiler_bytes: int
    samplers_bytes: int
    source: str

    def to_json(self) -> dict:
        return CALIBRATION.stamped(asdict(self))

    @classmethod
    def from_json(cls, data: object, where: str) -> Calibration:
        """Checked: a wrong field or format version raises ValueError naming ``where`` and the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object")
        CALIBRATION.check(where, data.get(FORMAT_VERSION))  # FormatVersionError is a ValueError
        values: dict[str, object] = {}
        for f in fields(cls):
            value = data.get(f.name)
            if f.name == "source":
                if not isinstance(value, str):
                    raise ValueError(f"{where}: source: expected a string")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{where}: {f.name}: expected bytes (an integer ≥ 0), got {value!r}")
            values[f.name] = value
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def read(cls, path: Path | str) -> Calibration:
        return cls.from_json(read_json(path, MAX_CALIBRATION_BYTES, what="calibration"), str(path))


REFERENCE_H100 = Calibration(
    cuda_context_bytes=1_307_377_664 - 16 * MiB,
    cudnn_bytes=16 * MiB,
    nccl_library_bytes=1_898_774_528 - 1_307_377_664,
    profiler_bytes=0,
    samplers_bytes=0,
    source="measured on the reference H100 (driver 580.159, CUDA 13.0, torch 2.11.0+cu130)",
)


@dataclass(frozen=True, slots=True)
class JobLoads:
    """What one process on the device loads besides its tensors."""

    cudnn: bool = False  # runs cuDNN kernels
    nccl_communicators: int = 0  # process groups that run NCCL collectives (0: fake or gloo)
    nccl_peers: bool = False  # whether they have peers (more than one rank)
    profiler: bool = False  # torch.profiler with CUDA activities (fsdpbench's profiled step)
    samplers: bool = False  # fsdpbench's NVML and RSS sampler threads
    other_processes_bytes: int = 0  # other processes' memory on the same device


@dataclass(frozen=True, slots=True)
class NvmlTerm:
    name: str
    nbytes: int
    source: str


@dataclass(frozen=True, slots=True)
class NvmlTerms:
    """Device memory outside the caching allocator (bytes), term by term."""

    terms: tuple[NvmlTerm, ...]

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.terms)

    @property
    def nccl_bytes(self) -> int:
        return sum(t.nbytes for t in self.terms if t.name.startswith("nccl"))

    @property
    def context_bytes(self) -> int:
        """Everything but NCCL's terms."""
        return self.total - self.nccl_bytes

    @property
    def context_source(self) -> str:
        return "; ".join(f"{t.name} {t.source}" for t in self.terms if not t.name.startswith("nccl"))

    @property
    def nccl_source(self) -> str:
        return "; ".join(f"{t.name} {t.source}" for t in self.terms if t.name.startswith("nccl"))

    def by_name(self) -> dict[str, int]:
        return {t.name: t.nbytes for t in self.terms}

    def nvml_bytes(self, reserved: int) -> int:
        """Predicted NVML used: the allocator's reserved memory plus these terms."""
        return reserved + self.total


def nccl_communicators(world_size: int, shard_group: int | None, backend: str, *, fake: bool = False) -> int:
    """Process groups that run NCCL collectives on a rank (0 without NCCL or with the fake process group)."""
    if backend != "nccl" or fake:
        return 0
    if shard_group and 1 < shard_group < world_size:
        return 2  # HSDP: a shard group and a replicate group
    return 1


def job_loads(case: object, *, fsdpbench_run: bool = False) -> JobLoads:
    """What ``case``'s process loads: a plain training job's, or (``fsdpbench_run``) one of fsdpbench's
    own ranks, with its profiled step and samplers. ``case`` is a ``Case``."""
    from fsdpbench.core.case import Case

    assert isinstance(case, Case)
    from fsdpbench.predictors.memory_model import resolve_shard_size
    from fsdpbench.strategies import get_strategy

    shard = resolve_shard_size(case, get_strategy(case.strategy).sharding)
    comms = nccl_communicators(case.world_size, shard, case.backend, fake=case.emulate)
    return JobLoads(
        cudnn=case.precision_spec.param_dtype in CUDNN_DTYPES,
        nccl_communicators=comms,
        nccl_peers=comms > 0 and case.world_size > 1,
        profiler=fsdpbench_run and case.profile_steps > 0,
        samplers=fsdpbench_run and case.nvml_interval_s > 0,
    )


def nvml_terms(
    loads: JobLoads,
    *,
    calibration: Calibration | None = None,
    context_bytes: int | None = None,
    nccl_channels: int | None = None,
    nccl_buffsize: int | None = None,
) -> NvmlTerms:
    """The terms for one process; ``context_bytes`` replaces the CUDA context term, ``nccl_channels`` and
    ``nccl_buffsize`` (Simple's) the NCCL defaults."""
    cal = calibration or REFERENCE_H100
    measured = f"(measured: {cal.source})"
    terms = [
        NvmlTerm(
            "cuda_context",
            cal.cuda_context_bytes if context_bytes is None else context_bytes,
            measured if context_bytes is None else "(given)",
        )
    ]
    if loads.cudnn:
        terms.append(NvmlTerm("cudnn", cal.cudnn_bytes, measured))
    if loads.nccl_communicators:
        terms.append(NvmlTerm("nccl_library", cal.nccl_library_bytes, measured))
    if loads.nccl_peers:
        channels = NCCL_ASSUMED_CHANNELS if nccl_channels is None else nccl_channels
        simple = NCCL_SIMPLE_BUFFSIZE if nccl_buffsize is None else nccl_buffsize
        per_connection = simple + NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE
        chan_src = "assumed" if nccl_channels is None else "given"
        buf_src = "NCCL's default" if nccl_buffsize is None else "given"
        terms.append(
            NvmlTerm(
                "nccl_buffers",
                loads.nccl_communicators * channels * per_connection,
                f"({loads.nccl_communicators} communicator(s) × {channels} channels ({chan_src}) × one ring "
                f"connection's buffers: Simple {simple / MiB:g} MiB ({buf_src}) + LL 0.5 MiB "
                "+ LL128 4.6875 MiB)",
            )
        )
    if loads.profiler:
        terms.append(NvmlTerm("profiler", cal.profiler_bytes, measured))
    if loads.samplers:
        terms.append(NvmlTerm("samplers", cal.samplers_bytes, measured))
    if loads.other_processes_bytes:
        terms.append(NvmlTerm("other_processes", loads.other_processes_bytes, "(given)"))
    return NvmlTerms(tuple(terms))
