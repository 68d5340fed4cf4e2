"""Strategies that fail on purpose, for the launcher's failure and timeout tests."""

from __future__ import annotations

import os
import signal
import time

from torch import nn

from fsdpbench.strategies.base import ApplyContext
from fsdpbench.strategies.ddp import DDP


class CrashOnRank1(DDP):
    """DDP, except rank 1 raises while the others wait in their first collective."""

    name = "crash_on_rank1"

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        if ctx.rank == 1:
            raise RuntimeError("injected failure on rank 1")
        return super().apply(model, ctx)


class HangOnRank1(DDP):
    """DDP, except rank 1 never returns from apply (a hang past the case's timeout)."""

    name = "hang_on_rank1"

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        if ctx.rank == 1:
            time.sleep(3600)
        return super().apply(model, ctx)


class ExitOnRank1(DDP):
    """DDP, except rank 1 dies without a Python exception (as a segfault or the OOM killer would)."""

    name = "exit_on_rank1"

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        if ctx.rank == 1:
            os._exit(9)
        return super().apply(model, ctx)


class SigkillRank1InTimedSteps(DDP):
    """DDP, except rank 1 SIGKILLs itself in its first timed step (after the case's warm-up steps):
    a rank that dies mid-step with no Python exception, as the OOM killer or `kill -9` would do it."""

    name = "sigkill_rank1_in_timed_steps"

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        if ctx.rank == 1:
            calls = [0]

            def hook(module: nn.Module, args: object) -> None:
                calls[0] += 1
                if calls[0] > ctx.case.warmup_steps:
                    os.kill(os.getpid(), signal.SIGKILL)

            model.register_forward_pre_hook(hook)
        return super().apply(model, ctx)


class HangOnRank1InTimedSteps(DDP):
    """DDP, except rank 1 sleeps in its first timed step (rank 0 waits in the all-reduce): a case that
    is mid-step for as long as a test needs to interrupt or kill the orchestrator."""

    name = "hang_rank1_in_timed_steps"

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        if ctx.rank == 1:
            calls = [0]

            def hook(module: nn.Module, args: object) -> None:
                calls[0] += 1
                if calls[0] > ctx.case.warmup_steps:
                    time.sleep(3600)

            model.register_forward_pre_hook(hook)
        return super().apply(model, ctx)


class OomOnRank1(DDP):
    """DDP, except rank 1 runs out of memory (torch.OutOfMemoryError, as a too-large CUDA allocation
    raises)."""

    name = "oom_on_rank1"

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        if ctx.rank == 1:
            import torch

            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 80.00 GiB")
        return super().apply(model, ctx)
