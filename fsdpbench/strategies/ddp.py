"""DDP: everything replicated; gradients all-reduced in buckets during backward."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from fsdpbench.core.case import Case
from fsdpbench.strategies.base import REPLICATED, ApplyContext, Strategy

if TYPE_CHECKING:  # torch is imported where a strategy is applied, not where it is declared
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel


def wrap_ddp(model: nn.Module, ctx: ApplyContext) -> DistributedDataParallel:
    """DistributedDataParallel on this rank's device, with low-precision gradient compression if asked."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    precision = ctx.case.precision_spec
    if precision.reduces_low:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {"bfloat16": default_hooks.bf16_compress_hook, "float16": default_hooks.fp16_compress_hook}
        ddp.register_comm_hook(None, hooks[precision.reduce_dtype])
    return ddp


def check_ddp_precision(case: Case) -> str | None:
    """DDP's bf16 gradient-compression hook all-reduces bf16 tensors, which gloo cannot."""
    if case.precision_spec.reduce_dtype == "bfloat16" and case.backend == "gloo":
        return (
            "precision=bf16-lowreduce under DDP needs NCCL: gloo has no bf16 all-reduce "
            "(use fp16-lowreduce, or a GPU)"
        )
    return None


class DDP(Strategy):
    """DistributedDataParallel: params, grads and optimizer state replicated (16Ψ)."""

    name = "ddp"
    sharding = REPLICATED
    color = "#4C78A8"
    checked_on_gpu = True
    # full: rank 0 torch.saves the plain state dict; no "sharded": every rank holds the whole model
    checkpoint_methods: ClassVar[tuple[str, ...]] = ("full", "dcp", "dcp_async")

    def check(self, case: Case) -> str | None:
        return super().check(case) or check_ddp_precision(case)

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        return wrap_ddp(model, ctx)
