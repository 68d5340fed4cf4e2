"""One rank's Chrome trace from ``torch.profiler``, parsed once into what the analyses read.

As Holistic Trace Analysis's ``Trace``: the file is read and its events sorted into kinds once, and the
communication volume (``comm``), the overlap (``overlap``), the achieved bandwidth (``bandwidth``) and
the step model (``predictors/step_model``) read the same object. What the kinds are:

* complete events: ``ph == "X"`` with a duration (everything else is metadata, flows, counters);
* kernels: ``cat == "kernel"`` (any case); an NCCL kernel has "nccl" in its name (any case), every
  other kernel is compute;
* gloo work: ``gloo:<op>`` user annotations, on the gloo worker threads (told apart by this work, not
  by their names, which the metadata sometimes gives as the process's); the threads that run none are
  the host threads, whose ``cpu_op`` events are ``aten::*`` compute and ``c10d::*`` enqueues;
* collectives: ``record_param_comms`` (NCCL) or the ``c10d::`` ops (gloo), made records by
  ``comm.collective_records``, which keeps them here so a trace's collectives are read once.

Intervals are (start_us, end_us) on the trace's clock.
"""

from __future__ import annotations

import gc
import gzip
import json
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

Interval = tuple[float, float]  # (start_us, end_us)
Thread = tuple[Any, Any]  # (pid, tid)


# -- interval algebra ------------------------------------------------------------------------
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


def span_of(intervals: list[Interval]) -> Interval:
    """From the first start to the last end ((0, 0) for none)."""
    return (min(s for s, _ in intervals), max(t for _, t in intervals)) if intervals else (0.0, 0.0)


def interval(event: dict[str, Any]) -> Interval:
    start = float(event["ts"])
    return start, start + float(event["dur"])


def _thread(event: dict[str, Any]) -> Thread:
    return event.get("pid"), event.get("tid")


# -- the trace -------------------------------------------------------------------------------
class Trace:
    """One rank's trace: its complete events sorted into kinds once (the module docstring)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.info: dict[str, Any] = data.get("distributedInfo") or {}
        self.events: list[dict[str, Any]] = [
            e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e
        ]
        # comm.collective_records' records by (group size, assumed dtype): read once per trace
        self.collective_records: dict[tuple[int | None, str], list[Any]] = {}

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """A Chrome trace file (.json or .json.gz; the object form or the bare array of events)."""
        path = Path(path)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            raw = f.read()
        # a profiled step's trace is ~10^5 objects and no reference cycle: with the collector on, parsing
        # it set off collections that walked the whole heap (torch's included) over and over, 0.03 s of
        # parsing taking 0.1-0.17 s in a rank or the orchestrator
        collecting = gc.isenabled()
        gc.disable()
        try:
            data = json.loads(raw)
        finally:
            if collecting:
                gc.enable()
        return cls({"traceEvents": data} if isinstance(data, list) else data)

    @classmethod
    def of(cls, trace: Trace | dict[str, Any]) -> Trace:
        """``trace`` itself, or the Trace of a trace's JSON object already read."""
        return trace if isinstance(trace, Trace) else cls(trace)

    @property
    def backend(self) -> str | None:
        """The process-group backend the trace says it ran with (torch writes distributedInfo)."""
        backend = self.info.get("backend")
        return str(backend) if backend else None

    @property
    def world_size(self) -> int:
        return int(self.info.get("world_size") or 1)

    # -- device ------------------------------------------------------------------------------
    @cached_property
    def kernels(self) -> list[dict[str, Any]]:
        return [e for e in self.events if str(e.get("cat", "")).lower() == "kernel"]

    @cached_property
    def nccl_kernels(self) -> list[dict[str, Any]]:
        return [e for e in self.kernels if "nccl" in str(e.get("name", "")).lower()]

    @cached_property
    def device_comm(self) -> list[Interval]:
        """The NCCL kernels' intervals."""
        return [interval(e) for e in self.nccl_kernels]

    @cached_property
    def device_compute(self) -> list[Interval]:
        """Every other kernel's intervals."""
        return [interval(e) for e in self.kernels if "nccl" not in str(e.get("name", "")).lower()]

    @cached_property
    def device_span(self) -> Interval:
        return span_of([interval(e) for e in self.kernels])

    # -- host --------------------------------------------------------------------------------
    @cached_property
    def gloo_work(self) -> list[dict[str, Any]]:
        """The ``gloo:<op>`` events, in the trace's order."""
        return [e for e in self.events if str(e.get("name", "")).startswith("gloo:")]

    @cached_property
    def host_comm(self) -> list[Interval]:
        """The gloo work's intervals."""
        return [interval(e) for e in self.gloo_work]

    @cached_property
    def comm_threads(self) -> set[Thread]:
        return {_thread(e) for e in self.gloo_work}

    @cached_property
    def host_ops(self) -> dict[Thread, tuple[list[Interval], list[Interval]]]:
        """Per host thread (one that runs no gloo work): its ``aten::*`` and its ``c10d::*`` cpu_ops."""
        ops: dict[Thread, tuple[list[Interval], list[Interval]]] = {}
        for e in self.events:
            key = _thread(e)
            if key in self.comm_threads or e.get("cat") != "cpu_op":
                continue
            name = str(e.get("name", ""))
            if name.startswith("aten::"):
                ops.setdefault(key, ([], []))[0].append(interval(e))
            elif name.startswith("c10d::"):
                ops.setdefault(key, ([], []))[1].append(interval(e))
        return ops

    @cached_property
    def host_span(self) -> Interval:
        """From the first to the last cpu_op or annotation of the host threads."""
        host = [
            interval(e)
            for e in self.events
            if _thread(e) not in self.comm_threads and e.get("cat") in ("cpu_op", "user_annotation")
        ]
        return span_of(host)

    def annotation_starts(self, prefix: str) -> list[float]:
        """The sorted starts of the events whose name begins with ``prefix``."""
        return sorted(float(e["ts"]) for e in self.events if str(e.get("name", "")).startswith(prefix))
