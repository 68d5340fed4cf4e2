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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpbench.case import Case

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
LOSS_SKIPPED_REASON = EMULATION_LIMITS["loss"]


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


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Join a fake process group of ``world_size`` as ``rank``: collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


@contextlib.contextmanager
def fake_collectives(case: Case) -> Iterator[None]:
    """What the fake process group does not do the way the case's backend would: futures that carry
    their tensors (DDP's hooks; shared with the traced predictor) and, for gloo, the copy of the input
    that gloo's reduce-scatter allocates while the input is already a reduce-scatter buffer."""
    from fsdpbench.predictors.traced import _fake_pg_compat

    rs_name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    reduce_scatter = getattr(dist, rs_name)  # what FSDP2's reduce-scatter calls

    def gloo_reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        work = reduce_scatter(*args, **kwargs)
        tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
        if tensor is not None:
            tensor.clone()  # gloo reduces a flattened copy; it lives (and is counted) beside the tagged input
        return work

    with _fake_pg_compat("nccl"):  # "nccl": no staging of its own (the traced predictor's, before the call)
        if case.backend == "gloo":
            setattr(dist, rs_name, gloo_reduce_scatter)
        try:
            yield
        finally:
            setattr(dist, rs_name, reduce_scatter)


def shards_on_meta(strategy: Any) -> bool:
    """FSDP2 strategies can be applied on ``meta`` and then materialised."""
    return strategy.fsdp_version == 2


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
    from fsdpbench.predictors.traced import _patch_ddp

    return _patch_ddp(model, world_size, rebuild_buckets=True)


def without_overlap(profiled: dict[str, Any]) -> dict[str, Any]:
    """An emulated rank's profiled-step columns: the collectives it issued are counted (their bytes are
    real), but they took no time, so overlap is not measured."""
    out = {
        k: (None if k.startswith("overlap_") and k != "overlap_compute_ms" else v)
        for k, v in profiled.items()
    }
    out["overlap_note"] = (
        "emulated: collectives take no time under the fake process group; overlap not measured"
    )
    return out


@dataclass(frozen=True, slots=True)
class EmulatedRank:
    """What one emulated rank measured (bytes; ``device_peak_bytes``: the allocator's peak reserved on a
    GPU, the tracker's peak on the CPU, where live tensors are the memory)."""

    case_id: str
    rank: int
    device: str
    peak_bytes: int  # tracker: live tensors, memory-tracked step
    peak_by_category: dict[str, int]
    states_by_category: dict[str, int]
    alloc_peak_allocated_bytes: int | None
    alloc_peak_reserved_bytes: int | None
    nvml_peak_bytes: int | None
    rss_peak_bytes: int | None
    step_time_ms: float | None  # compute only
    wall_s: float
    # with a link: the modelled N-rank step (model_* figures of metrics/step_model.py): this rank's
    # compute + the α–β time of the collectives it issued, every rank assumed alike
    modelled_step: dict[str, Any] | None = None

    @property
    def model_states_bytes(self) -> int:
        return sum(self.states_by_category.get(c, 0) for c in ("params", "grads", "optim"))

    @property
    def device_peak_bytes(self) -> int:
        return self.alloc_peak_reserved_bytes or self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in self.__slots__}
        out.update(
            method="emulated", device_peak_bytes=self.device_peak_bytes, notes=list(EMULATION_LIMITS.values())
        )
        return out


def emulate_rank(case: Case, rank: int = 0, *, out_dir: Path | None = None, link: Any = None) -> EmulatedRank:
    """Run ``rank`` of ``case`` emulated, in a fresh process (one warm-up, one timed, one tracked step;
    with a ``link`` (comm_model.Link) also one profiled step, and the modelled N-rank step time on it)."""
    import tempfile

    from fsdpbench.pipeline.launch import launch_case

    case = case.replace(
        emulate=True,
        emulate_ranks=(rank,),
        warmup_steps=1 if link is None else 2,
        steps=1 if link is None else 3,  # the compute the model adds communication to: a median
        memory_steps=1,
        profile_steps=0 if link is None else 1,
        timeout_s=max(case.timeout_s, 3600.0),
    )
    reason = check_emulation(case)
    if reason:
        raise ValueError(reason)
    if case.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "emulating a CUDA rank needs a visible GPU (this machine has none); use --device cpu"
        )
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        case_dir = (out_dir or Path(tmp)) / case.case_id
        outcome = launch_case(case, case_dir)
        wall = time.perf_counter() - t0
        if outcome.status != "ok":
            raise RuntimeError(f"emulated rank {rank} {outcome.status}: {outcome.error}")
        rec = outcome.ranks[0]
        modelled = None
        if link is not None and rec.get("step_time_ms"):
            modelled = _modelled_step(case, rank, case_dir / f"trace_rank{rank}.json.gz", rec, link)
    peak = dict(rec["memory"]["peak"])
    extra = rec.get("metric_columns") or {}
    return EmulatedRank(
        case_id=case.case_id,
        rank=rank,
        device=case.device,
        peak_bytes=int(peak.pop("total")),
        peak_by_category=peak,
        states_by_category=dict(rec["memory"].get("states_tracker") or {}),
        alloc_peak_allocated_bytes=extra.get("mem_alloc_peak_allocated_bytes"),
        alloc_peak_reserved_bytes=extra.get("mem_alloc_peak_reserved_bytes"),
        nvml_peak_bytes=extra.get("mem_nvml_peak_bytes"),
        rss_peak_bytes=extra.get("mem_rss_peak_case_bytes"),
        step_time_ms=rec.get("step_time_ms"),
        wall_s=wall,
        modelled_step=modelled,
    )


def _modelled_step(case: Case, rank: int, trace: Path, rec: dict[str, Any], link: Any) -> dict[str, Any]:
    """The model_* figures of the emulated rank: its timed compute, placed by its profiled step."""
    from fsdpbench.metrics import step_model
    from fsdpbench.metrics.profiled import shard_group_sizes
    from fsdpbench.strategies import get_strategy

    sharding = get_strategy(case.strategy).sharding
    cols = step_model.case_model_columns(
        {rank: trace},
        sharding,
        case.device.split(":", 1)[0],
        link,
        group_size=shard_group_sizes(case, sharding)[1],
        bare_compute_ms={rank: float(rec["step_time_ms"])},
        method=step_model.METHOD_EMULATED,
    )[rank]
    keys = ("model_step_time_ms", "model_compute_ms", "model_comm_ms", "model_exposed_comm_ms")
    return {
        **{k: cols[k] for k in keys},
        "model_link": cols["model_link"],
        "model_method": cols["model_method"],
    }
