"""Modelled step time at N ranks: the compute of one profiled step, measured, plus communication
modelled on a link (fsdpbench/predictors/comm_model.py), placed where the strategy issues and waits for it.

**Compute.** From the rank's profiled step (a real run's trace, or an emulated rank's, whose
collectives take no time), take the step's span on the compute timeline (CPU: the threads that run
aten ops and no gloo work; GPU: the non-NCCL kernels) and remove the time it spent *waiting for a
collective*: each gap in compute that contains the end of a communication interval is a wait from
the gap's start to that end (a blocked thread resumes when its collective finishes). The rest of
every gap (Python, hooks, launch latency) stays: it is compute-side time the link does not change.
What is left is the compute clock, on which every collective gets two points:

* **issue**: where the strategy issued it, read from the trace (the ``c10d::`` op, or on GPU the
  first kernel launched after it), so FSDP's prefetch order and DDP's bucket order are the ones
  the run really had;
* **needed**: where compute cannot go on without it, by the strategy's rules (``_needed_rule``):
  an FSDP2 all-gather at the unit's ``FSDP::all_gather_copy_out`` (FSDP2 waits for the unshard
  there; on the CPU without prefetch that is right after the issue, as FSDP2 unshards with
  ``async_op=False``); on the CPU FSDP2's reduce-scatters (and HSDP all-reduces) block the caller
  (needed = issue), on a GPU they run on their own stream and are needed before the optimizer step;
  DDP's bucket all-reduces are asynchronous and waited for before the optimizer step;
  ZeroRedundancyOptimizer's broadcasts are asynchronous and waited for at the end of the step.

**Communication.** One communication stream, first issued first served: a collective starts when
it is issued and the previous one has finished, and lasts α + S·factor/busbw. Compute stalls at a
collective's needed point until it has finished. Then

    model_step_time = compute + stalls,  model_exposed_comm = stalls,
    model_overlap_ratio = 1 − stalls / Σ collective times   (HTA's definition, as in overlap.py)

**Not modelled** (named, so a residual error can be explained): contention between compute and
communication for the same cores or memory bandwidth (on 2 CPU cores, 4 ranks' compute and gloo
threads share them), gloo's second worker thread (two collectives can run at once there), skew
between ranks (a collective waits for the slowest peer), and the profiler's own overhead in the
profiled step's compute.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdpbench.metrics.comm import collective_records
from fsdpbench.metrics.overlap import Interval, merge_intervals, subtract_intervals
from fsdpbench.predictors.comm_model import Link, collective_time_us
from fsdpbench.schema import (
    MODEL_COLLECTIVES,
    MODEL_COMM,
    MODEL_COMPUTE,
    MODEL_EXPOSED_COMM,
    MODEL_LINK,
    MODEL_LINK_SOURCE,
    MODEL_METHOD,
    MODEL_NOTE,
    MODEL_OVERLAP_RATIO,
    MODEL_PEER_WAIT,
    MODEL_PROFILER_REMOVED,
    MODEL_RANKS_SIMULATED,
    MODEL_STEP_TIME,
    MODEL_WAITS_REMOVED,
)

if TYPE_CHECKING:
    from fsdpbench.strategies.base import Sharding

METHOD = "modelled: measured compute of the profiled step + α–β communication on one stream"


@dataclass(frozen=True, slots=True)
class PlacedCollective:
    """One collective on the compute clock (µs from the step's start, waits removed)."""

    kind: str
    payload_bytes: int
    group_size: int
    issue_us: float
    needed_us: float


@dataclass(frozen=True, slots=True)
class StepTimeline:
    """The compute of the profiled step(s) and where each collective is issued and needed."""

    compute_us: float
    collectives: tuple[PlacedCollective, ...]
    waits_removed_us: float = 0.0
    steps: int = 1
    profiler_removed_us: float = 0.0
    note: str = ""  # why the compute figure is not corrected, if it is not


def simulate(timelines: list[StepTimeline], link: Link) -> list[dict[str, float]]:
    """Each rank's step time, communication, exposed communication and overlap per step, in ms, on
    ``link``, simulated jointly: collective k (the k-th issued; every rank issues the same ones in
    the same order) starts once every rank has issued it and the previous collective has finished,
    and ends for all ranks at once. One rank's timeline (an emulated run) is the same with no peers."""
    if not timelines:
        return []
    counts = {len(t.collectives) for t in timelines}
    if len(counts) > 1:  # ranks disagree (should not happen): model each rank on its own
        return [simulate([t], link)[0] for t in timelines]
    first = timelines[0].collectives
    durations = [collective_time_us(link, c.kind, c.payload_bytes, c.group_size) for c in first]
    stall = [0.0] * len(timelines)
    pending = [
        sorted((max(c.needed_us, c.issue_us), k) for k, c in enumerate(t.collectives)) for t in timelines
    ]
    ends: list[float] = []
    starts: list[float] = []
    exposed = [0.0] * len(timelines)  # the part of each stall during which the awaited collective ran

    def advance(r: int, clock: float, inclusive: bool) -> None:
        """Rank r computes up to ``clock``, stalling at every needed point on the way."""
        while pending[r] and (pending[r][0][0] < clock or (inclusive and pending[r][0][0] <= clock)):
            needed, k = pending[r][0]
            if k >= len(ends):
                return  # needed before it is issued cannot happen (needed >= issue); stop here
            pending[r].pop(0)
            wall = needed + stall[r]
            if ends[k] > wall:
                exposed[r] += ends[k] - max(wall, starts[k])
                stall[r] = ends[k] - needed

    comm_free = 0.0
    for k in range(len(durations)):
        issued = []
        for r, t in enumerate(timelines):
            advance(r, t.collectives[k].issue_us, inclusive=False)
            issued.append(t.collectives[k].issue_us + stall[r])
        start = max(max(issued), comm_free)
        starts.append(start)
        comm_free = start + durations[k]
        ends.append(comm_free)
    comm = sum(durations)
    out = []
    for r, t in enumerate(timelines):
        advance(r, float("inf"), inclusive=True)
        steps = max(1, t.steps)
        out.append(
            {
                MODEL_STEP_TIME: (t.compute_us + stall[r]) / steps / 1e3,
                MODEL_COMPUTE: t.compute_us / steps / 1e3,
                MODEL_COMM: comm / steps / 1e3,
                MODEL_EXPOSED_COMM: exposed[r] / steps / 1e3,
                MODEL_PEER_WAIT: (stall[r] - exposed[r]) / steps / 1e3,
                MODEL_OVERLAP_RATIO: 1.0 - exposed[r] / comm if comm > 0 else 0.0,
            }
        )
    return out


# -- the trace → StepTimeline ----------------------------------------------------------------
def _complete(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _span(e: dict[str, Any]) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _host_intervals(events: list[dict[str, Any]]) -> tuple[list[Interval], list[Interval], Interval]:
    """CPU ranks: (comm = gloo:* work, compute = aten ops minus c10d ops on the other threads, step span)."""
    comm = [_span(e) for e in events if str(e.get("name", "")).startswith("gloo:")]
    comm_threads = {
        (e.get("pid"), e.get("tid")) for e in events if str(e.get("name", "")).startswith("gloo:")
    }
    aten: list[Interval] = []
    c10d: list[Interval] = []
    for e in events:
        if (e.get("pid"), e.get("tid")) in comm_threads or e.get("cat") != "cpu_op":
            continue
        name = str(e.get("name", ""))
        if name.startswith("aten::"):
            aten.append(_span(e))
        elif name.startswith("c10d::"):
            c10d.append(_span(e))
    compute = subtract_intervals(aten, c10d)
    host = [
        _span(e)
        for e in events
        if (e.get("pid"), e.get("tid")) not in comm_threads and e.get("cat") in ("cpu_op", "user_annotation")
    ]
    span = (min(s for s, _ in host), max(t for _, t in host)) if host else (0.0, 0.0)
    return comm, compute, span


def _device_intervals(events: list[dict[str, Any]]) -> tuple[list[Interval], list[Interval], Interval]:
    """GPU ranks: (comm = NCCL kernels, compute = other kernels, step span on the device clock)."""
    kernels = [e for e in events if str(e.get("cat", "")).lower() == "kernel"]
    comm = [_span(e) for e in kernels if "nccl" in str(e.get("name", "")).lower()]
    compute = [_span(e) for e in kernels if "nccl" not in str(e.get("name", "")).lower()]
    all_k = [_span(e) for e in kernels]
    span = (min(s for s, _ in all_k), max(t for _, t in all_k)) if all_k else (0.0, 0.0)
    return comm, compute, span


def _waits(comm: list[Interval], compute: list[Interval], span: Interval) -> list[Interval]:
    """Parts of the step where compute waited for a collective: from a compute gap's start to the
    last communication end inside that gap."""
    comm_ends = sorted(e for _, e in comm)
    waits = []
    for g0, g1 in subtract_intervals([span], compute):
        lo, hi = bisect.bisect_right(comm_ends, g0), bisect.bisect_right(comm_ends, g1)
        if hi > lo:
            waits.append((g0, comm_ends[hi - 1]))
    return waits


class _Clock:
    """Trace time → compute clock: µs since the step's start, minus the waits before it, times
    ``scale`` (< 1 takes the profiler's own cost out, spread evenly over the step)."""

    def __init__(self, start: float, waits: list[Interval], scale: float = 1.0) -> None:
        self.start = start
        self.waits = merge_intervals(waits)
        self.scale = scale

    def __call__(self, t: float) -> float:
        removed = sum(max(0.0, min(t, e) - s) for s, e in self.waits if s < t)
        return (t - self.start - removed) * self.scale


def _host_to_device(events: list[dict[str, Any]]) -> Any:
    """GPU: host time → device time of the first kernel launched at or after it (None if none)."""
    launch_ts = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in (e.get("args") or {})
    }
    pairs = sorted(
        (launch_ts[c], float(e["ts"]))
        for e in events
        if str(e.get("cat", "")).lower() == "kernel"
        and (c := (e.get("args") or {}).get("correlation")) in launch_ts
    )
    launches = [p[0] for p in pairs]

    def to_device(t: float) -> float | None:
        i = bisect.bisect_left(launches, t)
        return pairs[i][1] if i < len(pairs) else None

    return to_device


def _annotation_starts(events: list[dict[str, Any]], prefix: str) -> list[float]:
    return sorted(float(e["ts"]) for e in events if str(e.get("name", "")).startswith(prefix))


def _needed_rule(kind: str, sharding: Sharding, device_type: str) -> str:
    """Where compute needs a collective: 'issue' (blocking), 'copy_out', 'optimizer' or 'step_end'."""
    if kind == "broadcast":
        return "step_end"  # ZeroRedundancyOptimizer waits for its broadcasts at the end of step()
    if kind == "all_reduce" and sharding.grad_reduction == "all_reduce":
        return "optimizer"  # DDP's buckets: asynchronous, all waited for when backward finishes
    if kind == "all_gather":
        # FSDP2 waits for an unshard right before its copy-out: on a GPU (all-gather stream) and on
        # the CPU with prefetch (fsdpbench sets async unshard there) that is later than the issue;
        # a synchronous CPU all-gather is followed by its copy-out at once, so the rule holds there too
        return "copy_out"
    if device_type != "cuda":
        return "issue"  # FSDP2's reduce-scatter (and HSDP all-reduce) on the CPU: the caller blocks
    return "optimizer"


def _profiled_ops(events: list[dict[str, Any]]) -> int:
    """cpu_op events on the threads that run no gloo work: what the profiler paid for on the compute side."""
    comm_threads = {
        (e.get("pid"), e.get("tid")) for e in events if str(e.get("name", "")).startswith("gloo:")
    }
    return sum(
        1 for e in events if e.get("cat") == "cpu_op" and (e.get("pid"), e.get("tid")) not in comm_threads
    )


# Above this share of the profiled compute, the profiler's estimated own cost is the figure, not a
# correction to it (it once took tiny steps down to 0 ms): such a step is modelled uncorrected, and says so.
MAX_PROFILER_SHARE = 0.5


def build_timeline(
    trace: dict[str, Any],
    sharding: Sharding,
    device_type: str,
    *,
    steps: int = 1,
    group_size: int | None = None,
    profiler_overhead_us_per_op: float = 0.0,
) -> StepTimeline:
    """The StepTimeline of one rank's profiled step(s); ``sharding`` is the strategy's declaration.

    On CPU ranks the profiled step's compute includes the profiler's own cost per recorded op;
    ``profiler_overhead_us_per_op`` (measured by comm_probe.py) × the ops recorded is taken out.
    On a GPU the compute is kernels, which the host-side profiler does not slow down."""
    events = _complete(trace)
    on_gpu = device_type == "cuda" and any(str(e.get("cat", "")).lower() == "kernel" for e in events)
    comm, compute, span = _device_intervals(events) if on_gpu else _host_intervals(events)
    waits = _waits(comm, compute, span)
    raw_compute = _Clock(span[0], waits)(span[1])
    overhead = 0.0 if on_gpu else profiler_overhead_us_per_op * _profiled_ops(events)
    note = ""
    if overhead > MAX_PROFILER_SHARE * raw_compute:
        note = (
            f"profiler cost not taken out: its estimate ({overhead / 1e3:.1f} ms, "
            f"{profiler_overhead_us_per_op:.2f} µs "
            f"× {_profiled_ops(events)} ops) is over {MAX_PROFILER_SHARE:.0%} of the profiled compute "
            f"({raw_compute / 1e3:.1f} ms); compute includes the profiler's cost (an over-estimate)"
        )
        overhead = 0.0
    scale = (raw_compute - overhead) / raw_compute if raw_compute > 0 else 1.0
    clock = _Clock(span[0], waits, scale)
    to_device = _host_to_device(events) if on_gpu else (lambda t: t)
    step_end = span[1]

    def on_clock(host_t: float | None) -> float:
        device_t = to_device(host_t) if host_t is not None else None
        return clock(min(device_t if device_t is not None else step_end, step_end))

    copy_outs = _annotation_starts(events, "FSDP::all_gather_copy_out")
    optim = _annotation_starts(events, "Optimizer.step#")

    def first_after(starts: list[float], t: float) -> float | None:
        i = bisect.bisect_left(starts, t)
        return starts[i] if i < len(starts) else None

    placed = []
    for r in collective_records(trace, group_size=group_size):
        rule = _needed_rule(r.kind, sharding, device_type)
        issue = on_clock(r.ts_us)
        needed = {
            "issue": issue,
            "copy_out": on_clock(first_after(copy_outs, r.ts_us))
            if first_after(copy_outs, r.ts_us)
            else issue,
            "optimizer": on_clock(first_after(optim, r.ts_us)),
            "step_end": on_clock(None),
        }[rule]
        placed.append(PlacedCollective(r.kind, r.payload_bytes, r.group_size, issue, needed))
    compute_us = clock(step_end)
    removed = sum(e - s for s, e in merge_intervals(waits))
    return StepTimeline(compute_us, tuple(placed), removed, max(1, steps), raw_compute - compute_us, note)


def model_columns(timelines: list[StepTimeline], link: Link) -> list[dict[str, Any]]:
    """The model_* columns of each rank whose timeline is given (modelled figures: every name says so)."""
    out = []
    for timeline, figures in zip(timelines, simulate(timelines, link)):
        steps = max(1, timeline.steps)
        out.append(
            {
                **figures,
                MODEL_LINK: link.label(),
                MODEL_LINK_SOURCE: link.source,
                MODEL_RANKS_SIMULATED: len(timelines),
                MODEL_COLLECTIVES: len(timeline.collectives) / steps,
                MODEL_WAITS_REMOVED: timeline.waits_removed_us / steps / 1e3,
                MODEL_PROFILER_REMOVED: timeline.profiler_removed_us / steps / 1e3,
                MODEL_NOTE: timeline.note,
            }
        )
    return out


def case_model_columns(
    trace_paths: dict[int, Any],
    sharding: Sharding,
    device_type: str,
    link: Link,
    *,
    steps: int = 1,
    group_size: int | None = None,
    profiler_overhead_us_per_op: float = 0.0,
) -> dict[int, dict[str, Any]]:
    """model_* columns per rank from each rank's profiled trace, simulated jointly."""
    from fsdpbench.metrics.overlap import load_trace

    ranks = sorted(trace_paths)
    timelines = [
        build_timeline(
            load_trace(trace_paths[r]),
            sharding,
            device_type,
            steps=steps,
            group_size=group_size,
            profiler_overhead_us_per_op=profiler_overhead_us_per_op,
        )
        for r in ranks
    ]
    return {r: {**cols, MODEL_METHOD: METHOD} for r, cols in zip(ranks, model_columns(timelines, link))}
