"""Achieved bandwidth of each collective kind in the profiled step, by nccl-tests' conventions.

nccl-tests (``doc/PERFORMANCE.md``) reports, for a collective on S bytes taking t seconds,

    algbw = S / t            S: the full tensor (all-gather output, reduce-scatter input,
                             the all-reduced or broadcast tensor)
    busbw = algbw · factor   all_reduce 2(N-1)/N, all_gather and reduce_scatter (N-1)/N,
                             broadcast 1 (the busiest link carries S)

so that busbw compares with the hardware's link bandwidth whatever the collective. Here t is the
collective's own duration in the trace, summed over the calls of a kind (algbw = ΣS / Σt):

* nccl: the NCCL kernels on the GPU (``cat == "kernel"``, "nccl" in the name), their kind from the
  kernel's "Collective name" argument or else its name (``ncclDevKernel_AllGather_RING_LL``);
* gloo: the ``gloo:<op>`` span on gloo's worker thread that ran each ``c10d::`` call (paired in
  ``comm.collective_records``). gloo has no reduce-scatter: it all-reduces the full input, and that
  time is the reduce-scatter's; its busbw is still by the reduce-scatter convention.

A span includes the wait for the slowest peer (skew between ranks), as in nccl-tests' own timing.
At world size 1 nothing moves between ranks: no bandwidth (None).
"""

from __future__ import annotations

from typing import Any

from fsdpbench.core.schema import COMM_ALGBW, COMM_BUSBW, COMM_TIME
from fsdpbench.metrics.comm import KINDS, CollectiveRecord, collective_kind
from fsdpbench.metrics.trace import Trace


def bus_factor(kind: str, group_size: int) -> float | None:
    """nccl-tests' busbw/algbw for a collective of ``kind`` over N ranks (None: no convention)."""
    n = int(group_size)
    if n <= 1:
        return None
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if kind == "broadcast":
        return 1.0
    return None


def nccl_kernel_us(trace: Trace | dict[str, Any]) -> dict[str, float]:
    """Summed duration (µs) of the NCCL kernels in the trace, by collective kind."""
    out = dict.fromkeys(KINDS, 0.0)
    for e in Trace.of(trace).nccl_kernels:
        name = str((e.get("args") or {}).get("Collective name") or e["name"])
        out[collective_kind(name)] += float(e["dur"])
    return out


def bandwidth_by_kind(
    records: list[CollectiveRecord], trace: Trace | dict[str, Any], *, backend: str, steps: int = 1
) -> dict[str, Any]:
    """comm_<kind>_time_ms (per step), comm_<kind>_algbw_gbs and comm_<kind>_busbw_gbs (GB/s, 1e9 B/s)
    for every kind that moved bytes between ranks in the trace."""
    kernel_us = nccl_kernel_us(trace) if backend == "nccl" else None
    out: dict[str, Any] = {}
    for kind in KINDS:
        calls = _calls_between_ranks(records, kind)
        if not calls:
            continue
        time_us = kernel_us[kind] if kernel_us is not None else _backend_span_us(calls)
        if time_us is not None and time_us > 0:
            out.update(_rates(kind, calls, time_us, steps))
    return out


def _calls_between_ranks(records: list[CollectiveRecord], kind: str) -> list[CollectiveRecord]:
    """The calls of ``kind`` that moved bytes between ranks (a group of more than one, a payload)."""
    return [r for r in records if r.kind == kind and r.group_size > 1 and r.payload_bytes > 0]


def _backend_span_us(calls: list[CollectiveRecord]) -> float | None:
    """Summed duration of the backend spans that ran the calls; None when a call's work is not in the
    trace: no honest rate for its kind."""
    spans = [r.dur_us for r in calls]
    if any(d is None for d in spans):
        return None
    return sum(d for d in spans if d is not None)


def _rates(kind: str, calls: list[CollectiveRecord], time_us: float, steps: int) -> dict[str, float]:
    """Time per step, algbw and (where every call's group has a convention) busbw of one kind."""
    payload = sum(r.payload_bytes for r in calls)
    factors = [bus_factor(kind, r.group_size) for r in calls]
    out = {
        COMM_TIME.of(kind): time_us / 1e3 / max(1, steps),
        COMM_ALGBW.of(kind): payload / (time_us * 1e-6) / 1e9,
    }
    if all(f is not None for f in factors):
        bus = sum(r.payload_bytes * f for r, f in zip(calls, factors) if f is not None)
        out[COMM_BUSBW.of(kind)] = bus / (time_us * 1e-6) / 1e9
    return out
