"""The fake process group (``torch.testing._internal.distributed.fake_pg``: collectives do nothing) and
what it does not do the way a real backend would; shared by the traced predictor (fake tensors) and
emulation (one real rank alone)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Join a fake process group of ``world_size`` as ``rank``: collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


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
def fake_pg_compat(backend: str) -> Iterator[None]:
    """What the fake process group does not do as ``backend`` would: DDP's shape check (reads data) off,
    ``all_reduce(async_op=True)`` futures that carry their tensor, and gloo's staged reduce-scatter copy."""
    import torch.nn.parallel.distributed as ddp_module

    verify, all_reduce = ddp_module._verify_param_shape_across_processes, dist.all_reduce
    rs_name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    reduce_scatter = getattr(dist, rs_name)  # what FSDP2's DefaultReduceScatter calls

    def async_all_reduce(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        work = all_reduce(tensor, *args, async_op=async_op, **kwargs)  # type: ignore[misc]  # op, group by position
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


class BucketsSeen:
    """The storages of the gradient buckets DDP's reducer handed to the all-reduce hook: on fake tensors the
    reducer keeps the one bucket it was built with (no rebuild), and a trace must know that storage for
    what it is (``traced_stream.py``)."""

    def __init__(self) -> None:
        self.storages: list[torch.UntypedStorage] = []

    def seen(self, buffer: torch.Tensor) -> None:
        storage = buffer.untyped_storage()
        if not any(s is storage or s._cdata == storage._cdata for s in self.storages):
            self.storages.append(storage)


def buckets_seen(model: torch.nn.Module) -> list[torch.UntypedStorage]:
    """The bucket storages ``patch_ddp``'s hook has seen on ``model`` (none for another hook)."""
    hooks = getattr(model, "_comm_hooks", None) or []
    return [s for _, state in hooks if isinstance(state, BucketsSeen) for s in state.storages]


class _ReducerWithoutRebuild:
    """DDP's reducer, except that its first-step bucket rebuild (which reads tensor data) is off."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def patch_ddp(model: torch.nn.Module, world_size: int, *, rebuild_buckets: bool = False) -> torch.nn.Module:
    """DDP under the fake process group: an in-place bucket all-reduce hook (no allocation, like the
    built-in one), and no first-step bucket rebuild unless the tensors are real."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return model
    if not model._comm_hooks:

        def allreduce_in_place(state, bucket):  # noqa: ANN001 — DDP checks these annotations at runtime
            buffer = bucket.buffer().div_(world_size)  # what DDP's built-in hook does, minus the wire
            if state is not None:
                state.seen(buffer)
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(buffer)
            return fut

        # on fake tensors the one bucket is kept, and named for the trace; real ones (emulation) rebuild,
        # and a reference to the first bucket would keep its memory past the rebuild
        model.register_comm_hook(None if rebuild_buckets else BucketsSeen(), allreduce_in_place)
    if not rebuild_buckets:  # fake tensors have no data to rebuild from; real ones (emulation) do
        model.reducer = _ReducerWithoutRebuild(model.reducer)
    return model
