"""The ``gloo`` link: α and bus bandwidth of gloo on this machine, measured once per run.

A one-shot probe: ``world_size`` fresh CPU processes (each with the torch threads a rank of the run
gets) join a gloo group and time every collective kind the model places — all-reduce, all-gather
(``all_gather_into_tensor``), broadcast (ZeRO-1), reduce-scatter (``reduce_scatter_tensor``, which gloo
runs as a clone of the full input, an all-reduce of it and a copy of the rank's chunk: not the
all-reduce's time, 1.5 × it at 4 MB) — over sizes spanning the runs' messages, **in context**: in a
step's rhythm, not back to back. Every rank runs ``PROBE_SEQUENCE`` fixed compute bursts
(``PROBE_COMPUTE_MS`` of matmuls on its threads), then the same bursts each followed by the collective,
with no barrier in between, so the ranks drift apart and gloo's threads work on the cores the ranks
compute on, as in a step. A collective's time is the slowest rank's extra time per collective
(``in_context_time_us``), the **mean** of ``reps`` repetitions after a warm-up (a step's time is a sum
of its collectives: a sum follows the mean, not the median). The *queued* times are kept beside them,
``points_queued``: bursts of ``PROBE_SEQUENCE`` and (to 1 MB) of ``PROBE_BURST_LONG`` collectives issued
at once (asynchronously, after a barrier) and waited for together, each repetition's total (the slowest
rank's). Per kind, a burst of n takes start + n·(α + S·factor/busbw) (``_fit_bursts``): the α–β line is
what one more collective adds to a burst, for the collectives a step issues queued behind the previous
one, with no compute between them (``Link.per_kind_queued``; ZeRO-1's burst of broadcasts at the end of
its step), which gloo's two worker threads pipeline. The start (a burst's idle threads woken) is not in
it: a burst's first collective, issued after compute and timed in context, pays it. Per collective of
one burst of 8, as until 2026-11-26, every queued collective paid an eighth of a start: 38 of them in
ZeRO-1's burst of 39 broadcasts at 2 ranks, and more with every parameter of a larger model.

Per kind, a line through its (S·factor, time) points — the nccl-tests factor of comm_model.py —
gives α (intercept) and busbw (1/slope), fitted by least *relative* squares so that the small
messages, where α is everything, count as much as the large ones. A line through all the points is
the link's fallback for other kinds. The processes write nothing to the terminal: each one's file
descriptors 1 and 2 (where gloo's, torch's and kineto's C++ log lines go) are its log,
``<run dir>/comm_probe/gloo_n<N>_rank<r>.log``, as a case rank's are its ``rank<r>.log``.
The result is cached as ``<run dir>/comm_probe/gloo_n<N>.json`` with its points, so a run's
modelled figures can be traced to the measurement behind them, and re-used on resume.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fsdpbench.core.rundir import (
    make_dirs,
    make_fresh_dir,
    remove_tree,
    use_torch_cache,
    write_atomically,
)
from fsdpbench.engine.intra_op import rank_threads
from fsdpbench.hosttuning.threads import (
    bind_to_rank_cores,
    gloo_loop_idle_wanted,
    idle_gloo_loops,
    loop_state,
    pin_compute_threads,
    rank_cores,
)
from fsdpbench.pipeline.interrupts import ignore_sigint
from fsdpbench.pipeline.launch import free_port
from fsdpbench.pipeline.lifeline import die_with_parent, send_output_to
from fsdpbench.predictors.comm_model import Link, algorithm_factor

PROBE_SIZES_BYTES = (
    4 << 10,
    64 << 10,
    1 << 20,
    8 << 20,
)  # the largest long enough that bandwidth, not noise, sets the slope
PROBE_KINDS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter")
# timed queued too (bursts): the kinds a step issues behind another with no compute between them. Not
# reduce_scatter: FSDP2's blocks its caller on CPU ranks, so none waits for the one before it
PROBE_QUEUED_KINDS = ("all_reduce", "all_gather", "broadcast")
PROBE_REPS = 4  # repetitions of each sequence
PROBE_SEQUENCE = 8  # collectives per sequence, each after a compute burst
PROBE_COMPUTE_MS = 2.0  # each burst: of the order of a step's compute between two collectives
PROBE_BURST_LONG = 4 * PROBE_SEQUENCE  # queued: a long burst beside the short one (ZeRO-1's: 39)
# ... up to this size: beyond it a burst of 8 takes 20-35 ms against a start of ~1.5 ms (gloo, 8 MB, this
# project's 2-core VM), so the long one adds nothing to the fit but a second to the probe
PROBE_BURST_LONG_MAX_BYTES = 1 << 20


def in_context_time_us(
    compute_s: list[list[float]], sequence_s: list[list[float]], per_sequence: int
) -> float:
    """A collective's time as a step meets it, in µs, from each rank's repetitions (index: rank, then
    repetition): ``compute_s``, a sequence of ``per_sequence`` fixed compute bursts; ``sequence_s``,
    the same bursts each followed by the collective, no barrier between them (the ranks drift apart
    as in a step). Per repetition, the slowest rank's extra time over its bursts alone, per
    collective: what the collective added to a rank whose cores compute — the collective itself, the
    waits for a peer it brings, and what gloo's threads took from the compute. The mean over
    repetitions, not the median: a step sums its collectives."""
    return max(0.0, statistics.fmean(in_context_reps_us(compute_s, sequence_s, per_sequence)))


def in_context_reps_us(
    compute_s: list[list[float]], sequence_s: list[list[float]], per_sequence: int
) -> list[float]:
    """``in_context_time_us`` of each repetition alone, in µs (kept in the probe's cache: its spread)."""
    if not sequence_s or per_sequence < 1:
        raise ValueError("no repetitions to time")
    reps = min(len(r) for r in sequence_s + compute_s)
    extra = [max(sequence_s[r][i] - compute_s[r][i] for r in range(len(sequence_s))) for i in range(reps)]
    return [x / per_sequence * 1e6 for x in extra]


def _burst(ms: float):
    """A fixed amount of compute (matmuls on this process's torch threads) that takes about ``ms``
    alone: calibrated once, then always the same work, so that its slow-down is measurable."""
    import torch

    a = torch.randn(128, 128)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.05:
        a @ a
        n += 1
    ops = max(1, round(n * ms / 50.0))

    def work() -> None:
        for _ in range(ops):
            a @ a

    return work


def _probe_rank(
    rank: int,
    world_size: int,
    port: int,
    out_path: str,
    reps: int,
    log_path: str,
    idle_loops: bool,
    root: str | None = None,
) -> None:
    """One probe process: join the gloo group, time every (kind, size) in context and back to back;
    rank 0 writes the points. ``root``: the run directory, beneath which its files are written without
    following a link (``rundir.open_log``, ``rundir.write_atomically``)."""
    ignore_sigint()  # a Ctrl-C is the orchestrator's to answer; it kills this process
    die_with_parent()  # the fork server, which dies with the orchestrator
    send_output_to(log_path, root)  # before torch runs: its C++ side writes to fds 1 and 2
    if root is not None:  # torch's caches and temporary files in the run directory, removed after
        use_torch_cache(Path(out_path).parent)
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename
    torch.set_num_threads(rank_threads(world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    cores = rank_cores(rank, world_size)
    cores = cores if pin_compute_threads(cores) else []  # as a case's CPU rank does, after its group
    if idle_loops:  # as a case's CPU rank does when the run's policy says so
        idle_gloo_loops()
        bind_to_rank_cores(cores)
    try:
        measured = measure_in_group(reps)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        write_atomically(Path(out_path), json.dumps(measured).encode(), Path(root) if root else None)


def measure_in_group(reps: int) -> dict[str, Any] | None:
    """Time every (kind, size) in context and queued, in the default process group (every rank calls
    it); rank 0 gets {"points": [...], "points_queued": [...]}, the others None."""
    import torch.distributed as dist

    world_size, rank = dist.get_world_size(), dist.get_rank()
    work = _burst(PROBE_COMPUTE_MS)
    # this rank's repetitions per (kind, size)
    mine = [
        _time_kind_size(kind, size, reps, work, world_size)
        for kind in PROBE_KINDS
        for size in PROBE_SIZES_BYTES
    ]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return _points(mine, gathered, reps) if rank == 0 else None


def _time_kind_size(
    kind: str, size: int, reps: int, work: Callable[[], None], world_size: int
) -> dict[str, Any]:
    """This rank's ``reps`` repetitions of one collective kind and size: the bursts alone, the bursts
    each followed by the collective (a step's rhythm), and queued bursts of collectives."""
    import torch
    import torch.distributed as dist

    numel = size // 4  # float32; S is the full tensor for every kind
    full = torch.ones(numel)
    shard = torch.ones(numel // world_size)
    _collective_once(kind, full, shard)  # warm-up: connection set-up and buffers
    compute: list[float] = []
    sequence: list[float] = []
    bursts = (PROBE_SEQUENCE,) + ((PROBE_BURST_LONG,) if size <= PROBE_BURST_LONG_MAX_BYTES else ())
    bursts = bursts if kind in PROBE_QUEUED_KINDS else ()
    queued: dict[int, list[float]] = {n: [] for n in bursts}  # a burst's total time, per length
    for _ in range(reps):
        dist.barrier()  # the bursts alone
        t0 = time.perf_counter()
        for _ in range(PROBE_SEQUENCE):
            work()
        compute.append(time.perf_counter() - t0)
        dist.barrier()  # a step's rhythm: burst, collective, burst, collective, ...
        t0 = time.perf_counter()
        for _ in range(PROBE_SEQUENCE):
            work()
            _collective_once(kind, full, shard)
        sequence.append(time.perf_counter() - t0)
        for n in bursts:
            dist.barrier()  # queued: every rank issues them all at once, then waits for them all
            t0 = time.perf_counter()
            handles = [_collective_once(kind, full, shard, async_op=True) for _ in range(n)]
            for handle in handles:
                handle.wait()
            queued[n].append(time.perf_counter() - t0)
    return {"kind": kind, "bytes": numel * 4, "compute": compute, "sequence": sequence, "queued": queued}


def _points(mine: list[dict[str, Any]], gathered: list[Any], reps: int) -> dict[str, Any]:
    """Rank 0's points from every rank's repetitions: the in-context time of each (kind, size) and the
    queued bursts' totals."""
    points, queued_points = [], []
    for i, p in enumerate(mine):
        compute_s = [g[i]["compute"] for g in gathered]
        sequence_s = [g[i]["sequence"] for g in gathered]
        t = in_context_time_us(compute_s, sequence_s, PROBE_SEQUENCE)
        reps_us = in_context_reps_us(compute_s, sequence_s, PROBE_SEQUENCE)  # its spread, for the record
        points.append({"kind": p["kind"], "payload_bytes": p["bytes"], "time_us": t, "reps_us": reps_us})
        # a burst ends for all when its slowest rank's ends: per repetition, the slowest rank's total
        lengths = p["queued"].keys()
        slowest = {n: [max(g[i]["queued"][n][r] for g in gathered) for r in range(reps)] for n in lengths}
        if not lengths:
            continue
        queued_points.append(
            {
                "kind": p["kind"],
                "payload_bytes": p["bytes"],
                "burst_s": {str(n): slowest[n] for n in lengths},  # per length, each repetition's total
            }
        )
    return {"points": points, "points_queued": queued_points}


def _collective_once(kind: str, full, shard, async_op: bool = False):
    """One probed collective on the S-byte tensor ``full``; ``shard`` is its 1/world part (its work
    handle with ``async_op``)."""
    import torch.distributed as dist

    if kind == "all_reduce":
        return dist.all_reduce(full, async_op=async_op)
    if kind == "broadcast":
        return dist.broadcast(full, src=0, async_op=async_op)
    if kind == "reduce_scatter":  # gloo clones ``full``, all-reduces the clone and copies out its chunk
        return dist.reduce_scatter_tensor(shard, full, async_op=async_op)
    return dist.all_gather_into_tensor(full, shard, async_op=async_op)


def _fit_line(points: list[dict[str, Any]], world_size: int) -> tuple[float, float]:
    """(α µs, slope µs/B) of time = α + S·factor·slope, least squares weighted by 1/time² (relative
    residuals); α clipped at 0."""
    xs = [p["payload_bytes"] * algorithm_factor(p["kind"], world_size) for p in points]
    ys = [float(p["time_us"]) for p in points]
    ws = [1.0 / max(y, 1e-9) ** 2 for y in ys]
    sw = sum(ws)
    mean_x = sum(w * x for w, x in zip(ws, xs)) / sw
    mean_y = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(ws, xs))
    if sxx <= 0:
        raise ValueError("the probe needs at least two different sizes")
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(ws, xs, ys)) / sxx
    if slope <= 0:
        raise ValueError(f"probe times do not grow with size (slope {slope:.3g} µs/B): {points}")
    return max(0.0, mean_y - slope * mean_x), slope


def _per_kind(points: list[dict[str, Any]], world_size: int) -> list[tuple[str, float, float]]:
    """(kind, α µs, busbw GB/s) of every kind whose points give a line."""
    per_kind = []
    for kind in dict.fromkeys(p["kind"] for p in points):
        of_kind = [p for p in points if p["kind"] == kind]
        if len({p["payload_bytes"] for p in of_kind}) >= 2:
            try:
                k_alpha, k_slope = _fit_line(of_kind, world_size)
            except ValueError:  # its times do not grow with size (a loaded machine): the line through all
                continue
            per_kind.append((kind, k_alpha, 1.0 / k_slope / 1e3))
    return per_kind


def _fit_bursts(points: list[dict[str, Any]], world_size: int) -> tuple[float, float, float]:
    """(start µs, α µs, slope µs/B) of time of a burst = start + n·(α + S·factor·slope), through every
    burst's total (``burst_s``: per length n, per repetition), least squares weighted by 1/time² (relative
    residuals; a total is never near 0, where a difference of two totals can be). α clipped at 0."""
    import numpy as np

    rows, totals = [], []
    for p in points:
        x = p["payload_bytes"] * algorithm_factor(p["kind"], world_size)
        for n, times in p["burst_s"].items():
            for t in times:
                rows.append((1.0, int(n), int(n) * x))
                totals.append(t * 1e6)
    a, y = np.array(rows), np.array(totals)
    if len({r[1] for r in rows}) < 2 or len({r[2] / r[1] for r in rows}) < 2 or (y <= 0).any():
        raise ValueError("a burst line needs two lengths at two sizes")
    w = 1.0 / y
    (start, alpha, slope), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    if slope <= 0:
        raise ValueError(f"burst times do not grow with size (slope {slope:.3g} µs/B)")
    return float(start), max(0.0, float(alpha)), float(slope)


def _per_kind_queued(points: list[dict[str, Any]], world_size: int) -> list[tuple[str, float, float]]:
    """(kind, α µs, busbw GB/s) of a collective queued in a burst, per kind whose bursts give a line."""
    per_kind = []
    for kind in dict.fromkeys(p["kind"] for p in points):
        try:
            _, k_alpha, k_slope = _fit_bursts([p for p in points if p["kind"] == kind], world_size)
        except ValueError:
            continue  # noise over signal (a loaded machine): its queued collectives take the in-context line
        per_kind.append((kind, k_alpha, 1.0 / k_slope / 1e3))
    return per_kind


def fit_link(
    points: list[dict[str, Any]],
    world_size: int,
    name: str = "gloo",
    queued_points: list[dict[str, Any]] | None = None,
    loops_idle: bool = False,
) -> Link:
    """One α–β line per probed kind (``Link.per_kind``), and one through every point for the rest;
    ``queued_points`` (the totals of bursts issued at once) give the lines of queued collectives
    (``Link.per_kind_queued``; without them, queued collectives take the in-context lines)."""
    alpha, slope = _fit_line(points, world_size)
    per_kind = _per_kind(points, world_size)
    return Link(
        name,
        alpha_us=alpha,
        busbw_GBps=1.0 / slope / 1e3,
        source=(
            f"probed: gloo, {world_size} CPU processes on this machine, each collective timed in a "
            f"step's rhythm (after {PROBE_COMPUTE_MS:g} ms of compute, {PROBE_SEQUENCE} in a row; the "
            f"mean extra time; queued: what one more adds to a burst issued at once, "
            f"{PROBE_SEQUENCE} against {PROBE_BURST_LONG}), "
            f"one line per kind ({', '.join(k for k, _, _ in per_kind)}) over {len(points)} points"
            + (f"; gloo's loop threads {loop_state(True)}" if loops_idle else "")
        ),
        # a cache from before reduce-scatters were probed (2026-11-26): time them as gloo's all-reduce
        reduce_scatter_as_all_reduce=all(kind != "reduce_scatter" for kind, _, _ in per_kind),
        per_kind=tuple(per_kind),
        per_kind_queued=tuple(_per_kind_queued(queued_points, world_size)) if queued_points else (),
    )


def probe_log_path(log_dir: Path, world_size: int, rank: int) -> Path:
    """Where probe process ``rank`` of a ``world_size``-process probe writes its output."""
    return Path(log_dir) / f"gloo_n{world_size}_rank{rank}.log"


def run_probe(
    world_size: int,
    reps: int = PROBE_REPS,
    timeout_s: float = 120.0,
    log_dir: Path | None = None,
    root: Path | None = None,
) -> dict[str, Any]:
    """Start ``world_size`` processes, run the probe, return rank 0's points. The processes' output goes
    to ``probe_log_path(log_dir, …)`` (without ``log_dir``: nowhere), written beneath ``root`` (the run
    directory; default ``log_dir``) without following a link."""
    from fsdpbench.pipeline.launch import forkserver_context

    ctx = forkserver_context()
    root = root if root is not None else log_dir
    # rank 0's points: in the run's directory where there is one (nothing is written outside a run), in
    # a directory this process made itself
    with _points_dir(log_dir, root) as tmp:
        out = str(Path(tmp) / "points.json")
        logs = [
            str(probe_log_path(log_dir, world_size, r)) if log_dir else os.devnull for r in range(world_size)
        ]
        port = free_port()
        procs = [
            ctx.Process(
                target=_probe_rank,
                args=(r, world_size, port, out, reps, logs[r], gloo_loop_idle_wanted(), root and str(root)),
            )
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:  # past the timeout, or interrupted: the probe's processes end with it
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        if any(p.exitcode != 0 for p in procs) or not Path(out).exists():
            where = f"; their output: {Path(logs[0]).parent}" if log_dir else ""
            raise RuntimeError(f"gloo probe failed (exit codes {[p.exitcode for p in procs]}{where})")
        return json.loads(Path(out).read_text())


@contextlib.contextmanager
def _points_dir(log_dir: Path | None, root: Path | None) -> Iterator[Path]:
    """A fresh directory for rank 0's points: in ``log_dir`` beneath ``root`` (made by this process, no
    link followed: ``rundir.make_fresh_dir``), removed after; without ``log_dir``, the system's."""
    if log_dir is None or root is None:
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp)
        return
    fresh = make_fresh_dir(log_dir, root, ".points-")
    try:
        yield fresh
    finally:
        remove_tree(fresh, root)


def probe(run_dir: Path, world_size: int, reps: int = PROBE_REPS) -> dict[str, Any]:
    """The probe's result for ``world_size`` CPU ranks, from the run's cache or measured now (``reps``
    repetitions of each sequence): {"link": Link fields, "points": [...], "world_size": N}."""
    world_size = max(2, int(world_size))
    path = Path(run_dir) / "comm_probe" / f"gloo_n{world_size}.json"
    cached = None if path.parent.is_symlink() else _cached_probe(path)
    if cached is not None and cached.get("loop_threads_idle", False) == gloo_loop_idle_wanted():
        return cached  # else measured with the other loop-thread policy, or not usable: measure again
    print(f"probing gloo with {world_size} processes for the step-time model …", file=sys.stderr)
    Path(run_dir).mkdir(parents=True, exist_ok=True)  # the run's own directory (--out)
    make_dirs(path.parent, run_dir)  # a link planted as comm_probe/ is replaced, never written through
    measured = run_probe(world_size, reps, log_dir=path.parent, root=Path(run_dir))
    idle = gloo_loop_idle_wanted()
    link = fit_link(
        measured["points"], world_size, queued_points=measured.get("points_queued"), loops_idle=idle
    )
    result = {"link": link.to_dict(), "world_size": world_size, "loop_threads_idle": idle}
    result |= measured
    write_atomically(path, json.dumps(result, indent=1).encode(), Path(run_dir))
    return result


MAX_PROBE_FILE_BYTES = 1 << 20  # a probe's result is a few kB


def _cached_probe(path: Path) -> dict[str, Any] | None:
    """The run's cached probe result, or None when there is none or it is not usable (not JSON, a link,
    its link's numbers not finite and in range): a cache is measured again, never trusted."""
    from fsdpbench.core.readback import ReadBackError, read_json
    from fsdpbench.predictors.comm_model import LinkError, check_link_numbers

    if not path.exists() and not path.is_symlink():
        return None
    try:
        cached = read_json(path, MAX_PROBE_FILE_BYTES, what="gloo probe result", follow_links=False)
        link = cached["link"]
        check_link_numbers(link["alpha_us"], link["busbw_GBps"], str(path))
        for key in ("per_kind", "per_kind_queued"):
            for _, alpha, busbw in link.get(key) or ():
                check_link_numbers(alpha, busbw, f"{path}: {key}")
    except (ReadBackError, LinkError, KeyError, TypeError, ValueError, AttributeError):
        return None
    return cached if isinstance(cached, dict) else None


def gloo_link(run_dir: Path, world_size: int) -> Link:
    """The probed gloo link for ``world_size`` ranks."""
    fields = dict(probe(run_dir, world_size)["link"])
    for key in ("per_kind", "per_kind_queued"):  # JSON gave lists
        fields[key] = tuple(tuple(k) for k in fields.get(key) or ())
    return Link(**fields)


def resolve_link(spec: str, backend: str, world_size: int, run_dir: Path) -> Link:
    """The Link a --link value names for a case: 'auto' is the probed gloo link for gloo cases
    and nvlink4 for the others; 'gloo' is probed (cached in the run directory). A 1-rank case, on any
    link, has no collective that leaves its process: nothing to probe, and no link to name
    (ONE_RANK_LINK; a 1-GPU NCCL case was labelled nvlink4)."""
    from fsdpbench.predictors.comm_model import AUTO, LINK_PRESETS, ONE_RANK_LINK, parse_explicit_link

    if world_size == 1:
        return ONE_RANK_LINK
    if spec == AUTO:
        spec = "gloo" if backend == "gloo" else "nvlink4"
    if spec == "gloo":
        return gloo_link(run_dir, world_size)
    if spec in LINK_PRESETS:
        return LINK_PRESETS[spec]
    return parse_explicit_link(spec)
