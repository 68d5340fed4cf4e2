"""What a strategy is: how it makes a model data-parallel, and which states it shards."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fsdpbench.core.case import OPTIMIZER_IMPLS, Case

if TYPE_CHECKING:  # a strategy's declaration is read without torch (the analytic memory model)
    import torch
    from torch import nn

GROUPS = ("world", "shard_group")
KEPT_NONE, KEPT_LAST, KEPT_ALL = "none", "last", "all"
KEPT_AFTER_FORWARD = (KEPT_NONE, KEPT_LAST, KEPT_ALL)
GRAD_REDUCTIONS = ("all_reduce", "reduce_scatter")
# the phases of a step a collective runs in, in step order
PHASES = ("forward", "backward", "after_step")


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

    def collectives(self) -> tuple[Collective, ...]:
        """What a step communicates to keep this sharding, phase by phase, in step order: the data the
        analytic communication volume sums (``metrics/comm.analytic_comm_bytes``)."""
        gathers = [Collective(phase="forward", kind="all_gather", payload="params")]
        if self.param_gathers == 2:
            gathers.append(Collective(phase="backward", kind="all_gather", payload="params"))
        plan = gathers[: self.param_gathers]
        plan.append(Collective(phase="backward", kind=self.grad_reduction, payload="grads"))
        if self.param_sync_after_step:
            plan.append(Collective(phase="after_step", kind=self.param_sync_after_step, payload="params"))
        if self.over_shard_group:  # each gradient shard, all-reduced across the replicas of the shard group
            plan.append(
                Collective(phase="backward", kind="all_reduce", payload="grad_shard", group="replicas")
            )
        return tuple(plan)

    def comm_pattern(self) -> str:
        """The textbook communication pattern (a row of the ZeRO paper's table) that ``collectives``
        follows: a label for the results, read off the collectives, not a key."""
        plan = {(c.phase, c.kind, c.group) for c in self.collectives()}
        if ("backward", "all_reduce", "shard") in plan:
            return "zero1" if any(phase == "after_step" for phase, _, _ in plan) else "ddp"
        if ("backward", "all_reduce", "replicas") in plan:
            return "hsdp"
        gathered_once = ("forward", "all_gather", "shard") in plan and (
            "backward",
            "all_gather",
            "shard",
        ) not in plan
        return "zero2" if gathered_once else "zero3"

    def degrees(self, world_size: int, shard_size: int | None = None) -> tuple[int, int, int]:
        """(d_p, d_g, d_o): 1 for a replicated state, the shard-group size for a sharded one.

        ``shard_size``: a shard-group sharding's group size, resolved (``Case.shard_group_size``)."""
        n = world_size
        if self.over_shard_group:
            if shard_size is None:
                raise ValueError("a shard-group sharding needs its shard size (Case.shard_group_size)")
            n = shard_size
        return (n if self.params else 1, n if self.grads else 1, n if self.optim else 1)


PAYLOADS = ("params", "grads", "grad_shard")
COLLECTIVE_GROUPS = ("shard", "replicas")


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective a step runs to keep a sharding: in which phase, of which kind, on what, over whom.

    ``payload``: S, the full tensor: all the parameters ("params"), all the gradients ("grads"), or one
    shard group's share of the gradients ("grad_shard"); ``group``: the ranks a state is sharded over
    ("shard": the world, or the shard group) or the replicas of one shard ("replicas")."""

    phase: str
    kind: str
    payload: str
    group: str = "shard"

    def __post_init__(self) -> None:
        kinds = ("all_gather", "all_reduce", "reduce_scatter", "broadcast")
        # the fields in declaration order: phase, kind, payload, group
        for field, allowed in zip(dataclasses.fields(self), (PHASES, kinds, PAYLOADS, COLLECTIVE_GROUPS)):
            value = getattr(self, field.name)
            if value not in allowed:
                raise ValueError(f"Collective.{field.name} must be one of {allowed}, got {value!r}")


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


STATE_DICT_APIS = ("module", "fsdp1", "distributed")
CHECKPOINT_GATHERS = ("nothing", "flat_parameters", "padded_tensors")
OPTIMIZER_CONSOLIDATIONS = ("none", "to_rank0")


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """How a strategy's engine makes its state dicts: with which API, what that gathers, and how the
    optimizer state becomes one. ``engine/checkpoint.py`` runs it, ``predictors/checkpoint.py`` models it."""

    # the API a full state dict comes from: "module": the wrapped module's ``state_dict()`` and the
    # optimizer's, as they are; "fsdp1": ``FullyShardedDataParallel.state_dict_type`` (FULL_STATE_DICT,
    # rank 0 only); "distributed": ``torch.distributed.checkpoint.state_dict`` (full_state_dict=True).
    # Sharded state dicts and DCP always go through ``torch.distributed.checkpoint.state_dict``.
    state_dict_api: str = "module"
    # what a state dict gathers: "nothing" (every tensor is whole on its rank); "flat_parameters" (each
    # unit's padded flat parameter, gathered whole, the entries cloned out of it, for full and sharded
    # state dicts alike); "padded_tensors" (a full state dict gathers each tensor's padded dim-0 shards)
    gathers: str = "nothing"
    # how a full checkpoint's optimizer state becomes one: "none" (the optimizer's own state dict is the
    # whole, or is gathered with the model's); "to_rank0": every rank sends its partition to rank 0 first
    # (``ZeroRedundancyOptimizer.consolidate_state_dict(to=0)``)
    optimizer_consolidation: str = "none"

    def __post_init__(self) -> None:
        for field_name, allowed in (
            ("state_dict_api", STATE_DICT_APIS),
            ("gathers", CHECKPOINT_GATHERS),
            ("optimizer_consolidation", OPTIMIZER_CONSOLIDATIONS),
        ):
            if getattr(self, field_name) not in allowed:
                raise ValueError(
                    f"Checkpointing.{field_name} must be one of {allowed}, got {getattr(self, field_name)!r}"
                )
        if (self.state_dict_api == "module") != (self.gathers == "nothing"):
            raise ValueError("Checkpointing: the module's own state dict gathers nothing; the others gather")
        if self.optimizer_consolidation == "to_rank0" and self.state_dict_api != "module":
            raise ValueError(
                "Checkpointing: only a module's own optimizer state dict is consolidated to rank 0"
            )


MODULE_STATE_DICT = Checkpointing()
FSDP1_STATE_DICT = Checkpointing(state_dict_api="fsdp1", gathers="flat_parameters")
DISTRIBUTED_STATE_DICT = Checkpointing(state_dict_api="distributed", gathers="padded_tensors")

# the trackers of metrics/tracker.py, by how the engine holds the model states: "module" (the model's own
# parameters and the optimizer's state: MemTracker), "fsdp2" (FSDP2's DTensor shards, the model its root:
# FSDPMemTracker), "fsdp1" (FSDP1's flat parameters), "deepspeed" (DeepSpeed ZeRO's flat buffers)
MEMORY_TRACKERS = ("module", "fsdp2", "fsdp1", "deepspeed")
# the case's knobs that only a strategy that says it reads them reads (FSDP1's prefetch and rate limit);
# for any other strategy a case's value is reset to the default, so a sweep over them collapses
STRATEGY_KNOBS = ("backward_prefetch", "forward_prefetch", "limit_all_gathers")


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
    # the tracker that files this engine's model states (one of MEMORY_TRACKERS)
    memory_tracker: ClassVar[str] = "module"
    # apply() works on a model on the meta device, each rank then materialising only its shards (FSDP2)
    shards_on_meta: ClassVar[bool] = False
    # which of STRATEGY_KNOBS this strategy reads
    reads_knobs: ClassVar[tuple[str, ...]] = ()
    # how the engine makes its state dicts (checkpoint_methods names the methods it runs)
    checkpointing: ClassVar[Checkpointing] = MODULE_STATE_DICT
    # what the analytic memory model leaves out for this strategy, said beside its prediction
    memory_model_notes: ClassVar[tuple[str, ...]] = ()
    # the report draws the strategy in this colour; None: one from a fallback palette
    color: ClassVar[str | None] = None
    # the checkpoint methods (Case.checkpoint, fsdpbench/engine/checkpoint.py) this strategy's engine runs
    checkpoint_methods: ClassVar[tuple[str, ...]] = ()
    # the optimizer implementations (Case.optimizer_impl) the strategy's engine runs
    optimizer_impls: ClassVar[tuple[str, ...]] = OPTIMIZER_IMPLS
    # gradient clipping (Case.max_norm) by torch.nn.utils over the model's gradients gives the global norm
    clips_with_torch: ClassVar[bool] = True
    # what a rank holds of a block is the same for every block, so a deep decoder's step can be built
    # from traces of shallow copies of it (predictors/block_repeat.py); False where a rank's share
    # depends on every parameter at once (a greedy partition of the whole model across the ranks)
    blocks_repeat: ClassVar[bool] = True
    # ``fsdpbench check`` measures it beside its predictions on a GPU (one strategy of each family)
    checked_on_gpu: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # what a subclass declares is checked where it is declared, as Sharding is
        if cls.memory_tracker not in MEMORY_TRACKERS:
            raise ValueError(f"{cls.__qualname__}.memory_tracker must be one of {MEMORY_TRACKERS}")
        unknown = set(cls.reads_knobs) - set(STRATEGY_KNOBS)
        if unknown:
            raise ValueError(f"{cls.__qualname__}.reads_knobs: {sorted(unknown)} not in {STRATEGY_KNOBS}")
        if not isinstance(cls.checkpointing, Checkpointing):
            raise TypeError(f"{cls.__qualname__}.checkpointing must be a Checkpointing")
        if not isinstance(cls.checked_on_gpu, bool):
            raise TypeError(f"{cls.__qualname__}.checked_on_gpu must be a bool")

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

    def analytic_gap(self, case: Case) -> str | None:
        """What of ``case`` the analytic models have no term for: the memory model then gives no peak (the
        traced predictor runs the strategy itself and stands in) and the communication model no volume;
        None where they have every term."""
        return None

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

    def vendor_model_states_bytes(self, case: Case) -> int | None:
        """The engine's own estimate of a rank's model-state bytes (the ``ds_est_*`` columns), or None."""
        return None

    def fsdp_root(self, model: nn.Module) -> nn.Module | None:
        """The FSDP2 root module if this strategy's model is one (FSDPMemTracker tracks it), else None."""
        return model if self.memory_tracker == "fsdp2" else None
