"""Modelled step time at N ranks: each rank's compute, timed, plus communication modelled on a link
(fsdpbench/predictors/comm_model.py), placed where the strategy issues and waits for it.

**Compute.** Timed without the profiler (the compute twin, fsdpbench/pipeline/compute_twin.py, or
an emulated rank's own timed steps): the profiler's cost per op is a large share of a small step.
The rank's profiled step (a real run's trace, or an emulated rank's, whose collectives take no time)
gives only the *placement*: take the step's span on the compute timeline (CPU: the threads that run
aten ops and no gloo work; GPU: the non-NCCL kernels), remove the time it spent *waiting for a
collective* (each gap in compute that contains the end of a communication interval is a wait from
the gap's start to that end: a blocked thread resumes when its collective finishes), and scale what
remains so that it sums to the timed compute (``compute_scale``; on a GPU the kernels, unscaled).
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

**No idle core** (``simulate(serial=True)``, ``no_idle_core``): CPU ranks whose threads fill every
core leave none for gloo's threads, so no collective overlaps compute: every rank's compute pauses
while a collective runs (model_method says so). The probed gloo link times a collective in context
(in a step's rhythm, after compute: comm_probe.py), so what gloo's threads take from compute is in
its time, and so are the waits for a peer that ranks drifting apart bring: the ranks then share one
placement (``shared_placement``), so the simulation does not count those waits again.

**Not modelled** (named, so a residual error can be explained): partial contention (a core idle for
some of gloo's work but not all; memory bandwidth), more CPU ranks than cores (not checkable),
gloo's second worker thread (two collectives can run at once there), and an uneven profiler cost
across the step (the scaling spreads it evenly).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdpbench.core.schema import (
    MODEL_COLLECTIVES,
    MODEL_COMM,
    MODEL_COMPUTE,
    MODEL_COMPUTE_BARE,
    MODEL_COMPUTE_SCALE,
    MODEL_EXPOSED_COMM,
    MODEL_LINK,
    MODEL_LINK_SOURCE,
    MODEL_METHOD,
    MODEL_OVERLAP_RATIO,
    MODEL_PEER_WAIT,
    MODEL_PROFILER_REMOVED,
    MODEL_RANKS_SIMULATED,
    MODEL_STEP_TIME,
    MODEL_WAITS_REMOVED,
)
from fsdpbench.metrics.comm import collective_records
from fsdpbench.metrics.trace import Interval, Trace, merge_intervals, subtract_intervals
from fsdpbench.predictors.comm_model import Link, collective_time_us

if TYPE_CHECKING:
    from fsdpbench.strategies.base import Sharding


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
    profiler_removed_us: float = 0.0  # profiled compute − bare compute: the profiler's cost taken out
    scale: float = 1.0  # bare / profiled compute (1: not scaled)


def simulate(timelines: list[StepTimeline], link: Link, *, serial: bool = False) -> list[dict[str, float]]:
    """Each rank's step time, communication, exposed communication and overlap per step, in ms, on
    ``link``, simulated jointly: collective k (the k-th issued; every rank issues the same ones in
    the same order) starts once every rank has issued it and the previous collective has finished,
    and ends for all ranks at once. One rank's timeline (an emulated run) is the same with no peers.

    ``serial``: no core is left idle for the collectives' own work (CPU ranks whose threads fill
    every core, ``no_idle_core``): gloo's threads then run on the cores the rank computes on, so a
    collective cannot overlap its rank's compute: while it runs (from its last rank's issue to its
    end) every rank's compute pauses, where it has got to by then (its needed point, if earlier,
    still holds). Waiting for a peer to issue costs no core (gloo's thread sleeps), so a rank that
    issued early computes on until the collective starts.

    A collective's time is the link's in-context time, or its *queued* time (``Link.per_kind_queued``:
    on gloo what one more adds to a burst issued at once) where it was issued, by its last rank, while
    the previous one was still running: it then waits in the queue and starts the moment the
    previous one ends, with no compute between them (ZeRO-1's burst of broadcasts). Decided here, in
    simulated time, not on the compute clock: a collective that blocks its caller (FSDP2's on the
    CPU) delays every later issue, so the next one follows compute and is never queued."""
    if not timelines:
        return []
    counts = {len(t.collectives) for t in timelines}
    if len(counts) > 1:  # ranks disagree (should not happen): model each rank on its own
        return [simulate([t], link, serial=serial)[0] for t in timelines]
    stall, exposed, durations = _simulated(timelines, link, serial)
    comm = sum(durations)
    out = []
    for r, t in enumerate(timelines):
        steps = max(1, t.steps)
        out.append(
            {
                MODEL_STEP_TIME: (t.compute_us + stall[r]) / steps / 1e3,
                MODEL_COMPUTE: t.compute_us / steps / 1e3,
                MODEL_COMM: comm / steps / 1e3,
                MODEL_EXPOSED_COMM: exposed[r] / steps / 1e3,
                # exposed ≤ stall and exposed ≤ comm by construction; the sums of the intervals can
                # overshoot by a rounding error, which must not read as a negative wait or overlap
                MODEL_PEER_WAIT: max(0.0, stall[r] - exposed[r]) / steps / 1e3,
                MODEL_OVERLAP_RATIO: max(0.0, 1.0 - exposed[r] / comm) if comm > 0 else 0.0,
            }
        )
    return out


def collective_durations(timelines: list[StepTimeline], link: Link, *, serial: bool = False) -> list[float]:
    """Each collective's modelled time on ``link``, µs, as ``simulate`` times it (in context, or queued)."""
    return _simulated(timelines, link, serial)[2] if timelines else []


def _simulated(
    timelines: list[StepTimeline], link: Link, serial: bool
) -> tuple[list[float], list[float], list[float]]:
    """``simulate``'s event loop: per rank its stall and the exposed part of it (µs), and each
    collective's duration (µs)."""
    collectives = timelines[0].collectives
    stall = [0.0] * len(timelines)
    # (compute-clock point where the rank needs collective k, k), in order; serial: added as each starts
    pending = [
        [] if serial else sorted((max(c.needed_us, c.issue_us), k) for k, c in enumerate(t.collectives))
        for t in timelines
    ]
    ends: list[float] = []
    starts: list[float] = []
    durations: list[float] = []
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
    for k, c in enumerate(collectives):
        issued = []
        for r, t in enumerate(timelines):
            advance(r, t.collectives[k].issue_us, inclusive=False)
            issued.append(t.collectives[k].issue_us + stall[r])
        queued = k > 0 and max(issued) < comm_free  # waits for the previous one, no compute between
        durations.append(collective_time_us(link, c.kind, c.payload_bytes, c.group_size, queued))
        start = max(max(issued), comm_free)
        starts.append(start)
        comm_free = start + durations[k]
        ends.append(comm_free)
        if serial:  # each rank pauses where its compute has got to when the collective starts
            for r, t in enumerate(timelines):
                ck = t.collectives[k]
                # held at its issue point until the collectives it is already paused for there have
                # ended (a burst issued at one point), then computing on until this one starts
                held = max([ends[j] for p, j in pending[r] if p <= ck.issue_us] + [issued[r]])
                running_at = ck.issue_us + max(0.0, start - held)
                bisect.insort(pending[r], (min(max(ck.needed_us, ck.issue_us), running_at), k))
    for r in range(len(timelines)):
        advance(r, float("inf"), inclusive=True)
    return stall, exposed, durations


# -- the trace → StepTimeline ----------------------------------------------------------------
def _host_intervals(trace: Trace) -> tuple[list[Interval], list[Interval], Interval]:
    """CPU ranks: (comm = gloo:* work, compute = aten ops minus c10d ops on the other threads, step span)."""
    aten = [i for ops, _ in trace.host_ops.values() for i in ops]
    c10d = [i for _, ops in trace.host_ops.values() for i in ops]
    return trace.host_comm, subtract_intervals(aten, c10d), trace.host_span


def _device_intervals(trace: Trace) -> tuple[list[Interval], list[Interval], Interval]:
    """GPU ranks: (comm = NCCL kernels, compute = other kernels, step span on the device clock)."""
    return trace.device_comm, trace.device_compute, trace.device_span


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


def _host_to_device(trace: Trace) -> Any:
    """GPU: host time → device time of the first kernel launched at or after it (None if none)."""
    launch_ts = {
        e["args"]["correlation"]: float(e["ts"])
        for e in trace.events
        if e.get("cat") == "cuda_runtime" and "correlation" in (e.get("args") or {})
    }
    pairs = sorted(
        (launch_ts[c], float(e["ts"]))
        for e in trace.kernels
        if (c := (e.get("args") or {}).get("correlation")) in launch_ts
    )
    launches = [p[0] for p in pairs]

    def to_device(t: float) -> float | None:
        i = bisect.bisect_left(launches, t)
        return pairs[i][1] if i < len(pairs) else None

    return to_device


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


def compute_scale(raw_compute_us: float, bare_compute_us: float | None) -> float:
    """Profiled compute → bare compute: the factor that takes the profiler's cost out of every interval
    of the profiled step (1 without a bare measurement)."""
    if bare_compute_us is None or not raw_compute_us > 0 or not bare_compute_us > 0:
        return 1.0
    return bare_compute_us / raw_compute_us


def build_timeline(
    trace: Trace | dict[str, Any],
    sharding: Sharding,
    device_type: str,
    *,
    steps: int = 1,
    group_size: int | None = None,
    bare_compute_us: float | None = None,
    scale: float | None = None,
) -> StepTimeline:
    """The StepTimeline of one rank's profiled step(s); ``sharding`` is the strategy's declaration.

    The profiled step's compute includes the profiler's own cost (on CPU ranks, per recorded op: a
    step of a few ms can be half profiler). The trace gives only the *placement*: every compute
    interval is scaled by ``scale``, or else by bare / profiled compute, so that the step's compute is
    ``bare_compute_us`` (per step) — a step timed without the profiler with collectives that take no
    time (``compute_twin``). Neither given: the profiled compute as it is (on a GPU the compute is
    kernels, which the host-side profiler does not slow down)."""
    trace = Trace.of(trace)
    on_gpu = device_type == "cuda" and bool(trace.kernels)
    comm, compute, span = _device_intervals(trace) if on_gpu else _host_intervals(trace)
    waits = _waits(comm, compute, span)
    raw_compute = _Clock(span[0], waits)(span[1])
    steps = max(1, steps)
    if scale is None:
        scale = compute_scale(raw_compute, None if bare_compute_us is None else bare_compute_us * steps)
    clock = _Clock(span[0], waits, scale)
    to_device = _host_to_device(trace) if on_gpu else (lambda t: t)
    step_end = span[1]

    def on_clock(host_t: float | None) -> float:
        device_t = to_device(host_t) if host_t is not None else None
        return clock(min(device_t if device_t is not None else step_end, step_end))

    copy_outs = trace.annotation_starts("FSDP::all_gather_copy_out")
    optim = trace.annotation_starts("Optimizer.step#")

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
    return StepTimeline(compute_us, tuple(placed), removed, steps, raw_compute - compute_us, scale=scale)


def no_idle_core(device_type: str, world_size: int, threads_per_rank: int, cores: int | None) -> bool:
    """Whether CPU ranks' threads fill every core, leaving none idle for gloo's threads (their copies,
    reductions and socket work): then communication cannot overlap compute (``simulate(serial=True)``).
    Only for real ranks of more than one on this machine; GPU ranks compute on the device."""
    return (
        device_type == "cpu"
        and world_size > 1
        and bool(cores)
        and world_size * threads_per_rank >= (cores or 0)
    )


def contended(device_type: str, world_size: int, emulated: bool, cores: int | None) -> str:
    """Why real CPU ranks beyond the cores are not modelled ("" if they are not beyond): they contend for
    the cores, which the model does not describe, so a modelled figure would be known not to hold."""
    if not emulated and device_type == "cpu" and cores and world_size > cores:
        return (
            f"{world_size} CPU ranks on {cores} cores: the ranks contend for cores, which the model "
            "does not describe"
        )
    return ""


def checkable(device_type: str, world_size: int, emulated: bool, cores: int | None) -> str:
    """Why this case's modelled step time cannot be checked against its measured one ("" if it can).
    CPU ranks beyond the cores contend for them (``contended``); an emulated rank's measured step is
    compute only, nothing to check the communication against."""
    if emulated:
        return "emulated: no measured step time with communication to check against"
    return contended(device_type, world_size, emulated, cores)


def model_columns(timelines: list[StepTimeline], link: Link, *, serial: bool = False) -> list[dict[str, Any]]:
    """The model_* columns of each rank whose timeline is given (modelled figures: every name says so)."""
    out = []
    for timeline, figures in zip(timelines, simulate(timelines, link, serial=serial)):
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
                MODEL_COMPUTE_SCALE: timeline.scale,
            }
        )
    return out


# model_method: how the compute was measured (the communication is always α–β on one stream)
METHOD_TWIN_INTERLEAVED = (
    "modelled: compute = the case's steps timed without the profiler under a no-op process group "
    "(the compute twin: every rank, same threads, same timer; at 1 rank the case itself on its 1-rank "
    "group), started beside the case's ranks and timed in turns with them, step by step, so both in "
    "the same moments; placed by the profiled trace scaled to it; α–β communication on one stream"
)
METHOD_TWIN = (
    "modelled: compute = the case's steps timed without the profiler under a no-op process group "
    "(the compute twin: every rank at once, same threads, same timer; at 1 rank the case itself on "
    "its 1-rank group), run after the case (none beside it: on a GPU, which the two would share; a "
    "compiled case; or the one beside it did not end well), placed by the profiled trace (on a GPU: "
    "its kernels) scaled to it; α–β communication on one stream"
)
METHOD_EMULATED = (
    "modelled: compute = this emulated rank's timed steps (collectives take no time), placed by its "
    "profiled trace scaled to it; α–β communication on one stream; every rank assumed alike"
)
METHOD_KERNELS = (
    "modelled: compute = the profiled step's kernels (device clock; no compute twin timed: where the "
    "host cannot launch kernels as fast as they run, the step is longer than this); α–β communication "
    "on one stream"
)
METHOD_PROFILED = (
    "modelled: compute = the profiled step's, the profiler's cost included (no bare measurement); "
    "α–β communication on one stream"
)
# appended to the method where simulate(serial=True) applied
METHOD_NO_IDLE_CORE = (
    "; no idle core (ranks × threads ≥ cores): gloo's work shares the ranks' cores, so no collective "
    "overlaps compute (compute pauses while each runs)"
)


def shared_placement(timelines: list[StepTimeline]) -> list[StepTimeline]:
    """The ranks' timelines with one placement: each collective issued and needed at the same fraction
    of every rank's compute, the ranks' mean (each rank keeps its own compute). For CPU ranks modelled
    with no idle core on the probed link: the ranks run the same ops, and what moves a collective
    between ranks in *one* profiled step is mostly the profiler's per-op cost, scaled away on average
    but not per segment; simulated as it stands it makes a rank wait for its peer at every collective,
    waits that the link's in-context time already holds (the probe's ranks drift apart as a step's do,
    comm_probe.in_context_time_us). Ranks that do not issue the same collectives keep their own."""
    if (
        len(timelines) < 2
        or len({tuple((c.kind, c.payload_bytes) for c in t.collectives) for t in timelines}) > 1
    ):
        return timelines
    n = len(timelines)

    def fraction(point: str, k: int) -> float:
        return sum(getattr(t.collectives[k], point) / t.compute_us for t in timelines if t.compute_us) / n

    shared = [
        (fraction("issue_us", k), fraction("needed_us", k)) for k in range(len(timelines[0].collectives))
    ]
    return [
        dataclasses.replace(
            t,
            collectives=tuple(
                dataclasses.replace(c, issue_us=i * t.compute_us, needed_us=max(i, nd) * t.compute_us)
                for c, (i, nd) in zip(t.collectives, shared)
            ),
        )
        for t in timelines
    ]


def case_model_columns(
    trace_paths: dict[int, Any],
    sharding: Sharding,
    device_type: str,
    link: Link,
    *,
    steps: int = 1,
    group_size: int | None = None,
    bare_compute_ms: dict[int, float] | None = None,
    method: str = METHOD_PROFILED,
    serial: bool = False,
) -> dict[int, dict[str, Any]]:
    """model_* columns per rank from each rank's profiled trace, simulated jointly (``serial``: no
    collective overlaps compute, see ``simulate``; said in model_method).

    ``bare_compute_ms``: per rank, one step's compute timed without the profiler. A rank without
    one is scaled by the factor of the first rank that has one (ranks of one SPMD job run the same
    ops, so the profiler costs them the same share); none at all: the profiled compute unscaled."""
    ranks = sorted(trace_paths)
    bare = bare_compute_ms or {}
    traces = {r: Trace.load(trace_paths[r]) for r in ranks}
    measured = [r for r in ranks if r in bare]
    shared_scale = None
    if measured:
        first = build_timeline(
            traces[measured[0]],
            sharding,
            device_type,
            steps=steps,
            group_size=group_size,
            bare_compute_us=bare[measured[0]] * 1e3,
        )
        shared_scale = first.scale
    timelines = [
        build_timeline(
            traces[r],
            sharding,
            device_type,
            steps=steps,
            group_size=group_size,
            bare_compute_us=bare[r] * 1e3 if r in bare else None,
            scale=None if r in bare else shared_scale,
        )
        for r in ranks
    ]
    if serial:
        timelines = shared_placement(timelines)
    method = method + METHOD_NO_IDLE_CORE if serial else method
    return {
        r: {**cols, MODEL_METHOD: method, MODEL_COMPUTE_BARE: bare.get(r)}
        for r, cols in zip(ranks, model_columns(timelines, link, serial=serial))
    }
