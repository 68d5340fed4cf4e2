"""What one rank measured, phase by phase: the worker fills a ``RankResult`` and writes it to
``rank{R}.json`` after every phase (the launcher adds ``exit_code``); ``results`` reads it back and
turns it into the rank's columns, each record giving its own.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from fsdpbench.core.readback import ReadBackError, read_json
from fsdpbench.core.schema import (
    BARE_STEP_TIME,
    CORES,
    CPUS,
    ERROR,
    EXIT_CODE,
    FAILED,
    FIRST_STEP,
    GLOO_LOOPS_IDLE,
    GLOO_THREADS_BOUND,
    HARNESS_LEFTOVERS,
    INIT_PG_S,
    LOSSES,
    N_UNITS,
    OOM,
    PAIRED,
    PHASE,
    RANK,
    RUNNING,
    SETUP_S,
    STATUS,
    STATUSES,
    STEP_CPU_SHARE,
    STEP_CPU_TIMES,
    STEP_TIMES,
    STEPS_WALL_S,
    THREADS,
    WALL_S,
    WARMUP_TIMES,
)
from fsdpbench.metrics.timing import StepTimes
from fsdpbench.metrics.tracker import TrackedMemory

PAIRED_SERIES = PAIRED.members  # metrics.reference.interleaved_steps
NO_RESULT = "no result written"
# a rank's exit code when the disk had no room even for the record of its failure (ENOSPC's number)
NO_SPACE_EXIT = 28
MAX_RANK_FILE_BYTES = 64 << 20  # a rank file holds per-step lists, not megabytes of them


def rank_file(rank: int) -> str:
    """A rank's record in its case directory."""
    return f"rank{rank}.json"


class RankFileError(ValueError):
    """A rank file that is not a rank record: names the file and the field."""


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
    cores: str = ""  # the cores its compute threads are bound to, "0" or "0,1" ("" unbound)
    gloo_loops_idle: int = 0  # its gloo TCP loop threads put under SCHED_IDLE (hosttuning/threads.py)
    gloo_threads_bound: int = 0  # its default group's gloo threads bound to its cores (hosttuning/threads.py)
    cpus: int = 0  # the logical CPUs its process may run on (0: not recorded)

    COLUMNS: ClassVar[tuple[str, ...]] = (
        "params",
        N_UNITS,
        THREADS,
        CORES,
        CPUS,
        GLOO_LOOPS_IDLE,
        GLOO_THREADS_BOUND,
        INIT_PG_S,
        SETUP_S,
    )

    def to_columns(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.COLUMNS}


@dataclass(kw_only=True, slots=True)
class Harness:
    """The harness measuring itself (docs/harness-overhead.md): the bare loop's step time and what the
    instruments left installed when the rank finished."""

    bare_step_time_ms: float | None = None  # the bare loop (``bare_steps``), no instrument
    leftovers: str | None = None  # "" when nothing is left

    def to_columns(self) -> dict[str, Any]:
        columns: dict[str, Any] = {HARNESS_LEFTOVERS: self.leftovers}
        if self.bare_step_time_ms is not None:
            columns[BARE_STEP_TIME] = self.bare_step_time_ms
        return columns


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
        from fsdpbench.core import schema

        return {column: getattr(self, name) for name, column in schema.CHECKPOINT_COLUMNS.items()}


_SOURCES = ("allocator", "placement", "profiled", "sampled")  # column records, one per measuring module
_HEAD = (RANK, "pid", STATUS, PHASE, ERROR)  # always in the file
_OPTIONAL = ("traceback", "failed_at", EXIT_CODE, LOSSES, "steps_total", STEPS_WALL_S, WALL_S)


@dataclass(kw_only=True, slots=True)
class RankResult:
    """One rank of one case: its status, each phase's record, and the metric modules' columns.

    A field is None until its phase has ended (``losses`` and ``steps_wall_s``: as of the last ended
    phase); ``status``, ``phase`` and ``error`` are None only in a record the rank never wrote."""

    rank: int
    pid: int | None = None
    status: str | None = RUNNING  # running → ok | failed | oom (the launcher: timeout, a rank's death)
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
    # each source's own columns, named by the module that measures them (core/schema.py declares each)
    allocator: dict[str, int] = field(default_factory=dict)  # metrics.allocator: the CUDA caching allocator
    placement: dict[str, int] = field(default_factory=dict)  # engine.knobs: where the parameters are kept
    profiled: dict[str, Any] = field(default_factory=dict)  # metrics.profiled: communication, overlap
    sampled: dict[str, Any] = field(default_factory=dict)  # metrics.samplers: RSS, NVML
    harness: Harness | None = None
    paired: dict[str, list[float]] = field(default_factory=dict)  # metrics.reference.interleaved_steps
    checkpoint: CheckpointRecord | None = None
    steps_total: int | None = None
    steps_wall_s: float | None = None  # time inside training steps, all phases (the rest is overhead)
    wall_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in _HEAD}
        out.update({k: getattr(self, k) for k in _OPTIONAL if getattr(self, k) is not None})
        if self.setup is not None:
            out.update(dataclasses.asdict(self.setup))
        if self.warmup is not None:
            times = self.warmup.times_ms
            out.update({WARMUP_TIMES: times, FIRST_STEP: times[0] if times else None})
        if self.timed is not None:
            out.update({STEP_TIMES: self.timed.times_ms, **self.timed.to_columns()})
            if self.timed.cpu_ms:
                out[STEP_CPU_TIMES] = self.timed.cpu_ms
        if self.memory is not None:
            out["memory"] = self.memory.to_json()
        for source in _SOURCES:
            if getattr(self, source):
                out[source] = getattr(self, source)
        if self.harness is not None:
            out["harness"] = dataclasses.asdict(self.harness)
        out.update({PAIRED.of(k): v for k, v in self.paired.items()})
        if self.checkpoint is not None:
            out["checkpoint"] = dataclasses.asdict(self.checkpoint)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankResult:
        warmup, timed = data.get(WARMUP_TIMES), data.get(STEP_TIMES)
        return cls(
            rank=data[RANK],
            **{k: data.get(k) for k in (*_HEAD[1:], *_OPTIONAL)},
            setup=_setup_from_json(data),
            warmup=StepTimes(times_ms=warmup) if warmup is not None else None,
            timed=StepTimes(times_ms=timed, cpu_ms=list(data.get(STEP_CPU_TIMES) or []))
            if timed is not None
            else None,
            memory=TrackedMemory.from_json(data["memory"]) if "memory" in data else None,
            allocator=dict(data.get("allocator") or {}),
            placement=dict(data.get("placement") or {}),
            profiled=dict(data.get("profiled") or {}),
            sampled=dict(data.get("sampled") or {}),
            harness=Harness(**data["harness"]) if data.get("harness") else None,
            paired={k: data[PAIRED.of(k)] for k in PAIRED_SERIES if PAIRED.of(k) in data},
            checkpoint=_checkpoint_from_json(data),
        )

    def to_columns(self) -> dict[str, Any]:
        """This rank's columns (each memory column names its source); None where a phase never ran."""
        setup = self.setup.to_columns() if self.setup else dict.fromkeys(Setup.COLUMNS)
        step_times = self.timed.to_columns() if self.timed else {}
        warmup = self.warmup.times_ms if self.warmup else []
        return {
            RANK: self.rank,
            STATUS: self.status,
            ERROR: self.error,
            PHASE: self.phase,
            **setup,
            WALL_S: self.wall_s,
            **{k: step_times.get(k) for k in StepTimes.COLUMNS},
            STEP_CPU_SHARE: step_times.get(STEP_CPU_SHARE),
            FIRST_STEP: warmup[0] if warmup else None,
            STEPS_WALL_S: self.steps_wall_s,
            EXIT_CODE: self.exit_code,
            STEP_TIMES: self.timed.times_ms if self.timed else [],
            STEP_CPU_TIMES: self.timed.cpu_ms if self.timed else [],
            WARMUP_TIMES: warmup,
            **{PAIRED.of(k): self.paired.get(k) or [] for k in PAIRED_SERIES},
            **(self.memory or TrackedMemory()).to_columns(),
            **self.allocator,
            **self.placement,
            **self.profiled,
            **self.sampled,
            **(self.harness.to_columns() if self.harness else {}),
            **(self.checkpoint.to_columns() if self.checkpoint else {}),
        }

    # ---- the record's state, as the launcher and the runner ask it ----------------------------------------
    @property
    def ended(self) -> bool:
        """The rank recorded how it ended (ok, failed, oom): not still running, not silent."""
        return self.status not in (None, RUNNING)

    @property
    def failed_itself(self) -> bool:
        """The rank recorded its own failure (a Python error, an out-of-memory error)."""
        return self.status in (FAILED, OOM)

    def where(self) -> str:
        """'rank R in PHASE: ERROR', the one line a failure is reported with."""
        return f"rank {self.rank} in {self.phase}: {self.error or NO_RESULT}"

    def step_time_ms(self) -> float | None:
        """The median of the timed steps (None before the timed phase ended)."""
        return self.timed.to_columns()[StepTimes.COLUMNS[0]] if self.timed and self.timed.times_ms else None

    # ---- the file -----------------------------------------------------------------------------------------
    @classmethod
    def missing(cls, rank: int, error: str = NO_RESULT) -> RankResult:
        """The record of a rank that wrote nothing usable."""
        return cls(rank=rank, status=None, phase="start", error=error)

    @classmethod
    def read(cls, path: Path, rank: int) -> RankResult:
        """``rank{R}.json``, checked: a missing, unreadable or malformed file is the record of a rank that
        wrote nothing usable, its error naming the file and the field (a rank file is input from a
        stranger: another run, a crashed rank, a hand edit)."""
        try:
            return cls.from_json(_checked_rank_json(path, rank))
        except FileNotFoundError:
            return cls.missing(rank)
        except OSError as exc:
            return cls.missing(rank, f"{path.name}: unreadable ({exc.strerror or exc})")
        except RankFileError as exc:
            return cls.missing(rank, str(exc))
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            return cls.missing(rank, f"{path.name}: not a rank record ({type(exc).__name__}: {exc})")


_TYPES: dict[str, tuple[type, ...]] = {
    "pid": (int,),
    STATUS: (str,),
    PHASE: (str,),
    ERROR: (str,),
    "traceback": (str,),
    "failed_at": (int, float),
    EXIT_CODE: (int,),
    LOSSES: (list,),
    "steps_total": (int,),
    STEPS_WALL_S: (int, float),
    WALL_S: (int, float),
    WARMUP_TIMES: (list,),
    STEP_TIMES: (list,),
    STEP_CPU_TIMES: (list,),
    "memory": (dict,),
    **dict.fromkeys(_SOURCES, (dict,)),
    "harness": (dict,),
    "checkpoint": (dict,),
    CORES: (str,),
    CPUS: (int,),
    GLOO_LOOPS_IDLE: (int,),
    GLOO_THREADS_BOUND: (int,),
}


def _setup_from_json(data: dict[str, Any]) -> Setup | None:
    """The setup record, once every field it requires was written (the rest: if written)."""
    fields = dataclasses.fields(Setup)
    names = [f.name for f in fields if f.default is dataclasses.MISSING]
    names += [f.name for f in fields if f.default is not dataclasses.MISSING and f.name in data]
    return Setup(**{k: data[k] for k in names}) if all(k in data for k in names) else None


def _checkpoint_from_json(data: dict[str, Any]) -> CheckpointRecord | None:
    return CheckpointRecord(**data["checkpoint"]) if data.get("checkpoint") else None


def _checked_rank_json(path: Path, rank: int) -> dict[str, Any]:
    """The rank file's JSON object, its fields of the right types and its numbers finite."""
    if path.is_symlink():
        raise RankFileError(f"{path.name}: a symbolic link, not a rank file")
    if not path.exists():
        raise FileNotFoundError(path)
    try:
        data = read_json(path, MAX_RANK_FILE_BYTES, what="rank file", follow_links=False)
    except ReadBackError as exc:
        raise RankFileError(str(exc).replace(str(path), path.name, 1)) from None
    if not isinstance(data, dict):
        raise RankFileError(f"{path.name}: a JSON object expected, got {type(data).__name__}")
    _check_fields(path, data, rank)
    return data


def _check_fields(path: Path, data: dict[str, Any], rank: int) -> None:
    """The rank file's fields: its rank, each known field of its type, times finite and ≥ 0."""
    if data.get(RANK) != rank or isinstance(data.get(RANK), bool):
        raise RankFileError(f"{path.name}: field {RANK!r} is {data.get(RANK)!r}, expected {rank}")
    for name, types in _TYPES.items():
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise RankFileError(f"{path.name}: field {name!r} has type {type(value).__name__}")
    if data.get(STATUS) not in (None, RUNNING, *STATUSES):
        raise RankFileError(f"{path.name}: field {STATUS!r} is {data.get(STATUS)!r}")
    for name in (LOSSES, WARMUP_TIMES, STEP_TIMES, STEP_CPU_TIMES):
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in data.get(name) or ()):
            raise RankFileError(f"{path.name}: field {name!r} holds a value that is not a number")
    _check_integers(data, path.name)
    # a diverged run's loss may be NaN (a measurement); a step time never is
    for name in (WARMUP_TIMES, STEP_TIMES, STEP_CPU_TIMES):
        if not all(math.isfinite(v) and v >= 0 for v in data.get(name) or ()):
            raise RankFileError(f"{path.name}: field {name!r} holds a time that is not a finite number ≥ 0")


@dataclass(kw_only=True)
class CaseOutcome:
    """What happened to one case: its status, error, and every rank's recorded results."""

    status: (
        str  # ok | failed | timeout | oom | skipped (this machine lacks the case's devices: nothing started)
    )
    error: str = ""
    exit_codes: dict[int, int | None] = field(
        default_factory=dict
    )  # per rank; negative: killed by that signal
    ranks: list[RankResult] = field(default_factory=list)
    wall_s: float = 0.0
    spawn_s: float = 0.0  # from launch to the last rank's process group being ready
    pids: list[int] = field(default_factory=list)  # the rank processes (all gone when launch_case returns)


_INT64 = 1 << 63  # what a results column holds: a larger integer (a forged 4000-digit count) cannot be stored


def _check_integers(value: Any, where: str, depth: int = 0) -> None:
    """Every integer in the record, at any depth, fits a results column (int64)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_integers(item, f"{where}: field {key!r}" if depth == 0 else f"{where}.{key}", depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_integers(item, where, depth + 1)
    elif isinstance(value, int) and not isinstance(value, bool) and not -_INT64 <= value < _INT64:
        raise RankFileError(f"{where}: an integer of {value.bit_length()} bits, beyond int64")
