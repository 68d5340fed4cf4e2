"""The layers of one prediction must nest as device memory does (docs/memory-model.md):

    live tensors (tracked)  ≤  allocated  ≤  reserved  ≤  NVML used

An allocation stream that misses allocations can predict less allocated memory than the tracker's live
tensors, which no caching allocator can hold; this says where a prediction breaks the order, for the
analytic layer (the schedule's stream, ``alloc_stream.from_schedule``) and the traced one (the stream
recorded op by op, ``traced_stream.py``), each replayed through the allocator model.

    from fsdpbench.predictors.consistency import layer_figures, violations
    violations(layer_figures(case, "traced"))     # [] when the layers nest
    disagreements(layer_figures(case, "analytic"), layer_figures(case, "traced"))   # [] when they agree

Two methods of one case answer the same question, so beside nesting their peaks must agree: the analytic
tracked peak and the traced one, and the allocated peaks of their streams, within ``AGREEMENT`` of each
other. ``predict --device-memory`` prints no fits verdict where either fails: the models contradict each
other, and which one is right is not known from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdpbench.core.case import Case
from fsdpbench.predictors.memory_model.alloc_stream import AllocStream, CudaRuntime

if TYPE_CHECKING:
    from fsdpbench.predictors.device_fit import DeviceModel

METHODS = ("analytic", "traced")
ANALYTIC_RESIDENT = ("params", "padding", "inputs")  # the schedule's categories that outlive a step
# the share by which the analytic and the traced peaks of one case may differ and still agree: the two
# differ by what each models (kernels' saved tensors on a CPU-only build, stand-ins for CUDA's), within a
# few per cent over the traced grid (docs/memory-model.md); beyond it one of them misses something
AGREEMENT = 0.10
COMPARED_LAYERS = ("tracked", "allocated")


def _bytes(n: int) -> str:
    return f"{n:,} B"


@dataclass(frozen=True, slots=True)
class LayerFigures:
    """One rank's predicted peaks, layer by layer (bytes; modelled)."""

    method: str
    tracked: int
    allocated: int
    reserved: int
    nvml: int


def violations(f: LayerFigures, fmt: Callable[[int], str] = _bytes) -> list[str]:
    """Each place where the layers do not nest, as a sentence (sizes by ``fmt``)."""
    out = []
    for lower, upper in (("tracked", "allocated"), ("allocated", "reserved"), ("reserved", "nvml")):
        if getattr(f, upper) < getattr(f, lower):
            out.append(f"{f.method}: {upper} {fmt(getattr(f, upper))} < {lower} {fmt(getattr(f, lower))}")
    return out


def disagreements(
    a: LayerFigures, b: LayerFigures, fmt: Callable[[int], str] = _bytes, band: float = AGREEMENT
) -> list[str]:
    """Where two methods' figures of one case contradict each other, as sentences: each method's layers
    that do not nest, then each compared layer (tracked, allocated) whose two peaks differ by more than
    ``band`` of the larger."""
    out = violations(a, fmt) + violations(b, fmt)
    for layer in COMPARED_LAYERS:
        x, y = getattr(a, layer), getattr(b, layer)
        if abs(x - y) > band * max(x, y):
            out.append(
                f"{layer} peak: {a.method} {fmt(x)}, {b.method} {fmt(y)}: "
                f"{abs(x - y) / max(x, y):.0%} apart (they agree within {band:.0%})"
            )
    return out


def analytic_stream(case: Case) -> AllocStream:
    """The analytic schedule's stream (stage by stage)."""
    from fsdpbench.predictors.memory_model import step_events
    from fsdpbench.predictors.memory_model.alloc_stream import from_schedule

    return from_schedule(step_events(case), ANALYTIC_RESIDENT, "optim")


def layer_figures(
    case: Case,
    method: str,
    *,
    rank: int = 0,
    runtime: CudaRuntime | None = None,
    model: DeviceModel | None = None,
) -> LayerFigures:
    """``method``'s tracked peak and its stream replayed: allocated, reserved; NVML from the terms.
    ``runtime``: what the CUDA libraries take from the allocator (cuBLAS's workspaces; default H100's);
    ``model``: the device model to replay with (its settings, NVML terms and traces), instead."""
    from fsdpbench.predictors.device_fit import DeviceModel

    model = model or DeviceModel.for_case(case, rank=rank, runtime=runtime)
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
