"""DeepSpeed's ZeRO engines (stages 1, 2, 3) as strategies beside PyTorch's: ``ds_zero1/2/3``.

An optional extra: ``DS_BUILD_OPS=0 pip install -e ".[deepspeed]"`` (no C++/CUDA ops are built; the
optimizer is the case's own torch optimizer, so none is needed). Without DeepSpeed a ds_* case is
skipped with the reason (``check``).

Built from the case like every other strategy: the same model (already on the rank's device), the
same torch optimizer (``build_optimizer``: AdamW with the case's lr, ``foreach=False``), handed to
``deepspeed.initialize`` as a client optimizer, which ZeRO wraps. fp32 runs DeepSpeed in fp32;
bf16/fp16 go through DeepSpeed's own ``bf16``/``fp16`` config (its fp32 master copy), not autocast.
The worker's process group is reused: ``deepspeed.init_distributed`` wraps an initialised group.

DeepSpeed's knobs that change memory or speed are ``strategy_args`` (sweepable as
``strategy_args.NAME``); ``DS_KNOBS`` lists them with DeepSpeed 0.19's defaults, which apply when a
case leaves them out. ``cpu_offload: true`` offloads the optimizer (stages 1-3) and, on stage 3 with
``offload_param`` left at its default, the parameters too.

The worker's step (``loss.backward(); optimizer.step(); optimizer.zero_grad()``) drives the engine
unchanged: the engine's forward registers DeepSpeed's backward hooks on its output (DeepSpeed >= 0.18
supports a PyTorch-style ``loss.backward()`` with ZeRO), and ``DeepSpeedOptimizer.step`` is
``engine.step()`` (reduction epilogue, optimizer step, parameter all-gather, gradient zeroing).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fsdpbench.core.case import Case
from fsdpbench.strategies.base import (
    FSDP_FULL_SHARD,
    OPTIM_SHARDED,
    ApplyContext,
    FlatBufferZero,
    Sharding,
    Strategy,
)
from fsdpbench.strategies.optim import build_optimizer

if TYPE_CHECKING:  # torch is imported where a strategy is applied, not where it is declared
    import torch
    from torch import nn

# name -> (type, DeepSpeed 0.19's default, which stages read it, what it does)
DS_KNOBS: dict[str, tuple[type, Any, tuple[int, ...], str]] = {
    "reduce_bucket_size": (int, 500_000_000, (1, 2, 3), "elements reduced per gradient bucket"),
    "allgather_bucket_size": (int, 500_000_000, (1, 2), "elements all-gathered per bucket after the step"),
    "overlap_comm": (bool, None, (1, 2, 3), "reduce while backward runs (default: true on stage 3 only)"),
    "contiguous_gradients": (bool, True, (1, 2, 3), "copy reduced gradients into one contiguous buffer"),
    "reduce_scatter": (bool, True, (1, 2), "reduce-scatter (true) or all-reduce (false) gradients"),
    "use_multi_rank_bucket_allreduce": (
        bool,
        True,
        (1, 2),
        "all-reduce a bucket spanning several ranks' partitions (else reduce)",
    ),
    "stage3_prefetch_bucket_size": (int, 50_000_000, (3,), "elements of parameters prefetched ahead"),
    "stage3_param_persistence_threshold": (int, 100_000, (3,), "params below this many elements stay whole"),
    "stage3_max_live_parameters": (int, 1_000_000_000, (3,), "most unsharded elements alive at once"),
    "stage3_max_reuse_distance": (
        int,
        1_000_000_000,
        (3,),
        "keep a gathered param if it is used again within this many elements",
    ),
    "offload_param": (bool, None, (3,), "parameters in host memory (default: cpu_offload)"),
}


def deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot be used here (a sentence), or None."""
    if importlib.util.find_spec("deepspeed") is None:
        return 'DeepSpeed is not installed (optional extra: DS_BUILD_OPS=0 pip install -e ".[deepspeed]")'
    return None


def resolve_ds_knobs(case: Case, stage: int) -> dict[str, Any]:
    """The case's DeepSpeed knobs with DeepSpeed's defaults filled in (None: DeepSpeed decides)."""
    knobs = {name: spec[1] for name, spec in DS_KNOBS.items() if stage in spec[2]}
    knobs.update({k: v for k, v in case.strategy_args.items() if k in knobs})
    return knobs


def build_ds_config(case: Case, stage: int) -> dict[str, Any]:
    """The DeepSpeed config dict for this case (batch, precision, ZeRO stage and knobs, offload)."""
    knobs = resolve_ds_knobs(case, stage)
    offload_param = knobs.pop("offload_param", None)
    zero: dict[str, Any] = {"stage": stage, **{k: v for k, v in knobs.items() if v is not None}}
    if case.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": case.device == "cuda"}
    if stage == 3 and (offload_param if offload_param is not None else case.cpu_offload):
        zero["offload_param"] = {"device": "cpu", "pin_memory": case.device == "cuda"}
    compute_dtype = case.precision_spec.param_dtype
    return {
        "train_micro_batch_size_per_gpu": case.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": compute_dtype == "bfloat16"},
        "fp16": {"enabled": compute_dtype == "float16", "initial_scale_power": 16},
        # the client optimizer is a plain torch optimizer: let ZeRO wrap it
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def import_deepspeed(device: torch.device) -> Any:
    """Import DeepSpeed with the accelerator of this rank's device (cpu or cuda), named explicitly: DeepSpeed
    reads DS_ACCELERATOR once per process, so this is library configuration derived from the case's device,
    whatever the user's environment holds."""
    os.environ["DS_ACCELERATOR"] = "cuda" if device.type == "cuda" else "cpu"
    import deepspeed

    if device.type == "cpu":
        # DeepSpeed's CPU communicator JIT-compiles a shared-memory all-reduce (about 2 minutes on a
        # 2-core machine, once per machine) that only inference_all_reduce uses; training never does.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def agree_alone() -> None:
    """Make DeepSpeed's cross-rank agreement checks those of a rank alone, in this (emulated) process.

    ZeRO-3 checks at every step that a rank's module and parameter order is rank 0's: it broadcasts
    rank 0's list and compares (``deepspeed.runtime.zero.utils.assert_ints_same_as_other_ranks``).
    Under the fake process group the broadcast moves nothing, so a rank other than 0 compared its own
    list with the -1s its buffer was filled with and raised in its first step: every emulated rank
    1..N-1, and so the compute twin of every 2-rank ``ds_zero3`` case, whose step time the model then
    took from the profiled step, the profiler's cost in it. An emulated rank is alone and every rank
    is assumed alike (docs/emulation.md): rank 0's list is its own. The broadcasts are still issued,
    as in a real run (the same two, with the same bytes)."""
    from deepspeed.runtime.zero import utils as zero_utils

    if getattr(zero_utils, "_fsdpbench_alone", False):  # a rebuilt engine (the checkpoint phase)
        return
    from_rank0 = zero_utils.get_lst_from_rank0

    def get_lst_from_rank0(lst: list[int]) -> list[int]:
        from_rank0(lst)
        return list(lst)

    def assert_lst_len_same_as_other_ranks(lst: list[int]) -> None:
        from_rank0([len(lst)])

    zero_utils.get_lst_from_rank0 = get_lst_from_rank0
    zero_utils.assert_lst_len_same_as_other_ranks = assert_lst_len_same_as_other_ranks
    zero_utils._fsdpbench_alone = True


class DeepSpeedOptimizer:
    """What the worker's step calls ``optimizer``: ``step`` is the engine's step (which also zeroes
    gradients); ``optim`` is the torch optimizer inside ZeRO, whose ``state`` the trackers read."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.zero = engine.optimizer  # DeepSpeedZeroOptimizer (stage 1/2) or DeepSpeedZeroOptimizer_Stage3
        self.optim: torch.optim.Optimizer = self.zero.optimizer
        # set by DeepSpeedMemTracker: stage 3 re-allocates its persistent parameters in the step's
        # all-gather, so the tracker files them again before the worker's after-step snapshot
        self.after_step: Callable[[], None] | None = None

    @property
    def state(self) -> Any:
        return self.optim.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    def step(self) -> None:
        self.engine.step()
        if self.after_step is not None:
            self.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing left to do: ``engine.step()`` zeroed the gradients."""


# DeepSpeed's ZeRO stages as fsdpbench strategies: name, what is sharded, the report's colour. Stages
# 1 and 2 are analysed as ZeRO-1 (gradients all-reduced, then the updated parameters spread: DeepSpeed
# all-gathers what ZeroRedundancyOptimizer broadcasts, the same bytes per rank), stage 3 as FULL_SHARD.
STAGES: dict[int, tuple[str, Sharding, str]] = {
    1: ("ds_zero1", OPTIM_SHARDED, "#83BCB6"),
    2: ("ds_zero2", dataclasses.replace(OPTIM_SHARDED, grads=True), "#FFBF79"),
    3: ("ds_zero3", dataclasses.replace(FSDP_FULL_SHARD, per_unit_gather=False), "#FF9D98"),
}


class _DeepSpeedZero(Strategy):
    stage: int
    native_mixed_precision = True  # DeepSpeed's bf16/fp16 config casts; the worker must not autocast
    supports_cpu_offload = True
    memory_tracker = "deepspeed"
    # the engine's save_checkpoint/load_checkpoint (fsdpbench/engine/checkpoint.py, "native")
    checkpoint_methods = ("native",)
    # the engine steps the torch optimizer over its flat fp32 partition one tensor at a time (flat_zero.py)
    optimizer_impls = ("for-loop",)
    clips_with_torch = False  # DeepSpeed clips with its gradient_clipping setting

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "stage" in vars(cls):  # one of DeepSpeed's stages: declared in STAGES
            cls.name, cls.sharding, cls.color = STAGES[cls.stage]
            # stages 1 and 2 give each rank one contiguous part of the whole model's flat fp32 copy
            cls.blocks_repeat = cls.stage == 3

    def check(self, case: Case) -> str | None:
        missing = deepspeed_missing()
        if missing:
            return missing
        readable = {k for k, spec in DS_KNOBS.items() if self.stage in spec[2]}
        unknown = set(case.strategy_args) - readable
        if unknown:
            allowed = "; ".join(
                f"{k} ({DS_KNOBS[k][0].__name__}, default {DS_KNOBS[k][1]}: {DS_KNOBS[k][3]})"
                for k in sorted(readable)
            )
            return f"strategy_args {sorted(unknown)} unknown to {self.name}; allowed: {allowed}"
        for k, v in case.strategy_args.items():
            if not isinstance(v, DS_KNOBS[k][0]) or (DS_KNOBS[k][0] is int and isinstance(v, bool)):
                return f"strategy_args.{k} must be {DS_KNOBS[k][0].__name__}, not {v!r}"
        if case.precision_spec.reduces_low:
            return (
                f"precision={case.precision}: {self.name} reduces in DeepSpeed's own precision; use bf16/fp16"
            )
        return super().check(case)

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        deepspeed = import_deepspeed(ctx.device)
        if ctx.case.emulate:
            agree_alone()
        deepspeed.init_distributed(dist_backend=ctx.case.backend)  # wraps the worker's group
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=build_optimizer(model.parameters(), ctx.case),
            config=build_ds_config(ctx.case, self.stage),
        )
        return engine

    def build_optimizer(self, model: nn.Module, case: Case) -> Any:
        return DeepSpeedOptimizer(model)

    def flat_buffers(self, case: Case) -> FlatBufferZero:
        """This stage's knobs as DeepSpeed resolves them (``DS_KNOBS``' defaults for those a case leaves
        out; ``overlap_comm`` unset: DeepSpeed turns it on for stage 3 only)."""
        knobs = {name: spec[1] for name, spec in DS_KNOBS.items()}
        knobs.update({k: v for k, v in case.strategy_args.items() if k in knobs})
        overlap = knobs["overlap_comm"]
        return FlatBufferZero(
            stage=self.stage,
            reduce_bucket_size=knobs["reduce_bucket_size"],
            allgather_bucket_size=knobs["allgather_bucket_size"],
            overlap_comm=self.stage == 3 if overlap is None else overlap,
            contiguous_gradients=knobs["contiguous_gradients"],
            reduce_scatter=knobs["reduce_scatter"],
            prefetch_bucket_size=knobs["stage3_prefetch_bucket_size"],
            param_persistence_threshold=knobs["stage3_param_persistence_threshold"],
            max_live_parameters=knobs["stage3_max_live_parameters"],
            max_reuse_distance=knobs["stage3_max_reuse_distance"],
        )

    def vendor_model_states_bytes(self, case: Case) -> int | None:
        """DeepSpeed's own model-states estimate (the third prediction, ``ds_est_*`` columns)."""
        return deepspeed_estimate_bytes(case, self.stage)


class DSZero1(_DeepSpeedZero):
    """DeepSpeed ZeRO stage 1: optimizer state (and fp32 master) sharded."""

    stage = 1


class DSZero2(_DeepSpeedZero):
    """DeepSpeed ZeRO stage 2: gradients and optimizer state sharded, params replicated."""

    stage = 2
    checked_on_gpu = True


class DSZero3(_DeepSpeedZero):
    """DeepSpeed ZeRO stage 3: params, gradients and optimizer state sharded."""

    stage = 3
    checked_on_gpu = True


def largest_layer_params(case: Case) -> int:
    """Parameters of the module holding the most parameters directly (DeepSpeed's "largest layer")."""
    from fsdpbench.models.facts import get_model_facts

    by_module: dict[str, int] = {}
    for p in get_model_facts(case.model, case.model_args).params or ():
        module = p.name.rpartition(".")[0]
        by_module[module] = by_module.get(module, 0) + p.numel
    return max(by_module.values(), default=0)


def deepspeed_estimate_bytes(case: Case, stage: int) -> int | None:
    """DeepSpeed's own per-GPU model-states estimate for this case (its ``estimate_zero{2,3}_model_states_
    mem_needs``, called with this case's Ψ, largest layer, world size and offload), or None: DeepSpeed
    has no stage-1 estimator, and none without DeepSpeed installed. It assumes fp16/bf16 training with
    an fp32 master (2Ψ + 18Ψ/N); docs/deepspeed.md compares it term by term with the measurement."""
    if stage == 1 or deepspeed_missing():
        return None
    from fsdpbench.models.facts import get_model_facts

    psi = get_model_facts(case.model, case.model_args).n_params
    # DeepSpeed needs an accelerator named to import; its estimators below are arithmetic on Ψ and the
    # ranks, the same whichever accelerator it picks
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if case.device == "cuda" else "cpu")
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, gpu = estimate_zero2_model_states_mem_needs(
            psi, num_gpus_per_node=case.world_size, cpu_offload=case.cpu_offload
        )
        return gpu
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    offload_param = case.strategy_args.get("offload_param", case.cpu_offload)
    _, gpu, _ = estimate_zero3_model_states_mem_needs(
        psi,
        largest_layer_params(case),
        num_gpus_per_node=case.world_size,
        cpu_offload=case.cpu_offload,
        cpu_offload_params=offload_param,
        zero_init=False,
    )
    return gpu
