"""Strategies that fail on purpose, for the launcher's failure and timeout tests, and the full-disk tests."""

from __future__ import annotations

import builtins
import errno
import io
import os
import signal
import time
from collections.abc import Callable
from typing import Any, ClassVar

from torch import nn

from fsdpbench.core.rundir import CHECKPOINT_DIR
from fsdpbench.strategies.base import ApplyContext
from fsdpbench.strategies.ddp import DDP
from fsdpbench.strategies.fsdp2 import Zero3


class _FaultOnRank1(DDP):
    """DDP, except rank 1 calls ``fault()``: in apply, or (``in_timed_steps``) at the start of its first
    timed step's forward, after the case's warm-up steps."""

    in_timed_steps: ClassVar[bool] = False

    def fault(self) -> None:
        raise NotImplementedError

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        if ctx.rank == 1 and self.in_timed_steps:
            self._fault_after_forwards(model, ctx.case.warmup_steps)
        elif ctx.rank == 1:
            self.fault()
        return super().apply(model, ctx)

    def _fault_after_forwards(self, model: nn.Module, n_forwards: int) -> None:
        forwards = [0]

        def hook(module: nn.Module, args: object) -> None:
            forwards[0] += 1
            if forwards[0] > n_forwards:
                self.fault()

        model.register_forward_pre_hook(hook)


class CrashOnRank1(_FaultOnRank1):
    """DDP, except rank 1 raises while the others wait in their first collective."""

    name = "crash_on_rank1"

    def fault(self) -> None:
        raise RuntimeError("injected failure on rank 1")


class HangOnRank1(_FaultOnRank1):
    """DDP, except rank 1 never returns from apply (a hang past the case's timeout)."""

    name = "hang_on_rank1"

    def fault(self) -> None:
        time.sleep(3600)


class ExitOnRank1(_FaultOnRank1):
    """DDP, except rank 1 dies without a Python exception (as a segfault or the OOM killer would)."""

    name = "exit_on_rank1"

    def fault(self) -> None:
        os._exit(9)


class SigkillRank1InTimedSteps(_FaultOnRank1):
    """DDP, except rank 1 SIGKILLs itself in its first timed step (after the case's warm-up steps):
    a rank that dies mid-step with no Python exception, as the OOM killer or `kill -9` would do it."""

    name = "sigkill_rank1_in_timed_steps"
    in_timed_steps = True

    def fault(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class HangOnRank1InTimedSteps(_FaultOnRank1):
    """DDP, except rank 1 sleeps in its first timed step (rank 0 waits in the all-reduce): a case that
    is mid-step for as long as a test needs to interrupt or kill the orchestrator."""

    name = "hang_rank1_in_timed_steps"
    in_timed_steps = True

    def fault(self) -> None:
        time.sleep(3600)


class OomOnRank1(_FaultOnRank1):
    """DDP, except rank 1 runs out of memory (torch.OutOfMemoryError, as a too-large CUDA allocation
    raises)."""

    name = "oom_on_rank1"

    def fault(self) -> None:
        import torch

        raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 80.00 GiB")


# ---- the disk under a checkpoint ------------------------------------------------------------------


class _FillsUp:
    """A file being written that takes what room is left on its "disk" (``room``, shared by every file
    of the rank under a checkpoint directory), then fails as a full disk does (ENOSPC), or calls
    ``when_full`` instead."""

    def __init__(self, file: Any, room: list[int], when_full: Callable[[], None] | None) -> None:
        self._file, self._room, self._when_full = file, room, when_full

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n <= self._room[0]:
            self._room[0] -= n
            return self._file.write(data)
        self._file.write(memoryview(data).cast("B")[: self._room[0]])  # what fits is on the disk
        self._file.flush()
        self._room[0] = 0
        if self._when_full is not None:
            self._when_full()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _FillsUp:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def fill_checkpoints_after(room_bytes: int, when_full: Callable[[], None] | None = None) -> None:
    """In this process, from now on: files written under a ``checkpoint/`` directory (whoever opens
    them through Python's ``io.open``: DCP's writer, fsdpbench's) get ``room_bytes`` in all, then fail."""
    real_open = io.open
    room = [room_bytes]

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, mode, *args, **kwargs)
        name = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else os.fspath(file)
        if any(c in mode for c in "wax") and f"/{CHECKPOINT_DIR}/" in str(name):
            return _FillsUp(f, room, when_full)
        return f

    io.open = builtins.open = open_  # type: ignore[assignment]


class DiskFullInCheckpoint(Zero3):
    """ZeRO-3 on a disk with 64 KiB left for the checkpoint: the save fails with ENOSPC once that is
    written (every rank; a partial checkpoint is on the disk)."""

    name = "disk_full_in_checkpoint"

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        fill_checkpoints_after(64 << 10)
        return super().apply(model, ctx)


class SigkillRank1InCheckpoint(Zero3):
    """ZeRO-3, except rank 1 SIGKILLs itself while it writes its part of the checkpoint (`kill -9`, the
    OOM killer), after 64 KiB of it are on the disk."""

    name = "sigkill_rank1_in_checkpoint"

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        if ctx.rank == 1:
            fill_checkpoints_after(64 << 10, when_full=lambda: os.kill(os.getpid(), signal.SIGKILL))
        return super().apply(model, ctx)


class NoRoomForRankFilesOnRank1(DDP):
    """DDP, except rank 1 fails where no file of it can grow by a byte (``RLIMIT_FSIZE`` 0, its signal
    ignored, so a write fails with EFBIG as a full disk fails with ENOSPC): not even the record of its
    failure, nor torch's launcher's error file, can be written."""

    name = "no_room_for_rank_files_on_rank1"

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        if ctx.rank == 1:
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            raise RuntimeError("injected failure on rank 1, its disk full")
        return super().apply(model, ctx)


class WaitsForLinksBeforeSaving(Zero3):
    """ZeRO-3, whose ranks wait, once the checkpoint directory exists, until ``links-planted`` appears
    beside it before they save: a test plants its links in that moment, as a racing attacker would."""

    name = "waits_for_links_before_saving"

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        from fsdpbench.engine import checkpoint

        real_save = checkpoint.save

        def save(method: str, parallel: Any, directory: Any, *args: Any, **kwargs: Any) -> Any:
            flag = directory.parent / "links-planted"
            deadline = time.monotonic() + 60
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            return real_save(method, parallel, directory, *args, **kwargs)

        checkpoint.save = save  # type: ignore[assignment]
        return super().apply(model, ctx)
