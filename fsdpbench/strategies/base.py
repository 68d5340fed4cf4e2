"""What a strategy is: how it makes a model data-parallel, and which states it shards."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from fsdpbench.core.case import OPTIMIZER_IMPLS, Case

if TYPE_CHECKING:  # a strategy's declaration is read without torch (the analytic memory model)
    import torch
    from torch import nn

GROUPS = ("world", "shard_group")
KEPT_NONE, KEPT_LAST, KEPT_ALL = "none", "last", "all"
KEPT_AFTER_FORWARD = (KEPT_NONE, KEPT_LAST, KEPT_ALL)
GRAD_REDUCTIONS = ("all_reduce", "reduce_scatter")


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """Which model states are sharded (over the shard group) rather than replicated, and what a step
    communicates to keep them so.

    The memory model and the analytic communication volume read this; neither needs a strategy's name.
    """

    params: bool
    grads: bool
    optim: bool
    # SHARD_GRAD_OP / ZeRO-2 via FSDP: params sharded at rest, unsharded from forward to backward.
    params_unsharded_fwd_to_bwd: bool = False
    # "world": sharded over all ranks; "shard_group": over the shard group only, replicated across groups
    # (the gradient shards are then all-reduced across the replicas).
    group: str = "world"
    # params are all-gathered unit by unit (FSDP); DDP/ZeRO-1 keep them whole.
    per_unit_gather: bool = False
    # all-gathers of the parameters per step: 2 = in forward and again in backward, 1 = kept to backward
    param_gathers: int = 0
    # how gradients are reduced: "all_reduce" (every rank gets the whole) or "reduce_scatter" (its shard)
    grad_reduction: str = "all_reduce"
    # the collective that hands every rank the parameters another rank updated (ZeRO-1), or None
    param_sync_after_step: str | None = None

    def __post_init__(self) -> None:
        for field_name, allowed in (
            ("group", GROUPS),
            ("grad_reduction", GRAD_REDUCTIONS),
            ("param_gathers", (0, 1, 2)),
            ("param_sync_after_step", (None, "broadcast", "all_gather")),
        ):
            value = getattr(self, field_name)
            if value not in allowed:
                raise ValueError(f"Sharding.{field_name} must be one of {allowed}, got {value!r}")
        # how often the parameters are gathered and whether they stay unsharded are one fact told twice:
        # sharded parameters are gathered in forward, and again in backward unless they were kept
        if not self.params and (self.param_gathers or self.params_unsharded_fwd_to_bwd):
            raise ValueError("Sharding: replicated parameters are never gathered (param_gathers 0, not kept)")
        if self.params and self.param_gathers != (1 if self.params_unsharded_fwd_to_bwd else 2):
            raise ValueError(
                "Sharding: sharded parameters kept from forward to backward are gathered once a step, "
                f"otherwise twice; got param_gathers={self.param_gathers} with "
                f"params_unsharded_fwd_to_bwd={self.params_unsharded_fwd_to_bwd}"
            )

    @property
    def over_shard_group(self) -> bool:
        """Sharded within a shard group and replicated across groups (HSDP): cases name a shard size."""
        return self.group == "shard_group"

    def comm_pattern(self) -> str:
        """The textbook communication pattern this sharding follows: a label for the results, not a key."""
        if self.grad_reduction == "all_reduce":
            return "zero1" if self.param_sync_after_step else "ddp"
        if self.over_shard_group:
            return "hsdp"
        return "zero2" if self.param_gathers == 1 else "zero3"

    def degrees(self, world_size: int, shard_size: int | None = None) -> tuple[int, int, int]:
        """(d_p, d_g, d_o): 1 for a replicated state, the shard-group size for a sharded one.

        ``shard_size``: a shard-group sharding's group size, resolved (``Case.shard_group_size``)."""
        n = world_size
        if self.over_shard_group:
            if shard_size is None:
                raise ValueError("a shard-group sharding needs its shard size (Case.shard_group_size)")
            n = shard_size
        return (n if self.params else 1, n if self.grads else 1, n if self.optim else 1)


# The shardings the textbook names; a strategy declares one of these or its own.
REPLICATED = Sharding(params=False, grads=False, optim=False)
OPTIM_SHARDED = Sharding(params=False, grads=False, optim=True, param_sync_after_step="broadcast")
FSDP_FULL_SHARD = Sharding(
    params=True,
    grads=True,
    optim=True,
    per_unit_gather=True,
    param_gathers=2,
    grad_reduction="reduce_scatter",
)
# FSDP's SHARD_GRAD_OP: gathered once in forward, kept unsharded until backward is done
FSDP_KEEP_PARAMS = dataclasses.replace(FSDP_FULL_SHARD, params_unsharded_fwd_to_bwd=True, param_gathers=1)
FSDP_HYBRID_SHARD = dataclasses.replace(FSDP_FULL_SHARD, group="shard_group")


@dataclass(frozen=True, kw_only=True)
class FlatBufferZero:
    """A ZeRO engine that keeps the model states in flat buffers of its own (DeepSpeed's ZeRO): its stage
    and its memory knobs, resolved (the engine's defaults filled in). The memory model lays the buffers
    out from these (fsdpbench/predictors/memory_model/flat_zero.py); elements, not bytes."""

    stage: int  # 1: optimizer state sharded; 2: and gradients; 3: and parameters
    reduce_bucket_size: int  # gradient elements per reduce bucket
    allgather_bucket_size: int  # stage 1/2: parameter elements all-gathered per bucket after the step
    overlap_comm: bool  # reduce while backward runs (stage 1/2: a second bucket)
    contiguous_gradients: bool  # gradients copied into the bucket as backward produces them
    reduce_scatter: bool  # stage 1/2: reduce-scatter (else all-reduce) the gradients
    prefetch_bucket_size: int  # stage 3: parameter elements prefetched ahead
    param_persistence_threshold: int  # stage 3: parameters of at most this many elements stay whole
    max_live_parameters: int  # stage 3: most gathered elements alive at once
    max_reuse_distance: int  # stage 3: a gathered parameter used again within this many elements is kept


@dataclass(kw_only=True)
class ApplyContext:
    """What a strategy gets to work with on one rank."""

    case: Case
    device: torch.device
    rank: int
    world_size: int
    units: list[nn.Module]  # wrap units in forward order, root excluded


class Strategy:
    """Base class; subclasses declare what they are in the class variables and implement ``apply``.

    What a subclass declares is all that the rest of fsdpbench knows of it: nothing outside
    ``fsdpbench/strategies/`` names a strategy.
    """

    name: ClassVar[str] = ""
    sharding: ClassVar[Sharding]
    uses_wrap: ClassVar[bool] = False
    uses_prefetch: ClassVar[bool] = False
    # True when the strategy casts parameters itself (FSDP mixed precision); else the worker autocasts.
    native_mixed_precision: ClassVar[bool] = False
    supports_cpu_offload: ClassVar[bool] = False
    # 0: no FSDP; 1: FullyShardedDataParallel (reads the FSDP1 knobs); 2: fully_shard (the model is
    # the FSDP2 root, it can be sharded on the meta device)
    fsdp_version: ClassVar[int] = 0
    # the report draws the strategy in this colour; None: one from a fallback palette
    color: ClassVar[str | None] = None
    # the checkpoint methods (Case.checkpoint, fsdpbench/engine/checkpoint.py) this strategy's engine runs
    checkpoint_methods: ClassVar[tuple[str, ...]] = ()
    # the optimizer implementations (Case.optimizer_impl) the strategy's engine runs
    optimizer_impls: ClassVar[tuple[str, ...]] = OPTIMIZER_IMPLS
    # gradient clipping (Case.max_norm) by torch.nn.utils over the model's gradients gives the global norm
    clips_with_torch: ClassVar[bool] = True
    # ``fsdpbench check`` measures it beside its predictions on a GPU (one strategy of each family)
    checked_on_gpu: ClassVar[bool] = False

    def check(self, case: Case) -> str | None:
        """Why this case cannot run (a sentence), or None."""
        if case.prefetch and not self.uses_prefetch:
            return f"prefetch={case.prefetch} applies to FSDP strategies; {self.name} has no prefetch"
        if case.checkpoint != "none" and case.checkpoint not in self.checkpoint_methods:
            runs = ", ".join(self.checkpoint_methods) or "none fsdpbench runs"
            return f"checkpoint={case.checkpoint}: {self.name} checkpoints with {runs}"
        if case.optimizer_impl not in self.optimizer_impls:
            return f"optimizer_impl={case.optimizer_impl}: {self.name} runs {', '.join(self.optimizer_impls)}"
        if case.max_norm is not None and not self.clips_with_torch:
            return (
                f"max_norm: {self.name} holds its gradients where torch.nn.utils.clip_grad_norm_ "
                "cannot see the global norm (its engine clips with its own API, not run)"
            )
        return None

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        raise NotImplementedError

    def kept_after_forward(self, case: Case) -> str:
        """Which wrap units stay unsharded from their forward to their backward (``KEPT_AFTER_FORWARD``):
        ``all`` (FSDP's SHARD_GRAD_OP), ``last`` (every unit but the last reshards: torchtitan's rule) or
        ``none``. The root unit is the strategy's own and follows ``sharding``."""
        return KEPT_ALL if self.sharding.params_unsharded_fwd_to_bwd else KEPT_NONE

    def build_optimizer(self, model: nn.Module, case: Case) -> torch.optim.Optimizer:
        from fsdpbench.strategies.optim import build_optimizer

        return build_optimizer(model.parameters(), case)

    def flat_buffers(self, case: Case) -> FlatBufferZero | None:
        """The engine's flat-buffer layout for this case when it keeps its states in flat buffers of its
        own (DeepSpeed's ZeRO), else None: the memory model then lays states out from ``sharding``."""
        return None

    def fsdp_root(self, model: nn.Module) -> nn.Module | None:
        """The FSDP2 root module if this strategy uses FSDP2 (memory tracking picks its tracker)."""
        return model if self.fsdp_version == 2 else None
