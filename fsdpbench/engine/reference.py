"""Step time as a ratio to a fixed reference workload run in the same processes, step by step.

A shared machine's load moves a case's step time by 2x between runs; it moves a workload that
runs in the same rank processes, on the same threads, a few milliseconds later, by nearly the
same factor. So each block alternates one training step and one reference step, ``k`` times,
and yields one sample: (sum of the k step times) / (sum of the k reference times). Blocks are
spread over the case's last phase; ``fsdpbench regress`` compares the samples' distribution with
the baseline's (a rank-sum test plus a minimum effect, docs/ci.md).

The reference is a fixed data-parallel step (``ReferenceWorkload``) over the case's process group,
so it uses the same compute threads and the same communication backend as the case, and it is
identical for every case, model and fsdpbench version (changing it invalidates every baseline's
samples: ``REFERENCE_VERSION``).

On CPU ranks the samples are ratios of *work CPU time* (``metrics.cpu_clock.WorkClock``: every thread
of the rank process but gloo's TCP loop threads): a rank that the machine's other processes preempt,
or that waits for a preempted peer, loses wall time but not CPU time, so CPU time moves far less with
load; what load still does to it (shared caches, hyper-threads) it does to the reference too. The
loop threads' spin is left out because it is not work: it grows with the load and with the number of
collectives in a step, which a step and the reference do not share (docs/ci.md). On GPUs the ratio is
of wall time (GPU work is asynchronous to the CPU, and a GPU is not shared the way a runner's cores are).

Each block also records how busy the machine was (``metrics.cpu_clock.MachineLoad``): the share of
the cores that every process used, and the share this rank used, so that the gate can tell the load
of other processes apart from the case's own (``other_load_share``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdpbench.core.case import Case
from fsdpbench.core.schema import PAIRED
from fsdpbench.metrics.cpu_clock import MachineLoad, WorkClock

if TYPE_CHECKING:
    import torch

# torch is imported where the workload runs, in a rank: the samples' arithmetic below is read by
# `regress` and `report` (through store/results.py), which need no torch

# 2: work CPU time (gloo's loop threads left out), the samples of a baseline kept by launch
REFERENCE_VERSION = 2
_REFERENCE_CASE = Case(model="decoder-tiny", batch_size=4, seq_len=64, seed=0)  # fixed: never the case's


class ReferenceWorkload:
    """A fixed data-parallel step on this rank's device: forward and backward of decoder-tiny on a
    fixed batch, then one all-reduce of the flattened gradients (what DDP does, in one bucket).

    A tiny decoder rather than one big matmul, so that it has the op mix of a training step
    (hundreds of small kernels, the dispatcher, Python), which a busy machine slows as it slows the
    case's steps; it does not update its weights, so every reference step does the same work."""

    def __init__(self, device: torch.device) -> None:
        import torch

        from fsdpbench.engine.step import rank_batch
        from fsdpbench.models import resolve_model

        mdef, margs = resolve_model(_REFERENCE_CASE.model, _REFERENCE_CASE.model_args)
        torch.manual_seed(_REFERENCE_CASE.seed)
        with torch.device(device):
            self.model = mdef.build(**margs)
        self.loss = mdef.loss
        self.x, self.y = rank_batch(_REFERENCE_CASE, 0, 0, device)

    def step(self) -> None:
        import torch
        import torch.distributed as dist

        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(self.loss(self.model(self.x), self.y), params)
        flat = torch.cat([g.flatten() for g in grads])
        if dist.is_initialized():
            dist.all_reduce(flat)


def interleaved_steps(
    train_step: Callable[[], None],
    reference: ReferenceWorkload,
    n: int,
    synchronize: Callable[[], None],
    steps_per_block: int = 1,
) -> dict[str, list[float]]:
    """``n`` training steps, each followed by a reference step: this rank's wall and work CPU time of each,
    and the CPU time of the gloo loop threads it leaves out (ms); per block of ``steps_per_block`` pairs,
    the machine's busy share of its cores and this rank's.

    Work CPU time is this process's, all threads but gloo's loop threads (``WorkClock``): the work
    done, which a busy machine does not stretch the way it stretches wall time (a preempted rank, a
    peer waiting for it), nor the way it stretches the loop threads' spin."""
    out: dict[str, list[float]] = {
        "step_ms": [],
        "ref_ms": [],
        "step_cpu_ms": [],
        "ref_cpu_ms": [],
        "step_spin_ms": [],
        "ref_spin_ms": [],
        "block_busy_share": [],
        "block_own_share": [],
    }
    clock, load = WorkClock(), MachineLoad()
    k = max(1, steps_per_block)
    for i in range(n):
        if i % k == 0:
            block_start = load.read()
        for name, work in (("step", train_step), ("ref", reference.step)):
            synchronize()
            t0, s0, c0 = time.perf_counter(), clock.spin(), clock()
            work()
            synchronize()
            out[f"{name}_ms"].append((time.perf_counter() - t0) * 1e3)
            out[f"{name}_cpu_ms"].append((clock() - c0) * 1e3)
            out[f"{name}_spin_ms"].append((clock.spin() - s0) * 1e3)
        if i % k == k - 1 or i == n - 1:
            busy, own = load.shares(block_start, load.read())
            if busy is not None:  # unknown off Linux: then no block has it
                out["block_busy_share"].append(busy)
            out["block_own_share"].append(own)
    return out


def ratio_series(rank: dict, device: str) -> tuple[list[float], list[float]]:
    """The (step, reference) times that the ratio uses for this device: CPU time on CPUs, wall on GPUs."""
    suffix = "cpu_ms" if device == "cpu" else "ms"
    return rank.get(PAIRED.of(f"step_{suffix}")) or [], rank.get(PAIRED.of(f"ref_{suffix}")) or []


def block_ratios(
    step_ms_by_rank: list[list[float]], ref_ms_by_rank: list[list[float]], steps_per_block: int
) -> list[float]:
    """One sample per block of ``steps_per_block`` pairs: the summed step time over the summed reference time.

    Per pair, the slowest rank's time, as for ``case_step_time_ms``: the collectives make every rank
    wait for it."""
    n = min((len(x) for x in (*step_ms_by_rank, *ref_ms_by_rank)), default=0)
    step = [max(r[i] for r in step_ms_by_rank) for i in range(n)]
    ref = [max(r[i] for r in ref_ms_by_rank) for i in range(n)]
    k = max(1, steps_per_block)
    return [
        sum(step[b : b + k]) / sum(ref[b : b + k]) for b in range(0, n - k + 1, k) if sum(ref[b : b + k]) > 0
    ]


def other_load_share(ranks: list[dict], device: str) -> float | None:
    """The share of the machine's cores that other processes kept busy during the reference blocks: per
    block, the machine's busy share (the mean of what its ranks read) less every rank's own share; the
    median block's. None for GPU ranks (their ratio is of wall time, judged as it is) and where a rank did
    not read the machine's load (not Linux). All ranks of a CPU case run on one machine."""
    if device != "cpu" or not ranks:
        return None
    busy = [rank.get(PAIRED.of("block_busy_share")) or [] for rank in ranks]
    own = [rank.get(PAIRED.of("block_own_share")) or [] for rank in ranks]
    n = min(len(x) for x in (*busy, *own))
    if not n:
        return None
    other = [sum(b[i] for b in busy) / len(busy) - sum(o[i] for o in own) for i in range(n)]
    return max(0.0, statistics.median(other))
