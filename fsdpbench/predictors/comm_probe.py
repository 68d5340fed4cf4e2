"""The ``gloo`` link: α and bus bandwidth of gloo on this machine, measured once per run.

A one-shot probe: ``world_size`` fresh CPU processes join a gloo group and time all-reduce and
all-gather (``all_gather_into_tensor``) over a few sizes, each the median of ``reps`` calls after
a warm-up. A least-squares line through every (S·factor, time) point — the nccl-tests factor of
comm_model.py, so one line fits both kinds — gives α (intercept) and busbw (1/slope).
The result is cached as ``<run dir>/comm_probe/gloo_n<N>.json`` with its points, so a run's
modelled figures can be traced to the measurement behind them, and re-used on resume.

The probe measures gloo with nothing else running; in a run the same cores also compute (the
residual this leaves is discussed in docs/step-time-model.md).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fsdpbench.pipeline.launch import free_port
from fsdpbench.predictors.comm_model import Link, algorithm_factor

PROBE_SIZES_BYTES = (
    4 << 10,
    64 << 10,
    1 << 20,
    8 << 20,
)  # the largest long enough that bandwidth, not noise, sets the slope
PROBE_KINDS = ("all_reduce", "all_gather")
PROBE_REPS = 8


def _probe_rank(rank: int, world_size: int, port: int, out_path: str, reps: int) -> None:
    """One probe process: join the gloo group, time every (kind, size), rank 0 writes the medians."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    points = []
    try:
        for kind in PROBE_KINDS:
            for size in PROBE_SIZES_BYTES:
                numel = size // 4  # float32; S is the full tensor for both kinds
                full = torch.ones(numel)
                shard = torch.ones(numel // world_size)
                _collective_once(kind, full, shard)  # warm-up: connection set-up and buffers
                times = []
                for _ in range(reps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    _collective_once(kind, full, shard)
                    times.append((time.perf_counter() - t0) * 1e6)
                points.append({"kind": kind, "payload_bytes": numel * 4, "time_us": statistics.median(times)})
        dist.barrier()
        overhead_us = _profiler_overhead_us()  # every rank at once: the run's contention for cores
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps({"points": points, "profiler_overhead_us_per_op": overhead_us}))


def _collective_once(kind: str, full, shard) -> None:
    """One probed collective on the S-byte tensor ``full``; ``shard`` is its 1/world part."""
    import torch.distributed as dist

    if kind == "all_reduce":
        dist.all_reduce(full)
    else:
        dist.all_gather_into_tensor(full, shard)


def _profiler_overhead_us(n_ops: int = 2000) -> float:
    """What torch.profiler (as the worker runs it, record_shapes=True) adds per recorded aten op:
    the same tiny ops timed bare and profiled (median of 3 each), divided by their count."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(16)

    def ops() -> float:
        t0 = time.perf_counter()
        for _ in range(n_ops):
            x.add(1.0)
        return (time.perf_counter() - t0) * 1e6

    ops()
    bare = statistics.median(ops() for _ in range(3))
    profiled = []
    for _ in range(3):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True):
            profiled.append(ops())
    return max(0.0, (statistics.median(profiled) - bare) / n_ops)


def fit_link(points: list[dict[str, Any]], world_size: int, name: str = "gloo") -> Link:
    """Least squares time = α + S·factor/busbw over the points; α clipped at 0."""
    xs = [p["payload_bytes"] * algorithm_factor(p["kind"], world_size) for p in points]
    ys = [float(p["time_us"]) for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx <= 0:
        raise ValueError("the probe needs at least two different sizes")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx  # µs per byte
    alpha = max(0.0, mean_y - slope * mean_x)
    if slope <= 0:
        raise ValueError(f"probe times do not grow with size (slope {slope:.3g} µs/B): {points}")
    return Link(
        name,
        alpha_us=alpha,
        busbw_GBps=1.0 / slope / 1e3,
        source=(
            f"probed: gloo, {world_size} CPU processes on this machine, "
            f"least squares over {len(points)} points"
        ),
        reduce_scatter_as_all_reduce=True,
    )


def run_probe(world_size: int, reps: int = PROBE_REPS, timeout_s: float = 120.0) -> dict[str, Any]:
    """Start ``world_size`` processes, run the probe, return rank 0's points and profiler overhead."""
    from multiprocessing import get_context

    ctx = get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "points.json")
        port = free_port()
        procs = [
            ctx.Process(target=_probe_rank, args=(r, world_size, port, out, reps)) for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if any(p.exitcode != 0 for p in procs) or not Path(out).exists():
            raise RuntimeError(f"gloo probe failed (exit codes {[p.exitcode for p in procs]})")
        return json.loads(Path(out).read_text())


def probe(run_dir: Path, world_size: int) -> dict[str, Any]:
    """The probe's result for ``world_size`` CPU ranks, from the run's cache or measured now:
    {"link": Link fields, "profiler_overhead_us_per_op": float, "points": [...], "world_size": N}."""
    world_size = max(2, int(world_size))
    path = Path(run_dir) / "comm_probe" / f"gloo_n{world_size}.json"
    if path.exists():
        return json.loads(path.read_text())
    print(f"probing gloo with {world_size} processes for the step-time model …", file=sys.stderr)
    measured = run_probe(world_size)
    link = fit_link(measured["points"], world_size)
    result = {"link": link.to_dict(), "world_size": world_size, **measured}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    return result


def gloo_link(run_dir: Path, world_size: int) -> Link:
    """The probed gloo link for ``world_size`` ranks."""
    return Link(**probe(run_dir, world_size)["link"])


def profiler_overhead_us(run_dir: Path, world_size: int) -> float:
    """µs the profiler adds per recorded op on this machine with ``world_size`` ranks running."""
    return float(probe(run_dir, world_size)["profiler_overhead_us_per_op"])


def resolve_link(spec: str, backend: str, world_size: int, run_dir: Path) -> Link:
    """The Link a --link value names for a case: 'auto' is the probed gloo link for gloo cases
    and nvlink4 for the others; 'gloo' is probed (cached in the run directory)."""
    from fsdpbench.predictors.comm_model import AUTO, LINK_PRESETS, parse_explicit_link

    if spec == AUTO:
        spec = "gloo" if backend == "gloo" else "nvlink4"
    if spec == "gloo":
        return gloo_link(run_dir, world_size)
    if spec in LINK_PRESETS:
        return LINK_PRESETS[spec]
    return parse_explicit_link(spec)
