"""Live tensor bytes by category, from PyTorch's own trackers (``torch.distributed._tools``).

FSDP2 models get ``FSDPMemTracker`` (sharded/unsharded params and grads, all-gather and
reduce-scatter buffers); everything else gets ``MemTracker``. Works on CPU and GPU; on CPU these
are the only deterministic memory figures, so tests assert them exactly.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the record (TrackedMemory) is read back by processes that never import torch
    import torch
    from torch import nn

    from fsdpbench.strategies.base import Strategy

from fsdpbench.core.schema import (
    LOCAL_STATES,
    MODEL_STATE_CATEGORIES,
    TRACKER_CATEGORIES,
    TRACKER_MODEL_STATES,
    TRACKER_PEAK,
    TRACKER_STATES,
    tracker_peak_column,
)

# our category name for each tracker category (by the enum's value string)
CATEGORY_NAMES = {
    "Sharded Param": "params",
    "Parameter": "params",
    "Unsharded Param": "params_unsharded",
    "Buffer": "buffers",
    "Sharded Grad": "grads",
    "Gradient": "grads",
    "Unsharded Grad": "grads_unsharded",
    "Activation": "activations",
    "Temp": "temp",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
    "OptState": "optim",
    "Optstate": "optim",
    "Inputs": "inputs",
    "Other": "other",
}

MODEL_STATES = MODEL_STATE_CATEGORIES


@dataclass(kw_only=True, slots=True)
class TrackedMemory:
    """The memory-tracked step of one rank: the tracker's peak by category (with "total"), and the
    model states after ``optimizer.step`` by the tracker and counted tensor by tensor."""

    peak: dict[str, int] = field(default_factory=dict)
    states_tracker: dict[str, int] = field(default_factory=dict)
    states_local: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        parts = {"states_tracker": self.states_tracker, "states_local": self.states_local, "peak": self.peak}
        return {k: v for k, v in parts.items() if v}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrackedMemory:
        return cls(**{k: dict(data.get(k) or {}) for k in ("peak", "states_tracker", "states_local")})

    def to_columns(self) -> dict[str, Any]:
        """mem_tracker_peak[_<category>]_bytes, mem_tracker_states_*, mem_local_* (None: not measured)."""
        out: dict[str, Any] = {}
        for cat in TRACKER_CATEGORIES:
            out[tracker_peak_column(cat)] = self.peak.get(cat)
        out[TRACKER_PEAK] = self.peak.get("total")
        for cat in MODEL_STATES:
            out[TRACKER_STATES.of(cat)] = self.states_tracker.get(cat)
            out[LOCAL_STATES.of(cat)] = self.states_local.get(cat)
        if self.states_tracker:
            out[TRACKER_MODEL_STATES] = sum(self.states_tracker.get(c, 0) for c in MODEL_STATES)
        return out


def build_tracker(
    model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, *, module_peaks: bool = True
) -> Any:
    """The tracker the strategy says files its model states, already told about the model and optimizer;
    without ``module_peaks``, keeping only the total peak up to date op by op (``with_total_peak_only``)."""
    tracker = TRACKERS[strategy.memory_tracker](model, optimizer)
    return with_active_module_peaks(tracker) if module_peaks else with_total_peak_only(tracker)


def _module_tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    tracker = module_tracker_class()()
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps the real one in .optim
    tracker.track_external(model, inner)
    return tracker


def _fsdp2_tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    tracker_class = blind_to_sharding_propagation(fsdp2_tracker_class())
    return tracker_class(model, optimizer)  # the model is the FSDP2 root


def _fsdp1_tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    from fsdpbench.metrics.fsdp1_tracker import FSDP1MemTracker

    return FSDP1MemTracker(model, optimizer)


def _deepspeed_tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    from fsdpbench.metrics.deepspeed_tracker import DeepSpeedMemTracker

    return DeepSpeedMemTracker(model, optimizer)


# Strategy.memory_tracker -> the tracker for it (every one of strategies.base.MEMORY_TRACKERS)
TRACKERS: dict[str, Callable[[nn.Module, torch.optim.Optimizer], Any]] = {
    "module": _module_tracker,
    "fsdp2": _fsdp2_tracker,
    "fsdp1": _fsdp1_tracker,
    "deepspeed": _deepspeed_tracker,
}


@functools.cache
def fsdp2_tracker_class() -> type:
    """``FSDPMemTracker`` answering device queries quickly (``quick_device_queries``)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState

    return quick_device_queries(FSDPMemTracker, _FSDPModState.PEAK_FW, _FSDPModState.PEAK_BW)


@functools.cache
def module_tracker_class() -> type:
    """``MemTracker`` answering device queries quickly (``quick_device_queries``)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    return quick_device_queries(MemTracker, _ModState.PEAK_FW, _ModState.PEAK_BW)


def quick_device_queries(tracker_class: type, peak_fw: Any, peak_bw: Any) -> type:
    """``tracker_class``, answering a device query (``prim.device``) with just what its dispatch does then.

    On fake tensors every ``tensor.device`` that C++ asks for is an op dispatched through the tracker:
    half of a traced step's dispatches (llama-70b on 1,024 ranks: 40,599 of 79,004; the autograd engine
    asks for every gradient's device). For such an op the tracker's ``__torch_dispatch__`` (``MemTracker``'s
    and ``FSDPMemTracker``'s alike) runs it, finds no tensor in its result (a ``torch.device``) to track,
    and updates the peaks, unless it is DTensor's op or (where this torch's tracker decides so) a nested
    fake mode's. The subclass does those steps and skips the search."""
    import inspect

    import torch
    from torch._guards import active_fake_mode
    from torch.distributed.tensor import DTensor

    # torch 2.13's trackers skip an op run under another fake mode than the one active on entering them
    base: Any = tracker_class  # a TorchDispatchMode subclass
    by_fake_mode = "_fake_mode_on_entry" in inspect.unwrap(base.__torch_dispatch__).__code__.co_names
    device_query = torch.ops.prim.device.default

    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not device_query or any(t == DTensor for t in types):
            return base.__torch_dispatch__(self, func, types, args, kwargs)
        res = func(*args, **(kwargs or {}))
        if not by_fake_mode or active_fake_mode() is self._fake_mode_on_entry:
            self._update_peak_stats(peak_bw if self._mod_tracker.is_bw else peak_fw)
        return res

    name = f"QuickDeviceQueries{tracker_class.__name__}"
    return type(name, (tracker_class,), {"__torch_dispatch__": dispatch})


_SHARDING_PROPAGATION = threading.local()  # .depth: calls of DTensor's tensor-meta propagation in progress
# the ShardingPropagator method that runs an op on fake global-shape tensors to learn its output's shape
_PROPAGATE_TENSOR_META = "_propagate_tensor_meta_non_cached"


@functools.cache
def blind_to_sharding_propagation(tracker_class: type) -> type:
    """``tracker_class``, not counting the tensors DTensor's sharding propagation makes to learn an op's
    output shapes.

    For an op on DTensors, DTensor works out the output's global shape by running the op on fake tensors
    of the inputs' *global* shapes (``ShardingPropagator._propagate_tensor_meta_non_cached``); the rank's
    memory is the op on its local shards, which runs next. A tracker that counts the propagation's fake
    tensors counts, for each op, its inputs as if they were unsharded. When that propagation runs
    depends on the torch: it is cached on the op's schema except where ``_are_we_tracing()`` holds, which
    an active ``FakeTensorMode`` makes true, so in a traced step (predictors/traced.py) it runs wherever
    DTensor's native dispatch cache does not answer. Torch 2.11's does not answer its foreach ops: each of
    a foreach AdamW step's list ops propagates again, and ``FSDPMemTracker`` counted the lists' global
    shapes as optimizer state (llama-7b on 8 ranks: 91 GB at the step instead of the 23 GB an H100 with
    2.11 measured). Torch 2.13's answers them from its cache, and its trackers skip ops run under a
    fake mode other than the one active when they were entered (the eager case). This skips the
    propagation on every torch: its tensors are metadata, never memory."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    base: Any = tracker_class  # a TorchDispatchMode subclass
    base_dispatch, base_enter, base_exit = base.__torch_dispatch__, base.__enter__, base.__exit__

    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(_SHARDING_PROPAGATION, "depth", 0):
            return func(*args, **(kwargs or {}))
        return base_dispatch(self, func, types, args, kwargs)

    def enter(self: Any) -> Any:
        propagate = self._propagate_tensor_meta = getattr(ShardingPropagator, _PROPAGATE_TENSOR_META)

        def counted_propagation(propagator: Any, op_schema: Any) -> Any:
            _SHARDING_PROPAGATION.depth = getattr(_SHARDING_PROPAGATION, "depth", 0) + 1
            try:
                return propagate(propagator, op_schema)
            finally:
                _SHARDING_PROPAGATION.depth -= 1

        setattr(ShardingPropagator, _PROPAGATE_TENSOR_META, counted_propagation)
        try:
            return base_enter(self)
        except BaseException:
            setattr(ShardingPropagator, _PROPAGATE_TENSOR_META, propagate)
            raise

    def exit(self: Any, *exc: Any) -> Any:
        try:
            return base_exit(self, *exc)
        finally:
            setattr(ShardingPropagator, _PROPAGATE_TENSOR_META, self._propagate_tensor_meta)

    methods = {"__torch_dispatch__": dispatch, "__enter__": enter, "__exit__": exit}
    return type(f"PropagationBlind{tracker_class.__name__}", (tracker_class,), methods)


def with_active_module_peaks(tracker: Any) -> Any:
    """The tracker, updating per-module peaks only for the modules that are running.

    ``MemTracker._update_peak_stats`` runs on every tensor the step creates or frees and walks *every*
    tracked module (a ``WeakIdKeyDictionary``, whose each entry costs a ``hasattr`` through
    ``nn.Module.__getattr__``) to find the few whose forward or backward is running
    (``_mod_tracker.parents``): quadratic in the model's size (llama-70b traced: ~70,000 updates ×
    ~1,000 modules, most of the trace's time). This does the same updates from the other side: the
    running modules' fully qualified names, looked up in an index of the tracked modules by name (rebuilt
    when a module is added). Same modules, same comparisons, same snapshots: same numbers."""
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    index: dict[str, list[Any]] = {}
    indexed = -1

    def update_peak_stats(peak_state: Any) -> None:
        nonlocal indexed
        tracking = tracker.memory_tracking
        if len(tracking) != indexed:
            index.clear()
            for stats in tracking.values():
                index.setdefault(stats.mod_fqn, []).append(stats)
            indexed = len(tracking)
        curr_snap = tracker._curr_mem_snap
        for fqn in tracker._mod_tracker.parents:
            for mod_stats in index.get(fqn, ()):
                if peak_state in mod_stats.snapshots:
                    for dev, dev_snap in curr_snap.items():
                        if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                            mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                            mod_stats.snapshots[peak_state][-1][dev] = deepcopy(dev_snap)
        _raise_total_peak(tracker)

    tracker._update_peak_stats = update_peak_stats
    return tracker


def with_total_peak_only(tracker: Any) -> Any:
    """The tracker, updating on each op only its total peak: the peak ``snapshot_by_category`` reads, the
    same snapshot as ``with_active_module_peaks`` takes (same comparison, same moment). The modules' own
    peaks keep what the tracker's module hooks record: a traced step (predict) reads none of them, and
    on the module tracker (DDP, ZeRO-1), whose running modules each took a snapshot whenever the memory
    rose, their updates were ~9% of a whole llama-7b trace."""

    def update_peak_stats(peak_state: Any) -> None:
        _raise_total_peak(tracker)

    tracker._update_peak_stats = update_peak_stats
    return tracker


def _raise_total_peak(tracker: Any) -> None:
    """The tracker's total peak and its snapshot, per device, where the current total passes it (what
    ``MemTracker._update_peak_stats`` does last)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    peak_mem, peak_snap = tracker._peak_mem, tracker._peak_mem_snap
    for dev, dev_snap in tracker._curr_mem_snap.items():
        if peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
            peak_mem[dev] = dev_snap[_TOTAL_KEY]
            peak_snap[dev] = dict(dev_snap)  # byte counts: a copy of the dict is a deep one


def snapshot_by_category(tracker: Any, kind: str, device: torch.device) -> dict[str, int]:
    """Bytes per category ('peak' = at the moment of the total peak, or 'current'); plus 'total'."""
    import torch

    snap = tracker.get_tracker_snapshot(kind)
    out = dict.fromkeys(TRACKER_CATEGORIES, 0)
    total = 0
    for dev, by_type in snap.items():
        if torch.device(dev).type != device.type:
            continue
        for key, nbytes in by_type.items():
            if key == "Total":
                total += int(nbytes)
                continue
            name = CATEGORY_NAMES.get(getattr(key, "value", str(key)), "other")
            out[name] += int(nbytes)
    out["total"] = total
    return out


def local_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy
) -> dict[str, int]:
    """Exact bytes of this rank's own params, grads and optimizer state, counted tensor by tensor."""
    import torch

    if strategy.memory_tracker == "deepspeed":  # its states live in its flat buffers, not in parameters()
        from fsdpbench.metrics.deepspeed_tracker import deepspeed_storages

        states = deepspeed_storages(model.optimizer)
        inner = getattr(optimizer, "optim", optimizer)
        states["optim"] += [
            v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]
        return {k: _storage_bytes(states[k]) for k in ("params", "grads", "optim")}

    seen: set[int] = set()

    def nbytes(t: torch.Tensor) -> int:
        # storage bytes (FSDP padding included), each storage once (FSDP1 flat params share one)
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if not local.numel() or storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    params = list(model.parameters())
    inner = getattr(optimizer, "optim", optimizer)
    optim = 0
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                optim += nbytes(value)
    return {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optim": optim,
    }


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(storages.values())
