"""Gloo's synchronous collectives, returning only once gloo has let go of their tensors: in the memory-tracked
step, the same live bytes at every moment on every run.

Gloo runs a collective on a worker thread that keeps the collective's work (the tensors it was given, and
the staged copy its reduce-scatter reduces: a clone of the input) until it lets go of it, a little after
the caller's wait has returned. Which comes first, that release or the caller's next allocation, is thread
scheduling, so the tracker's peak, counting live tensors, could differ between runs of one case by a
staged copy or an all-gather buffer (examples/my_model, zero3 on 2 CPU ranks: 1,135,020 or 1,267,628 B,
4 rank-runs in 48). Under ``collectives_settled`` each synchronous collective returns once the storages it
was given are back to the references they had before it and the tensors the tracker saw appear during it
are freed; what the tracker counts is then what the traced predictor and emulation count, where the
staged copy is freed as the collective returns (engine/fake_pg.py). No time is measured in the tracked
step. An asynchronous collective (``async_op=True``: FSDP2's prefetched all-gathers on CPU ranks) is
left as it is."""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

# the synchronous collectives FSDP2 and FSDP1 call through ``torch.distributed``'s attributes
COLLECTIVES = (
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
)
# the strategies (by Strategy.memory_tracker) whose tracked step is settled: FSDP2's and FSDP1's, where
# settling was measured to make the peak repeat (docs/results/ci.md). Not DeepSpeed's: its ZeRO-1 with a
# 50,000-element bucket on 2 ranks moves rank 1's peak by 3,004 B in some runs with or without settling
# (7 of 30 with, 4 of 60 without), so its variation has another cause and its ranks run as before
SETTLED_TRACKERS = ("fsdp2", "fsdp1")
# how long a collective's tensors may stay with gloo's thread before settling is given up for the step:
# a bound on a busy machine's scheduling delay; a release takes microseconds
SETTLE_LIMIT_S = 10.0
_POLL_S = 20e-6  # time.sleep releases the GIL, which gloo's thread needs to free a storage's Python object


def _use_count(storage: torch.UntypedStorage) -> int:
    return int(torch._C._storage_Use_Count(storage._cdata))


def _new(ref: Any, given: dict[int, torch.UntypedStorage]) -> bool:
    """Whether a storage the tracker saw appear is alive and not one the collective was given."""
    storage = ref()
    return storage is not None and storage._cdata not in given


class _Settler:
    """Waits out each wrapped collective's release; gives up for the rest of the step after one timeout."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.gave_up = False

    def tracked_refs(self) -> dict[int, Any]:
        """id of each tracked storage's record -> the weak reference to its storage (the tracker's own)."""
        tracked = getattr(self.tracker, "_WINFO", None)
        return {id(winfo): ref for winfo, ref in list(tracked.values())} if tracked is not None else {}

    def wrap(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(collective)
        def settled(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("async_op") or self.gave_up:
                return collective(*args, **kwargs)
            given = {
                t.untyped_storage()._cdata: t.untyped_storage()
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            }
            counts = {key: _use_count(st) for key, st in given.items()}
            before = self.tracked_refs()
            result = collective(*args, **kwargs)
            made = [ref for key, ref in self.tracked_refs().items() if key not in before and _new(ref, given)]

            def released() -> bool:
                return all(_use_count(st) == counts[key] for key, st in given.items()) and all(
                    ref() is None for ref in made
                )

            self.wait_for(released, collective.__name__)
            return result

        return settled

    def wait_for(self, released: Callable[[], bool], name: str) -> None:
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while not released():
            if time.monotonic() > deadline:
                self.gave_up = True
                print(
                    f"fsdpbench: gloo kept the tensors of {name} for {SETTLE_LIMIT_S:g} s; the tracked "
                    "step's later collectives are not settled, its peak may count gloo's buffers",
                    file=sys.stderr,
                )
                return
            time.sleep(_POLL_S)


@contextlib.contextmanager
def collectives_settled(tracker: Any) -> Iterator[None]:
    """``torch.distributed``'s synchronous collectives, each returning once gloo has let go of its tensors."""
    settler = _Settler(tracker)
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, collective in originals.items():
        setattr(dist, name, settler.wrap(collective))
    try:
        yield
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
