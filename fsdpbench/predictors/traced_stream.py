"""Record the allocation stream of a traced step (``memory_model/alloc_stream.py``): every storage the step
creates and frees, op by op, in order, with the stream it is allocated on and the tracker's category.

Where it comes from: PyTorch's memory tracker (``FSDPMemTracker``/``MemTracker``) already sees every storage
come and go on the fake tensors — an op's outputs through its dispatch mode, FSDP2's ``resize_``-based
unsharded parameters through its patched ``UntypedStorage.resize_``, deaths through weak references — and
updates its snapshot for each. The recorder listens to those updates. The stream an allocation belongs to
is the one FSDP2 makes current around it: FSDP2 enters ``device_handle.stream(s)`` for its all-gather
copy-in (``foreach_all_gather``) and reduce-scatter (``foreach_reduce``) work, and the recorder follows
that context manager, naming FSDP2's streams from its ``FSDPCommContext``. It also marks the first matmul
of forward and of backward (cuBLAS's workspaces) and the optimizer step (the lazily created state).

What exists before the step is what the tracker knows when the step begins, whenever it learnt it:
``FSDPMemTracker`` registers the model on entering, ``MemTracker.track_external`` (DDP, ZeRO-1) before.
DistributedDataParallel's reducer also holds its gradient buckets, which no tracker sees (the C++
reducer makes them when DDP is built): ``ddp_bucket_mallocs``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from fsdpbench.predictors.memory_model.alloc_stream import (
    DDP_BUCKET,
    DEFAULT_STREAM,
    MATMUL_BACKWARD,
    MATMUL_FORWARD,
    OPTIMIZER_STEP,
    UNREBUILT_BUCKET,
    AllocStream,
)
from fsdpbench.predictors.memory_model.allocator import AllocEvent, Free, Malloc, Mark

# ops whose CUDA kernels call cuBLAS (and so take its workspace the first time a thread runs one)
MATMUL_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten._scaled_mm.")
# FSDPCommContext's streams, by attribute
FSDP_STREAMS = (
    "all_gather_copy_in_stream",
    "all_gather_stream",
    "reduce_scatter_stream",
    "all_reduce_stream",
)
LAZY_KINDS = ("opt",)  # tracker categories the first optimizer.step creates (the rest exists before)


class StreamRecorder:
    """Listens to a tracker's snapshot updates for one step; ``stream()`` gives the result."""

    def __init__(self, tracker: Any, model: torch.nn.Module, optimizer: Any, device_type: str) -> None:
        # the device whose allocator the stream stands for: the trace's ("cpu" where CUDA's rules stand in
        # for CUDA kernels on fake CPU tensors). A trace on fake CUDA tensors also makes host tensors (the
        # optimizer's step counters), which the CUDA caching allocator never sees
        self.device_type = device_type
        self.tracker = tracker
        self.model = model
        self.optimizer = optimizer
        self.events: list[tuple[str, Any]] = []  # ("add"/"del", winfo id, ...) in order
        self.keys: dict[int, str] = {}
        self.serial = 0
        self.entered = False  # False while the tracker registers what exists before the step
        self.resident: list[Malloc] = []
        self.lazy: list[Malloc] = []
        self.step: list[AllocEvent] = []
        self.local = threading.local()
        self.stream_names: dict[int, str] = {}
        self.matmul_seen = {"forward": False, "backward": False}

    # ---- hooks into the tracker ---------------------------------------------------------------------
    @contextlib.contextmanager
    def attached(self) -> Iterator[StreamRecorder]:
        """Record while the tracker runs; the resident state is what it registers on entering."""
        tracker = self.tracker
        base_update = tracker._update_snap
        base_class = type(tracker)
        recorder = self

        def update(u_type: Any, winfo: Any, old_mem_consumed: int | None = None, old_reftype: Any = None):
            base_update(u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)
            recorder._on_update(u_type.name, winfo, old_mem_consumed)

        def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            recorder.local.op = str(func)
            return base_class.__torch_dispatch__(self, func, types, args, kwargs)

        tracker._update_snap = update
        recording = type(f"Recording{base_class.__name__}", (base_class,), {"__torch_dispatch__": dispatch})
        tracker.__class__ = recording
        self._name_fsdp_streams()
        hook = self.optimizer.register_step_pre_hook(lambda *_: self.step.append(Mark(OPTIMIZER_STEP)))
        with self._following_streams():
            try:
                yield self
            finally:
                hook.remove()
                tracker.__class__ = base_class
                del tracker._update_snap

    def begin_step(self, host_tensors: Sequence[torch.Tensor] = ()) -> None:
        """Everything registered so far existed before the step, except ``host_tensors``: tensors the
        target keeps in host memory although the trace made them on its device (a CPU trace of a CUDA
        target: the optimizer's step counters)."""
        self.entered = True
        self._register_known_storages()
        self.resident.extend(ddp_bucket_mallocs(self.model, self.device_type))
        host = set()
        for t in host_tensors:
            winfo, _ = self.tracker._WINFO.get(t.untyped_storage(), (None, None))
            if winfo is not None:
                host.add(self.keys.get(id(winfo)))
        self.resident = [m for m in self.resident if m.key not in host]
        self.lazy = [m for m in self.lazy if m.key not in host]

    def _register_known_storages(self) -> None:
        """Storages the tracker registered before the recorder attached (``MemTracker.track_external``):
        resident, or lazy for the optimizer state, in the order the tracker registered them."""
        entered, self.entered = self.entered, False
        for winfo, _ in list(self.tracker._WINFO.values()):
            if id(winfo) not in self.keys and winfo.mem_consumed > 0:
                self._alloc(winfo, int(winfo.mem_consumed))
        self.entered = entered

    def _name_fsdp_streams(self) -> None:
        for module in self.model.modules():
            state_fn = getattr(module, "_get_fsdp_state", None)
            ctx = getattr(state_fn(), "_comm_ctx", None) if state_fn else None
            for attr in FSDP_STREAMS:
                stream = getattr(ctx, attr, None) if ctx is not None else None
                if stream is not None:
                    self.stream_names[id(stream)] = attr.removesuffix("_stream")

    @contextlib.contextmanager
    def _following_streams(self) -> Iterator[None]:
        """Know the current stream: FSDP2 enters ``torch.<device>.stream(s)`` around its collectives' work."""
        recorder = self
        patched = {}
        for handle in (torch.cpu, torch.cuda):
            original = handle.stream

            @contextlib.contextmanager
            def stream(s: Any, _original: Any = original) -> Iterator[Any]:
                previous = getattr(recorder.local, "stream", DEFAULT_STREAM)
                if s is not None:
                    recorder.local.stream = recorder.stream_names.get(id(s), previous)
                try:
                    with _original(s) as entered:
                        yield entered
                finally:
                    recorder.local.stream = previous

            patched[handle] = original
            handle.stream = stream  # type: ignore[attr-defined]
        try:
            yield
        finally:
            for handle, original in patched.items():
                handle.stream = original  # type: ignore[attr-defined]

    # ---- what an update means -----------------------------------------------------------------------
    def _on_update(self, kind: str, winfo: Any, old_mem_consumed: int | None) -> None:
        nbytes = int(winfo.mem_consumed)
        if kind == "ADD" or (kind == "SIZE" and not old_mem_consumed and nbytes):
            self._alloc(winfo, nbytes)
        elif kind == "DEL" or (kind == "SIZE" and old_mem_consumed and not nbytes):
            self._free(winfo)
        elif kind == "SIZE" and old_mem_consumed and nbytes:  # resized in place: a new allocation
            self._free(winfo)
            self._alloc(winfo, nbytes)

    def _alloc(self, winfo: Any, nbytes: int) -> None:
        if nbytes <= 0 or winfo.device.type != self.device_type:
            return
        self.serial += 1
        key = f"t{self.serial}"
        self.keys[id(winfo)] = key
        category = _category(winfo.reftype)
        where = self._where()
        malloc = Malloc(key, nbytes, getattr(self.local, "stream", DEFAULT_STREAM), category, where)
        if not self.entered:
            (self.lazy if category in LAZY_KINDS else self.resident).append(malloc)
            return
        phase = "backward" if self.tracker._mod_tracker.is_bw else "forward"
        op = getattr(self.local, "op", "")
        if not self.matmul_seen[phase] and op.startswith(MATMUL_OPS):
            self.matmul_seen[phase] = True
            self.step.append(Mark(MATMUL_FORWARD if phase == "forward" else MATMUL_BACKWARD))
        self.step.append(malloc)

    def _free(self, winfo: Any) -> None:
        key = self.keys.pop(id(winfo), None)
        if key is not None and self.entered:
            self.step.append(Free(key))

    def _where(self) -> str:
        parents = getattr(self.tracker._mod_tracker, "parents", ())
        deepest = max(parents, key=len, default="") if parents else ""
        phase = "backward" if self.tracker._mod_tracker.is_bw else "forward"
        return f"{phase}: {deepest}" if deepest else phase

    def stream(self, notes: tuple[str, ...] = ()) -> AllocStream:
        """The recorded step; anything it allocated and did not free (none in a steady state) is freed at
        its end, as the next step would find it. DDP's bucket as the trace keeps it (``unrebuilt_buckets``)
        is the tracker's, not the allocator's."""
        unrebuilt = self._unrebuilt_bucket_keys()
        alive = dict.fromkeys(e.key for e in self.step if isinstance(e, Malloc))
        for e in self.step:
            if isinstance(e, Free):
                alive.pop(e.key, None)
        step = [
            replace(e, category=UNREBUILT_BUCKET) if isinstance(e, Malloc) and e.key in unrebuilt else e
            for e in (*self.step, *(Free(k) for k in alive))
        ]
        return AllocStream(tuple(self.resident), tuple(step), tuple(self.lazy), source="traced", notes=notes)

    def _unrebuilt_bucket_keys(self) -> set[str]:
        """The keys of the storages of DDP's one bucket, which the trace's reducer keeps because it cannot
        rebuild on fake tensors (``engine/fake_pg.py``). The tracker first sees it when backward writes a
        gradient into it and counts it from there, as it counts a run's rebuilt buckets from their first
        write; the allocator holds the rebuilt buckets from before the step instead
        (``ddp_bucket_mallocs``), so this storage is no allocation of the step."""
        from fsdpbench.engine.fake_pg import buckets_seen

        keys = set()
        for storage in buckets_seen(self.model):
            winfo, _ = self.tracker._WINFO.get(storage, (None, None))
            key = self.keys.get(id(winfo)) if winfo is not None else None
            if key is not None:
                keys.add(key)
        return keys


def ddp_bucket_mallocs(model: Any, device_type: str) -> list[Malloc]:
    """DistributedDataParallel's gradient buckets as its reducer holds them from the second step on.

    torch/nn/parallel/distributed.py builds the reducer with one bucket of every parameter (bucket limit
    ``sys.maxsize`` unless ``find_unused_parameters`` or ``static_graph``); the second step's forward
    calls ``Reducer::rebuild_buckets``, which frees it and assigns the parameters, in the order their
    gradients became ready (the reverse of registration for a model run front to back), to buckets of
    at most ``first_bucket_bytes_cap`` (1 MiB) then ``bucket_bytes_cap`` (``bucket_cap_mb``, 25 MiB),
    each one ``at::empty`` of its parameters' dtype (reducer.cpp, ``initialize_buckets``). With
    ``gradient_as_bucket_view=False`` (DDP's default, what fsdpbench runs) gradients are separate tensors
    copied in and out, so the buckets come on top of them; with it the gradients are the buckets' views
    (not modelled: fsdpbench does not set it)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return []
    import torch.distributed as dist

    params = [p for p in model.module.parameters() if p.requires_grad and p.device.type == device_type]
    if not params:
        return []
    ready_order = params[::-1]
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, int(model.bucket_bytes_cap)]
    buckets, _ = dist._compute_bucket_assignment_by_size(ready_order, limits)
    out = []
    for n, indices in enumerate(buckets):
        nbytes = sum(ready_order[i].numel() * ready_order[i].element_size() for i in indices)
        out.append(Malloc(f"ddp bucket {n}", nbytes, DEFAULT_STREAM, DDP_BUCKET, "DDP()"))
    return out


def _category(reftype: Any) -> str:
    """The tracker's category, lower case without its enum prefix ("sharded_param", "act", "opt", ...)."""
    name = getattr(reftype, "name", str(reftype))
    return name.lower()
