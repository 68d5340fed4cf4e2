"""What every rank does for one case: set up, train, and measure in separate phases.

Run by ``fsdpbench run`` (one fresh set of processes per case), or by hand on any launcher that
sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, e.g. across two nodes:

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        -m fsdpbench.engine.worker --case case.json --out results/case_dir
    srun --ntasks-per-node 8 python -m fsdpbench.engine.worker --case case.json --out results/case_dir

Phases, in order, so instruments never disturb what they measure:
warm-up → timed steps (bare) → memory-tracked steps → one profiled step (→ optional bare loop)
(→ optional checkpoint: save, load into a fresh model, one more step).
RSS (and on GPUs NVML) is sampled in a background thread across the whole case, tagged by phase.
Each rank writes ``rank{R}.json`` into the case directory after every phase, so a crash or a
hang loses nothing already measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdpbench.core.case import NO_HOST_TUNING, Case
from fsdpbench.core.rundir import DiskReserve, space_error, write_atomically
from fsdpbench.core.schema import FAILED, OK, OOM
from fsdpbench.engine.emulate import (
    build_rank_model,
    fake_collectives,
    prepare_ddp,
    shards_on_meta,
    without_overlap,
)
from fsdpbench.engine.fake_pg import init_fake_process_group
from fsdpbench.engine.gloo_settle import SETTLED_TRACKERS, collectives_settled
from fsdpbench.engine.intra_op import rank_threads
from fsdpbench.engine.knobs import state_placement_bytes
from fsdpbench.engine.parallel import Build, Parallel, Parallelize, build_parallel
from fsdpbench.engine.process_env import process_env
from fsdpbench.engine.rank_result import NO_SPACE_EXIT, Harness, RankResult, Setup, rank_file
from fsdpbench.engine.reference import ReferenceWorkload, interleaved_steps
from fsdpbench.engine.step import Batch, rank_batch, train_step
from fsdpbench.metrics.allocator import cuda_allocator_stats, reset_cuda_peaks
from fsdpbench.metrics.harness import instruments_left_installed, interleaved_blocks
from fsdpbench.metrics.profiled import Samplers, analyze_profile, profile_steps
from fsdpbench.metrics.rss import fix_mmap_threshold
from fsdpbench.metrics.timing import StepTimes
from fsdpbench.metrics.tracker import TrackedMemory, build_tracker, local_state_bytes, snapshot_by_category
from fsdpbench.models import ModelDef


class RankRecorder:
    """This rank's ``RankResult``, written atomically to rank{R}.json after every phase."""

    def __init__(self, out_dir: Path, rank: int) -> None:
        self.path = out_dir / rank_file(rank)
        self.result = RankResult(rank=rank, pid=os.getpid())
        # on a disk that fills, the record that says so still fits: the reserve is given back for it
        self.reserve = DiskReserve(self.path, out_dir)
        self.flush()

    def update(self, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self.result, name, value)
        self.flush()

    def flush(self) -> None:
        data = json.dumps(self.result.to_json(), default=str).encode()
        try:
            write_atomically(self.path, data)
        except OSError as exc:
            if space_error(exc) is None or not self.reserve.release():
                raise
            write_atomically(self.path, data)


class RankHooks:
    """The moments of a rank's phases where host tuning may act (``fsdpbench.hosttuning`` implements
    them); this base does nothing, which is how a rank runs by default: the machine as it is. The
    worker knows only these moments, never how a host is tuned."""

    def before_setup(self) -> None:
        """First of all, before the process group."""

    def after_process_group(self, device: torch.device, local_rank: int, local_world: int) -> list[int]:
        """Once the process group exists; returns the cores this rank's compute threads are bound to."""
        return []

    def after_build(self, device: torch.device, cores: list[int]) -> tuple[int, int]:
        """Once the strategy has made its groups; returns (gloo loop threads idled, threads bound)."""
        return 0, 0

    def after_warmup(self) -> None:
        """After the warm-up steps."""

    def before_timed(self) -> None:
        """After the barrier that starts the timed phase."""

    def before_step(self) -> None:
        """Before each timed step, outside its timer."""

    def after_step(self) -> None:
        """After each timed step, outside its timer."""

    def after_timed(self) -> None:
        """After the last timed step."""

    def failed(self) -> None:
        """This rank failed: whatever waits on it must stop waiting."""


NO_HOOKS = RankHooks()


def resolve_device(case: Case, local_rank: int) -> torch.device:
    if case.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_rank(case: Case, out_dir: Path, hooks: RankHooks = NO_HOOKS) -> RankResult:
    """Set up this rank, run every phase of the case, return (and write) its results. The process was
    started with ``process_env(case)``; RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE are the
    launcher protocol (torchrun's)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    rec = RankRecorder(out_dir, rank)
    t_start = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            _run_phases(case, rank, world, local_rank, rec, t_start, stack, hooks)
        rec.update(status=OK, phase="done")
    except BaseException as exc:  # noqa: BLE001 — every failure is recorded, then re-raised
        hooks.failed()
        status = OOM if isinstance(exc, torch.OutOfMemoryError) else FAILED
        try:
            rec.update(
                status=status,
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
                failed_at=time.time(),
            )
        except OSError as lost:
            if space_error(lost) is None:
                raise
            os._exit(NO_SPACE_EXIT)  # no room left even for the record: the exit code says why
        raise
    finally:
        rec.reserve.release()
        if dist.is_initialized():
            dist.destroy_process_group()
    return rec.result


class RankSteps:
    """This rank's training steps: ``run`` one (its batch built beforehand, outside any timer);
    recorded steps keep their loss and their wall time."""

    def __init__(self, case: Case, parallel: Parallel, rank: int, device: torch.device) -> None:
        self.case, self.parallel, self.rank, self.device = case, parallel, rank, device
        self.losses: list[float] = []  # of every recorded step
        self.wall_s = 0.0  # inside recorded steps, all phases: the rest of a case is overhead
        self.next = 0  # the step index: it seeds the step's batch

    def batch(self, step: int) -> Batch:
        return rank_batch(self.case, self.rank, step, self.device)

    def run(self, batch: Batch, after_optim: Callable[[], None] | None = None, record: bool = True) -> None:
        t0 = time.perf_counter()
        loss = train_step(self.parallel, batch, after_optim=after_optim)
        if record:
            self.losses.append(loss.item())
            self.wall_s += time.perf_counter() - t0
        self.next += 1

    def timed(self, n: int, hooks: RankHooks = NO_HOOKS) -> StepTimes:
        """Wall and CPU ms of each of the next n steps, device-synchronised before and after each;
        ``hooks`` act before and after each step, outside the timer."""
        times = StepTimes()
        for _ in range(n):
            batch = self.batch(self.next)
            hooks.before_step()
            synchronize(self.device)
            t0, c0 = time.perf_counter(), time.process_time()
            self.run(batch)
            synchronize(self.device)
            times.times_ms.append((time.perf_counter() - t0) * 1e3)
            times.cpu_ms.append((time.process_time() - c0) * 1e3)
            hooks.after_step()
            del batch
        return times

    def bare(self, n: int) -> float:
        """Wall ms of the next n steps with nothing of the harness: no per-step sync, timer or loss read."""
        batches = [self.batch(self.next + i) for i in range(n)]
        synchronize(self.device)
        t0 = time.perf_counter()
        for batch in batches:
            self.run(batch, record=False)
        synchronize(self.device)
        return (time.perf_counter() - t0) * 1e3

    def instrumented(self, after_optim: Callable[[], None] | None = None) -> None:
        """The next step under an instrument (tracker, profiler): its batch is built inside the
        instrument, which sees it as part of the step."""
        self.run(self.batch(self.next), after_optim=after_optim)

    def tracked(self) -> TrackedMemory:
        """The next step under the memory tracker: the peak by category, and the model states after
        ``optimizer.step``."""
        model, optimizer = self.parallel.model, self.parallel.optimizer
        tracker = build_tracker(model, optimizer, self.parallel.strategy)
        memory = TrackedMemory()

        def record_states() -> None:
            memory.states_tracker = snapshot_by_category(tracker, "current", self.device)
            memory.states_local = local_state_bytes(model, optimizer, self.parallel.strategy)

        settled = (
            self.case.backend == "gloo"
            and not self.case.emulate  # emulation's group is fake
            and self.parallel.strategy.memory_tracker in SETTLED_TRACKERS
        )
        with tracker, collectives_settled(tracker) if settled else contextlib.nullcontext():
            self.instrumented(after_optim=record_states)
        memory.peak = snapshot_by_category(tracker, "peak", self.device)
        return memory


def _allowed_cpus() -> int:
    """The logical CPUs this process may run on: its affinity where the OS has one (Linux), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 0


def _run_phases(
    case: Case,
    rank: int,
    world: int,
    local_rank: int,
    rec: RankRecorder,
    t_start: float,
    stack: contextlib.ExitStack,
    hooks: RankHooks,
) -> None:
    """The case's phases in order, each a function below."""
    run = setup(case, rank, world, local_rank, rec, t_start, stack, hooks)
    warmup_phase(run)
    timed_phase(run)
    memory_phase(run)
    profile_phase(run)
    reference_phase(run)
    checkpoint_phase(run)
    finish(run)


@dataclass(kw_only=True, slots=True)
class RankRun:
    """What the phases of one rank share: the case, where it runs, what records it, its model and steps."""

    case: Case
    rank: int
    device: torch.device
    rec: RankRecorder
    hooks: RankHooks
    samplers: Samplers
    parallel: Parallel
    steps: RankSteps
    t_start: float
    bare_ms: float = 0.0  # the bare loop's wall time, summed over its blocks


def setup(
    case: Case,
    rank: int,
    world: int,
    local_rank: int,
    rec: RankRecorder,
    t_start: float,
    stack: contextlib.ExitStack,
    hooks: RankHooks,
) -> RankRun:
    """Process group, samplers, model, strategy, optimizer."""
    hooks.before_setup()
    device = resolve_device(case, local_rank)
    if case.memory_fraction and device.type == "cuda":  # before the first allocation
        torch.cuda.set_per_process_memory_fraction(case.memory_fraction, device)
    if case.checkpoint != "none":
        # before any training allocation: a fixed mmap threshold, so that training leaves no heap of large
        # free chunks for the checkpoint phase's transients to land on unseen (docs/checkpointing.md)
        fix_mmap_threshold()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # cores ÷ local ranks: the same rule the gloo probe runs with (so its α is this rank's)
    torch.set_num_threads(rank_threads(local_world))
    if case.emulate:  # this rank alone, collectives are no-ops (fsdpbench/engine/emulate.py)
        init_fake_process_group(rank, world)
        stack.enter_context(fake_collectives(case))
    else:
        dist.init_process_group(case.backend, device_id=device if device.type == "cuda" else None)
    cores = hooks.after_process_group(device, local_rank, local_world)
    assert dist.get_world_size() == case.world_size, "launcher world size differs from the case's"
    t_pg = time.perf_counter()
    samplers = Samplers(case, device, local_rank)
    samplers.set_phase("setup")

    parallel = build_parallel(
        case, device, rank, build=_emulated_build(case, device, rank) if case.emulate else None
    )
    steps = RankSteps(case, parallel, rank, device)
    idle_loops, bound = hooks.after_build(device, cores)
    setup = Setup(
        params=parallel.params,
        n_units=parallel.n_units,
        mode=case.mode,
        threads=torch.get_num_threads(),
        init_pg_s=t_pg - t_start,
        setup_s=time.perf_counter() - t_start,
        samplers=samplers.status,
        cores=",".join(map(str, cores)),
        cpus=_allowed_cpus(),
        gloo_loops_idle=idle_loops,
        gloo_threads_bound=bound,
    )
    rec.update(phase="warmup", setup=setup)
    return RankRun(
        case=case,
        rank=rank,
        device=device,
        rec=rec,
        hooks=hooks,
        samplers=samplers,
        parallel=parallel,
        steps=steps,
        t_start=t_start,
    )


def warmup_phase(run: RankRun) -> None:
    """Compile, lazy init, optimizer state creation."""
    run.samplers.set_phase("warmup")
    run.rec.update(warmup=run.steps.timed(run.case.warmup_steps))
    run.hooks.after_warmup()


def timed_phase(run: RankRun) -> None:
    """Timed steps, no instrument; with bare_steps, in blocks interleaved with a bare loop of the same
    steps, before any instrument has run, so both see the same machine state."""
    run.rec.update(phase="timed")  # before the barrier: the file write is not timed
    dist.barrier()
    reset_cuda_peaks(run.device)
    run.hooks.before_timed()
    timed = StepTimes()
    for kind, n in interleaved_blocks(run.case.steps, run.case.bare_steps):
        run.samplers.set_phase(kind)
        if kind == "timed":
            timed.extend(run.steps.timed(n, run.hooks))
        else:
            run.bare_ms += run.steps.bare(n)
    run.hooks.after_timed()
    run.rec.update(phase="memory", timed=timed, losses=list(run.steps.losses))


def memory_phase(run: RankRun) -> None:
    """Memory-tracked steps: the last one's peak by category and its model states."""
    run.samplers.set_phase("memory")
    memory = TrackedMemory()
    for _ in range(run.case.memory_steps):
        memory = run.steps.tracked()
    run.rec.update(
        phase="profile",
        memory=memory,
        losses=list(run.steps.losses),
        allocator=cuda_allocator_stats(run.device),
        # where the strategy keeps this rank's parameters (CPU offload: host), from its own bookkeeping
        placement=state_placement_bytes(run.parallel.model),
    )


def profile_phase(run: RankRun) -> None:
    """Profiled steps: communication volume and overlap."""
    run.samplers.set_phase("profile")
    if not run.case.profile_steps:
        return
    trace_path = run.rec.path.parent / f"trace_rank{run.rank}.json.gz"
    with profile_steps(run.device, trace_path):
        for _ in range(run.case.profile_steps):
            run.steps.instrumented()
    parallel = run.parallel
    strategy = parallel.strategy
    gap = strategy.analytic_gap(run.case)
    profiled = analyze_profile(trace_path, run.case, strategy.sharding, parallel.params, analytic_gap=gap)
    run.rec.update(profiled=without_overlap(profiled) if run.case.emulate else profiled)


def reference_phase(run: RankRun) -> None:
    """Optional: blocks of steps, each step paired with a fixed reference step (the CI time gate)."""
    case, steps, device = run.case, run.steps, run.device
    if not case.time_blocks:
        return
    reference = ReferenceWorkload(device)
    reference.step()  # its own warm-up, untimed
    n = case.time_blocks * case.time_block_steps
    batches = iter([steps.batch(steps.next + i) for i in range(n)])
    dist.barrier()
    paired = interleaved_steps(
        lambda: steps.run(next(batches), record=False),
        reference,
        n,
        lambda: synchronize(device),
        case.time_block_steps,
    )
    run.rec.update(paired=paired)


def checkpoint_phase(run: RankRun) -> None:
    """Optional: save, load into a freshly built model and optimizer, one more step."""
    case, rank, device = run.case, run.rank, run.device
    if case.checkpoint == "none":
        return
    from fsdpbench.engine.checkpoint import run_checkpoint_phase

    run.rec.update(phase="checkpoint")
    run.samplers.set_phase("checkpoint")
    next_step = run.steps.next  # the step the uninterrupted run takes next, and the restored run too
    run.rec.update(
        checkpoint=run_checkpoint_phase(
            run.parallel,
            rebuild=lambda: build_parallel(case, device, rank),
            step=lambda p: train_step(p, rank_batch(case, rank, next_step, device)).item(),
            case_dir=run.rec.path.parent,
            rank=rank,
            device=device,
            case=case,
        )
    )


def finish(run: RankRun) -> None:
    """Samplers stopped; the harness's own figures, the timeline and the totals written."""
    case, steps = run.case, run.steps
    run.samplers.stop()
    run.rec.update(
        harness=Harness(
            bare_step_time_ms=run.bare_ms / case.bare_steps if case.bare_steps else None,
            leftovers="; ".join(instruments_left_installed()),  # "" when nothing is left
        ),
        sampled=run.samplers.columns(),
    )
    run.samplers.write_timeline(
        run.rec.path.parent / f"timeline_rank{run.rank}.parquet", case.case_id, run.rank
    )
    run.rec.update(
        losses=list(steps.losses),
        steps_total=steps.next,
        steps_wall_s=steps.wall_s,
        wall_s=time.perf_counter() - run.t_start,
    )


def _emulated_build(case: Case, device: torch.device, rank: int) -> Build:
    """An emulated rank's model: built on meta, only this rank's data materialised (engine/emulate.py)."""

    def build(mdef: ModelDef, margs: dict[str, Any], parallelize: Parallelize) -> tuple[torch.nn.Module, int]:
        model, params = build_rank_model(
            mdef,
            margs,
            parallelize,
            shard_on_meta=shards_on_meta(parallelize.strategy),
            device=device,
            seed=case.seed,
            rank=rank,
        )
        return prepare_ddp(model, case.world_size), params

    return build


def main(argv: list[str] | None = None) -> None:
    """Run one case on an external launcher (torchrun, srun): every rank calls this."""
    parser = argparse.ArgumentParser(prog="python -m fsdpbench.engine.worker", description=main.__doc__)
    parser.add_argument(
        "--case", required=True, help="case JSON file (fsdpbench run SCENARIO --export-cases DIR writes them)"
    )
    parser.add_argument("--out", required=True, help="directory for rank{R}.json")
    args = parser.parse_args(argv)
    case = Case.from_dict(json.loads(Path(args.case).read_text()))
    if case.host_tuning != NO_HOST_TUNING:  # fsdpbench's own launcher applies it (pipeline/rank_process.py)
        parser.exit(2, f"error: {args.case}: host_tuning {case.host_tuning}: run it with fsdpbench run\n")
    # this process's configuration, as fsdpbench's launcher would have given it: before torch uses a device
    os.environ.update(process_env(case))
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # srun without torchrun
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_rank(case, out)


if __name__ == "__main__":
    main()
