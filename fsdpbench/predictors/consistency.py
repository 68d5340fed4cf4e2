"""The layers of one prediction must nest as device memory does (docs/memory-model.md):

    live tensors (tracked)  ≤  allocated  ≤  reserved  ≤  NVML used

An allocation stream that misses allocations can predict less allocated memory than the tracker's live
tensors, which no caching allocator can hold; this says where a prediction breaks the order, for the
analytic layer (the schedule's stream, ``alloc_stream.from_schedule``) and the traced one (the stream
recorded op by op, ``traced_stream.py``), each replayed through the allocator model.

    from fsdpbench.predictors.consistency import layer_figures, violations
    violations(layer_figures(case, "traced"))     # [] when the layers nest
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpbench.core.case import Case
from fsdpbench.predictors.memory_model.alloc_stream import AllocStream, CudaRuntime

METHODS = ("analytic", "traced")
ANALYTIC_RESIDENT = ("params", "padding", "inputs")  # the schedule's categories that outlive a step


@dataclass(frozen=True, slots=True)
class LayerFigures:
    """One rank's predicted peaks, layer by layer (bytes; modelled)."""

    method: str
    tracked: int
    allocated: int
    reserved: int
    nvml: int


def violations(f: LayerFigures) -> list[str]:
    """Each place where the layers do not nest, as a sentence."""
    out = []
    for lower, upper in (("tracked", "allocated"), ("allocated", "reserved"), ("reserved", "nvml")):
        if getattr(f, upper) < getattr(f, lower):
            out.append(f"{f.method}: {upper} {getattr(f, upper):,} B < {lower} {getattr(f, lower):,} B")
    return out


def analytic_stream(case: Case) -> AllocStream:
    """The analytic schedule's stream (stage by stage)."""
    from fsdpbench.predictors.memory_model import step_events
    from fsdpbench.predictors.memory_model.alloc_stream import from_schedule

    return from_schedule(step_events(case), ANALYTIC_RESIDENT, "optim")


def layer_figures(
    case: Case, method: str, *, rank: int = 0, runtime: CudaRuntime | None = None
) -> LayerFigures:
    """``method``'s tracked peak and its stream replayed: allocated, reserved; NVML from the terms.
    ``runtime``: what the CUDA libraries take from the allocator (cuBLAS's workspaces; default H100's)."""
    from fsdpbench.predictors.device_fit import DeviceModel

    model = DeviceModel.for_case(case, rank=rank, runtime=runtime)
    if method == "analytic":
        from fsdpbench.predictors.memory_model import predict_memory

        tracked = int(predict_memory(case, rank=rank).peak_bytes or 0)
        stream = analytic_stream(case)
    elif method == "traced":
        stream, tracked = model.stream(case)
    else:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    memory = model.replayed(case, stream, tracked)
    return LayerFigures(method, tracked, memory.allocated_peak, memory.reserved_peak, memory.nvml_peak)
