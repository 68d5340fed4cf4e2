"""Communication/computation overlap of one rank, from a Chrome trace of torch.profiler.

Definition (Holistic Trace Analysis's, so numbers compare): merge the
communication intervals and the compute intervals of one rank separately, then

    overlap_ratio   = |comm ∩ compute| / |comm|
    exposed_comm_us = |comm| - |comm ∩ compute|

What is communication and what is compute depends on the backend:

* **nccl (GPU)** — events with ``cat == "kernel"``; a kernel whose name contains
  "nccl" (any case) is communication, every other kernel is compute, on any
  stream. Memcpy/memset activities (``gpu_memcpy``/``gpu_memset``) are neither.
* **gloo (CPU)** — what torch 2.13's profiler records for gloo: the issuing
  thread gets a short ``c10d::<op>`` cpu_op (e.g. ``c10d::_allgather_base_``,
  ``c10d::allreduce_``) that only enqueues the work; the transfer itself is a
  ``gloo:<op>`` user annotation (``gloo:all_gather``, ``gloo:all_reduce``,
  ``gloo:broadcast``, ``gloo:barrier``) on one of the gloo worker threads
  (named ``pt_gloo_runloop``, though the metadata sometimes names the same tid
  after the process, so threads are told apart by their ``gloo:*`` events, not
  their names). There is no ``record_param_comms`` event on gloo, and a
  rank blocked in ``Work.wait()`` records *no* event: the wait is a gap.
  So here **communication** = the ``gloo:*`` intervals, on whichever thread;
  **compute** = the ``aten::*`` cpu_ops of every thread that runs no ``gloo:*``
  work (in practice the main thread, where forward, backward and the optimizer
  run on CPU), minus the time inside ``c10d::*`` ops (the enqueue and gloo's
  staging copies, e.g. the ``aten::clone`` of a reduce-scatter input).
  Wrapper events (``autograd::engine::evaluate_function: …``, FSDP's
  ``FSDP::post_backward_reduce`` annotations, DDP's ``DistributedDataParallel.forward``)
  are not used, because the blocking waits happen inside them.

Limitations on CPU: a ``gloo:*`` span covers the whole collective on the
worker thread, including its own copies and the time spent waiting for the
slowest peer, so skew between ranks counts as communication. The time
between aten ops (Python, dispatcher, hooks) counts as neither. With fewer
cores than threads (2 ranks × (main + gloo threads) on 2 cores) "overlap" means
concurrent in wall-clock time, not that communication came for free.
"""

from __future__ import annotations

import gc
import gzip
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fsdpbench.core.schema import OVERLAP_RATIO, RANK

Interval = tuple[float, float]  # (start_us, end_us)

GPU_BACKENDS = ("nccl",)
CPU_BACKENDS = ("gloo",)


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of the intervals; empty and inverted ones dropped, touching ones joined."""
    merged: list[list[float]] = []
    for start, end in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def intersect_intervals(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Union(a) ∩ union(b) as sorted disjoint intervals."""
    left, right = merge_intervals(a), merge_intervals(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(left) and j < len(right):
        start = max(left[i][0], right[j][0])
        end = min(left[i][1], right[j][1])
        if end > start:
            out.append((start, end))
        if left[i][1] <= right[j][1]:
            i += 1
        else:
            j += 1
    return out


def intersection_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """|union(a) ∩ union(b)|."""
    return sum(e - s for s, e in intersect_intervals(a, b))


def subtract_intervals(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Union(a) minus union(b) as sorted disjoint intervals."""
    holes = merge_intervals(b)
    out: list[Interval] = []
    first = 0  # both lists are sorted and disjoint: holes ending before an interval end before the next
    for start, end in merge_intervals(a):
        while first < len(holes) and holes[first][1] <= start:
            first += 1
        cursor = start
        for h_start, h_end in holes[first:]:
            if h_start >= end:
                break
            if h_start > cursor:
                out.append((cursor, h_start))
            cursor = max(cursor, h_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def overlap_stats(comm: Iterable[Interval], compute: Iterable[Interval]) -> dict[str, Any]:
    """comm_us, compute_us, overlap_us, exposed_comm_us, overlap_ratio (0.0 and a note when no comm)."""
    comm_merged, compute_merged = merge_intervals(comm), merge_intervals(compute)
    comm_us = float(sum(e - s for s, e in comm_merged))
    compute_us = float(sum(e - s for s, e in compute_merged))
    overlap_us = float(intersection_length(comm_merged, compute_merged))
    note = "" if comm_us > 0 else "no communication in the trace: overlap_ratio is 0.0 by convention"
    return {
        "comm_us": comm_us,
        "compute_us": compute_us,
        "overlap_us": overlap_us,
        "exposed_comm_us": comm_us - overlap_us,
        OVERLAP_RATIO: overlap_us / comm_us if comm_us > 0 else 0.0,
        "note": note,
    }


def load_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace (.json or .json.gz) as a dict with "traceEvents"."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    # a profiled step's trace is ~10^5 objects and no reference cycle: with the collector on, parsing it
    # set off collections that walked the whole heap (torch's included) over and over, 0.03 s of parsing
    # taking 0.1-0.17 s in a rank or the orchestrator
    collecting = gc.isenabled()
    gc.disable()
    try:
        trace = json.loads(data)
    finally:
        if collecting:
            gc.enable()
    if isinstance(trace, list):  # the bare-array form of the Chrome trace format
        trace = {"traceEvents": trace}
    return trace


def trace_backend(trace: dict[str, Any]) -> str | None:
    """The process-group backend the trace says it ran with (torch writes distributedInfo)."""
    info = trace.get("distributedInfo") or {}
    backend = info.get("backend")
    return str(backend) if backend else None


def _complete_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Complete ("X") events that have a duration."""
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _interval(event: dict[str, Any]) -> Interval:
    start = float(event["ts"])
    return start, start + float(event["dur"])


def _classify_gpu(events: list[dict[str, Any]]) -> tuple[list[Interval], list[Interval]]:
    comm: list[Interval] = []
    compute: list[Interval] = []
    for e in events:
        if str(e.get("cat", "")).lower() != "kernel":
            continue
        (comm if "nccl" in str(e.get("name", "")).lower() else compute).append(_interval(e))
    return comm, compute


def _classify_gloo(events: list[dict[str, Any]]) -> tuple[list[Interval], list[Interval]]:
    comm = [_interval(e) for e in events if str(e.get("name", "")).startswith("gloo:")]
    comm_threads = {
        (e.get("pid"), e.get("tid")) for e in events if str(e.get("name", "")).startswith("gloo:")
    }
    per_thread_aten: dict[tuple[Any, Any], list[Interval]] = {}
    per_thread_c10d: dict[tuple[Any, Any], list[Interval]] = {}
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if key in comm_threads or e.get("cat") != "cpu_op":
            continue
        name = str(e.get("name", ""))
        if name.startswith("aten::"):
            per_thread_aten.setdefault(key, []).append(_interval(e))
        elif name.startswith("c10d::"):
            per_thread_c10d.setdefault(key, []).append(_interval(e))
    compute: list[Interval] = []
    for key, aten in per_thread_aten.items():
        compute.extend(subtract_intervals(aten, per_thread_c10d.get(key, [])))
    return comm, compute


def classify_trace_events(
    trace: dict[str, Any], backend: str | None = None
) -> tuple[list[Interval], list[Interval]]:
    """(comm intervals, compute intervals) in µs, per the backend's definition in the module docstring."""
    backend = (backend or trace_backend(trace) or "").lower()
    events = _complete_events(trace)
    if backend in GPU_BACKENDS:
        return _classify_gpu(events)
    if backend in CPU_BACKENDS:
        return _classify_gloo(events)
    raise ValueError(
        f"backend {backend!r} is not supported for overlap; allowed: {GPU_BACKENDS + CPU_BACKENDS}"
    )


def analyze_trace(path: str | Path | dict[str, Any], backend: str | None = None) -> dict[str, Any]:
    """Overlap statistics of one rank's trace (its file, or the file loaded), with the backend, rank and
    interval counts."""
    trace = path if isinstance(path, dict) else load_trace(path)
    backend = (backend or trace_backend(trace) or "").lower()
    comm, compute = classify_trace_events(trace, backend)
    info = trace.get("distributedInfo") or {}
    return {
        "backend": backend,
        RANK: info.get(RANK),
        "n_comm_intervals": len(comm),
        "n_compute_intervals": len(compute),
        **overlap_stats(comm, compute),
    }
