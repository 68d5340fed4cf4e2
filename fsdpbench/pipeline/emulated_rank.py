"""One emulated rank of a case, run in a fresh process and read back (``predict --method emulated``):
the pipeline's launcher with the case set to emulate that rank alone (fsdpbench/engine/emulate.py
says what emulation is and what it cannot see)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpbench.core.case import Case
from fsdpbench.core.schema import (
    ALLOC_PEAK_ALLOCATED,
    ALLOC_PEAK_RESERVED,
    MODEL_COMM,
    MODEL_COMPUTE,
    MODEL_EXPOSED_COMM,
    MODEL_LINK,
    MODEL_METHOD,
    MODEL_STATE_CATEGORIES,
    MODEL_STEP_TIME,
    OK,
    SAMPLED_PEAK,
    SAMPLED_PEAK_CASE,
)
from fsdpbench.engine.emulate import EMULATION_LIMITS, check_emulation


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
    # with a link: the modelled N-rank step (model_* figures of predictors/step_model.py): this rank's
    # compute + the α–β time of the collectives it issued, every rank assumed alike
    modelled_step: dict[str, Any] | None = None

    @property
    def model_states_bytes(self) -> int:
        return sum(self.states_by_category.get(c, 0) for c in MODEL_STATE_CATEGORIES)

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

    import torch

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
        if outcome.status != OK:
            raise RuntimeError(f"emulated rank {rank} {outcome.status}: {outcome.error}")
        rec = outcome.ranks[0]
        step_ms = rec.step_time_ms()
        modelled = None
        if link is not None and step_ms:
            modelled = _modelled_step(case, rank, case_dir / f"trace_rank{rank}.json.gz", step_ms, link)
    if rec.memory is None:
        raise RuntimeError(f"emulated rank {rank} recorded no memory-tracked step")
    peak = dict(rec.memory.peak)
    return EmulatedRank(
        case_id=case.case_id,
        rank=rank,
        device=case.device,
        peak_bytes=int(peak.pop("total")),
        peak_by_category=peak,
        states_by_category=dict(rec.memory.states_tracker),
        alloc_peak_allocated_bytes=rec.allocator.get(ALLOC_PEAK_ALLOCATED),
        alloc_peak_reserved_bytes=rec.allocator.get(ALLOC_PEAK_RESERVED),
        nvml_peak_bytes=rec.sampled.get(SAMPLED_PEAK.of("nvml")),
        rss_peak_bytes=rec.sampled.get(SAMPLED_PEAK_CASE.of("rss")),
        step_time_ms=step_ms,
        wall_s=wall,
        modelled_step=modelled,
    )


def _modelled_step(case: Case, rank: int, trace: Path, step_ms: float, link: Any) -> dict[str, Any]:
    """The model_* figures of the emulated rank: its timed compute, placed by its profiled step."""
    from fsdpbench.metrics.profiled import shard_group_sizes
    from fsdpbench.predictors import step_model
    from fsdpbench.strategies import get_strategy

    sharding = get_strategy(case.strategy).sharding
    cols = step_model.case_model_columns(
        {rank: trace},
        sharding,
        case.device.split(":", 1)[0],
        link,
        group_size=shard_group_sizes(case, sharding)[1],
        bare_compute_ms={rank: float(step_ms)},
        method=step_model.METHOD_EMULATED,
    )[rank]
    keys = (MODEL_STEP_TIME, MODEL_COMPUTE, MODEL_COMM, MODEL_EXPOSED_COMM, MODEL_LINK, MODEL_METHOD)
    return {k: cols[k] for k in keys}
