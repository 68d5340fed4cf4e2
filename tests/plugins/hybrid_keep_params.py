"""A strategy from outside fsdpbench, in one file: FSDP2 on a 2-D mesh that keeps the parameters
unsharded from forward to backward (HSDP with ZeRO-2's single all-gather). Registering it (importing
this module) is all it takes for fsdpbench to run it, label it, colour it and predict its traffic
from what it declares; ``tests/test_strategies.py`` checks that.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdpbench.strategies import register_strategy
from fsdpbench.strategies.base import DISTRIBUTED_STATE_DICT, FSDP_HYBRID_SHARD, ApplyContext, Strategy
from fsdpbench.strategies.fsdp2 import apply_fsdp2


@register_strategy
class HybridKeepParams(Strategy):
    """FSDP2 sharded within shard groups of ``shard_size`` ranks, params kept from forward to backward."""

    name = "hybrid_keep_params"
    sharding = dataclasses.replace(FSDP_HYBRID_SHARD, params_unsharded_fwd_to_bwd=True, param_gathers=1)
    color = "#17BECF"
    uses_wrap = True
    uses_prefetch = True
    native_mixed_precision = True
    memory_tracker = "fsdp2"
    shards_on_meta = True
    checkpointing = DISTRIBUTED_STATE_DICT
    checkpoint_methods = ("full", "sharded", "dcp", "dcp_async")

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        shard = ctx.case.shard_size or ctx.world_size
        mesh = init_device_mesh(
            ctx.device.type, (ctx.world_size // shard, shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )
        return apply_fsdp2(model, ctx, kept_after_forward=self.kept_after_forward(ctx.case), mesh=mesh)
