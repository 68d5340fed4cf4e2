"""What every rank does for one case: set up, train, and measure in separate phases.

Run by ``fsdpbench run`` (one fresh set of processes per case), or by hand on any launcher that
sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, e.g. across two nodes:

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        -m fsdpbench.worker --case case.json --out results/case_dir
    srun --ntasks-per-node 8 python -m fsdpbench.worker --case case.json --out results/case_dir

Phases, in order, so instruments never disturb what they measure:
warm-up → timed steps (bare) → memory-tracked steps → one profiled step (→ optional bare loop).
RSS (and on GPUs NVML) is sampled in a background thread across the whole case, tagged by phase.
Each rank writes ``rank{R}.json`` into the case directory after every phase, so a crash or a
hang loses nothing already measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdpbench.case import Case
from fsdpbench.emulate import (
    build_rank_model,
    fake_collectives,
    init_fake_process_group,
    prepare_ddp,
    shards_on_meta,
    without_overlap,
)
from fsdpbench.knobs import apply_activation_checkpointing, apply_compile, state_placement_bytes
from fsdpbench.metrics.allocator import cuda_allocator_stats, reset_cuda_peaks
from fsdpbench.metrics.harness import instruments_left_installed, interleaved_blocks
from fsdpbench.metrics.profiled import Samplers, analyze_profile, profile_steps
from fsdpbench.metrics.reference import ReferenceWorkload, interleaved_steps
from fsdpbench.metrics.tracker import build_tracker, local_state_bytes, snapshot_by_category
from fsdpbench.models import resolve_model
from fsdpbench.step import autocast_for
from fsdpbench.step import train_step as run_step
from fsdpbench.strategies import ApplyContext, get_strategy
from fsdpbench.wrap import get_wrap_units


class RankRecorder:
    """This rank's result dict, written atomically to disk after every phase."""

    def __init__(self, out_dir: Path, rank: int) -> None:
        self.path = out_dir / f"rank{rank}.json"
        self.data: dict[str, Any] = {
            "rank": rank,
            "pid": os.getpid(),
            "status": "running",
            "phase": "setup",
            "error": "",
        }
        self.flush()

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, default=str))
        os.replace(tmp, self.path)


def resolve_device(case: Case, local_rank: int) -> torch.device:
    if case.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_rank(case: Case, out_dir: Path) -> dict[str, Any]:
    """Set up this rank, run every phase of the case, return (and write) its results."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    rec = RankRecorder(out_dir, rank)
    t_start = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            _run_phases(case, rank, world, local_rank, rec, t_start, stack)
        rec.update(status="ok", phase="done")
    except BaseException as exc:  # noqa: BLE001 — every failure is recorded, then re-raised
        status = "oom" if isinstance(exc, torch.OutOfMemoryError) else "failed"
        rec.update(
            status=status,
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(),
            failed_at=time.time(),
        )
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return rec.data


def _run_phases(
    case: Case,
    rank: int,
    world: int,
    local_rank: int,
    rec: RankRecorder,
    t_start: float,
    stack: contextlib.ExitStack,
) -> None:
    # ---- setup: process group, samplers, model, strategy, optimizer ------------------------
    device = resolve_device(case, local_rank)
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    )
    if case.emulate:  # this rank alone, collectives are no-ops (fsdpbench/emulate.py)
        init_fake_process_group(rank, world)
        stack.enter_context(fake_collectives(case))
    else:
        dist.init_process_group(case.backend, device_id=device if device.type == "cuda" else None)
    assert dist.get_world_size() == case.world_size, "launcher world size differs from the case's"
    t_pg = time.perf_counter()
    samplers = Samplers(case, device, local_rank)
    samplers.set_phase("setup")

    mdef, margs = resolve_model(case.model, case.model_args)
    strategy = get_strategy(case.strategy)
    units: list[torch.nn.Module] = []

    def apply_strategy(model: torch.nn.Module) -> torch.nn.Module:
        units[:] = get_wrap_units(model, case) if strategy.uses_wrap else []
        ctx = ApplyContext(case=case, device=device, rank=rank, world_size=world, units=list(units))
        model = apply_activation_checkpointing(model, case)
        model = apply_compile(model, case)
        return strategy.apply(model, ctx)

    if case.emulate:  # only this rank's shards are ever allocated
        model, n_params = build_rank_model(
            mdef,
            margs,
            apply_strategy,
            shard_on_meta=shards_on_meta(strategy),
            device=device,
            seed=case.seed,
            rank=rank,
        )
        model = prepare_ddp(model, world)
    else:
        torch.manual_seed(case.seed)  # same initial weights on every rank
        with torch.device(device):
            model = mdef.build(**margs)
        n_params = sum(p.numel() for p in model.parameters())
        model = apply_strategy(model)
    optimizer = strategy.build_optimizer(model, case)
    rec.update(
        phase="warmup",
        params=n_params,
        n_units=len(units) + 1 if strategy.uses_wrap else 1,
        mode=case.mode,
        threads=torch.get_num_threads(),
        init_pg_s=t_pg - t_start,
        setup_s=time.perf_counter() - t_start,
        samplers=samplers.status,
    )

    autocast = autocast_for(case, strategy, device)
    losses: list[float] = []
    steps_wall_s = [0.0]  # time inside training steps, all phases: the rest of a case is overhead

    def train_step(step: int, after_optim: Callable[[], None] | None = None, record: bool = True) -> None:
        t0 = time.perf_counter()
        loss = run_step(
            case,
            model,
            optimizer,
            mdef.loss,
            rank=rank,
            step=step,
            device=device,
            autocast=autocast,
            after_optim=after_optim,
        )
        if record:
            losses.append(loss.item())
            steps_wall_s[0] += time.perf_counter() - t0

    def timed_steps(first: int, n: int) -> list[float]:
        times = []
        for i in range(n):
            synchronize(device)
            t0 = time.perf_counter()
            train_step(first + i)
            synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    step = 0
    # ---- warm-up: compile, lazy init, optimizer state creation ---------------------------
    samplers.set_phase("warmup")
    warmup_ms = timed_steps(step, case.warmup_steps)
    step += case.warmup_steps
    rec.update(warmup_times_ms=warmup_ms, first_step_ms=warmup_ms[0] if warmup_ms else None)

    def bare_loop(first: int, n: int) -> float:
        """Wall ms of n steps with nothing of the harness: no per-step sync, timer or loss read."""
        synchronize(device)
        t0 = time.perf_counter()
        for i in range(n):
            train_step(first + i, record=False)
        synchronize(device)
        return (time.perf_counter() - t0) * 1e3

    # ---- phase 1: timed steps, no instrument; with bare_steps, in blocks interleaved with a bare
    # loop of the same steps, before any instrument has run, so both see the same machine state ----
    rec.update(phase="timed")  # before the barrier: the file write is not timed
    dist.barrier()
    reset_cuda_peaks(device)
    step_times_ms: list[float] = []
    bare_ms = 0.0
    for kind, n in interleaved_blocks(case.steps, case.bare_steps):
        samplers.set_phase(kind)
        if kind == "timed":
            step_times_ms += timed_steps(step, n)
        else:
            bare_ms += bare_loop(step, n)
        step += n
    extra: dict[str, Any] = {"bare_step_time_ms": bare_ms / case.bare_steps} if case.bare_steps else {}
    rec.update(phase="memory", step_times_ms=step_times_ms, losses=list(losses), **_time_stats(step_times_ms))

    # ---- phase 2: memory-tracked steps ---------------------------------------------------
    samplers.set_phase("memory")
    mem: dict[str, Any] = {}
    for _ in range(case.memory_steps):
        tracker = build_tracker(model, optimizer, strategy.fsdp_root(model))

        def record_states() -> None:
            mem["states_tracker"] = snapshot_by_category(tracker, "current", device)
            mem["states_local"] = local_state_bytes(model, optimizer)

        with tracker:
            train_step(step, after_optim=record_states)
        mem["peak"] = snapshot_by_category(tracker, "peak", device)
        step += 1
    extra.update({f"mem_{k}": v for k, v in cuda_allocator_stats(device).items()})
    # where the strategy keeps this rank's parameters (CPU offload: host), from its own bookkeeping
    extra.update({f"mem_placement_{k}": v for k, v in state_placement_bytes(model).items()})
    rec.update(phase="profile", memory=mem, losses=list(losses), extra_columns=extra)

    # ---- phase 3: one profiled step: communication volume and overlap ----------------------
    samplers.set_phase("profile")
    if case.profile_steps:
        trace_path = rec.path.parent / f"trace_rank{rank}.json.gz"
        with profile_steps(device, trace_path):
            for _ in range(case.profile_steps):
                train_step(step)
                step += 1
        profiled = analyze_profile(trace_path, case, strategy.sharding, n_params)
        extra.update(without_overlap(profiled) if case.emulate else profiled)
        rec.update(extra_columns=extra)

    # ---- optional: blocks of steps, each step paired with a fixed reference step (the CI time gate)
    if case.time_blocks:
        reference = ReferenceWorkload(device)
        reference.step()  # its own warm-up, untimed
        next_step = [step]

        def block_step() -> None:
            train_step(next_step[0], record=False)
            next_step[0] += 1

        dist.barrier()
        paired = interleaved_steps(
            block_step, reference, case.time_blocks * case.time_block_steps, lambda: synchronize(device)
        )
        step = next_step[0]
        rec.update(**{f"paired_{k}": v for k, v in paired.items()})

    # ---- done ------------------------------------------------------------------------------
    samplers.stop()
    extra["harness_leftovers"] = "; ".join(
        instruments_left_installed()
    )  # "" when the instruments left nothing
    extra.update(samplers.columns())
    samplers.write_timeline(rec.path.parent / f"timeline_rank{rank}.parquet", case.case_id, rank)
    rec.update(
        losses=list(losses),
        steps_total=step,
        steps_wall_s=steps_wall_s[0],
        wall_s=time.perf_counter() - t_start,
        extra_columns=extra,
    )


def _time_stats(times_ms: list[float]) -> dict[str, float]:
    if not times_ms:
        return {}
    q = statistics.quantiles(times_ms, n=10, method="inclusive") if len(times_ms) > 1 else [times_ms[0]] * 9
    return {
        "step_time_ms": statistics.median(times_ms),
        "step_time_p10_ms": q[0],
        "step_time_p90_ms": q[-1],
        "step_time_mean_ms": statistics.fmean(times_ms),
        "step_time_std_ms": statistics.stdev(times_ms) if len(times_ms) > 1 else 0.0,
    }


def rank_entry(case_json: str, out_dir: str) -> None:
    """Entry point for launch.py: stdout/stderr go to the case directory, results to rank{R}.json."""
    from fsdpbench.lifeline import die_with_parent, watch_orchestrator

    die_with_parent()  # the fork server is the parent; it dies with the orchestrator
    watch_orchestrator()
    rank = int(os.environ["RANK"])
    log = open(Path(out_dir) / f"rank{rank}.log", "w")  # noqa: SIM115 — lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    run_rank(Case.from_dict(json.loads(case_json)), Path(out_dir))


def main(argv: list[str] | None = None) -> None:
    """Run one case on an external launcher (torchrun, srun): every rank calls this."""
    parser = argparse.ArgumentParser(prog="python -m fsdpbench.worker", description=main.__doc__)
    parser.add_argument(
        "--case", required=True, help="case JSON file (fsdpbench run SCENARIO --export-cases DIR writes them)"
    )
    parser.add_argument("--out", required=True, help="directory for rank{R}.json")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # srun without torchrun
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_rank(Case.from_dict(json.loads(Path(args.case).read_text())), out)


if __name__ == "__main__":
    main()
