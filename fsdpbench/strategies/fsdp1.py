"""FSDP1 (`FullyShardedDataParallel`): FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD, with the
knobs the FSDP1 guides name: ``auto_wrap_policy`` (from the wrap axis), ``backward_prefetch``,
``forward_prefetch``, ``limit_all_gathers``, ``MixedPrecision`` (from the precision axis),
``CPUOffload`` and ``device_id``.

``use_orig_params=True`` so that the optimizer, the memory tracker and ``local_state_bytes`` see the
model's own parameters (views into FSDP1's flat parameters) rather than one ``FlatParameter`` per unit.

FSDP1's enums are named here, not imported: a strategy's declaration is read without torch (the
analytic memory model); ``apply`` imports FSDP1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsdpbench.core.case import Case
from fsdpbench.core.precision import Precision
from fsdpbench.strategies.base import (
    FSDP1_STATE_DICT,
    FSDP_FULL_SHARD,
    FSDP_HYBRID_SHARD,
    FSDP_KEEP_PARAMS,
    REPLICATED,
    STRATEGY_KNOBS,
    ApplyContext,
    Sharding,
    Strategy,
)

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

# Case.backward_prefetch -> the BackwardPrefetch member it names (None: no backward prefetch)
BACKWARD_PREFETCH_MODES = {"pre": "BACKWARD_PRE", "post": "BACKWARD_POST", "none": None}


def backward_prefetch_for(mode: str) -> BackwardPrefetch | None:
    """FSDP1's ``backward_prefetch`` argument for ``Case.backward_prefetch``."""
    from torch.distributed.fsdp import BackwardPrefetch

    member = BACKWARD_PREFETCH_MODES[mode]
    return None if member is None else BackwardPrefetch[member]


STRATEGY_ARGS = {"use_orig_params": "bool, default true: the optimizer sees the model's own parameters"}


def mixed_precision_for(precision: Precision) -> MixedPrecision | None:
    """fp32 → None; bf16/fp16 → 16-bit params in compute, fp32 reduction; '-lowreduce': 16-bit reduction.

    The same casts as FSDP2's ``mp_policy_for`` (buffers are not cast), so FSDP1 and FSDP2 compare.
    """
    from torch.distributed.fsdp import MixedPrecision

    if not precision.casts:
        return None
    param_dtype, reduce_dtype = precision.torch_dtypes()
    return MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def auto_wrap_policy_for(model: nn.Module, ctx: ApplyContext) -> CustomPolicy | ModuleWrapPolicy | None:
    """The wrap axis as an FSDP1 ``auto_wrap_policy``: wrap exactly the units ``fsdpbench.models.wrap`` chose
    (as FSDP2 does); None when the root is the only unit.

    ``wrap.get_wrap_units`` follows FSDP1's own ``size_based_auto_wrap_policy`` for ``size``
    (tests/test_fsdp1.py checks it against FSDP1's recursive wrapper). With ``classes``, FSDP1 refuses
    a list of which no name is a module class of the model (FSDP2 runs it as one unit).
    """
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

    case = ctx.case
    if case.wrap == "classes" and not ctx.units:
        names = list(case.wrap_classes)
        raise ValueError(f"wrap_classes: none of {names} is a module class of model {case.model!r}")
    if not ctx.units:
        return None
    unit_types = {type(unit) for unit in ctx.units}
    if sum(type(m) in unit_types for m in model.modules() if m is not model) == len(ctx.units):
        # units chosen by class (block, classes): FSDP1's class policy. A CustomPolicy wrapping the
        # same modules made the BACKWARD_PRE peak differ between identical runs (2 of 6 in
        # tests/test_fsdp1.py's prefetch test); the class policy did not (6 of 6).
        return ModuleWrapPolicy(unit_types)
    units = set(ctx.units)
    return CustomPolicy(lambda module: module in units)


def apply_fsdp1(model: nn.Module, ctx: ApplyContext, *, sharding_strategy: ShardingStrategy) -> nn.Module:
    """Wrap ``model`` in ``FullyShardedDataParallel`` with every knob taken from the case."""
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, ShardingStrategy

    case = ctx.case
    kwargs: dict[str, Any] = {}
    if sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        from torch.distributed.device_mesh import init_device_mesh

        shard = case.shard_group_size
        kwargs["device_mesh"] = init_device_mesh(
            ctx.device.type, (ctx.world_size // shard, shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )
    return FullyShardedDataParallel(
        model,
        sharding_strategy=sharding_strategy,
        auto_wrap_policy=auto_wrap_policy_for(model, ctx),
        backward_prefetch=backward_prefetch_for(case.backward_prefetch),
        forward_prefetch=case.forward_prefetch,
        limit_all_gathers=case.limit_all_gathers,
        mixed_precision=mixed_precision_for(case.precision_spec),
        cpu_offload=CPUOffload(offload_params=case.cpu_offload),
        device_id=ctx.device,  # FSDP1 refuses a CPU compute device unless named explicitly
        use_orig_params=case.strategy_args.get("use_orig_params", True),
        **kwargs,
    )


# FSDP1's sharding strategies (ShardingStrategy members by name) as fsdpbench strategies: name, what is
# sharded, the report's colour
VARIANTS: dict[str, tuple[str, Sharding, str]] = {
    "FULL_SHARD": ("fsdp1_full", FSDP_FULL_SHARD, "#B279A2"),
    "SHARD_GRAD_OP": ("fsdp1_grad_op", FSDP_KEEP_PARAMS, "#D6A5C9"),
    "NO_SHARD": ("fsdp1_no_shard", REPLICATED, "#9ECAE9"),
    "HYBRID_SHARD": ("fsdp1_hybrid", FSDP_HYBRID_SHARD, "#88D27A"),
}


class _FSDP1(Strategy):
    uses_wrap = True
    uses_prefetch = False  # FSDP1 has no explicit prefetch depth; it has backward_prefetch/forward_prefetch
    native_mixed_precision = True
    supports_cpu_offload = True
    memory_tracker = "fsdp1"
    reads_knobs = STRATEGY_KNOBS
    checkpointing = FSDP1_STATE_DICT
    memory_model_notes = (
        "FSDP1 is predicted with FSDP2's per-parameter layout (FSDP1 pads one flat parameter per "
        "unit and keeps the root unsharded between forward and backward): use --method traced",
    )
    sharding_strategy_name: str  # the ShardingStrategy member
    # torch.distributed.checkpoint.state_dict drives FSDP1's own state_dict_type: full is FULL_STATE_DICT
    # with FullStateDictConfig(offload_to_cpu=True, rank0_only=True), sharded is SHARDED_STATE_DICT
    checkpoint_methods = ("full", "sharded", "dcp", "dcp_async")
    # FSDP1's flat parameters hold local shards: the global norm needs FSDP's own clip_grad_norm_
    clips_with_torch = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "sharding_strategy_name" in vars(cls):  # one of FSDP1's own: declared in VARIANTS
            cls.name, cls.sharding, cls.color = VARIANTS[cls.sharding_strategy_name]

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        from torch.distributed.fsdp import ShardingStrategy

        return ShardingStrategy[self.sharding_strategy_name]

    def check(self, case: Case) -> str | None:
        shard = case.shard_group_size
        if self.sharding.over_shard_group and case.world_size % shard:
            return f"{self.name} shard_size={shard} does not divide world_size={case.world_size}"
        unknown = set(case.strategy_args) - set(STRATEGY_ARGS)
        if unknown:
            allowed = "; ".join(f"{k} ({v})" for k, v in STRATEGY_ARGS.items())
            return f"strategy_args {sorted(unknown)} unknown to {self.name}; allowed: {allowed}"
        if case.cpu_offload and case.device != "cuda":
            return (
                "FSDP1 CPUOffload pins host memory (Tensor.pin_memory), which needs a GPU; on CPU use "
                "zero2/zero3/hsdp (FSDP2 CPUOffloadPolicy, pin_memory=False)"
            )
        if case.prefetch:
            return (
                f"prefetch={case.prefetch} is FSDP2's explicit prefetch depth; {self.name} (FSDP1) "
                "prefetches with backward_prefetch (pre|post|none) and forward_prefetch"
            )
        return super().check(case)

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        return apply_fsdp1(model, ctx, sharding_strategy=self.sharding_strategy)


class FSDP1Full(_FSDP1):
    """FSDP1 FULL_SHARD: params, grads, optimizer state sharded (16Ψ/N), resharded after forward."""

    sharding_strategy_name = "FULL_SHARD"
    checked_on_gpu = True  # FSDP1's family: its other strategies share its engine


class FSDP1GradOp(_FSDP1):
    """FSDP1 SHARD_GRAD_OP: grads+optimizer sharded, params unsharded from forward to backward."""

    sharding_strategy_name = "SHARD_GRAD_OP"


class FSDP1NoShard(_FSDP1):
    """FSDP1 NO_SHARD: nothing sharded, gradients all-reduced (DDP's memory, 16Ψ)."""

    sharding_strategy_name = "NO_SHARD"


class FSDP1Hybrid(_FSDP1):
    """FSDP1 HYBRID_SHARD: FULL_SHARD within a shard group, replicated across groups."""

    sharding_strategy_name = "HYBRID_SHARD"
