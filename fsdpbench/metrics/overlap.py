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

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fsdpbench.core.schema import OVERLAP_RATIO, RANK
from fsdpbench.metrics.trace import Interval, Trace, intersection_length, merge_intervals, subtract_intervals

GPU_BACKENDS = ("nccl",)
CPU_BACKENDS = ("gloo",)


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


def _host_compute(trace: Trace) -> list[Interval]:
    """Each host thread's aten ops minus its own c10d ops (the enqueue and gloo's staging copies)."""
    compute: list[Interval] = []
    for aten, c10d in trace.host_ops.values():
        compute.extend(subtract_intervals(aten, c10d))
    return compute


def classify_trace_events(
    trace: Trace | dict[str, Any], backend: str | None = None
) -> tuple[list[Interval], list[Interval]]:
    """(comm intervals, compute intervals) in µs, per the backend's definition in the module docstring."""
    trace = Trace.of(trace)
    backend = (backend or trace.backend or "").lower()
    if backend in GPU_BACKENDS:
        return trace.device_comm, trace.device_compute
    if backend in CPU_BACKENDS:
        return trace.host_comm, _host_compute(trace)
    raise ValueError(
        f"backend {backend!r} is not supported for overlap; allowed: {GPU_BACKENDS + CPU_BACKENDS}"
    )


def analyze_trace(path: str | Path | Trace | dict[str, Any], backend: str | None = None) -> dict[str, Any]:
    """Overlap statistics of one rank's trace (its file, or the trace read), with the backend, rank and
    interval counts."""
    trace = Trace.of(path) if isinstance(path, (Trace, dict)) else Trace.load(path)
    backend = (backend or trace.backend or "").lower()
    comm, compute = classify_trace_events(trace, backend)
    return {
        "backend": backend,
        RANK: trace.info.get(RANK),
        "n_comm_intervals": len(comm),
        "n_compute_intervals": len(compute),
        **overlap_stats(comm, compute),
    }
