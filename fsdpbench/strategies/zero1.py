"""ZeRO-1: DDP for gradients plus ZeroRedundancyOptimizer, which shards the optimizer state."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from fsdpbench.case import Case
from fsdpbench.strategies import register_strategy
from fsdpbench.strategies.base import ApplyContext, Sharding, Strategy
from fsdpbench.strategies.ddp import check_ddp_precision, wrap_ddp
from fsdpbench.strategies.optim import get_optimizer


@register_strategy
class Zero1(Strategy):
    name = "zero1"
    description = "DDP + ZeroRedundancyOptimizer: optimizer state sharded (4Ψ + 12Ψ/N)"
    sharding = Sharding(params=False, grads=False, optim=True)

    def check(self, case: Case) -> str | None:
        return super().check(case) or check_ddp_precision(case)

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        return wrap_ddp(model, ctx)

    def build_optimizer(self, model: nn.Module, case: Case) -> torch.optim.Optimizer:
        cls, kwargs = get_optimizer(case.optimizer)
        return ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=cls, lr=case.lr, foreach=False, **kwargs
        )
