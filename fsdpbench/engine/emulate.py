"""Emulation: one real rank of an N-rank job, alone on one device (``run --emulate``, ``emulate: true``).

The rank joins torch's fake process group (``torch.testing._internal.distributed.fake_pg``) of the
case's world size: every collective returns at once and moves no data, while every tensor the rank
allocates — its parameter shards, gradients, optimizer state, all-gather outputs, reduce-scatter
inputs, activations, on a GPU the allocator's rounding and cuBLAS/cuDNN workspaces — is allocated
for real. The worker runs the same phases and instruments as a real run (``worker.py``).

The model is built on ``meta``, the strategy applied there, and only this rank's data is
materialised (``to_empty``, then a deterministic fill of the local tensors), so a rank of a
64-way ZeRO-3 job never holds the whole model. DDP and ZeRO-1 replicate parameters: they hold
the whole model, as a real rank does.

What emulation cannot see is kept out of its numbers and named in ``EMULATION_LIMITS``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpbench.core.case import Case
from fsdpbench.core.schema import OVERLAP_COMM, OVERLAP_EXPOSED, OVERLAP_NOTE, OVERLAP_RATIO
from fsdpbench.engine.fake_pg import fake_pg_compat, patch_ddp

# what an emulated rank's figures leave out; stored in run.json and shown in the report's notes
EMULATION_LIMITS: dict[str, str] = {
    "collective_time": "no data moves: step times are one rank's compute only (no communication time, "
    "no waiting for other ranks)",
    "nccl_buffers": "NCCL's communicator buffers are never created (fake process group); fsdpbench has no "
    "NCCL-only allowance to add — the predictor's --context-allowance covers CUDA "
    "context and NCCL together, and an emulated rank's NVML figure already includes its CUDA "
    "context, so nothing is added",
    "cross_rank": "cross-rank effects are absent: stragglers, link contention, rank-to-rank imbalance",
    "loss": "losses are not measured: parameters and data are garbage on purpose (no all-reduce, "
    "deterministic fill), so loss and correctness checks are skipped",
}
WHY_NO_LOSS = EMULATION_LIMITS["loss"]  # an emulated row's loss_skipped_reason


def resolve_emulate_ranks(value: Any, world_size: int) -> tuple[int, ...]:
    """``all`` → every rank; an int or a list → those ranks, sorted, without repeats."""
    if value == "all":
        return tuple(range(world_size))
    ranks = [value] if isinstance(value, int) else list(value)
    return tuple(sorted(set(int(r) for r in ranks)))


def check_emulation(case: Case) -> str | None:
    """Why this case cannot be emulated as asked (a sentence), or None."""
    if not case.emulate:
        return None
    outside = [r for r in case.emulate_ranks if not 0 <= r < case.world_size]
    if outside:
        return (
            f"emulate_ranks {outside} outside world_size={case.world_size} (ranks 0..{case.world_size - 1})"
        )
    if not case.emulate_ranks:
        return "emulate_ranks is empty; give at least one rank, or 'all'"
    if case.compile:
        return "compile: emulation runs eagerly only (an untested combination with the fake process group)"
    return None


@contextlib.contextmanager
def fake_collectives(case: Case) -> Iterator[None]:
    """What the fake process group does not do the way the case's backend would: futures that carry
    their tensors (DDP's hooks; shared with the traced predictor) and, for gloo, the copy of the input
    that gloo's reduce-scatter allocates while the input is already a reduce-scatter buffer."""
    rs_name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    reduce_scatter = getattr(dist, rs_name)  # what FSDP2's reduce-scatter calls

    def gloo_reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        work = reduce_scatter(*args, **kwargs)
        tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
        if tensor is not None:
            tensor.clone()  # gloo reduces a flattened copy; it lives (and is counted) beside the tagged input
        return work

    with fake_pg_compat("nccl"):  # "nccl": no staging of its own (the traced predictor's, before the call)
        if case.backend == "gloo":
            setattr(dist, rs_name, gloo_reduce_scatter)
        try:
            yield
        finally:
            setattr(dist, rs_name, reduce_scatter)


def shards_on_meta(strategy: Any) -> bool:
    """The strategy can be applied on ``meta`` and then materialised (FSDP2 can: it says so)."""
    return bool(strategy.shards_on_meta)


def build_rank_model(
    mdef: Any,
    margs: dict[str, Any],
    apply_strategy: Callable[[nn.Module], nn.Module],
    *,
    shard_on_meta: bool,
    device: torch.device,
    seed: int,
    rank: int,
) -> tuple[nn.Module, int]:
    """The model as this rank holds it after ``apply_strategy`` (knobs + strategy), with only its own
    data materialised; returns (model, parameter count).

    With ``shard_on_meta`` (FSDP2) the strategy is applied on ``meta`` and only the shards are then
    allocated; otherwise (DDP, ZeRO-1, FSDP1) the whole model is materialised first, as those
    strategies read their parameters' storage when applied (and DDP/ZeRO-1 replicate it anyway)."""
    with torch.device("meta"):
        model = mdef.build(**margs)
    n_params = sum(p.numel() for p in model.parameters())
    if shard_on_meta:
        model = apply_strategy(model)
    model.to_empty(device=device)
    fill_local_data(model, seed=seed, rank=rank)
    if not shard_on_meta:
        model = apply_strategy(model)
    return model, n_params


@torch.no_grad()
def fill_local_data(model: nn.Module, *, seed: int, rank: int) -> None:
    """Deterministic values for what ``to_empty`` left uninitialised: N(0, 0.02) parameters (this
    rank's local shard of a DTensor), zero buffers. Not the model's init: no cross-rank RNG needed."""
    generators: dict[torch.device, torch.Generator] = {}  # one per device: the fill runs where the data is
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if not local.numel():
            continue
        if isinstance(tensor, nn.Parameter) and local.is_floating_point():
            if local.device not in generators:
                generators[local.device] = torch.Generator(device=local.device).manual_seed(
                    seed * 100_003 + rank
                )
            local.normal_(0.0, 0.02, generator=generators[local.device])
        else:
            local.zero_()


def prepare_ddp(model: nn.Module, world_size: int) -> nn.Module:
    """DDP under the fake process group: an in-place bucket all-reduce hook (the traced predictor's)."""
    return patch_ddp(model, world_size, rebuild_buckets=True)


def without_overlap(profiled: dict[str, Any]) -> dict[str, Any]:
    """An emulated rank's profiled-step columns: the collectives it issued are counted (their bytes are
    real), but they took no time, so overlap is not measured."""
    unmeasured = (OVERLAP_COMM, OVERLAP_EXPOSED, OVERLAP_RATIO)  # the compute is measured
    out = {k: (None if k in unmeasured else v) for k, v in profiled.items()}
    out[OVERLAP_NOTE] = (
        "emulated: collectives take no time under the fake process group; overlap not measured"
    )
    return out
