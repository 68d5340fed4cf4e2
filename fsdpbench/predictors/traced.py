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
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fsdpbench.case import Case

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdpbench.engine.parallel import Build, Parallelize
    from fsdpbench.models import ModelDef


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
            "rank": self.rank,
            "params": self.params,
            "method": self.method,
            "model_states_bytes": self.model_states_bytes,
            "peak_bytes": self.peak_bytes,
            "bytes": dict(self.peak_by_category),
            "states_bytes": dict(self.states_by_category),
            "wall_s": self.wall_s,
            "peak_rss_bytes": self.peak_rss_bytes,
            "notes": list(self.notes),
        }


def estimate(
    case: Case, *, rank: int = 0, warmup_steps: int = 1, record_stream: bool = False
) -> TracedEstimate:
    """Trace one rank of ``case`` (any world size) and return the tracker's peak and model states; with
    ``record_stream``, also the tracked step's allocation stream (``traced_stream.py``)."""
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
    _init_fake_process_group(rank, case.world_size)
    try:
        with (
            contextlib.ExitStack() as fake_scope,
            _fake_pg_compat(case.backend),
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
                train_step(parallel, rank_batch(case, rank, step, device))
            model, optimizer = parallel.model, parallel.optimizer
            tracker = build_tracker(model, optimizer, parallel.strategy.fsdp_root(model))
            states: dict[str, int] = {}
            recorder = _recorder(record_stream, tracker, model, optimizer)
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


def _recorder(active: bool, tracker: Any, model: Any, optimizer: Any) -> Any:
    if not active:
        return None
    from fsdpbench.predictors.traced_stream import StreamRecorder

    return StreamRecorder(tracker, model, optimizer)


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
    from fsdpbench.engine.parallel import count_params
    from fsdpbench.predictors.emulate import shards_on_meta

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
            model = _patch_ddp(parallelize(model), world_size)
        return model, params

    return build


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


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
    """The optimizer's ``step`` counters: host tensors on CUDA (not capturable, not fused)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps the real one in .optim
    states = inner.state.values()
    return [t for state in states for name, t in state.items() if name == "step" and torch.is_tensor(t)]


def _drop_host_step_counters(snapshot: dict[str, int], optimizer: Any) -> None:
    """Take the optimizer's ``step`` counters out of a CPU-traced snapshot of a CUDA target: torch keeps
    them on the host unless the optimizer is capturable or fused (fsdpbench's are neither), so a GPU's
    tracker does not count them (states.py leaves them out of CUDA predictions for the same reason)."""
    from fsdpbench.predictors.memory_model.kernels import storage_bytes

    host = _host_step_counters(optimizer)
    counters = sum(storage_bytes(t.untyped_storage().nbytes(), "cuda") for t in host)
    if snapshot.get("optim", 0) >= counters:
        snapshot["optim"] -= counters
        if "total" in snapshot:
            snapshot["total"] -= counters


@contextlib.contextmanager
def _cuda_rules(active: bool) -> Iterator[list[str]]:
    if not active:
        yield []
        return
    from fsdpbench.predictors.cuda_standins import cuda_kernel_standins, cuda_storage_rounding

    with cuda_kernel_standins() as uncovered, cuda_storage_rounding():
        yield uncovered


def _init_fake_process_group(rank: int, world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def _build(mdef: Any, margs: dict[str, Any], device: Any) -> torch.nn.Module:
    with torch.device(device):
        return mdef.build(**margs)


class _CompletedWork:
    """A finished collective whose future carries its tensor (the fake process group's carry None)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([self._tensor])
        return fut


@contextlib.contextmanager
def _fake_pg_compat(backend: str) -> Iterator[None]:
    import torch.nn.parallel.distributed as ddp_module

    verify, all_reduce = ddp_module._verify_param_shape_across_processes, dist.all_reduce
    rs_name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    reduce_scatter = getattr(dist, rs_name)  # what FSDP2's DefaultReduceScatter calls

    def async_all_reduce(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        work = all_reduce(tensor, *args, async_op=async_op, **kwargs)
        return _CompletedWork(tensor) if async_op else work

    def gloo_reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
        staged = tensor.clone() if tensor is not None else None  # gloo reduces a flattened copy of the input
        work = reduce_scatter(*args, **kwargs)
        del staged
        return work

    ddp_module._verify_param_shape_across_processes = lambda *a, **k: None
    dist.all_reduce = async_all_reduce
    if backend == "gloo":
        setattr(dist, rs_name, gloo_reduce_scatter)
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = verify
        dist.all_reduce = all_reduce
        setattr(dist, rs_name, reduce_scatter)


class _ReducerWithoutRebuild:
    """DDP's reducer, except that its first-step bucket rebuild (which reads tensor data) is off."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def _patch_ddp(model: torch.nn.Module, world_size: int, *, rebuild_buckets: bool = False) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return model
    if not model._comm_hooks:

        def allreduce_in_place(state, bucket):  # noqa: ANN001 — DDP checks these annotations at runtime
            buffer = bucket.buffer().div_(world_size)  # what DDP's built-in hook does, minus the wire
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(buffer)
            return fut

        model.register_comm_hook(None, allreduce_in_place)
    if not rebuild_buckets:  # fake tensors have no data to rebuild from; real ones (emulation) do
        model.reducer = _ReducerWithoutRebuild(model.reducer)
    return model


# ---- traced predictions beside a run's measurements --------------------------------------------------
TRACED_COLUMNS = (
    "traced_peak_bytes",
    "traced_model_states_bytes",
    "traced_peak_err",
    "traced_model_states_err",
    "traced_wall_s",
)


def trace_ranks(case_dict: dict[str, Any], ranks: list[int]) -> dict[int, dict[str, Any]]:
    """``estimate`` for each rank of a case (run in a child process by the runner: picklable in and out);
    a CUDA case also gets its allocation stream (as JSON) and the allocator model's figures for it."""
    case = Case.from_dict(case_dict)
    out: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        cuda = case.device == "cuda"
        est = estimate(case, rank=rank, record_stream=cuda)
        out[rank] = {"peak": est.peak_bytes, "states": est.model_states_bytes, "wall_s": est.wall_s}
        if cuda and est.alloc_stream is not None:
            from fsdpbench.predictors.device_fit import DeviceModel

            memory = DeviceModel.for_case(case, rank=rank).replayed(case, est.alloc_stream, est.peak_bytes)
            out[rank]["device_memory"] = memory.to_dict()
            out[rank]["alloc_stream"] = est.alloc_stream.to_json()
    return out


def traced_columns(traced: dict[int, dict[str, Any]], rows: Any) -> dict[str, list[Any]]:
    """traced_* columns for a case's rows, with the relative error against the same rank's tracker; on a
    CUDA case, the allocator model's peaks and predicted NVML beside the allocator's and NVML's."""
    from fsdpbench import schema
    from fsdpbench.predictors.memory_model.columns import relative_error

    device = any("device_memory" in t for t in traced.values())
    columns = (*TRACED_COLUMNS, *(schema.ALLOCATOR_PREDICTION_COLUMNS if device else ()))
    out: dict[str, list[Any]] = {c: [] for c in columns}
    for _, row in rows.iterrows():
        t = traced.get(int(row["rank"]))
        peak, states = (t["peak"], t["states"]) if t else (None, None)
        out["traced_peak_bytes"].append(peak)
        out["traced_model_states_bytes"].append(states)
        out["traced_peak_err"].append(relative_error(peak, row.get("mem_tracker_peak_bytes")))
        out["traced_model_states_err"].append(
            relative_error(states, row.get("mem_tracker_model_states_bytes"))
        )
        out["traced_wall_s"].append(t["wall_s"] if t else None)
        if device:
            for name, value in _allocator_cells((t or {}).get("device_memory"), row).items():
                out[name].append(value)
    return out


def _allocator_cells(memory: dict[str, Any] | None, row: Any) -> dict[str, Any]:
    """One row's allocator/NVML predictions (None where this rank was not traced) and their errors."""
    from fsdpbench import schema
    from fsdpbench.predictors.memory_model.columns import relative_error

    m = memory or {}
    cells = {
        schema.TRACED_ALLOC_ALLOCATED: m.get("allocated_peak_bytes"),
        schema.TRACED_ALLOC_RESERVED: m.get("reserved_peak_bytes"),
        schema.TRACED_ALLOC_FRAGMENTATION: m.get("fragmentation"),
        schema.TRACED_NVML: m.get("nvml_peak_bytes"),
        schema.TRACED_NVML_CONTEXT: m.get("context_bytes"),
        schema.TRACED_NVML_NCCL: m.get("nccl_bytes"),
    }
    for err, (pred, measured) in schema.ERROR_COLUMNS.items():
        if err in schema.ALLOCATOR_PREDICTION_COLUMNS:
            cells[err] = relative_error(cells[pred], row.get(measured))
    return cells
