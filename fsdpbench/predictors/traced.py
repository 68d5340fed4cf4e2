"""The traced predictor: run the case's real strategy code on fake tensors with a fake process group
of any world size, in this one process, under PyTorch's memory trackers. Nothing is allocated: a 7B
decoder on 64 ranks traces on a laptop CPU.

    from fsdpbench.predictors.traced import estimate
    from fsdpbench.strategies import FULL_SHARD_STRATEGY
    est = estimate(Case(model="llama-7b", strategy=FULL_SHARD_STRATEGY, world_size=64))   # rank 0
    est.peak_bytes, est.peak_by_category, est.model_states_bytes

How: ``dist.init_process_group("fake")`` (``torch.testing._internal.distributed.fake_pg``: collectives
do nothing); FSDP strategies are applied to a meta-device model (their device mesh needs real
tensors) and materialised with ``to_empty`` under ``FakeTensorMode``; other strategies are built and
applied under ``FakeTensorMode``. Then the worker's own step (global batch → slice → forward → loss →
backward → optimizer.step → zero_grad) runs once to create optimizer state and once more inside the
worker's tracker (``FSDPMemTracker`` / ``MemTracker``), which records the same categories as a run.

What makes a large trace fast, none of it changing a byte (tests/test_estimate.py traces both ways):
the FSDP2 first step shortened to what it leaves behind (the root's lazy init, the optimizer's state from
a step on zero gradients); FSDP2 splitting each parameter into only the chunks it reads
(``rank_chunks.py``); the tracker answering device queries, half of a fake step's dispatches, directly
(``metrics/tracker.quick_device_queries``); the garbage collector run less often (``_fewer_collections``).
llama-70b on 1,024 ranks, in-process: 6.5–6.9 s, 7.4–8.2 s without the last three
(docs/results/self-speed.md).

With ``backend: gloo`` (the CPU runs) the trace also stages the copy of the input that gloo's
reduce-scatter makes, so it predicts what a gloo run measures; with nccl it does not.

Two things the fake process group cannot do for DDP, and what is done instead (inside
``estimate`` only; no strategy code changes):
- its ``Work`` futures carry no tensors, so DDP's built-in all-reduce hook fails: an equivalent
  Python hook is registered (divide the bucket in place, return it — no allocation, like the
  built-in one), and ``dist.all_reduce(async_op=True)`` futures are completed with their tensor so
  compression hooks (``-lowreduce``) work;
- DDP reads real tensor data when it checks parameter shapes across ranks and when it rebuilds its
  buckets after the first step: the check is skipped and the rebuild kept off (buckets stay as built:
  one bucket; the tracker counts a bucket once backward first writes it, so mid-backward the traced
  DDP peak can count bucket memory earlier than a real run does).
Which kernels a trace runs is the target device's (``case.device``), never silently the CPU's for a CUDA
target: on a machine whose torch can run CUDA kernels, a ``cuda`` case is traced on fake CUDA tensors (the
reference H100 data shows this exact to the byte); on a CPU-only build, where CUDA kernels cannot be
dispatched even on fake tensors, it is traced on fake CPU tensors with CUDA's rules swapped in for RMSNorm
and SDPA and CUDA's 512-byte rounding (fsdpbench/predictors/cuda_standins.py), and the notes say so.
Not traced: ``torch.compile`` (the model runs eagerly), ``mixed`` (an accounting, not a runnable
precision).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fsdpbench.core.case import Case
from fsdpbench.core.schema import (
    RANK,
    WALL_S,
)
from fsdpbench.engine.fake_pg import fake_pg_compat, init_fake_process_group, patch_ddp
from fsdpbench.metrics.rss import peak_rss_bytes
from fsdpbench.predictors.rank_chunks import rank_chunks_only

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdpbench.engine.parallel import Build, Parallelize
    from fsdpbench.models import ModelDef


# an FSDP2 or DDP trace's warm-up creates the states without a forward and backward (_create_first_states);
# tests/test_estimate.py turns it off to check that the tracked step's bytes are those of a full warm-up
FIRST_STEP_SHORTCUT = True
# the garbage collector's young generation during a trace (Python's default: 700 objects); _fewer_collections
YOUNG_GENERATION_OBJECTS = 10_000


@dataclass(frozen=True, slots=True)
class TracedEstimate:
    """What PyTorch's tracker saw on one fake rank (bytes)."""

    case_id: str
    strategy: str
    world_size: int
    rank: int
    params: int
    method: str
    peak_bytes: int
    peak_by_category: dict[str, int]
    states_by_category: dict[str, int]  # after optimizer.step, before zero_grad
    model_states_bytes: int
    wall_s: float
    peak_rss_bytes: int  # this process's peak resident memory so far (ru_maxrss)
    notes: tuple[str, ...] = field(default_factory=tuple)
    alloc_stream: Any = None  # the tracked step's allocation stream (AllocStream), when asked for

    def to_dict(self) -> dict[str, Any]:
        return {
            "case_id": self.case_id,
            "strategy": self.strategy,
            "world_size": self.world_size,
            RANK: self.rank,
            "params": self.params,
            "method": self.method,
            "model_states_bytes": self.model_states_bytes,
            "peak_bytes": self.peak_bytes,
            "bytes": dict(self.peak_by_category),
            "states_bytes": dict(self.states_by_category),
            WALL_S: self.wall_s,
            "peak_rss_bytes": self.peak_rss_bytes,
            "notes": list(self.notes),
        }


def estimate(
    case: Case, *, rank: int = 0, warmup_steps: int = 1, record_stream: bool = False
) -> TracedEstimate:
    """Trace one rank of ``case`` (any world size) and return the tracker's peak and model states; with
    ``record_stream``, also the tracked step's allocation stream (``traced_stream.py``)."""
    with _fewer_collections():
        return _estimate(case, rank, warmup_steps, record_stream)


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """Python's garbage collector, run less often. A trace makes cyclic garbage at every op (torch's
    ``tree_flatten`` defines a recursive closure per call: llama-70b on 1,024 ranks leaves ~700,000 such
    objects), so the collector runs thousands of times, each run walking the young objects and every tenth
    the older ones too. A young generation of 10,000 objects instead of 700 collects the same garbage in a
    tenth of the runs. A tensor is freed by reference counting when its last reference goes, whenever the
    collector runs; only one held by a reference cycle waits for a collection, whose moment was never the
    trace's to choose."""
    thresholds = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_OBJECTS, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


# what a trace imports on its first call (its strategies', trackers' and fake tensors' torch modules):
# imported before predict forks its processes, which then start with them
TRACE_MODULES = (
    "torch._dynamo",
    "torch._subclasses.fake_tensor",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.optim",
    "torch.distributed._tools.mem_tracker",
    "torch.distributed._tools.fsdp2_mem_tracker",
    "torch.nn.parallel",
    "fsdpbench.engine.parallel",
    "fsdpbench.engine.step",
    "fsdpbench.metrics.tracker",
    "fsdpbench.models.decoder",
    "fsdpbench.predictors.block_repeat",
    "fsdpbench.predictors.traced_stream",
)


def import_trace_modules() -> None:
    import importlib

    for name in TRACE_MODULES:
        importlib.import_module(name)


def _estimate(case: Case, rank: int, warmup_steps: int, record_stream: bool) -> TracedEstimate:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdpbench.engine.parallel import build_parallel
    from fsdpbench.engine.step import rank_batch, train_step
    from fsdpbench.metrics.tracker import build_tracker, snapshot_by_category
    from fsdpbench.strategies import get_strategy

    if not case.precision_spec.runnable:
        raise ValueError(
            f"precision {case.precision!r} is an accounting, not a runnable precision: "
            "trace bf16 (what FSDP2 keeps) or use --method analytic"
        )
    if not 0 <= rank < case.world_size:
        raise ValueError(f"rank {rank} is outside world_size={case.world_size}")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("estimate() starts its own fake process group; call it outside an initialized one")
    t0 = time.perf_counter()
    device, cuda_rules = trace_device(case)
    notes = _trace_notes(case, device, cuda_rules)
    reason = get_strategy(case.strategy).check(case)
    if reason:
        raise ValueError(f"case {case.case_id}: {reason}")
    excepthook = sys.excepthook  # init_process_group chains a rank-prefixing hook on every call
    init_fake_process_group(rank, case.world_size)
    try:
        with (
            contextlib.ExitStack() as fake_scope,
            fake_pg_compat(case.backend),
            rank_chunks_only(),
            _strided_shard_flag_checked_once(),
            _fsdp1_allocation_by_size(),
            _cuda_rules(cuda_rules) as uncovered,
        ):
            # the model runs eagerly: torch.compile is not traced
            build = _fake_build(
                FakeTensorMode(allow_non_fake_inputs=True), fake_scope, device, case.world_size
            )
            parallel = build_parallel(case.replace(compile=False), device, rank, build=build)
            if cuda_rules and not isinstance(parallel.autocast, contextlib.nullcontext):
                notes.append(
                    "autocast traced with the CPU's autocast op lists (CUDA's may cast some ops differently)"
                )
            for step in range(warmup_steps):
                if step == 0 and FIRST_STEP_SHORTCUT and _first_states_creatable(parallel):
                    _create_first_states(parallel)
                else:
                    train_step(parallel, rank_batch(case, rank, step, device))
            model, optimizer = parallel.model, parallel.optimizer
            tracker = build_tracker(model, optimizer, parallel.strategy, module_peaks=False)
            states: dict[str, int] = {}
            recorder = _recorder(record_stream, tracker, model, optimizer, device.type)
            with recorder.attached() if recorder else contextlib.nullcontext(), tracker:
                if recorder:
                    recorder.begin_step(_host_step_counters(optimizer) if cuda_rules else [])
                train_step(
                    parallel,
                    rank_batch(case, rank, warmup_steps, device),
                    after_optim=lambda: states.update(snapshot_by_category(tracker, "current", device)),
                )
            peak = snapshot_by_category(tracker, "peak", device)
            if cuda_rules:  # on CUDA these are host tensors; the CPU trace counted them with the device's
                for snap in (peak, states):
                    _drop_host_step_counters(snap, optimizer)
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
    notes.extend(uncovered)
    return TracedEstimate(
        case_id=case.case_id,
        strategy=case.strategy,
        world_size=case.world_size,
        rank=rank,
        params=int(parallel.params),
        method="traced",
        peak_bytes=int(peak.pop("total")),
        peak_by_category=peak,
        states_by_category=states,
        model_states_bytes=sum(states.get(c, 0) for c in ("params", "grads", "optim")),
        wall_s=time.perf_counter() - t0,
        peak_rss_bytes=peak_rss_bytes(),
        notes=tuple(notes),
        alloc_stream=recorder.stream(tuple(notes)) if recorder else None,
    )


def _first_states_creatable(parallel: Any) -> bool:
    """Whether the first step's states can be made without its forward and backward: FSDP2's (sharded on
    meta) and DistributedDataParallel's (DDP, ZeRO-1), whose first forward and backward leave nothing
    behind but the gradients on fake tensors (DDP's bucket rebuild is off there: ``fake_pg.patch_ddp``)."""
    from torch.nn.parallel import DistributedDataParallel

    from fsdpbench.engine.emulate import shards_on_meta

    return shards_on_meta(parallel.strategy) or isinstance(parallel.model, DistributedDataParallel)


def _create_first_states(parallel: Any) -> None:
    """What a model's first step leaves behind, without its forward and backward (on fake tensors a 70B
    model's forward and backward are seconds of dispatch): an FSDP2 root's lazy initialisation, which its
    first forward would run, and the optimizer's state, created by a step on zero gradients (for FSDP2 a
    DTensor of the parameter's placement, as a real gradient is; the state's values are not traced), after
    clipping where the case clips (its first call allocates for good). Then the gradients are dropped, as
    ``train_step`` drops them."""
    import torch

    from fsdpbench.engine.emulate import shards_on_meta

    if shards_on_meta(parallel.strategy):
        parallel.strategy.fsdp_root(parallel.model)._get_fsdp_state()._lazy_init()
    for param in parallel.model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    if parallel.max_norm is not None:
        from fsdpbench.engine.step import clip_grad_norm

        clip_grad_norm(parallel.model, parallel.max_norm)
    parallel.optimizer.step()
    parallel.optimizer.zero_grad(set_to_none=True)


def _recorder(active: bool, tracker: Any, model: Any, optimizer: Any, device_type: str) -> Any:
    if not active:
        return None
    from fsdpbench.predictors.traced_stream import StreamRecorder

    return StreamRecorder(tracker, model, optimizer, device_type)


def _trace_notes(case: Case, device: torch.device, cuda_rules: bool) -> list[str]:
    """What a trace on ``device`` stands for, and what it leaves out."""
    if cuda_rules:
        from fsdpbench.predictors.memory_model.kernels import ASSUMED_CASE

        notes = [
            "CUDA target on a torch build that cannot run CUDA kernels: traced on fake CPU tensors with "
            "CUDA's rules swapped in for RMSNorm and SDPA (memory_model/kernels.py) and CUDA's 512-byte "
            "rounding (no memory allocated); " + ASSUMED_CASE["cuda"]
        ]
    else:
        kind = device.type.upper()
        notes = [f"traced on fake {kind} tensors with {kind} kernels (no memory allocated)"]
    if case.compile:
        notes.append("torch.compile not traced: the model runs eagerly")
    return notes


def _fake_build(
    fake: FakeTensorMode, fake_scope: contextlib.ExitStack, device: torch.device, world_size: int
) -> Build:
    """The model as fake tensors on ``device``; ``fake`` is entered into ``fake_scope`` on the way, and
    stays entered for the steps. FSDP2 strategies are applied on meta (their device mesh needs real
    tensors), then materialised; others are built and applied under ``fake``."""
    from fsdpbench.engine.emulate import shards_on_meta
    from fsdpbench.engine.parallel import count_params

    def build(mdef: ModelDef, margs: dict[str, Any], parallelize: Parallelize) -> tuple[torch.nn.Module, int]:
        if shards_on_meta(parallelize.strategy):
            model = _build(mdef, margs, "meta")
            params = count_params(model)
            model = parallelize(model)
            fake_scope.enter_context(fake)
            model.to_empty(device=device)
        else:
            fake_scope.enter_context(fake)
            model = _build(mdef, margs, device)
            params = count_params(model)
            model = patch_ddp(parallelize(model), world_size)
        return model, params

    return build


def cuda_kernels_dispatchable() -> bool:
    """Whether this torch can run CUDA kernels (fake CUDA tensors need them too): a CUDA build with a GPU."""
    return bool(torch.backends.cuda.is_built() and torch.cuda.is_available())


def trace_device(case: Case) -> tuple[torch.device, bool]:
    """Where the fake tensors live, and whether CUDA's rules stand in for CUDA kernels (a ``cuda`` target
    on a build that cannot run them)."""
    if case.device != "cuda":
        return torch.device("cpu"), False
    if cuda_kernels_dispatchable():
        return torch.device("cuda", torch.cuda.current_device()), False
    return torch.device("cpu"), True


# ---- helpers ------------------------------------------------------------------------------------------
def _host_step_counters(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's ``step`` counters: host tensors on CUDA unless the update is fused (or capturable),
    which keeps them on the parameters' device."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps the real one in .optim
    if any(group.get("fused") or group.get("capturable") for group in inner.param_groups):
        return []
    states = inner.state.values()
    return [t for state in states for name, t in state.items() if name == "step" and torch.is_tensor(t)]


def _drop_host_step_counters(snapshot: dict[str, int], optimizer: Any) -> None:
    """Take the optimizer's ``step`` counters out of a CPU-traced snapshot of a CUDA target: torch keeps
    them on the host unless the optimizer is capturable or fused (``_host_step_counters``), so a GPU's
    tracker does not count them (states.py leaves them out of CUDA predictions for the same reason)."""
    from fsdpbench.predictors.memory_model.kernels import storage_bytes

    host = _host_step_counters(optimizer)
    counters = sum(storage_bytes(t.untyped_storage().nbytes(), "cuda") for t in host)
    if snapshot.get("optim", 0) >= counters:
        snapshot["optim"] -= counters
        if "total" in snapshot:
            snapshot["total"] -= counters


@contextlib.contextmanager
def _strided_shard_flag_checked_once() -> Iterator[None]:
    """DTensor's sharding propagation of a foreach op (the optimizer's update, clipping's norms) fixes up
    each output's ``_StridedShard`` flag (``_sharding_prop._propagate_use_strided_shard_flag``), first
    scanning every argument's placements for a ``_StridedShard``, once per tensor of the list: quadratic
    in the parameters, a third of a foreach trace of a 32-block model. FSDP2's placements have none (then
    the function returns having changed nothing), so the scan is made once per op and the function called
    only when it finds one. Where this torch has no such function, nothing changes."""
    try:
        from torch.distributed.tensor import _sharding_prop
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        yield
        return
    original = getattr(_sharding_prop, "_propagate_use_strided_shard_flag", None)
    if original is None:
        yield
        return
    last: list[Any] = [None, True]  # the op schema scanned last, and whether it has a _StridedShard

    def propagate(op_strategy: Any, op_schema: Any) -> None:
        if last[0] is not op_schema:
            specs = op_schema.args_spec
            last[:] = [op_schema, any(isinstance(p, _StridedShard) for s in specs for p in s.placements)]
        if last[1]:
            original(op_strategy, op_schema)

    _sharding_prop._propagate_use_strided_shard_flag = propagate
    try:
        yield
    finally:
        _sharding_prop._propagate_use_strided_shard_flag = original
        last.clear()


@contextlib.contextmanager
def _fsdp1_allocation_by_size() -> Iterator[None]:
    """FSDP1 asks whether a flat parameter's storage is allocated by its data pointer
    (``_data_ptr_allocated``), which is 0 for every fake tensor: SHARD_GRAD_OP's backward then asserts that
    its unsharded flat parameter is not. Inside the block the question is answered by the storage's size,
    as FSDP1 frees a storage by resizing it to 0 bytes (real storages: the same answer)."""
    from torch.distributed.fsdp import _flat_param

    original = getattr(_flat_param, "_data_ptr_allocated", None)
    if original is None:  # a torch whose FSDP1 does not ask
        yield
        return
    _flat_param._data_ptr_allocated = lambda tensor: tensor.untyped_storage().size() > 0
    try:
        yield
    finally:
        _flat_param._data_ptr_allocated = original


@contextlib.contextmanager
def _cuda_rules(active: bool) -> Iterator[list[str]]:
    if not active:
        yield []
        return
    from fsdpbench.predictors.cuda_standins import cuda_kernel_standins, cuda_storage_rounding

    with cuda_kernel_standins() as uncovered, cuda_storage_rounding():
        yield uncovered


def _build(mdef: Any, margs: dict[str, Any], device: Any) -> torch.nn.Module:
    with torch.device(device):
        return mdef.build(**margs)
