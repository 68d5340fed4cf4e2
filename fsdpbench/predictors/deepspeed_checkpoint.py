"""The bytes DeepSpeed's ``engine.save_checkpoint(dir, tag)`` writes, per rank (modelled; the checkpoint
method ``native`` of the ``ds_zero*`` strategies), from DeepSpeed 0.19's ``runtime/engine.py``
(``_save_checkpoint``, ``_save_zero_checkpoint``, ``_common_checkpoint_state``) and its ZeRO optimizers'
``state_dict`` (``runtime/zero/stage_1_and_2.py``, ``runtime/zero/stage3.py``), without DeepSpeed or torch.

Files under ``dir`` (every one a ``torch.save`` archive but ``latest`` and the scripts):

- ``TAG/mp_rank_00_model_states.pt`` (rank 0; ZeRO-3: ``TAG/zero_pp_rank_{r}_mp_rank_00_model_states.pt``
  on every rank): ``module`` (the module's state dict: stage 1/2, every parameter a view of the flat
  parameter buffer, whose storage, padded, is written once; stage 3, every parameter is an empty tensor of
  its own, the data lives in the partitions), ``param_shapes``, the bookkeeping of
  ``_common_checkpoint_state`` (steps, samples, world sizes), the case's DeepSpeed config dict and version;
- ``TAG/zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` (every rank): the ZeRO optimizer's ``state_dict``:
  this rank's fp32 partition of the flat parameters and the torch optimizer's state of it (its step and
  moments, the padded partition), the loss scaler, paddings, and (stage 1/2) where each parameter's
  fragment lies in the partition (``param_slice_mappings``);
- ``latest`` (rank 0: the tag) and the recovery scripts ``zero_to_fp32.py``, ``zero_to_torch.py`` copied
  from the installed DeepSpeed (rank 0; their sizes are read from the package, not imported).

The layout, fp32 (the case's parameters in DeepSpeed's fp32 mode; bf16/fp16 are not modelled):
stage 1/2 flatten the parameters in order, padded at the end to a multiple of 2N elements
(``nccl_start_alignment_factor`` × N), and split it in N equal partitions (the last rank's holds the
padding, ``groups_padding``); stage 3 partitions every parameter alone, ceil(numel / N) elements per rank,
and the rank's fp32 partition is those partitions concatenated (one sub-group below 10^9 elements).
Not modelled: modules without parameters in ``_metadata`` (a few bytes each), buffers, frozen parameters.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpbench.core.case import Case
from fsdpbench.predictors import torch_save_format as fmt

DTYPE = "float32"
NCCL_START_ALIGNMENT = 2  # stage_1_and_2's nccl_start_alignment_factor (elements)
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # engine._copy_recovery_script, rank 0

LOSS_SCALER = fmt.Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
ZERO_STAGE_ENUM = fmt.Global("deepspeed.runtime.zero.config", "ZeroStageEnum")
FRAGMENT_ADDRESS = fmt.Global("deepspeed.utils.tensor_fragment", "fragment_address")
DS_VERSION = "ds_version"


@dataclass(frozen=True, slots=True)
class _P:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def model_state_file(stage: int, rank: int) -> str | None:
    """The model-states file this rank writes (under the tag), or None."""
    if stage == 3:
        return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
    return "mp_rank_00_model_states.pt" if rank == 0 else None


def optim_state_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def deepspeed_version() -> str:
    return importlib.metadata.version("deepspeed")


def recovery_script_bytes() -> int:
    """The recovery scripts' bytes, as the installed DeepSpeed ships them (rank 0 copies them)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("DeepSpeed is not installed: its checkpoint files are not predicted")
    utils = Path(next(iter(spec.submodule_search_locations))) / "utils"
    return sum((utils / name).stat().st_size for name in RECOVERY_SCRIPTS)


def steps_before_checkpoint(case: Case) -> int:
    """The optimizer steps the worker takes before the checkpoint phase (``engine.global_steps``): warm-up,
    timed and bare, memory-tracked, profiled, and the reference-interleaved blocks."""
    return (
        case.warmup_steps
        + case.steps
        + case.bare_steps
        + case.memory_steps
        + case.profile_steps
        + case.time_blocks * case.time_block_steps
    )


def _fresh(name: str) -> str:
    """A new string object equal to ``name``: DeepSpeed builds each occurrence of a parameter's name
    anew, so pickle writes it again rather than memoising it."""
    return "".join(list(name))


def _module_metadata(params: list[_P]) -> OrderedDict[str, Any]:
    """``state_dict()._metadata``: every module's prefix in traversal order with its version (1); the
    modules are those the parameters' names name (a module without parameters is not known here)."""
    version = "version"
    out: OrderedDict[str, Any] = OrderedDict()
    for p in params:
        parts = p.name.split(".")[:-1]
        for i in range(len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in out:
                out[prefix] = {version: 1}
    return out


def _module_state(params: list[_P], stage: int, world: int) -> Any:
    sd: OrderedDict[str, Any] = OrderedDict()
    if stage == 3:  # every parameter released: an empty tensor of its own
        for p in params:
            sd[_fresh(p.name)] = fmt.Tensor(DTYPE, (0,))
    else:
        flat = fmt.Storage(DTYPE, _flat_numel(params, world))
        offset = 0
        for p in params:
            sd[_fresh(p.name)] = fmt.Tensor(DTYPE, p.shape, flat, offset=offset)
            offset += p.numel
    setattr(sd, "_metadata", _module_metadata(params))  # noqa: B010 — as Module.state_dict sets it
    return sd


def _flat_numel(params: list[_P], world: int) -> int:
    """Stage 1/2's flat parameter buffer: the parameters in order, padded to a multiple of 2N."""
    total = sum(p.numel for p in params)
    alignment = NCCL_START_ALIGNMENT * world
    return -(-total // alignment) * alignment


def _common_state(case: Case, params: list[_P], stage: int, config: dict[str, Any], version: str) -> Any:
    world = case.world_size
    steps = steps_before_checkpoint(case)
    # save_frozen_param: partition_gradients (stage 2, 3); no parameter is frozen
    frozen: OrderedDict[str, Any] | None = OrderedDict() if stage >= 2 else None
    return {
        "module": _module_state(params, stage, world),
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [OrderedDict((_fresh(p.name), fmt.torch_size(p.shape)) for p in params)],
        "frozen_param_shapes": frozen,
        "shared_params": {},
        "frozen_param_fragments": None if frozen is None else OrderedDict(),
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": steps,
        "global_samples": steps * case.batch_size * world,
        "dp_world_size": world,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": config,
        DS_VERSION: version,
    }


def _loss_scaler() -> fmt.Instance:
    return fmt.Instance(LOSS_SCALER, {"cur_scale": 1.0, "dynamic": False})


def _torch_optimizer_state(case: Case, partition: int) -> dict[str, Any]:
    """The torch optimizer's state_dict over the one flat fp32 partition (parameter 0)."""
    from fsdpbench.predictors.optimizer_state_dict import OPTIMIZER_STATE, PARAM_GROUP

    state = {
        name: fmt.Tensor(DTYPE, () if scalar else (partition,))
        for name, scalar in OPTIMIZER_STATE.get(case.optimizer, ())
    }
    group = {"lr": case.lr, **PARAM_GROUP.get(case.optimizer, {}), "params": [0]}
    return {"state": {0: state} if state else {}, "param_groups": [group]}


def _zero12_optim_state(case: Case, params: list[_P], stage: int, rank: int, version: str) -> dict[str, Any]:
    world = case.world_size
    flat = _flat_numel(params, world)
    size = flat // world
    left = rank * size
    total = sum(p.numel for p in params)
    padding = size if total <= left else max(0, left + size - total)
    mappings: OrderedDict[str, Any] = OrderedDict()
    offset = 0
    for p in params:
        start, end = max(offset, left), min(offset + p.numel, left + size)
        if start < end:
            mappings[_fresh(p.name)] = fmt.Instance(
                FRAGMENT_ADDRESS, {"numel": end - start, "start": start - left}
            )
        offset += p.numel
    fp32 = fmt.Tensor(DTYPE, (size - padding,), fmt.Storage(DTYPE, size), requires_grad=True)
    return {
        "loss_scaler": _loss_scaler(),
        "dynamic_loss_scale": False,
        "overflow": False,
        "clip_grad": 1.0,  # any float: 9 bytes
        "base_optimizer_state": _torch_optimizer_state(case, size),
        "single_partition_of_fp32_groups": [fp32],
        "zero_stage": fmt.Reduced(ZERO_STAGE_ENUM, (stage,)),
        "group_paddings": [padding],
        "param_alignment_paddings": [[0] * len(params)],
        "partition_count": [world],
        DS_VERSION: version,
        "param_slice_mappings": [mappings],
    }


def _zero3_optim_state(case: Case, params: list[_P], version: str) -> dict[str, Any]:
    world = case.world_size
    size = sum(-(-p.numel // world) for p in params)
    fp32 = fmt.TypedTensor(DTYPE, (size,), {"ds_id": f"0_{len(params) - 1}"}, requires_grad=True)
    return {
        "zero_stage": fmt.Reduced(ZERO_STAGE_ENUM, (3,)),
        "loss_scaler": _loss_scaler(),
        "dynamic_loss_scale": False,
        "overflow": False,
        "partition_count": world,
        "optimizer_state_dict": _torch_optimizer_state(case, size),
        "fp32_flat_groups": [fp32],
    }


@dataclass(frozen=True, kw_only=True)
class NativeFiles:
    """One rank's files of a DeepSpeed checkpoint (bytes) and the tensors' storages among them."""

    model_states: int
    optim_states: int
    latest: int
    recovery_scripts: int
    payload: int

    @property
    def total(self) -> int:
        return self.model_states + self.optim_states + self.latest + self.recovery_scripts


def native_files(
    case: Case, params: list[tuple[str, tuple[int, ...]]], stage: int, rank: int, tag: str
) -> NativeFiles:
    """What ``engine.save_checkpoint(dir, tag)`` writes on ``rank`` (fp32 cases)."""
    from fsdpbench.strategies.deepspeed_zero import build_ds_config

    if case.precision_spec.param_dtype != DTYPE:
        raise ValueError(f"DeepSpeed's {case.precision} checkpoint files are not modelled (fp32 only)")
    ps = [_P(name, tuple(shape)) for name, shape in params]
    version = deepspeed_version()
    config = build_ds_config(case, stage)
    model_bytes, payload = 0, 0
    model_file = model_state_file(stage, rank)
    if model_file is not None:
        graph = _common_state(case, ps, stage, config, version)
        model_bytes = fmt.torch_save_bytes(graph, Path(model_file).stem)
        payload += fmt.payload_bytes(graph)
    zero = (
        _zero3_optim_state(case, ps, version)
        if stage == 3
        else _zero12_optim_state(case, ps, stage, rank, version)
    )
    optim = {"optimizer_state_dict": zero, "ds_config": config, DS_VERSION: version}
    optim_bytes = fmt.torch_save_bytes(optim, Path(optim_state_file(rank)).stem)
    payload += fmt.payload_bytes(optim)
    return NativeFiles(
        model_states=model_bytes,
        optim_states=optim_bytes,
        latest=len(tag) if rank == 0 else 0,
        recovery_scripts=recovery_script_bytes() if rank == 0 else 0,
        payload=payload,
    )
