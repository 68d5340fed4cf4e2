"""FSDP2 (`fully_shard`): ZeRO-2, ZeRO-3 and HSDP, with the case's wrap, prefetch and precision."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from fsdpbench.core.case import Case
from fsdpbench.core.precision import Precision
from fsdpbench.strategies.base import (
    DISTRIBUTED_STATE_DICT,
    FSDP_FULL_SHARD,
    FSDP_HYBRID_SHARD,
    FSDP_KEEP_PARAMS,
    KEPT_ALL,
    KEPT_LAST,
    ApplyContext,
    Strategy,
)

if TYPE_CHECKING:  # torch is imported where a strategy is applied, not where it is declared
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy


def mp_policy_for(precision: Precision) -> MixedPrecisionPolicy:
    """fp32 → no casting; bf16/fp16 → 16-bit unsharded params, fp32 reduction ('-lowreduce': 16-bit)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not precision.casts:
        return MixedPrecisionPolicy()
    param_dtype, reduce_dtype = precision.torch_dtypes()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


# strategy_args.reshard_after_forward of a strategy that reshards: every unit (true, FSDP2's default),
# every unit but the last in forward order (torchtitan's rule: the last is needed again at once in
# backward), or an int n, FSDP2's int form: after its forward each unit keeps its parameters sharded over
# groups of n ranks (a 1/n slice in the compute dtype) and gathers them back over that group in backward
RESHARD_ARG = "reshard_after_forward"
RESHARD_VALUES = (True, "except_last")


def reshard_group(case: Case) -> int | None:
    """The group size a case's units reshard to after forward: FSDP2's int ``reshard_after_forward``
    (None: true, except_last or not given)."""
    value = case.strategy_args.get(RESHARD_ARG)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def apply_fsdp2(
    model: nn.Module, ctx: ApplyContext, *, kept_after_forward: str, mesh: DeviceMesh | None = None
) -> nn.Module:
    """fully_shard every wrap unit, then the root; set explicit prefetch of depth ``case.prefetch``.
    ``kept_after_forward``: the units not resharded after their forward (``Strategy.kept_after_forward``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    case = ctx.case
    # always name the mesh: fully_shard's default mesh is on torch's current accelerator, so on a
    # machine with a GPU a `device: cpu` case would shard onto cuda:<rank> (invalid for rank >= GPUs)
    mesh = mesh or init_device_mesh(ctx.device.type, (ctx.world_size,))
    pin = (
        ctx.device.type == "cuda"
    )  # pinned host memory needs a GPU; on CPU offloaded states stay in host memory
    kwargs: dict[str, Any] = dict(
        mesh=mesh,
        mp_policy=mp_policy_for(case.precision_spec),
        offload_policy=CPUOffloadPolicy(pin_memory=pin) if case.cpu_offload else OffloadPolicy(),
    )
    last, group = len(ctx.units) - 1, reshard_group(case)
    for i, unit in enumerate(ctx.units):
        kept = kept_after_forward == KEPT_ALL or (kept_after_forward == KEPT_LAST and i == last)
        fully_shard(unit, reshard_after_forward=group or not kept, **kwargs)
    fully_shard(model, reshard_after_forward=kept_after_forward != KEPT_ALL, **kwargs)
    apply_prefetch(ctx.units, case.prefetch)
    if ctx.device.type == "cpu" and case.prefetch > 0:
        # CPU has no streams, so FSDP2's all-gathers block the compute thread. With async unshard,
        # an explicitly prefetched all-gather runs on gloo's thread while compute goes on: the CPU
        # analogue of FSDP2's all-gather stream. (Private API; see docs/measurements.md.)
        cast(FSDPModule, model)._set_unshard_async_op(True)
    return model


def apply_prefetch(units: list[nn.Module], depth: int) -> None:
    """Explicit prefetch: each unit prefetches the next ``depth`` in forward and the previous in backward."""
    from torch.distributed.fsdp import FSDPModule

    if depth <= 0 or len(units) < 2:
        return
    for i, unit in enumerate(units):
        assert isinstance(unit, FSDPModule)
        following = units[i + 1 : i + 1 + depth]
        preceding = list(reversed(units[max(0, i - depth) : i]))
        if following:
            unit.set_modules_to_forward_prefetch(cast("list[FSDPModule]", following))
        if preceding:
            unit.set_modules_to_backward_prefetch(cast("list[FSDPModule]", preceding))


class _FSDP2(Strategy):
    uses_wrap = True
    uses_prefetch = True
    native_mixed_precision = True
    supports_cpu_offload = True
    memory_tracker = "fsdp2"
    shards_on_meta = True
    checked_on_gpu = True
    # full: DTensors gathered to rank 0's host; sharded: each rank's local shards; dcp: DCP's writer
    checkpoint_methods = ("full", "sharded", "dcp", "dcp_async")
    checkpointing = DISTRIBUTED_STATE_DICT

    def check(self, case: Case) -> str | None:
        resharding = not self.sharding.params_unsharded_fwd_to_bwd
        allowed = {RESHARD_ARG} if resharding else set()
        unknown = set(case.strategy_args) - allowed
        if unknown:
            known = f"{RESHARD_ARG} (true, except_last or an int)" if resharding else "none"
            return f"strategy_args {sorted(unknown)} unknown to {self.name}; allowed: {known}"
        value = case.strategy_args.get(RESHARD_ARG, True)
        group = reshard_group(case)
        shard = self.sharding.degrees(case.world_size, case.shard_group_size)[0]
        if group is not None and not (1 < group < shard and shard % group == 0):
            return (
                f"strategy_args.{RESHARD_ARG}: {group} is not a group size to reshard to: FSDP2's int form "
                f"needs a factor of the {shard} ranks the parameters are sharded over, above 1 (1 is "
                "false: zero2) and below it (that is true)"
            )
        if group is None and value not in RESHARD_VALUES:
            return f"strategy_args.{RESHARD_ARG}: {value!r} is not true, except_last or an int (a group size)"
        return super().check(case)

    def analytic_gap(self, case: Case) -> str | None:
        group = reshard_group(case)
        if group is None:
            return None
        return (
            f"{RESHARD_ARG}={group} (FSDP2's int form: each unit keeps a 1/{group} slice of its unsharded "
            f"parameters from its forward to its backward and gathers them back over groups of {group})"
        )

    def kept_after_forward(self, case: Case) -> str:
        if case.strategy_args.get(RESHARD_ARG) == "except_last":
            return KEPT_LAST
        return super().kept_after_forward(case)

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        return apply_fsdp2(model, ctx, kept_after_forward=self.kept_after_forward(ctx.case))


class Zero2(_FSDP2):
    """FSDP2 reshard_after_forward=False: grads+optimizer sharded, params unsharded fwd→bwd."""

    name = "zero2"
    sharding = FSDP_KEEP_PARAMS
    color = "#F58518"


class Zero3(_FSDP2):
    """FSDP2 fully_shard (FULL_SHARD): params, grads, optimizer state sharded (16Ψ/N)."""

    name = "zero3"
    sharding = FSDP_FULL_SHARD
    color = "#E45756"


class HSDP(_FSDP2):
    """FSDP2 on a 2-D mesh: sharded within a shard group, replicated across groups."""

    name = "hsdp"
    sharding = FSDP_HYBRID_SHARD
    color = "#54A24B"

    def check(self, case: Case) -> str | None:
        shard = case.shard_group_size
        if case.world_size % shard:
            return f"hsdp shard_size={shard} does not divide world_size={case.world_size}"
        return super().check(case)

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        shard = ctx.case.shard_group_size
        mesh = init_device_mesh(
            ctx.device.type, (ctx.world_size // shard, shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )
        return apply_fsdp2(model, ctx, kept_after_forward=self.kept_after_forward(ctx.case), mesh=mesh)
