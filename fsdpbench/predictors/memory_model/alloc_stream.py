"""One rank's device allocations over a training step, in order — what the CUDA caching allocator sees —
and what a run makes of it: the step replayed through the allocator model (``allocator.py``) the way a
job runs it, from the first step (which lazily creates the optimizer state and cuBLAS's workspaces) to
the steady state that ``max_memory_allocated``/``max_memory_reserved`` measure.

A stream (``AllocStream``) has three parts:

- ``resident``: what exists before the first step (sharded parameters, buffers), allocated once;
- ``step``: one step's ``Malloc``/``Free`` events, each with its stream (FSDP2 allocates all-gather
  buffers on its all-gather copy-in stream and the reduce-scatter output on its reduce-scatter stream;
  everything else runs on the default stream) and category, plus ``Mark``s at the points where the
  first step allocates for good:
  - ``MATMUL_FORWARD``/``MATMUL_BACKWARD``: the first matmul of forward (the Python thread) and of backward
    (autograd's device thread). cuBLAS gets a workspace per (handle, stream) from the caching allocator
    and keeps it (aten/src/ATen/cuda/CublasHandlePool.cpp: ``getChosenWorkspaceSize``, 32 MiB on Hopper
    and Blackwell, 4096 KiB × 2 + 16 KiB × 8 before; cuBLASLt shares it, ``TORCH_CUBLASLT_UNIFIED_WORKSPACE``
    on by default); handles are per thread, so forward and backward each hold one;
  - ``OPTIMIZER_STEP``: where ``lazy`` is allocated in the first step: the optimizer's state, which
    ``torch.optim`` creates inside its first ``step()`` — after a whole forward and backward have filled
    the cache, so where it lands shapes every later step;
- ``lazy``: those state tensors.

Sources: the traced predictor records a stream op by op (``fsdpbench/predictors/traced_stream.py``:
fake tensors, every storage the step creates and frees, the stream FSDP2 runs it on); the analytic
schedule (``timeline.py``) gives a coarser one (``from_schedule``: buffers and a stage's activations,
temporaries as one block each).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fsdpbench.core.numbers import MiB
from fsdpbench.core.rundir import write_atomically
from fsdpbench.predictors.memory_model.allocator import (
    AllocatorStats,
    AllocConf,
    AllocEvent,
    CachingAllocator,
    Free,
    Malloc,
    Mark,
)

MATMUL_FORWARD = "first matmul: forward"
MATMUL_BACKWARD = "first matmul: backward"
OPTIMIZER_STEP = "optimizer step"
MEASURED_STEP = "step"  # allocator.replay's mark: peaks restart here
DEFAULT_STREAM = "default"
# DDP's gradient buckets as its reducer holds them from the second step on: allocated by C++, which no
# tracker sees (``traced_stream.ddp_bucket_mallocs``)
DDP_BUCKET = "ddp_bucket"
# DDP's one bucket as a trace keeps it (the reducer cannot rebuild on fake tensors): the tracker counts it
# from its first write, the allocator holds the rebuilt ones instead, so a replay skips it
UNREBUILT_BUCKET = "ddp_bucket_unrebuilt"

# cuBLAS's workspace per (handle, stream), by GPU generation (CublasHandlePool.cpp, parseChosenWorkspaceSize)
CUBLAS_WORKSPACE_HOPPER = 32 * MiB  # ":4096:8", compute capability 9.x–12.x
CUBLAS_WORKSPACE_OLDER = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8"


def stream_file(rank: int) -> str:
    """A rank's allocation stream in its case directory."""
    return f"alloc_stream_rank{rank}.json.gz"


@dataclass(frozen=True, slots=True)
class CudaRuntime:
    """What the CUDA libraries allocate through the caching allocator besides tensors."""

    cublas_workspace_bytes: int = CUBLAS_WORKSPACE_HOPPER  # per thread that runs matmuls (0: none)
    description: str = "cuBLAS workspace 32 MiB per thread (H100: sm90)"


@dataclass(frozen=True, slots=True)
class AllocStream:
    resident: tuple[Malloc, ...]
    step: tuple[AllocEvent, ...]
    lazy: tuple[Malloc, ...] = ()
    source: str = "traced"  # traced (op by op) | analytic (by stage)
    notes: tuple[str, ...] = field(default_factory=tuple)

    # ---- replay -------------------------------------------------------------------------------------
    def replay(
        self,
        conf: AllocConf | None = None,
        *,
        runtime: CudaRuntime | None = None,
        limit: int | None = None,
        fraction_set: bool = False,
        steps: int = 3,
    ) -> AllocatorStats:
        """The allocator's figures over step ``steps`` (the first ``steps - 1`` warm it up), or at the first
        out-of-memory error under ``limit`` (bytes the allocator may reserve)."""
        alloc = CachingAllocator(conf, limit=limit, fraction_set=fraction_set)
        for ev in self.run_events(runtime or CudaRuntime(), steps=steps):
            if isinstance(ev, Malloc):
                if not alloc.malloc(ev.key, ev.nbytes, ev.stream, ev.where):
                    break
            elif isinstance(ev, Free):
                alloc.free(ev.key, ev.recorded_on)
            elif ev.label == MEASURED_STEP:
                alloc.reset_peaks(ev.label)
        return alloc.stats

    def run_events(self, runtime: CudaRuntime, *, steps: int = 3) -> Iterator[AllocEvent]:
        """The events of ``steps`` steps of a run, keys made unique per step; ``Mark(MEASURED_STEP)``
        before the last."""
        yield from self.resident
        kept = frozenset(m.key for m in (*self.resident, *self.lazy))  # freed by no step
        skipped = frozenset(
            e.key for e in self.step if isinstance(e, Malloc) and e.category == UNREBUILT_BUCKET
        )
        for n in range(1, steps + 1):
            if n == steps:
                yield Mark(MEASURED_STEP)
            for ev in self.step:
                if isinstance(ev, Malloc):
                    if ev.key not in skipped:
                        yield Malloc(f"{n}:{ev.key}", ev.nbytes, ev.stream, ev.category, ev.where)
                elif isinstance(ev, Free):
                    if ev.key not in skipped:
                        yield Free(ev.key if ev.key in kept else f"{n}:{ev.key}", ev.recorded_on)
                elif n == 1:
                    yield from self._first_step_allocations(ev, runtime)

    def _first_step_allocations(self, mark: Mark, runtime: CudaRuntime) -> Iterator[Malloc]:
        if mark.label in (MATMUL_FORWARD, MATMUL_BACKWARD) and runtime.cublas_workspace_bytes:
            thread = "forward" if mark.label == MATMUL_FORWARD else "autograd"
            key, nbytes = f"cublas workspace ({thread} thread)", runtime.cublas_workspace_bytes
            yield Malloc(key, nbytes, category="workspace", where=mark.label)
        elif mark.label == OPTIMIZER_STEP:
            yield from self.lazy

    # ---- files --------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """A compact form: events as short lists, streams and categories as indexes into tables."""
        streams: dict[str, int] = {}
        categories: dict[str, int] = {}

        def index(table: dict[str, int], name: str) -> int:
            return table.setdefault(name, len(table))

        def malloc(m: Malloc) -> list:
            return ["m", m.key, m.nbytes, index(streams, m.stream), index(categories, m.category), m.where]

        def event(ev: AllocEvent) -> list:
            if isinstance(ev, Malloc):
                return malloc(ev)
            if isinstance(ev, Free):
                return ["f", ev.key, *([list(ev.recorded_on)] if ev.recorded_on else [])]
            return ["k", ev.label]

        body = {
            "resident": [malloc(m) for m in self.resident],
            "lazy": [malloc(m) for m in self.lazy],
            "step": [event(e) for e in self.step],
        }
        return {
            "format": "fsdpbench allocation stream 1",
            "source": self.source,
            "notes": list(self.notes),
            "streams": list(streams),
            "categories": list(categories),
            **body,
        }

    @classmethod
    def from_json(cls, data: dict) -> AllocStream:
        streams, categories = data["streams"], data["categories"]

        def event(row: list) -> AllocEvent:
            if row[0] == "m":
                return Malloc(row[1], row[2], streams[row[3]], categories[row[4]], row[5])
            if row[0] == "f":
                return Free(row[1], tuple(row[2]) if len(row) > 2 else ())
            return Mark(row[1])

        return cls(
            resident=tuple(event(r) for r in data["resident"]),  # type: ignore[misc]
            step=tuple(event(r) for r in data["step"]),
            lazy=tuple(event(r) for r in data["lazy"]),  # type: ignore[misc]
            source=data.get("source", "traced"),
            notes=tuple(data.get("notes", ())),
        )

    def write(self, path: Path) -> Path:
        """Write (gzip-compressed JSON) atomically."""
        path = Path(path)
        text = json.dumps(self.to_json(), separators=(",", ":"))
        write_atomically(path, gzip.compress(text.encode("utf-8")))  # never through a planted link
        return path

    @classmethod
    def read(cls, path: Path) -> AllocStream:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return cls.from_json(json.load(f))

    # ---- summaries ----------------------------------------------------------------------------------
    def bytes_by_stream(self) -> dict[str, int]:
        """Bytes the step allocates on each stream (a sum over its allocations, not a peak)."""
        out: dict[str, int] = {}
        for ev in self.step:
            if isinstance(ev, Malloc):
                out[ev.stream] = out.get(ev.stream, 0) + ev.nbytes
        return out


def from_schedule(events: Iterable, resident_categories: Iterable[str], optim_category: str) -> AllocStream:
    """A stage-level stream from the analytic schedule (``timeline.step_schedule``): its buffers, and each
    recorded moment's transients as one allocation freed at once. Coarse: it knows stages, not ops, so
    its reserved memory is a floor (no per-op holes); streams by category as FSDP2 allocates them."""
    from fsdpbench.predictors.memory_model.timeline import Alloc as TAlloc
    from fsdpbench.predictors.memory_model.timeline import Free as TFree
    from fsdpbench.predictors.memory_model.timeline import Record

    resident_categories = set(resident_categories)
    resident: list[Malloc] = []
    lazy: list[Malloc] = []
    step: list[AllocEvent] = []
    in_backward = False
    matmul_marked = {"forward": False, "backward": False}
    for n, ev in enumerate(events):
        if isinstance(ev, TAlloc):
            if ev.nbytes <= 0:
                continue
            m = Malloc(ev.name, ev.nbytes, SCHEDULE_STREAMS.get(ev.category, DEFAULT_STREAM), ev.category)
            if ev.category in resident_categories:
                resident.append(m)
            elif ev.category == optim_category:
                lazy.append(m)
            else:
                step.append(m)
        elif isinstance(ev, TFree):
            step.append(Free(ev.name))
        elif isinstance(ev, Record):
            phase = "backward" if ev.label.startswith(("backward", "optimizer")) else "forward"
            in_backward = in_backward or phase == "backward"
            if ev.label.startswith(("forward: block", "backward: block")) and not matmul_marked[phase]:
                matmul_marked[phase] = True
                step.append(Mark(MATMUL_FORWARD if phase == "forward" else MATMUL_BACKWARD))
            if ev.label == "optimizer step":
                step.append(Mark(OPTIMIZER_STEP))
            # a moment's transients are alive together, then gone
            keys = [f"{ev.label} · {category} #{n}" for category, _ in ev.transient]
            for key, (category, nbytes) in zip(keys, ev.transient, strict=True):
                if nbytes > 0:
                    step.append(Malloc(key, nbytes, DEFAULT_STREAM, category, ev.label))
            step.extend(Free(key) for key, (_, nbytes) in zip(keys, ev.transient, strict=True) if nbytes > 0)
    # the schedule keeps everything alive to the end of the step; a step of a run frees what it made
    alive = _alive_after(step)
    step.extend(Free(k) for k in alive)
    return AllocStream(
        tuple(resident),
        tuple(step),
        tuple(lazy),
        source="analytic",
        notes=("stage-level stream from the analytic schedule: no per-op temporaries or holes",),
    )


# where FSDP2 allocates each of the schedule's buffers (_fsdp_collectives.py: the all-gather output on the
# all-gather copy-in stream, the reduce-scatter output on the reduce-scatter stream)
SCHEDULE_STREAMS = {"all_gather": "all_gather_copy_in", "grads": "reduce_scatter"}


def _alive_after(events: list[AllocEvent]) -> list[str]:
    alive: dict[str, None] = {}
    for ev in events:
        if isinstance(ev, Malloc):
            alive[ev.key] = None
        elif isinstance(ev, Free):
            alive.pop(ev.key, None)
    return list(alive)
