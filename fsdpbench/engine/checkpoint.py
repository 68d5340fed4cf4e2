"""The checkpoint phase: save this rank's model (and optimizer) state, load it into a freshly built model
and optimizer, and take one more step, measuring each part.

The methods (``Case.checkpoint``), as the engines' guides write them:

- ``full``: the whole state on rank 0's host. DDP: rank 0 ``torch.save``s ``module.state_dict()`` and
  ``optimizer.state_dict()`` (ZeRO-1: after ``consolidate_state_dict(to=0)`` on every rank; every rank
  loads the file, ``ZeroRedundancyOptimizer.load_state_dict`` keeping its own partition). FSDP1/FSDP2:
  ``get_state_dict`` with ``StateDictOptions(full_state_dict=True, cpu_offload=True)`` (for FSDP1 that is
  ``FULL_STATE_DICT`` with ``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)``), then rank 0
  ``torch.save``s it; loading broadcasts it from rank 0 (``broadcast_from_rank0=True``).
- ``sharded``: the sharded state dict (FSDP2's DTensors, FSDP1's ``SHARDED_STATE_DICT``); each rank
  ``torch.save``s its own local shards into its own file.
- ``dcp``: ``torch.distributed.checkpoint.save``/``load`` of the sharded state dict (a replicated state
  is written once, by the rank DCP's planner picks), with its ``FileSystemWriter``/``FileSystemReader``
  named, as DCP's examples do: given only ``checkpoint_id``, DCP tries every storage it knows
  (``_storage_utils._storage_setup``) and so imports fsspec on its first save in a process, ~2 MB of
  host memory once that is not the checkpoint's.
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` (a thread writes; the loop is blocked only
  while the state is staged).
- ``native``: the engine's own checkpoint API, DeepSpeed's ``engine.save_checkpoint(dir, tag)`` (every
  rank: its ZeRO partition's ``*_optim_states.pt``; the model's ``*_model_states.pt`` on rank 0, on every
  rank with ZeRO-3; rank 0 also ``latest`` and the recovery scripts) and ``engine.load_checkpoint(dir, tag,
  load_optimizer_states=...)`` into the freshly built engine.

Every file goes under the case's ``checkpoint/`` directory, which rank 0 makes anew; the phase removes
it unless the case keeps it (``keep_checkpoints``), whether the save ends well or not. fsdpbench creates
each file itself, ``O_EXCL | O_NOFOLLOW`` beneath the case directory (``rundir.create_new``), DCP's
included (``FilesBeneath``, its file system), so that no link planted there is written through;
``torch.save`` writes to that file as a stream (its records are then named "archive/…", not after the
file). DeepSpeed opens its own files: its checkpoint is checked after the save and refused if it holds a
link. A save that fails is one line (``CheckpointSaveError``: "no space left while saving …" on a full
disk), and the launcher removes the partial checkpoint once the ranks are gone, unless kept.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

# imported with this module, before the phase's baseline: torch.distributed.optim's first import costs
# ~4.7 MB of anonymous memory in a rank (its modules), which a save that first imports it would count
import torch.distributed.optim  # noqa: F401
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdpbench.core.rundir import (
    CHECKPOINT_DIR,
    NATIVE_TAG,
    check_no_links,
    create_new,
    make_dirs,
    make_new_dir,
    remove_tree,
    replace_beneath,
    space_error,
)
from fsdpbench.engine.parallel import Parallel
from fsdpbench.engine.rank_result import CheckpointRecord
from fsdpbench.metrics.allocator import reset_cuda_peaks
from fsdpbench.metrics.rss import (
    fix_mmap_threshold,
    read_anon_rss_bytes,
    read_status_bytes,
    reset_peak_rss,
    trim_heap,
)
from fsdpbench.metrics.sampler import BackgroundSampler

FULL_FILE = "full.pt"  # rank 0's, for ``full``
RSS_INTERVAL_S = 0.0005  # the phase is short: sample often enough to see the state dict held


def sharded_file(rank: int) -> str:
    return f"rank{rank}.pt"


def checkpoint_dir(case_dir: Path) -> Path:
    return case_dir / CHECKPOINT_DIR


class CheckpointSaveError(RuntimeError):
    """A save that failed (a full disk, a quota, a planted link): one line, the partial checkpoint removed."""


class FilesBeneath(FileSystem):
    """DCP's local file system, every file it writes created by fsdpbench beneath ``root`` without
    following a link (``rundir.create_new``), its rename and removals by directory descriptor."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = Path(root)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:  # a read: nothing is written
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with os.fdopen(create_new(Path(path), self.root), mode) as stream:
                yield stream
        except Exception as exc:
            # torch.save, which DCP writes each item with, turns the stream's OSError into a RuntimeError
            # that keeps it only as its context, which DCP's gathering of every rank's exception drops
            full = space_error(exc)
            if full is None or full is exc:
                raise
            raise OSError(full.errno, full.strerror, str(path)) from exc

    def mkdir(self, path: str | os.PathLike) -> None:
        make_dirs(Path(path), self.root)

    def exists(self, path: str | os.PathLike) -> bool:
        return os.path.lexists(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        replace_beneath(Path(path), Path(new_path), self.root)

    def rm_file(self, path: str | os.PathLike) -> None:
        remove_tree(Path(path), self.root)


def _writer(directory: Path, root: Path) -> dcp.FileSystemWriter:
    writer = dcp.FileSystemWriter(directory)
    writer.fs = FilesBeneath(root)
    return writer


@contextlib.contextmanager
def _new_file(path: Path, root: Path) -> Iterator[Any]:
    """A file for ``torch.save`` to stream into, created beneath ``root`` with ``O_EXCL | O_NOFOLLOW``."""
    with os.fdopen(create_new(path, root), "wb") as stream:
        yield stream


# ---- what each method saves and loads ---------------------------------------------------------------


def _full_state_dict_api(parallel: Parallel) -> str:
    return str(parallel.strategy.checkpointing.state_dict_api)


def _consolidated_optimizer(parallel: Parallel) -> Any | None:
    """The case's optimizer when its state is consolidated on rank 0 for a checkpoint (ZeRO-1's
    ZeroRedundancyOptimizer), else None."""
    consolidates = parallel.strategy.checkpointing.optimizer_consolidation == "to_rank0"
    return parallel.optimizer if consolidates else None


def _local(value: Any) -> Any:
    """A DTensor's or ShardedTensor's local shard (what this rank holds); anything else as it is."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        return shards[0].tensor if shards else torch.empty(0)
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value


def _state(parallel: Parallel, with_optim: bool, options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model (and optimizer) state dict of this rank, through torch.distributed.checkpoint.state_dict."""
    if with_optim:
        model_sd, optim_sd = get_state_dict(parallel.model, parallel.optimizer, options=options)
        return {"model": model_sd, "optim": optim_sd}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {"model": get_model_state_dict(parallel.model, options=options)}


def _apply_state(parallel: Parallel, state: dict[str, Any], options: StateDictOptions | None = None) -> None:
    # the model and the optimizer one after the other: set_state_dict takes an empty model state dict
    # (a broadcast_from_rank0 load's other ranks) for "optimizer only" and skips the model's broadcast
    set_model_state_dict(parallel.model, state["model"], options=options)
    if "optim" in state:
        set_optimizer_state_dict(parallel.model, parallel.optimizer, state["optim"], options=options)


FULL_OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL_LOAD_OPTIONS = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _fsdp1_full_state(parallel: Parallel, with_optim: bool, device: torch.device) -> dict[str, Any]:
    """FSDP1's FULL_STATE_DICT, rank 0 only. ``offload_to_cpu`` only from a GPU: FSDP1 frees the unsharded
    flat parameter after moving it to the CPU, and on a CPU device that move is no move, so its state
    dict's views would point at freed memory (a segfault in FSDP1's clone on CPU ranks)."""
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    offload = device.type == "cuda"
    with FSDP.state_dict_type(
        parallel.model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True),
    ):
        state = {"model": parallel.model.state_dict()}
        if with_optim:
            state["optim"] = FSDP.optim_state_dict(parallel.model, parallel.optimizer)
    return state


def _plain_ddp_state(parallel: Parallel, with_optim: bool) -> dict[str, Any]:
    """DDP's own way: the wrapped module's state dict and the optimizer's, as they are."""
    module = getattr(parallel.model, "module", parallel.model)
    state = {"model": module.state_dict()}
    if with_optim:
        state["optim"] = parallel.optimizer.state_dict()
    return state


class _Async:
    """The future of an async save: the loop was blocked only until ``async_save`` returned."""

    def __init__(self, future: Any) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()


def save(
    method: str,
    parallel: Parallel,
    directory: Path,
    rank: int,
    with_optim: bool,
    device: torch.device,
    root: Path | None = None,
) -> _Async | None:
    """Save this rank's part of the checkpoint under ``directory`` (the async method: return its future);
    every file is created beneath ``root`` (the case directory; default: ``directory``) without following
    a link."""
    root = directory if root is None else root
    if method == "full":
        if _full_state_dict_api(parallel) == "module":
            zero = _consolidated_optimizer(parallel)
            if zero is not None and with_optim:
                zero.consolidate_state_dict(to=0)  # every rank: each sends rank 0 its partition
            state = _plain_ddp_state(parallel, with_optim) if rank == 0 else None
        elif _full_state_dict_api(parallel) == "fsdp1":
            state = _fsdp1_full_state(parallel, with_optim, device)
        else:
            state = _state(parallel, with_optim, FULL_OPTIONS)  # empty except on rank 0
        if rank == 0:
            with _new_file(directory / FULL_FILE, root) as stream:
                torch.save(state, stream)
        del state
    elif method == "sharded":
        with _new_file(directory / sharded_file(rank), root) as stream:
            torch.save(_local(_state(parallel, with_optim)), stream)
    elif method == "dcp":
        dcp.save(_state(parallel, with_optim), storage_writer=_writer(directory, root))
    elif method == "dcp_async":
        writer = _writer(directory, root)
        return _Async(dcp.async_save(_state(parallel, with_optim), storage_writer=writer))
    elif method == "native":  # DeepSpeed's engine: it always writes its optimizer partitions
        engine: Any = parallel.model
        engine.save_checkpoint(str(directory), tag=NATIVE_TAG)
        check_no_links(directory)  # it opens its files by name: what it wrote is checked instead
    else:
        raise ValueError(f"unknown checkpoint method {method!r}")
    return None


def load(method: str, parallel: Parallel, directory: Path, rank: int, with_optim: bool) -> None:
    """Load the checkpoint under ``directory`` into ``parallel`` (freshly built)."""
    if method == "full":
        if _full_state_dict_api(parallel) == "module":
            state = torch.load(directory / FULL_FILE, map_location="cpu", weights_only=True)
            module = getattr(parallel.model, "module", parallel.model)
            module.load_state_dict(state["model"])
            if with_optim:
                parallel.optimizer.load_state_dict(state["optim"])
        else:
            state = (
                torch.load(directory / FULL_FILE, map_location="cpu", weights_only=True) if rank == 0 else {}
            )
            if rank != 0:  # broadcast_from_rank0: the other ranks give empty dicts
                state = {"model": {}, "optim": {}} if with_optim else {"model": {}}
            _apply_state(parallel, state, FULL_LOAD_OPTIONS)
        del state
    elif method == "sharded":
        saved = torch.load(directory / sharded_file(rank), map_location="cpu", weights_only=True)
        fresh = _state(parallel, with_optim)
        _copy_into_local(fresh, saved)
        _apply_state(parallel, fresh)
    elif method in ("dcp", "dcp_async"):
        fresh = _state(parallel, with_optim)
        dcp.load(fresh, storage_reader=dcp.FileSystemReader(directory))
        _apply_state(parallel, fresh)
    elif method == "native":
        engine: Any = parallel.model
        path, _ = engine.load_checkpoint(
            str(directory), tag=NATIVE_TAG, load_optimizer_states=with_optim, load_lr_scheduler_states=False
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed's load_checkpoint found no checkpoint under {directory}")
    else:
        raise ValueError(f"unknown checkpoint method {method!r}")


def _copy_into_local(fresh: Any, saved: Any) -> None:
    """Copy the saved local shards into the fresh state dict's own (DTensor/ShardedTensor) shards."""
    if isinstance(fresh, dict):
        for key, value in fresh.items():
            if isinstance(value, (dict, list)):
                _copy_into_local(value, saved[key])
            elif isinstance(value, torch.Tensor):
                _local(value).copy_(saved[key])
            else:
                fresh[key] = saved[key]
    elif isinstance(fresh, list):
        for i, value in enumerate(fresh):
            if isinstance(value, (dict, list)):
                _copy_into_local(value, saved[i])


def files_written(method: str, directory: Path, rank: int) -> list[Path]:
    """The files this rank wrote: DCP names its per-rank files ``__{rank}_{i}.distcp``; its coordinator
    (rank 0) writes ``.metadata``."""
    if method == "full":
        return [directory / FULL_FILE] if rank == 0 else []
    if method == "sharded":
        return [directory / sharded_file(rank)]
    if method == "native":  # DeepSpeed names a rank's files zero_pp_rank_{rank}_*; rank 0 writes the rest
        files = sorted(p for p in directory.rglob("*") if p.is_file())
        mine = [p for p in files if f"zero_pp_rank_{rank}_" in p.name]
        return mine + ([p for p in files if "zero_pp_rank_" not in p.name] if rank == 0 else [])
    own = sorted(directory.glob(f"__{rank}_*.distcp"))
    return own + ([directory / ".metadata"] if rank == 0 else [])


# ---- the round trip ---------------------------------------------------------------------------------


def local_state_copy(parallel: Parallel, with_optim: bool, method: str = "full") -> list[torch.Tensor]:
    """Every tensor this rank holds of the state, cloned, in state-dict order (the round trip's reference).

    ``native`` (a DeepSpeed engine): the module's parameters (ZeRO-3: this rank's partitions,
    ``ds_tensor``) and the ZeRO optimizer's own state dict (its fp32 partitions and the torch optimizer's
    state), what ``save_checkpoint`` writes of this rank."""
    out: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(value[k])
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, torch.Tensor):
            out.append(value.detach().clone())

    if method == "native":  # the rank's parameters (ZeRO-3: its partitions) and ZeRO's state dict
        engine: Any = parallel.model
        zero_optim: Any = parallel.optimizer
        params = {n: getattr(p, "ds_tensor", p) for n, p in engine.module.named_parameters()}
        walk({"model": params, **({"optim": zero_optim.zero.state_dict()} if with_optim else {})})
        return out
    zero = _consolidated_optimizer(parallel)
    if zero is not None:  # no get_state_dict of ZeRO-1: the model's and this rank's partition's own
        module = getattr(parallel.model, "module", parallel.model)
        walk({"model": module.state_dict(), **({"optim": zero.optim.state_dict()} if with_optim else {})})
    else:
        walk(_local(_state(parallel, with_optim)))
    return out


def states_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


# ---- host memory ------------------------------------------------------------------------------------


@contextlib.contextmanager
def allocations_visible_in_rss() -> Iterator[None]:
    """Make every large host allocation of the phase its own mapping, so RSS rises and falls with it: the
    mmap threshold fixed (the worker already fixed it when the rank started, ``metrics.rss.
    fix_mmap_threshold``, so that training leaves no heap of large free chunks to serve the phase), then
    the free heap returned to the system. Not glibc: nothing changes."""
    fix_mmap_threshold()
    trim_heap()
    yield


class HostPeak:
    """Host memory the phase adds above what it starts with: the kernel's RSS high-water mark (``VmHWM``,
    reset here), less the file-backed pages faulted in meanwhile (code run for the first time, e.g. DCP's
    modules on its first save: mapped, not allocated); where the mark cannot be reset, anonymous RSS
    sampled every ``RSS_INTERVAL_S`` (which misses a transient shorter than that)."""

    def __init__(self) -> None:
        gc.collect()
        self.sampler = BackgroundSampler(
            read_anon_rss_bytes, interval_s=RSS_INTERVAL_S, name="rss_checkpoint"
        )
        self.sampler.start()  # before the baseline: its thread's stack is not the phase's memory
        self.baseline_bytes = read_anon_rss_bytes()
        self.kernel_peak = reset_peak_rss()
        self.status = read_status_bytes()

    def mark(self) -> None:
        self.sampler.sample_now()

    def stop(self) -> int:
        """Peak host memory above the baseline, bytes (never negative)."""
        self.sampler.stop()
        if self.kernel_peak:
            end = read_status_bytes()
            mapped_files = max(0, _file_backed(end) - _file_backed(self.status))
            return max(0, end["VmHWM"] - self.status["VmRSS"] - mapped_files)
        return max(0, (self.sampler.peak_bytes or 0) - self.baseline_bytes)


def _file_backed(status: dict[str, int]) -> int:
    return status.get("RssFile", 0) + status.get("RssShmem", 0)


def device_peak_bytes(device: torch.device) -> int | None:
    """The caching allocator's peak since the last reset (GPU); None on a CPU rank (its RSS is the record)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def _dir_bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


def run_checkpoint_phase(
    parallel: Parallel, rebuild: Any, step: Any, case_dir: Path, rank: int, device: torch.device, case: Any
) -> CheckpointRecord:
    """Save, reference the state, take the uninterrupted step, rebuild, load, compare, step again.

    ``rebuild()``: a freshly built ``Parallel`` of the same case; ``step(parallel)``: the loss of the next
    step (the same batch every time it is called)."""
    method, with_optim = case.checkpoint, case.checkpoint_optimizer
    directory = checkpoint_dir(case_dir)
    if rank == 0:
        remove_tree(directory, case_dir)
        make_new_dir(directory, case_dir)
    dist.barrier()
    record = CheckpointRecord(method=method, with_optimizer=with_optim)
    with allocations_visible_in_rss():
        # ---- save
        reset_cuda_peaks(device)
        host = HostPeak()
        t0 = time.perf_counter()
        with _save_failure_in_one_line(method, directory, case.keep_checkpoints):
            pending = save(method, parallel, directory, rank, with_optim, device, case_dir)
            record.save_blocked_s = time.perf_counter() - t0
            host.mark()
            if pending is not None:
                pending.wait()
        record.save_s = time.perf_counter() - t0
        record.save_host_peak_bytes = host.stop()
        record.save_device_peak_bytes = device_peak_bytes(device)
        dist.barrier()
        written = files_written(method, directory, rank)
        record.files = len(written)
        record.bytes_written = _dir_bytes(written)

        # ---- the reference: the saved state, and the step the uninterrupted run takes next
        reference = local_state_copy(parallel, with_optim, method)
        record.loss_uninterrupted = float(step(parallel))

        # ---- load into a fresh model and optimizer
        fresh = rebuild()
        dist.barrier()
        reset_cuda_peaks(device)
        host = HostPeak()
        t0 = time.perf_counter()
        load(method, fresh, directory, rank, with_optim)
        record.load_s = time.perf_counter() - t0
        record.load_host_peak_bytes = host.stop()
        record.load_device_peak_bytes = device_peak_bytes(device)
        record.state_equal = states_equal(reference, local_state_copy(fresh, with_optim, method))
        record.loss_after_load = float(step(fresh))
        record.loss_equal = record.loss_after_load == record.loss_uninterrupted
    dist.barrier()
    if rank == 0 and not case.keep_checkpoints:
        remove_tree(directory, case_dir)
    return record


@contextlib.contextmanager
def _save_failure_in_one_line(method: str, directory: Path, keep: bool) -> Iterator[None]:
    """A save that fails says why in one line (DCP gathers every rank's exception into one of many
    lines), and what becomes of the partial checkpoint: the launcher removes it once every rank is gone,
    unless the case keeps its checkpoints. Not here: a peer still writing would fail for the directory
    gone, and could be taken for the cause."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        left = "kept (keep_checkpoints)" if keep else "removed"
        full = space_error(exc)
        if full is not None:
            raise CheckpointSaveError(
                f"no space left while saving the checkpoint ({method}) in {directory} "
                f"({full.strerror}); the partial checkpoint is {left}"
            ) from exc
        first = _first_failure(exc)
        raise CheckpointSaveError(
            f"saving the checkpoint ({method}) in {directory} failed: "
            f"{type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''}; "
            f"the partial checkpoint is {left}"
        ) from exc


def _first_failure(exc: BaseException) -> BaseException:
    """The first rank's exception in a DCP CheckpointException, or ``exc`` itself."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, BaseException):
            return first
    return exc
