"""Strategies that fail on purpose, for the launcher's failure and timeout tests."""

from __future__ import annotations

import os
import signal
import time
from typing import ClassVar

from torch import nn

from fsdpbench.strategies.base import ApplyContext
from fsdpbench.strategies.ddp import DDP


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
