"""Does it fit, with how large a batch, on how few ranks — searches over the analytic model.

- ``parse_bytes("80GiB")``: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024); a bare
  number is bytes; case-insensitive, optional space, decimals allowed ("1.5 TB").
- Fit test: the predicted device peak (live tensors at the peak + buffers the trackers do not see + the
  CUDA context allowance on a GPU) ≤ the device memory. Without a model (``--params``) only the model
  states can be tested: a necessary condition, reported as such.
- Largest batch: the per-rank batch, doubling from 1 then bisecting (memory grows with the batch).
- Smallest world size: powers of two from 1 up to ``max_world_size`` (multiples of the HSDP shard size).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from fsdpbench.core.case import Case

# what the searches ask of the memory model: a case's prediction (a MemoryPrediction)
Predictor = Callable[[Case], object]

MAX_BYTES = 2**60  # an exbibyte: more than any device or host holds; past it a number is a typo
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'80GiB' → 85899345920; raises ValueError naming the accepted units."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size; use a number with one of "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 80GiB"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise ValueError(f"{text!r}: larger than any memory ({MAX_BYTES / 2**60:g} EiB at most)")
    return int(value)


@dataclass(frozen=True, slots=True)
class FitReport:
    device_memory_bytes: int
    needed_bytes: int
    fits: bool
    complete: bool  # False: only model states were known (a necessary condition)
    largest_batch: int | None  # None: not searched (no activation model) or even batch 1 does not fit
    smallest_world_size: int | None  # None: none up to the limit fits


def needed_bytes(pred) -> tuple[int, bool]:  # noqa: ANN001 — a MemoryPrediction
    """(bytes the device must hold, whether the whole peak was estimated)."""
    if pred.peak_bytes is not None:
        return pred.device_peak_bytes, True
    return pred.model_states_bytes + pred.context_bytes, False


def fit_report(
    case: Case,
    predict: Predictor,
    device_memory_bytes: int,
    *,
    max_world_size: int = 65536,
    shard_multiple: int = 1,
    max_batch: int = 1 << 20,
) -> FitReport:
    """Fit of ``case``, the largest per-rank batch that fits, the smallest world size that fits."""
    needed, complete = needed_bytes(predict(case))
    fits = needed <= device_memory_bytes
    batch = largest_batch(case, predict, device_memory_bytes, max_batch=max_batch) if complete else None
    world = smallest_world_size(
        case, predict, device_memory_bytes, max_world_size=max_world_size, multiple=shard_multiple
    )
    return FitReport(device_memory_bytes, needed, fits, complete, batch, world)


def largest_batch(case: Case, predict: Predictor, limit: int, *, max_batch: int = 1 << 20) -> int | None:
    def ok(b: int) -> bool:
        return needed_bytes(predict(case.replace(batch_size=b)))[0] <= limit

    if not ok(1):
        return None
    lo = 1
    while lo < max_batch and ok(min(2 * lo, max_batch)):
        lo = min(2 * lo, max_batch)
    if lo >= max_batch:
        return max_batch
    hi = min(2 * lo, max_batch)  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def smallest_world_size(
    case: Case, predict: Predictor, limit: int, *, max_world_size: int = 65536, multiple: int = 1
) -> int | None:
    n = 1
    while n <= max_world_size:
        if n % multiple == 0 and needed_bytes(predict(case.replace(world_size=n)))[0] <= limit:
            return n
        n *= 2
    return None
