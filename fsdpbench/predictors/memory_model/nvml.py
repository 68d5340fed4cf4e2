"""What NVML reports beyond the caching allocator's reserved memory, term by term: predicted NVML used =
reserved + CUDA context & libraries + NCCL's communicator buffers. Each term says where its number comes
from and can be overridden (``fsdpbench predict --context-bytes``, ``--nccl-channels``).

- CUDA context & libraries: the driver's context, the kernels loaded (torch's, cuBLAS's, cuDNN's), library
  handles — memory the caching allocator never sees. Not derivable from first principles; the default is a
  MEASUREMENT: NVML peak − ``max_memory_reserved`` on the reference H100 (driver 580.159, CUDA 13.0,
  torch 2.11.0+cu130, one rank, world size 1, so no NCCL peers): 1,881,997,312 B in fp32 and
  1,896,677,376–1,898,774,528 B in bf16 (cuDNN attention's kernels), ../shared/reference/gpu-h100/
  single_gpu_decoder-base_results.parquet. The larger is used: other GPUs, drivers and CUDA versions differ.
- NCCL: per communicator and channel, one connection's buffers for each protocol, at NCCL's documented
  defaults — Simple ``NCCL_BUFFSIZE`` = 4 MiB (docs: "The default is 4194304 (4 MB)"), LL 512 KiB
  (``NCCL_LL_LINES_PER_THREAD × NCCL_LL_MAX_NTHREADS × NCCL_STEPS × 16 B`` = 8·512·8·16) and LL128
  4.6875 MiB (``NCCL_LL128_ELEMS_PER_THREAD × NCCL_LL128_MAX_NTHREADS × NCCL_STEPS × 8 B`` = 120·640·8·8),
  NCCL 2.x src/include/device.h. FSDP's all-gather and reduce-scatter run rings, so each channel receives
  from one peer. How many channels NCCL opens depends on the topology (up to 32, ``MAXCHANNELS``); the
  default 16 is an ASSUMPTION (an NVLink-connected node), stated as such. A communicator is one process
  group that runs NCCL collectives: one for FSDP/DDP, two for HSDP (shard and replicate groups); none on one
  rank or with the fake process group. NVLS/CollNet buffers are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpbench.core.numbers import MiB

# NVML peak − allocator peak reserved, measured on the reference H100 (bf16: the larger of the two precisions)
H100_CONTEXT_BYTES = 1_898_774_528
H100_CONTEXT_SOURCE = (
    "measured: NVML peak − allocator peak reserved on the reference H100 (driver 580.159, CUDA 13.0, "
    "torch 2.11, world size 1)"
)
NCCL_SIMPLE_BUFFSIZE = 4 * MiB  # NCCL_BUFFSIZE's documented default
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16  # 512 KiB
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8  # 4.6875 MiB
NCCL_PROTOCOL_BYTES = NCCL_SIMPLE_BUFFSIZE + NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE
NCCL_ASSUMED_CHANNELS = 16


@dataclass(frozen=True, slots=True)
class NvmlTerms:
    """Device memory outside the caching allocator (bytes), each term with its source."""

    context_bytes: int
    nccl_bytes: int
    context_source: str
    nccl_source: str

    @property
    def total(self) -> int:
        return self.context_bytes + self.nccl_bytes

    def nvml_bytes(self, reserved: int) -> int:
        """Predicted NVML used: the allocator's reserved memory plus these terms."""
        return reserved + self.total


def nccl_communicators(world_size: int, shard_group: int | None, backend: str) -> int:
    """Process groups that run NCCL collectives on a rank (0 with one rank or without NCCL)."""
    if backend != "nccl" or world_size <= 1:
        return 0
    if shard_group and 1 < shard_group < world_size:
        return 2  # HSDP: a shard group and a replicate group
    return 1


def nvml_terms(
    world_size: int,
    *,
    shard_group: int | None = None,
    backend: str = "nccl",
    context_bytes: int | None = None,
    nccl_channels: int | None = None,
    nccl_buffsize: int | None = None,
) -> NvmlTerms:
    """The terms for one rank; ``context_bytes``, ``nccl_channels`` and ``nccl_buffsize`` (Simple's)
    override the defaults."""
    comms = nccl_communicators(world_size, shard_group, backend)
    channels = NCCL_ASSUMED_CHANNELS if nccl_channels is None else nccl_channels
    simple = NCCL_SIMPLE_BUFFSIZE if nccl_buffsize is None else nccl_buffsize
    per_connection = simple + NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE
    nccl = comms * channels * per_connection
    chan_src = "assumed" if nccl_channels is None else "given"
    buf_src = "NCCL's default" if nccl_buffsize is None else "given"
    nccl_source = (
        f"{comms} communicator(s) × {channels} channels ({chan_src}) × one ring connection's buffers "
        f"(Simple {simple / MiB:g} MiB ({buf_src}) + LL 0.5 MiB + LL128 4.6875 MiB)"
    )
    return NvmlTerms(
        context_bytes=H100_CONTEXT_BYTES if context_bytes is None else context_bytes,
        nccl_bytes=nccl,
        context_source=H100_CONTEXT_SOURCE if context_bytes is None else "given",
        nccl_source=nccl_source,
    )
