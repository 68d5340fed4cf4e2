"""The worker's instruments: background memory samplers across a case, and the profiled step
(Chrome trace → communication volume per collective and communication/computation overlap)."""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fsdpbench.core.case import Case
from fsdpbench.core.precision import Precision
from fsdpbench.core.rundir import create_new, make_fresh_dir, remove_tree
from fsdpbench.core.schema import (
    COMM_BACKEND_BYTES,
    COMM_BYTES,
    COMM_COUNT,
    COMM_PATTERN,
    COMM_PRED,
    COMM_PRED_NOTE,
    COMM_PRED_TOTAL,
    COMM_TOTAL,
    OVERLAP_COMM,
    OVERLAP_COMPUTE,
    OVERLAP_EXPOSED,
    OVERLAP_NOTE,
    OVERLAP_RATIO,
    RANK,
    SAMPLED_COUNT,
    SAMPLED_PEAK,
    SAMPLED_PEAK_CASE,
)
from fsdpbench.metrics.harness import request_cupti_teardown
from fsdpbench.metrics.sampler import BackgroundSampler
from fsdpbench.strategies.base import Sharding

# phases that are steady-state steps (the optimizer state exists, no profiler running)
STEADY_PHASES = ("timed", "memory")


class Samplers:
    """RSS always (host memory of this rank); NVML on CUDA devices. Never raises."""

    def __init__(self, case: Case, device: torch.device, local_rank: int) -> None:
        from fsdpbench.metrics.nvml import nvml_sampler
        from fsdpbench.metrics.rss import rss_sampler

        self.status: dict[str, str] = {}
        self.samplers: dict[str, BackgroundSampler] = {"rss": rss_sampler(case.nvml_interval_s)}
        self.status["rss"] = "sampled /proc/self/statm"
        if device.type == "cuda":
            sampler, reason = nvml_sampler(local_rank, case.nvml_interval_s)
            self.status["nvml"] = reason
            if sampler is not None:
                self.samplers["nvml"] = sampler
        else:
            self.status["nvml"] = "not sampled: CPU ranks have no GPU memory"
        for sampler in self.samplers.values():
            sampler.start()

    def set_phase(self, phase: str) -> None:
        for sampler in self.samplers.values():
            sampler.set_phase(phase)

    def stop(self) -> None:
        for sampler in self.samplers.values():
            sampler.stop()

    def columns(self) -> dict[str, Any]:
        """mem_<source>_peak_bytes (steady-state steps) and mem_<source>_peak_case_bytes (whole case)."""
        out: dict[str, Any] = {}
        for name, sampler in self.samplers.items():
            by_phase = sampler.peak_bytes_by_phase()
            steady = [by_phase[p] for p in STEADY_PHASES if p in by_phase]
            out[SAMPLED_PEAK.of(name)] = max(steady) if steady else None
            out[SAMPLED_PEAK_CASE.of(name)] = sampler.peak_bytes
            out[SAMPLED_COUNT.of(name)] = len(sampler.samples)
        return out

    def write_timeline(self, path: Path, case_id: str, rank: int) -> None:
        import pandas as pd

        frames = [s.to_frame() for s in self.samplers.values()]
        frames = [f for f in frames if not f.empty]
        if not frames:
            return
        frame = pd.concat(frames, ignore_index=True)
        frame.insert(0, RANK, rank)
        frame.insert(0, "case_id", case_id)
        # opened here, not by pyarrow (which would encode the path as UTF-8, which it need not be), and
        # never through a link planted at its name (rundir.create_new)
        with os.fdopen(create_new(path, Path(path).parent), "wb") as file:
            frame.to_parquet(file, index=False)


@contextlib.contextmanager
def profile_steps(device: torch.device, trace_path: Path) -> Iterator[None]:
    """torch.profiler over the enclosed steps, exported as a gzipped Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        request_cupti_teardown()  # else CUPTI stays attached and slows every later step
    with profile(activities=activities, record_shapes=True) as prof:
        yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    export_gzipped_trace(prof, trace_path)


# zlib's default level 6: a tiny case's 1.45 MB trace in 8 ms (93 KB); level 9 took 36 ms for 81 KB
TRACE_GZIP_LEVEL = 6


def export_gzipped_trace(prof: Any, trace_path: Path) -> None:
    """``prof``'s Chrome trace at ``trace_path`` (.json.gz), by way of a plain JSON file beside it.
    ``export_chrome_trace`` with a .gz path writes its JSON to the system's temporary directory, outside
    the run, and gzips it a line at a time: 0.075 s of a tiny case's rank (2-core CPU, 47,775 lines),
    where one pass over the file takes 0.008 s. torch opens the plain file by its name: it is written in a
    directory this process made itself (``rundir.make_fresh_dir``), and the trace is created
    ``O_EXCL | O_NOFOLLOW`` (``rundir.create_new``), so neither is written through a planted link."""
    trace_path = Path(trace_path)
    fresh = make_fresh_dir(trace_path.parent, trace_path.parent, ".trace-")
    plain = fresh / "trace.partial"  # not .json: never read as a trace
    try:
        prof.export_chrome_trace(str(plain))  # a path without .gz: torch writes it there, as it is
        with (
            open(plain, "rb") as src,
            os.fdopen(create_new(trace_path, trace_path.parent), "wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=TRACE_GZIP_LEVEL) as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
    finally:
        remove_tree(fresh, trace_path.parent)


def analyze_profile(
    trace_path: Path, case: Case, sharding: Sharding, n_params: int, *, analytic_gap: str | None = None
) -> dict[str, Any]:
    """comm_<kind>_{count,bytes} per step (measured and analytic: none where the strategy says the
    analytic models have no term for the case, ``analytic_gap``) and overlap_* from the trace."""
    from fsdpbench.metrics.bandwidth import bandwidth_by_kind
    from fsdpbench.metrics.comm import collective_records, collectives_from_trace
    from fsdpbench.metrics.overlap import analyze_trace
    from fsdpbench.metrics.trace import Trace

    trace = Trace.load(trace_path)  # read once: volume, bandwidth and overlap read the same object
    shard, group = shard_group_sizes(case, sharding)
    comm = collectives_from_trace(trace, steps=max(1, case.profile_steps), group_size=group)
    out: dict[str, Any] = {}
    for row in comm.itertuples():
        out[COMM_COUNT.of(row.kind)] = row.count
        out[COMM_BYTES.of(row.kind)] = row.sent_bytes
        out[COMM_BACKEND_BYTES.of(row.kind)] = row.backend_sent_bytes
    out[COMM_TOTAL] = float(comm["sent_bytes"].sum())
    records = collective_records(trace, group_size=group)
    out.update(bandwidth_by_kind(records, trace, backend=case.backend, steps=max(1, case.profile_steps)))
    out.update(_analytic_comm_columns(case, sharding, n_params, shard, analytic_gap))
    out[COMM_PATTERN] = sharding.comm_pattern()
    stats = analyze_trace(trace, case.backend)
    out[OVERLAP_COMM] = stats["comm_us"] / 1e3
    out[OVERLAP_COMPUTE] = stats["compute_us"] / 1e3
    out[OVERLAP_EXPOSED] = stats["exposed_comm_us"] / 1e3
    out[OVERLAP_RATIO] = stats[OVERLAP_RATIO]
    out[OVERLAP_NOTE] = stats.get("note", "")
    if case.world_size == 1:
        # a 1-rank "collective" is a local copy: there is nothing to hide, so no ratio to report
        out[OVERLAP_RATIO] = None
        out[OVERLAP_NOTE] = "world_size 1: no communication between ranks"
    return out


def _analytic_comm_columns(
    case: Case, sharding: Sharding, n_params: int, shard: int | None, analytic_gap: str | None
) -> dict[str, Any]:
    """comm_pred_<kind>_bytes and comm_pred_total_bytes, or comm_pred_note saying why there are none."""
    from fsdpbench.metrics.comm import analytic_comm_bytes

    if analytic_gap is not None:
        return {COMM_PRED_NOTE: f"no term for {analytic_gap}"}
    p_bytes, g_bytes = _comm_dtype_bytes(case.precision_spec, sharding)
    try:
        pred = analytic_comm_bytes(
            sharding,
            n_params * p_bytes,
            case.world_size,
            grad_bytes_total=n_params * g_bytes,
            shard_size=shard,
        )
    except ValueError as exc:
        return {COMM_PRED_NOTE: str(exc)}
    return {**{COMM_PRED.of(k): v for k, v in pred.items()}, COMM_PRED_TOTAL: float(sum(pred.values()))}


def shard_group_sizes(case: Case, sharding: Sharding) -> tuple[int | None, int | None]:
    """(shard group size, replicate group size) of a sharding over a shard group (HSDP), else
    (None, None): the trace's all-reduces run over the replicate group, which the trace does not name."""
    if not sharding.over_shard_group:
        return None, None
    shard = case.shard_group_size
    return shard, case.world_size // shard


def _comm_dtype_bytes(precision: Precision, sharding: Sharding) -> tuple[int, int]:
    """Bytes per element of communicated params and grads: FSDP gathers in param_dtype, reduces in
    reduce_dtype; DDP (autocast) all-reduces fp32 grads unless compressed ('-lowreduce')."""
    p = precision.unsharded_bytes if sharding.params else 4
    return p, precision.reduce_bytes
