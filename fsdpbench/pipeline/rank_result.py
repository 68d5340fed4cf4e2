"""What one rank measured, phase by phase: the worker fills a ``RankResult`` and writes it to
``rank{R}.json`` after every phase (the launcher adds ``exit_code``); ``results`` reads it back and
turns it into the rank's columns, each record giving its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fsdpbench.metrics.timing import StepTimes
from fsdpbench.metrics.tracker import TrackedMemory

PAIRED_SERIES = ("step_ms", "ref_ms", "step_cpu_ms", "ref_cpu_ms")  # metrics.reference.interleaved_steps


@dataclass(kw_only=True, slots=True)
class Setup:
    """The setup phase: the model, the strategy, this rank's threads, and how long it took."""

    params: int  # Ψ of the whole model
    n_units: int  # FSDP units, the root included
    mode: str  # "real" or "emulated"
    threads: int
    init_pg_s: float  # from the rank's start to its process group
    setup_s: float  # from the rank's start to the optimizer built
    samplers: dict[str, str]  # per background sampler: what it samples, or why it does not

    COLUMNS: ClassVar[tuple[str, ...]] = ("params", "n_units", "threads", "init_pg_s", "setup_s")

    def to_columns(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.COLUMNS}


@dataclass(kw_only=True, slots=True)
class CheckpointRecord:
    """The checkpoint phase on this rank (fsdpbench/engine/checkpoint.py): save, load into a fresh model
    and optimizer, one more step. Host memory is RSS above the phase's baseline (sampled); device memory
    the caching allocator's peak (GPU only: on a CPU rank the device is the host, its RSS is the record)."""

    method: str
    with_optimizer: bool
    save_s: float | None = None  # wall, until this rank's files are written
    save_blocked_s: float | None = None  # wall the training loop waited (async: until staged)
    load_s: float | None = None
    bytes_written: int | None = None  # this rank's files
    files: int | None = None
    save_host_peak_bytes: int | None = None  # RSS above the baseline before the save
    load_host_peak_bytes: int | None = None
    save_device_peak_bytes: int | None = None  # allocator, GPU only
    load_device_peak_bytes: int | None = None
    state_equal: bool | None = None  # the loaded local state equals the saved one, tensor by tensor
    loss_uninterrupted: float | None = None  # the next step's loss without the round trip
    loss_after_load: float | None = None  # the same step's loss after it
    loss_equal: bool | None = None

    def to_columns(self) -> dict[str, Any]:
        from fsdpbench import schema

        return {column: getattr(self, name) for name, column in schema.CHECKPOINT_COLUMNS.items()}


_OPTIONAL = ("traceback", "failed_at", "exit_code", "losses", "steps_total", "steps_wall_s", "wall_s")


@dataclass(kw_only=True, slots=True)
class RankResult:
    """One rank of one case: its status, each phase's record, and the metric modules' columns.

    A field is None until its phase has ended (``losses`` and ``steps_wall_s``: as of the last ended
    phase); ``status``, ``phase`` and ``error`` are None only in a record the rank never wrote."""

    rank: int
    pid: int | None = None
    status: str | None = "running"  # running → ok | failed | oom (the launcher: timeout, a rank's death)
    phase: str | None = "setup"
    error: str | None = ""
    traceback: str | None = None
    failed_at: float | None = None
    exit_code: int | None = None  # the launcher's
    setup: Setup | None = None
    warmup: StepTimes | None = None
    timed: StepTimes | None = None
    losses: list[float] | None = None  # every recorded step's loss, in step order
    memory: TrackedMemory | None = None
    # columns named by the metric modules: the harness (bare loop, leftovers), the allocator, where
    # the parameters are kept, the profiled step (communication, overlap), the samplers
    metric_columns: dict[str, Any] = field(default_factory=dict)
    paired: dict[str, list[float]] = field(default_factory=dict)  # metrics.reference.interleaved_steps
    checkpoint: CheckpointRecord | None = None
    steps_total: int | None = None
    steps_wall_s: float | None = None  # time inside training steps, all phases (the rest is overhead)
    wall_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in ("rank", "pid", "status", "phase", "error")}
        out.update({k: getattr(self, k) for k in _OPTIONAL if getattr(self, k) is not None})
        if self.setup is not None:
            out.update(dataclasses.asdict(self.setup))
        if self.warmup is not None:
            times = self.warmup.times_ms
            out.update(warmup_times_ms=times, first_step_ms=times[0] if times else None)
        if self.timed is not None:
            out.update(step_times_ms=self.timed.times_ms, **self.timed.to_columns())
        if self.memory is not None:
            out["memory"] = self.memory.to_json()
        if self.metric_columns:
            out["metric_columns"] = self.metric_columns
        out.update({f"paired_{k}": v for k, v in self.paired.items()})
        if self.checkpoint is not None:
            out["checkpoint"] = dataclasses.asdict(self.checkpoint)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankResult:
        setup_names = [f.name for f in dataclasses.fields(Setup)]
        warmup, timed = data.get("warmup_times_ms"), data.get("step_times_ms")
        return cls(
            rank=data["rank"],
            **{k: data.get(k) for k in ("pid", "status", "phase", "error", *_OPTIONAL)},
            setup=Setup(**{k: data[k] for k in setup_names}) if all(k in data for k in setup_names) else None,
            warmup=StepTimes(times_ms=warmup) if warmup is not None else None,
            timed=StepTimes(times_ms=timed) if timed is not None else None,
            memory=TrackedMemory.from_json(data["memory"]) if "memory" in data else None,
            metric_columns=dict(data.get("metric_columns") or {}),
            paired={k: data[f"paired_{k}"] for k in PAIRED_SERIES if f"paired_{k}" in data},
            checkpoint=CheckpointRecord(**data["checkpoint"]) if data.get("checkpoint") else None,
        )

    def to_columns(self) -> dict[str, Any]:
        """This rank's columns (each memory column names its source); None where a phase never ran."""
        setup = self.setup.to_columns() if self.setup else dict.fromkeys(Setup.COLUMNS)
        step_times = self.timed.to_columns() if self.timed else {}
        warmup = self.warmup.times_ms if self.warmup else []
        return {
            "rank": self.rank,
            "status": self.status,
            "error": self.error,
            "phase": self.phase,
            **setup,
            "wall_s": self.wall_s,
            **{k: step_times.get(k) for k in StepTimes.COLUMNS},
            "first_step_ms": warmup[0] if warmup else None,
            "steps_wall_s": self.steps_wall_s,
            "exit_code": self.exit_code,
            "step_times_ms": self.timed.times_ms if self.timed else [],
            "warmup_times_ms": warmup,
            **{f"paired_{k}": self.paired.get(k) or [] for k in PAIRED_SERIES},
            **(self.memory or TrackedMemory()).to_columns(),
            **self.metric_columns,
            **(self.checkpoint.to_columns() if self.checkpoint else {}),
        }
