"""Strategies that fail on purpose, for the launcher's failure and timeout tests."""

from __future__ import annotations

import os
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
