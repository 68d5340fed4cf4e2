"""The results table's columns, each declared once: name, unit, how a case's rows become the case's value,
where it comes from, one line of doc. Also the tracker categories, the collective kinds and the statuses.

Torch-free. Whatever writes a column (results, the metric modules, the predictors, the step model) and
whatever reads one (``analysis.frame.case_frame``, the summary, the report, regress) names it through the
constants here, so a name is spelled in one place; ``tests/test_schema.py`` fails on a column name or a
status written as a string literal anywhere else in the package, on a column a run writes that is not
declared, and on a declared column that ``docs/measurements.md`` does not document.

Adding a column is one declaration, in the section of its source::

    MY_COLUMN = column("my_column_ms", MS, Agg.SLOWEST, "timing", "what it is, one line")
    #                   name            unit  per case   source    doc

``agg`` says how ``case_frame`` makes the case's value of it from the case's per-rank rows (see ``Agg``).
A column per tracker category or per collective kind is a ``family`` (one declaration for all its
members): ``family("comm_{}_bytes", COLLECTIVES, ...)``; ``FAMILY.of("all_gather")`` is one member's name.
Then regenerate the table in docs/measurements.md: ``python -m fsdpbench.core.schema --write-docs``.

A ``# ---- issue N: ...`` section of plain constants with a comment (``X = "x_ms"  # ms, max over ranks,
source``) becomes declarations by wrapping each: ``X = column("x_ms", MS, Agg.MAX, "source", "doc")``; the
constant's name and every import of it stay as they are.

A field of the case (source "config") is declared by the field itself, in ``fsdpbench.core.case.Case``
(its doc; its column's name where that differs): ``case_field_columns`` derives its column, and
``case_to_columns`` /
``case_from_columns`` are the one conversion of a case to its columns and back. Those names are the
scenario's field names too, so the literal test leaves them to the Case dataclass; statuses and every other
column are spelled only here. A literal that only looks like a
column (a git subcommand, a CLI command) carries ``# not a column`` on its line or the line above.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import sys
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpbench.core.case import Case, field_column, field_doc

# ---- statuses ----------------------------------------------------------------------------------------
OK = "ok"
SKIPPED = "skipped"
FAILED = "failed"
OOM = "oom"
TIMEOUT = "timeout"
RUNNING = "running"  # a rank record whose phase has not ended
UNKNOWN = "unknown"  # a case row with no status (never written by fsdpbench)
STATUSES = (OK, SKIPPED, FAILED, OOM, TIMEOUT)
FAILED_STATUSES = (FAILED, TIMEOUT, OOM)

# ---- modes -----------------------------------------------------------------------------------------
REAL = "real"
EMULATED = "emulated"  # one rank alone with a fake process group (fsdpbench/engine/emulate.py)

# ---- memory: the live-tensor trackers' categories (fsdpbench.metrics.tracker) -------------------------
TRACKER_CATEGORIES = (
    "params",
    "params_unsharded",
    "grads",
    "grads_unsharded",
    "optim",
    "activations",
    "temp",
    "all_gather",
    "reduce_scatter",
    "inputs",
    "buffers",
    "other",
)
MODEL_STATE_CATEGORIES = ("params", "grads", "optim")
# collective kinds, as the communication analysis files them (fsdpbench.metrics.comm)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "other")
SAMPLED_SOURCES = ("rss", "nvml")  # the background samplers (fsdpbench.metrics.profiled)

# ---- units ----------------------------------------------------------------------------------------------
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")  # powers of 1024
BYTES = "B"
MS = "ms"
SECONDS = "s"
RATIO = "ratio"  # a dimensionless fraction or quotient
LOSS = "loss"  # the model's criterion (cross-entropy: nats)
COUNT = "count"
TEXT = "text"
LIST = "list"  # one value per step, block or rank
FLOP = "FLOP"
TFLOPS = "TFLOP/s"
GBS = "GB/s"  # 1e9 B/s
SAMPLES_S = "samples/s"
TOKENS_S = "tokens/s"
BOOL = "bool"
CONFIG = "config"  # a field of the case (its unit, if any, is in its name)


class Agg(enum.Enum):
    """How ``case_frame`` turns a case's per-rank rows into the case's value of a column (the value is the
    label docs/measurements.md shows)."""

    SAME = "same on every rank"  # the first row's
    CASE = "the case's own"  # computed by case_frame from the rows (status, error, errors, ranks)
    SLOWEST = "slowest rank"  # the rank with the largest step_time_ms: what goes with the step time
    MODEL_SLOWEST = "model's slowest rank"  # the rank the step-time model finds slowest
    PEAK_RANK = "peak rank"  # the rank with the largest tracker peak: its categories add up to that peak
    MAX = "max over ranks"
    MEAN = "mean over ranks"  # text: the first rank's that has one
    PER_RANK = "per rank only"  # lists, the rank's own identity: not a value of the case


@dataclass(frozen=True, slots=True)
class Column:
    """One declared column: ``agg`` is how case_frame makes the case's value from its ranks' rows."""

    name: str
    unit: str
    agg: Agg
    source: str
    doc: str
    family: str | None = None  # the pattern of its family, if it is one's member


@dataclass(frozen=True, slots=True)
class Family:
    """Columns that differ by one part of their name (a tracker category, a collective kind)."""

    pattern: str  # with one "{}"
    members: tuple[str, ...]
    unit: str
    agg: Agg
    source: str
    doc: str

    def of(self, member: str) -> str:
        """The name of one member's column; an unknown member is an error (a typo is not a column)."""
        if member not in self.members:
            raise KeyError(
                f"{member!r} is not a member of {self.pattern} (members: {', '.join(self.members)})"
            )
        return self.pattern.format(member)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.pattern.format(m) for m in self.members)

    @property
    def label(self) -> str:
        """The pattern as the docs write it: ``comm_<kind>_bytes``."""
        return self.pattern.replace("{}", "<" + _MEMBER_WORD.get(self.members, "name") + ">")


_MEMBER_WORD = {
    TRACKER_CATEGORIES: "category",
    COLLECTIVES: "kind",
    SAMPLED_SOURCES: "source",
    MODEL_STATE_CATEGORIES: "state",
}

COLUMNS: dict[str, Column] = {}  # every declared column by name (family members included)
FAMILIES: dict[str, Family] = {}  # by pattern


def column(name: str, unit: str, agg: Agg, source: str, doc: str) -> str:
    """Declare one column; returns its name (bind it to a constant and use that)."""
    _register(Column(name, unit, agg, source, doc))
    return name


def _config(name: str, doc: str) -> str:
    """A configuration column derived from a case (``case_to_columns``), not a field of it: same on every
    rank. A field's column is declared by the field (``case_field_columns``)."""
    return column(name, CONFIG, Agg.SAME, "config", doc)


def family(pattern: str, members: tuple[str, ...], *, unit: str, agg: Agg, source: str, doc: str) -> Family:
    """Declare a family of columns, one per member (``pattern`` holds one ``{}``)."""
    fam = Family(pattern, tuple(members), unit, agg, source, doc)
    if pattern in FAMILIES:
        raise ValueError(f"column family {pattern} declared twice")
    FAMILIES[pattern] = fam
    for name in fam.names:
        _register(Column(name, unit, agg, source, doc, family=pattern))
    return fam


def _register(col: Column) -> None:
    if col.name in COLUMNS:
        raise ValueError(f"column {col.name} declared twice")
    COLUMNS[col.name] = col


def get_column(name: str) -> Column:
    """The declaration of a column; KeyError naming it when it is not declared."""
    try:
        return COLUMNS[name]
    except KeyError:
        raise KeyError(f"column {name!r} is not declared in fsdpbench/core/schema.py") from None


def undeclared(names: Iterable[str]) -> list[str]:
    """The names among ``names`` that no declaration covers."""
    return [n for n in names if n not in COLUMNS]


# ---- a case's configuration: a column per field of core.case.Case, and the columns derived from it ----
def case_field_columns(case_type: type[Any]) -> tuple[Column, ...]:
    """The configuration columns of a dataclass of ``case_field``s, one per field in its order: named as
    the field declares (its own name unless ``column=``), unit CONFIG, same on every rank, the field's doc."""
    return tuple(
        Column(field_column(f), CONFIG, Agg.SAME, "config", field_doc(f))
        for f in dataclasses.fields(case_type)
    )


# field name → its column's name; the declarations are Case's fields (fsdpbench/core/case.py)
CASE_FIELD_COLUMNS: dict[str, str] = {
    f.name: column(c.name, c.unit, c.agg, c.source, c.doc)
    for f, c in zip(dataclasses.fields(Case), case_field_columns(Case))
}


def _case_column(field_name: str) -> str:
    """The column of a Case field, by the field's name: a handle for the modules that name it."""
    return CASE_FIELD_COLUMNS[field_name]  # KeyError: not a field of Case


STRATEGY = _case_column("strategy")
WORLD_SIZE = _case_column("world_size")
MODEL = _case_column("model")
MODEL_ARGS = _case_column("model_args")
PRECISION = _case_column("precision")
OPTIMIZER = _case_column("optimizer")
BATCH_SIZE = _case_column("batch_size")
SEQ_LEN = _case_column("seq_len")
WARMUP_STEPS = _case_column("warmup_steps")
TIMED_STEPS = _case_column("steps")
BACKEND = _case_column("backend")
DEVICE = _case_column("device")
ACTIVATION_CHECKPOINTING = _case_column("activation_checkpointing")
COMPILE = _case_column("compile")
CPU_OFFLOAD = _case_column("cpu_offload")
HOST_TUNING = _case_column("host_tuning")
# derived from the fields (Case's properties), or measured once per case (the model's size)
MODE = _config("mode", "real, or emulated (one rank alone with a fake process group)")
GLOBAL_BATCH_SIZE = _config("global_batch_size", "samples per step over all ranks")
PARAMS = _config("params", "Ψ, the parameters of the whole model")
CASE_ID = column("case_id", TEXT, Agg.SAME, "config", "the case's id (unique in a run)")
RUN = column("run", TEXT, Agg.SAME, "analysis", "the run directory (when runs are compared)")
RUN_CASE_ID = column(
    "run_case_id", TEXT, Agg.SAME, "analysis", "the case's id before --map-strategy renamed it"
)


# ---- Case ↔ its configuration columns (the one place): results write them, regress and remeasure read back
def case_to_columns(case: Case) -> dict[str, Any]:
    """The configuration columns of a case's rows: each field as its column (a dict as JSON text, a tuple
    comma-separated), then the columns derived from the case."""
    row = {CASE_FIELD_COLUMNS[f.name]: _cell(getattr(case, f.name)) for f in dataclasses.fields(case)}
    row[MODE] = case.mode  # emulated: one rank alone with a fake process group (engine/emulate.py)
    row[CASE_ID] = case.case_id
    row[GLOBAL_BATCH_SIZE] = case.global_batch_size
    return row


def case_from_columns(row: Any) -> Case:
    """The case of a result row (a mapping or a pandas row, as read back from Parquet); a field whose
    column the row lacks keeps its default. Unchecked: a row read back from a file is checked as a
    scenario's case is by ``pipeline.scenario.case_from_row``, which builds on ``case_field_values``."""
    return Case(**case_field_values(row))


def case_field_values(row: Any) -> dict[str, Any]:
    """The Case fields of a result row, each cell decoded as its field's type (by field name; a field
    whose column the row lacks is left out); ValueError names a column whose text cannot be decoded."""
    data: dict[str, Any] = {}
    for f in dataclasses.fields(Case):
        col = CASE_FIELD_COLUMNS[f.name]
        if col in row:
            try:
                data[f.name] = _field_value(row[col], _CASE_HINTS[f.name], f)
            except (TypeError, ValueError, RecursionError) as exc:
                raise ValueError(f"column {col}: cannot be read as the case's {f.name} ({exc})") from None
    return data


_CASE_HINTS = typing.get_type_hints(Case)  # field name → its type


def _cell(value: Any) -> Any:
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return value


def _field_value(value: Any, hint: Any, f: dataclasses.Field[Any]) -> Any:
    """A cell back as the value of a field of type ``hint`` (its text decoded, Parquet's types undone)."""
    value = value.item() if hasattr(value, "item") else value
    origin = typing.get_origin(hint)
    if origin is dict and isinstance(value, str):
        return json.loads(value or "{}")
    if origin is tuple:
        (item, _) = typing.get_args(hint)
        parts = [item(v) for v in str(value or "").split(",") if v]
        return tuple(parts) if parts else f.default  # no items: the field's default
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and value.is_integer() and int in (hint, *typing.get_args(hint)):
        return int(value)  # an int column with missing values comes back from Parquet as floats
    return value


# ---- where and when ---------------------------------------------------------------------------------
DEVICE_NAME = column("device_name", TEXT, Agg.SAME, "env", "the device's name (CPU ranks: the CPU)")
TORCH_VERSION = column("torch_version", TEXT, Agg.SAME, "env", "torch.__version__")
COMMIT = column("commit", TEXT, Agg.SAME, "env", "fsdpbench's git commit")
HOSTNAME = column("hostname", TEXT, Agg.SAME, "env", "the machine")

# ---- status -----------------------------------------------------------------------------------------
RANK = column("rank", COUNT, Agg.PER_RANK, "launcher", "the rank (−1: a skipped case's row)")
STATUS = column(
    "status", TEXT, Agg.CASE, "launcher", "ok, failed, oom, timeout or skipped (case: case_status)"
)
ERROR = column("error", TEXT, Agg.CASE, "launcher", "the error, one line ('' when none)")
CASE_STATUS = column("case_status", TEXT, Agg.SAME, "launcher", "the case's status")
CASE_ERROR = column("case_error", TEXT, Agg.SAME, "launcher", "the case's error")
PHASE = column("phase", TEXT, Agg.PER_RANK, "worker", "the rank's last phase")
EXIT_CODE = column("exit_code", COUNT, Agg.PER_RANK, "launcher", "the rank process's exit code")
N_RANKS_REPORTED = column("n_ranks_reported", COUNT, Agg.CASE, "analysis", "rows of the case with a rank ≥ 0")
SLOWEST_RANK = column("slowest_rank", COUNT, Agg.CASE, "analysis", "the rank with the largest step time")
PEAK_RANK = column("peak_rank", COUNT, Agg.CASE, "analysis", "the rank with the largest tracker peak")

# ---- setup ------------------------------------------------------------------------------------------
N_UNITS = column("n_units", COUNT, Agg.SAME, "worker", "FSDP units, the root included")
THREADS = column("threads", COUNT, Agg.PER_RANK, "worker", "the rank's intra-op threads")
CORES = column(
    "cores", TEXT, Agg.PER_RANK, "worker", "the cores the rank's compute threads are bound to ('' unbound)"
)
CPUS = column(
    "cpus",
    COUNT,
    Agg.SAME,
    "worker",
    "the logical CPUs the rank's process may run on (its affinity at setup); a CPU rank's fair share of "
    "them is min(1, cpus ÷ world_size), the base of the starved threshold (metrics/timing.py)",
)
GLOO_LOOPS_IDLE = column(
    "gloo_loops_idle", COUNT, Agg.PER_RANK, "worker", "the rank's gloo TCP loop threads put under SCHED_IDLE"
)
GLOO_THREADS_BOUND = column(
    "gloo_threads_bound",
    COUNT,
    Agg.PER_RANK,
    "worker",
    "the rank's threads from before its pin (its default group's gloo threads) bound to its cores",
)
INIT_PG_S = column("init_pg_s", SECONDS, Agg.MAX, "worker", "rank start → process group")
SETUP_S = column("setup_s", SECONDS, Agg.MAX, "worker", "rank start → optimizer built")
WALL_S = column("wall_s", SECONDS, Agg.MAX, "worker", "the rank's wall time")
STEPS_WALL_S = column("steps_wall_s", SECONDS, Agg.MAX, "worker", "time inside training steps, all phases")
CASE_WALL_S = column("case_wall_s", SECONDS, Agg.SAME, "launcher", "wall time of the whole case")

# ---- step time --------------------------------------------------------------------------------------
STEP_TIME = column(
    "step_time_ms", MS, Agg.SLOWEST, "timing", "median of the rank's timed steps (case: the slowest rank's)"
)
STEP_TIME_P10 = column("step_time_p10_ms", MS, Agg.SLOWEST, "timing", "10th percentile of the timed steps")
STEP_TIME_P90 = column("step_time_p90_ms", MS, Agg.SLOWEST, "timing", "90th percentile of the timed steps")
STEP_TIME_MEAN = column("step_time_mean_ms", MS, Agg.SLOWEST, "timing", "mean of the timed steps")
STEP_TIME_STD = column("step_time_std_ms", MS, Agg.SLOWEST, "timing", "standard deviation of the timed steps")
STEP_TIME_SPREAD_COLUMNS = (STEP_TIME_P10, STEP_TIME_P90, STEP_TIME_MEAN, STEP_TIME_STD)
STEP_TIMES = column("step_times_ms", LIST, Agg.PER_RANK, "timing", "every timed step")
STEP_CPU_TIMES = column(
    "step_cpu_times_ms",
    LIST,
    Agg.PER_RANK,
    "timing",
    "CPU time of every timed step (the process's, all threads)",
)
STEP_CPU_SHARE = column(
    "step_cpu_share",
    RATIO,
    Agg.SLOWEST,
    "timing",
    "the timed steps' CPU time (time.process_time, all threads) ÷ their wall time; on CPU ranks under "
    "STARVED_CPU_SHARE of the rank's fair share of the cores the steps were starved (metrics/timing.py)",
)
WARMUP_TIMES = column("warmup_times_ms", LIST, Agg.PER_RANK, "timing", "every warm-up step")
FIRST_STEP = column("first_step_ms", MS, Agg.MAX, "timing", "the first warm-up step (holds compilation)")
CASE_STEP_TIME = column(
    "case_step_time_ms", MS, Agg.SAME, "timing", "the case's step time: the slowest rank's median"
)
THROUGHPUT_SAMPLES = column(
    "throughput_samples_s", SAMPLES_S, Agg.SAME, "timing", "global batch / case step time"
)
THROUGHPUT_TOKENS = column(
    "throughput_tokens_s", TOKENS_S, Agg.SAME, "timing", "global batch × seq_len / case step time"
)
FLOPS_PER_STEP = column(
    "flops_per_step", FLOP, Agg.MAX, "counted (FlopCounterMode, meta)", "FLOPs of one rank's forward+backward"
)
ACHIEVED_TFLOPS = column(
    "achieved_tflops",
    TFLOPS,
    Agg.SLOWEST,
    "counted FLOPs / step time",
    "flops_per_step / step_time_ms; on CPU ranks not meaningful (no datasheet peak to compare with)",
)
MFU = column(
    "mfu",
    RATIO,
    Agg.SLOWEST,
    "counted FLOPs / step time / datasheet peak",
    "model FLOPs utilisation; only on GPUs with a known datasheet peak (None elsewhere)",
)
BARE_STEP_TIME = column(
    "bare_step_time_ms", MS, Agg.SLOWEST, "harness", "with bare_steps: the bare loop's mean step"
)
HARNESS_OVERHEAD_RATIO = column(
    "harness_overhead_ratio", RATIO, Agg.SLOWEST, "harness", "mean measured step / mean bare step"
)
HARNESS_LEFTOVERS = column(
    "harness_leftovers", TEXT, Agg.MEAN, "harness", "what a tracker or the profiler left installed"
)
LOSSES = column("losses", LIST, Agg.SAME, "training", "the global loss of every recorded step")
LOSS_FIRST = column("loss_first", LOSS, Agg.SAME, "training", "the first recorded global loss")
LOSS_FINAL = column("loss_final", LOSS, Agg.SAME, "training", "the last recorded global loss")
LOSS_SKIPPED_REASON = column(
    "loss_skipped_reason", TEXT, Agg.SAME, "emulation", "why an emulated case has no loss"
)
PAIRED = family(
    "paired_{}",
    (
        "step_ms",
        "ref_ms",
        "step_cpu_ms",
        "ref_cpu_ms",
        "step_spin_ms",
        "ref_spin_ms",
        "block_busy_share",
        "block_own_share",
    ),
    unit=LIST,
    agg=Agg.PER_RANK,
    source="engine/reference.py",
    doc="with time_blocks: wall and work CPU time (gloo's loop threads left out) of each step and of the "
    "reference step after it, and the loop threads' CPU time left out (spin); per block, the machine's "
    "busy share of its cores and this rank's",
)
STEP_TIME_REF_RATIOS = column(
    "step_time_ref_ratios",
    LIST,
    Agg.SAME,
    "engine/reference.py",
    "per block: summed step ÷ summed reference time, slowest rank per pair (the CI time gate's samples)",
)
STEP_TIME_REF_OTHER_LOAD = column(
    "step_time_ref_other_load",
    RATIO,
    Agg.SAME,
    "engine/reference.py",
    "share of the machine's cores that other processes kept busy during the reference blocks (the "
    "machine's busy share less the case's ranks'), the median block's; empty where /proc/stat is not read",
)

# ---- memory: the live-tensor tracker (fsdpbench.metrics.tracker) ---------------------------------------
TRACKER_PEAK = column(
    "mem_tracker_peak_bytes", BYTES, Agg.PEAK_RANK, "tracker", "live tensors at the step's peak"
)
TRACKER_PEAK_BY_CATEGORY = family(
    "mem_tracker_peak_{}_bytes",
    TRACKER_CATEGORIES,
    unit=BYTES,
    agg=Agg.PEAK_RANK,
    source="tracker",
    doc="one tracker category at the moment of the peak",
)
TRACKER_MODEL_STATES = column(
    "mem_tracker_model_states_bytes",
    BYTES,
    Agg.MAX,
    "tracker",
    "params + grads + optimizer state after optimizer.step",
)
TRACKER_STATES = family(
    "mem_tracker_states_{}_bytes",
    MODEL_STATE_CATEGORIES,
    unit=BYTES,
    agg=Agg.MAX,
    source="tracker",
    doc="one model state after optimizer.step",
)
LOCAL_STATES = family(
    "mem_local_{}_bytes",
    MODEL_STATE_CATEGORIES,
    unit=BYTES,
    agg=Agg.MAX,
    source="counted tensor by tensor",
    doc="storage bytes of this rank's own params, grads, optimizer state",
)
PLACEMENT = family(
    "mem_placement_params_{}_bytes",
    ("host", "device"),
    unit=BYTES,
    agg=Agg.MAX,
    source="strategy bookkeeping",
    doc="where this rank's resident parameter storage lives (CPU offload)",
)


def tracker_peak_column(category: str) -> str:
    """The column of one tracker category at the moment of the peak."""
    return TRACKER_PEAK_BY_CATEGORY.of(category)


TRACKER_PEAK_COLUMNS = (TRACKER_PEAK, *TRACKER_PEAK_BY_CATEGORY.names)

# ---- memory: the CUDA caching allocator, the samplers (GPU; RSS everywhere) ----------------------------
ALLOC_PEAK_ALLOCATED = column(
    "mem_alloc_peak_allocated_bytes", BYTES, Agg.MAX, "allocator", "torch.cuda.max_memory_allocated"
)
ALLOC_PEAK_RESERVED = column(
    "mem_alloc_peak_reserved_bytes", BYTES, Agg.MAX, "allocator", "torch.cuda.max_memory_reserved"
)
ALLOC_RETRIES = column(
    "mem_alloc_num_alloc_retries", COUNT, Agg.MAX, "allocator", "allocator retries (cache flushes)"
)
ALLOC_OOMS = column("mem_alloc_num_ooms", COUNT, Agg.MAX, "allocator", "allocator OOMs")
SAMPLED_PEAK = family(
    "mem_{}_peak_bytes",
    SAMPLED_SOURCES,
    unit=BYTES,
    agg=Agg.MAX,
    source="sampler (rss: /proc/self/statm; nvml: the driver)",
    doc="the largest sample in the steady-state steps",
)
SAMPLED_PEAK_CASE = family(
    "mem_{}_peak_case_bytes",
    SAMPLED_SOURCES,
    unit=BYTES,
    agg=Agg.MAX,
    source="sampler",
    doc="the largest sample over the whole case",
)
SAMPLED_COUNT = family(
    "mem_{}_samples", SAMPLED_SOURCES, unit=COUNT, agg=Agg.MAX, source="sampler", doc="samples taken"
)

# ---- communication and overlap (the profiled step; fsdpbench.metrics.profiled) -------------------------
COMM_COUNT = family(
    "comm_{}_count", COLLECTIVES, unit=COUNT, agg=Agg.MEAN, source="traced (profiler)", doc="calls per step"
)
COMM_BYTES = family(
    "comm_{}_bytes",
    COLLECTIVES,
    unit=BYTES,
    agg=Agg.MEAN,
    source="traced (profiler)",
    doc="bytes each rank sends per step (nccl-tests convention)",
)
COMM_BACKEND_BYTES = family(
    "comm_{}_backend_bytes",
    COLLECTIVES,
    unit=BYTES,
    agg=Agg.MEAN,
    source="traced (profiler)",
    doc="bytes the backend really moves per step",
)
COMM_TIME = family(
    "comm_{}_time_ms",
    COLLECTIVES,
    unit=MS,
    agg=Agg.MEAN,
    source="traced (profiler)",
    doc="the kind's span per step",
)
COMM_ALGBW = family(
    "comm_{}_algbw_gbs", COLLECTIVES, unit=GBS, agg=Agg.MEAN, source="traced (profiler)", doc="ΣS / Σt"
)
COMM_BUSBW = family(
    "comm_{}_busbw_gbs",
    COLLECTIVES,
    unit=GBS,
    agg=Agg.MEAN,
    source="traced (profiler)",
    doc="algbw × the bus factor",
)
COMM_TOTAL = column("comm_total_bytes", BYTES, Agg.MEAN, "traced (profiler)", "Σ comm_<kind>_bytes")
COMM_PRED = family(
    "comm_pred_{}_bytes",
    COLLECTIVES,
    unit=BYTES,
    agg=Agg.MEAN,
    source="analytic model (Sharding)",
    doc="the analytic volume per step (modelled)",
)
COMM_PRED_TOTAL = column(
    "comm_pred_total_bytes", BYTES, Agg.MEAN, "analytic model (Sharding)", "Σ comm_pred_<kind>_bytes"
)
COMM_PRED_NOTE = column(
    "comm_pred_note", TEXT, Agg.MEAN, "analytic model (Sharding)", "why there is no analytic volume"
)
COMM_PATTERN = column(
    "comm_pattern", TEXT, Agg.MEAN, "analytic model (Sharding)", "the textbook pattern it follows"
)
OVERLAP_COMM = column("overlap_comm_ms", MS, Agg.MEAN, "traced (profiler)", "|comm| per profiled step")
OVERLAP_COMPUTE = column("overlap_compute_ms", MS, Agg.MEAN, "traced (profiler)", "|compute|")
OVERLAP_EXPOSED = column("overlap_exposed_comm_ms", MS, Agg.MEAN, "traced (profiler)", "|comm − compute|")
OVERLAP_RATIO = column("overlap_ratio", RATIO, Agg.MEAN, "traced (profiler)", "|comm ∩ compute| / |comm|")
OVERLAP_NOTE = column("overlap_note", TEXT, Agg.MEAN, "traced (profiler)", "how overlap was read")

# ---- the step-time model (fsdpbench.predictors.step_model) -----------------------------------------------
_STEP_MODEL = "step model (modelled)"
MODEL_STEP_TIME = column(
    "model_step_time_ms", MS, Agg.MODEL_SLOWEST, _STEP_MODEL, "the modelled step on the link"
)
MODEL_COMPUTE = column("model_compute_ms", MS, Agg.MODEL_SLOWEST, _STEP_MODEL, "compute")
MODEL_COMM = column("model_comm_ms", MS, Agg.MODEL_SLOWEST, _STEP_MODEL, "collectives' α–β time")
MODEL_EXPOSED_COMM = column(
    "model_exposed_comm_ms", MS, Agg.MODEL_SLOWEST, _STEP_MODEL, "communication not hidden"
)
MODEL_PEER_WAIT = column("model_peer_wait_ms", MS, Agg.MODEL_SLOWEST, _STEP_MODEL, "waiting for slower peers")
MODEL_OVERLAP_RATIO = column(
    "model_overlap_ratio", RATIO, Agg.MODEL_SLOWEST, _STEP_MODEL, "1 − exposed / comm"
)
MODEL_LINK = column("model_link", TEXT, Agg.MODEL_SLOWEST, _STEP_MODEL, "the link modelled")
MODEL_LINK_SOURCE = column(
    "model_link_source", TEXT, Agg.MODEL_SLOWEST, _STEP_MODEL, "where the link's α, β came from"
)
MODEL_METHOD = column("model_method", TEXT, Agg.MODEL_SLOWEST, _STEP_MODEL, "how it was modelled")
MODEL_RANKS_SIMULATED = column(
    "model_ranks_simulated", COUNT, Agg.MODEL_SLOWEST, _STEP_MODEL, "ranks whose traces were replayed"
)
MODEL_COLLECTIVES = column("model_collectives", COUNT, Agg.MODEL_SLOWEST, _STEP_MODEL, "collectives per step")
MODEL_WAITS_REMOVED = column(
    "model_waits_removed_ms", MS, Agg.MODEL_SLOWEST, _STEP_MODEL, "waits taken out of compute"
)
MODEL_PROFILER_REMOVED = column(
    "model_profiler_removed_ms", MS, Agg.MODEL_SLOWEST, _STEP_MODEL, "profiled minus bare compute"
)
MODEL_COMPUTE_BARE = column(
    "model_compute_bare_ms",
    MS,
    Agg.MODEL_SLOWEST,
    "compute twin (pipeline/compute_twin.py)",
    "one step's compute timed without the profiler, collectives taking no time",
)
MODEL_COMPUTE_SCALE = column(
    "model_compute_scale", RATIO, Agg.MODEL_SLOWEST, _STEP_MODEL, "bare / profiled compute: the trace's scale"
)
MODEL_CHECKABLE = column(
    "model_checkable", BOOL, Agg.SAME, _STEP_MODEL, "a measured step time the model describes exists"
)
MODEL_UNCHECKED_REASON = column(
    "model_unchecked_reason", TEXT, Agg.SAME, _STEP_MODEL, "why the modelled step cannot be checked here"
)
CASE_MODEL_STEP_TIME = column(
    "case_model_step_time_ms", MS, Agg.SAME, _STEP_MODEL, "the case's modelled step time: the slowest rank's"
)
MODEL_STEP_ERR = column(
    "model_step_err", RATIO, Agg.CASE, _STEP_MODEL, "(modelled − measured) / measured step time"
)
STEP_MODEL_COLUMNS = tuple(c.name for c in COLUMNS.values() if c.agg is Agg.MODEL_SLOWEST)

# ---- the analytic memory model (fsdpbench.predictors.memory_model.columns) ----------------------------
_ANALYTIC = "analytic model (modelled)"
PRED_PARAMS = column("pred_params_bytes", BYTES, Agg.PEAK_RANK, _ANALYTIC, "params (sharded at rest)")
PRED_GRADS = column("pred_grads_bytes", BYTES, Agg.PEAK_RANK, _ANALYTIC, "grads at rest after optimizer.step")
PRED_OPTIM = column("pred_optim_bytes", BYTES, Agg.PEAK_RANK, _ANALYTIC, "optimizer state")
PRED_PADDING = column("pred_padding_bytes", BYTES, Agg.PEAK_RANK, _ANALYTIC, "FSDP padding")
PRED_MODEL_STATES = column(
    "pred_model_states_bytes", BYTES, Agg.PEAK_RANK, _ANALYTIC, "params + grads + optimizer state at rest"
)
PRED_ACTIVATIONS = column(
    "pred_activations_bytes", BYTES, Agg.PEAK_RANK, _ANALYTIC, "activations + inputs at the predicted peak"
)
PRED_UNSHARDED = column(
    "pred_unsharded_bytes",
    BYTES,
    Agg.PEAK_RANK,
    _ANALYTIC,
    "unsharded params and grads at the predicted peak",
)
PRED_COMM_BUFFERS = column(
    "pred_comm_buffers_bytes",
    BYTES,
    Agg.PEAK_RANK,
    _ANALYTIC,
    "all-gather, reduce-scatter buffers and DDP buckets at the predicted peak",
)
PRED_TEMP = column("pred_temp_bytes", BYTES, Agg.PEAK_RANK, _ANALYTIC, "temporaries at the predicted peak")
PRED_PEAK = column("pred_peak_bytes", BYTES, Agg.PEAK_RANK, _ANALYTIC, "the predicted peak")
PRED_DEVICE_PEAK = column(
    "pred_device_peak_bytes",
    BYTES,
    Agg.PEAK_RANK,
    _ANALYTIC,
    "the predicted peak on the device (CPU offload: less)",
)
PRED_HOST = column("pred_host_bytes", BYTES, Agg.PEAK_RANK, _ANALYTIC, "bytes kept on the host (CPU offload)")
PRED_PARAMS_HOST = column("pred_params_host_bytes", BYTES, Agg.PEAK_RANK, _ANALYTIC, "params on the host")
PRED_PARAMS_DEVICE = column(
    "pred_params_device_bytes", BYTES, Agg.PEAK_RANK, _ANALYTIC, "params on the device"
)
PRED_PEAK_MOMENT = column(
    "pred_peak_moment", TEXT, Agg.PEAK_RANK, _ANALYTIC, "the moment of the predicted peak"
)
PRED_PEAK_BY_CATEGORY = family(
    "pred_peak_{}_bytes",
    TRACKER_CATEGORIES,
    unit=BYTES,
    agg=Agg.PEAK_RANK,
    source=_ANALYTIC,
    doc="the model's terms at the predicted peak filed as the tracker files them",
)

# ---- the traced predictor (fsdpbench.predictors.traced) and DeepSpeed's own estimator -------------------
_TRACED = "traced predictor (fake tensors; modelled)"
TRACED_PEAK = column("traced_peak_bytes", BYTES, Agg.PEAK_RANK, _TRACED, "the traced peak")
TRACED_MODEL_STATES = column(
    "traced_model_states_bytes", BYTES, Agg.PEAK_RANK, _TRACED, "traced model states"
)
TRACED_WALL_S = column("traced_wall_s", SECONDS, Agg.PEAK_RANK, _TRACED, "time the trace took")
VENDOR_MODEL_STATES = column(
    "ds_est_model_states_bytes",
    BYTES,
    Agg.PEAK_RANK,
    "DeepSpeed's estimator (modelled)",
    "DeepSpeed's estimate of the model states",
)

# ---- predictions against measurements: error column → (predicted, measured) --------------------------
# an error is (predicted − measured) / measured (fsdpbench.analysis.frame.relative_error)
ERROR_COLUMNS = {
    column("pred_peak_err", RATIO, Agg.PEAK_RANK, _ANALYTIC, "(pred − tracker) / tracker peak"): (
        PRED_PEAK,
        TRACKER_PEAK,
    ),
    column("pred_model_states_err", RATIO, Agg.PEAK_RANK, _ANALYTIC, "error of the model states"): (
        PRED_MODEL_STATES,
        TRACKER_MODEL_STATES,
    ),
    column("traced_peak_err", RATIO, Agg.PEAK_RANK, _TRACED, "(traced − tracker) / tracker peak"): (
        TRACED_PEAK,
        TRACKER_PEAK,
    ),
    column("traced_model_states_err", RATIO, Agg.PEAK_RANK, _TRACED, "error of the model states"): (
        TRACED_MODEL_STATES,
        TRACKER_MODEL_STATES,
    ),
    column("ds_est_model_states_err", RATIO, Agg.PEAK_RANK, "DeepSpeed's estimator", "its error"): (
        VENDOR_MODEL_STATES,
        TRACKER_MODEL_STATES,
    ),
}
PRED_PEAK_ERR, PRED_MODEL_STATES_ERR, TRACED_PEAK_ERR, TRACED_MODEL_STATES_ERR, VENDOR_MODEL_STATES_ERR = (
    ERROR_COLUMNS
)

# ---- what two cases must share for one's step time to be compared with the other's -------------------
# (the reference case's); strategy, wrap, prefetch and shard size are what is compared
PEER_COLUMNS = (
    RUN,
    WORLD_SIZE,
    MODEL,
    MODEL_ARGS,
    PRECISION,
    OPTIMIZER,
    BATCH_SIZE,
    SEQ_LEN,
    ACTIVATION_CHECKPOINTING,
    COMPILE,
    CPU_OFFLOAD,
    DEVICE,
    BACKEND,
    WARMUP_STEPS,
    TIMED_STEPS,
)

# ---- checkpointing, measured (fsdpbench/engine/checkpoint.py) and predicted ------------------
_CKPT = "checkpoint phase"
_CKPT_RSS = "RSS sampler (checkpoint phase)"
_CKPT_MODEL = "checkpoint model (modelled)"
# CheckpointRecord field → column, per rank (the case's figures are the ckpt case columns below)
CHECKPOINT_COLUMNS = {
    "method": column("ckpt_method", TEXT, Agg.SAME, _CKPT, "the case's checkpoint method"),
    "with_optimizer": column("ckpt_with_optimizer", BOOL, Agg.SAME, _CKPT, "optimizer state saved too"),
    "save_s": column("ckpt_save_s", SECONDS, Agg.MAX, _CKPT, "wall time of the save on this rank"),
    "save_blocked_s": column(
        "ckpt_save_blocked_s", SECONDS, Agg.MAX, _CKPT, "wall time the loop waited (async: until staged)"
    ),
    "load_s": column("ckpt_load_s", SECONDS, Agg.MAX, _CKPT, "wall time of the load into a fresh model"),
    "bytes_written": column("ckpt_bytes_written", BYTES, Agg.PER_RANK, _CKPT, "this rank's files on disk"),
    "files": column("ckpt_files", COUNT, Agg.PER_RANK, _CKPT, "this rank's files"),
    "save_host_peak_bytes": column(
        "mem_rss_ckpt_save_peak_bytes", BYTES, Agg.MAX, _CKPT_RSS, "RSS peak above the save's baseline"
    ),
    "load_host_peak_bytes": column(
        "mem_rss_ckpt_load_peak_bytes", BYTES, Agg.MAX, _CKPT_RSS, "RSS peak above the load's baseline"
    ),
    "save_device_peak_bytes": column(
        "mem_alloc_ckpt_save_peak_bytes", BYTES, Agg.MAX, "CUDA allocator", "device peak in the save (GPU)"
    ),
    "load_device_peak_bytes": column(
        "mem_alloc_ckpt_load_peak_bytes", BYTES, Agg.MAX, "CUDA allocator", "device peak in the load (GPU)"
    ),
    "state_equal": column(
        "ckpt_state_equal", BOOL, Agg.PER_RANK, _CKPT, "loaded local state == saved, tensor by tensor"
    ),
    "loss_uninterrupted": column(
        "ckpt_loss_uninterrupted", LOSS, Agg.SAME, _CKPT, "the step after the save, without the round trip"
    ),
    "loss_after_load": column("ckpt_loss_after_load", LOSS, Agg.SAME, _CKPT, "the same step after the load"),
    "loss_equal": column("ckpt_loss_equal", BOOL, Agg.PER_RANK, _CKPT, "the two losses are equal"),
}
CKPT_BYTES = CHECKPOINT_COLUMNS["bytes_written"]
CKPT_SAVE_HOST_PEAK = CHECKPOINT_COLUMNS["save_host_peak_bytes"]
CKPT_SAVE_S = CHECKPOINT_COLUMNS["save_s"]
CKPT_LOAD_S = CHECKPOINT_COLUMNS["load_s"]
# the analytic prediction (fsdpbench/predictors/checkpoint.py), per rank, labelled modelled
PRED_CKPT_BYTES = column(
    "pred_ckpt_bytes", BYTES, Agg.PER_RANK, _CKPT_MODEL, "this rank's files: payload + the format's framing"
)
PRED_CKPT_PAYLOAD_BYTES = column(
    "pred_ckpt_payload_bytes",
    BYTES,
    Agg.PER_RANK,
    _CKPT_MODEL,
    "the saved tensors' bytes in this rank's files",
)
PRED_CKPT_HOST_PEAK = column(
    "pred_ckpt_save_host_peak_bytes", BYTES, Agg.MAX, _CKPT_MODEL, "host memory the save adds on this rank"
)
PRED_CKPT_DEVICE_TRANSIENT = column(
    "pred_ckpt_device_transient_bytes", BYTES, Agg.MAX, _CKPT_MODEL, "device memory while gathering"
)
PRED_CKPT_BYTES_ERR = column(
    "pred_ckpt_bytes_err", RATIO, Agg.PER_RANK, _CKPT_MODEL, "(pred − measured) / measured, this rank's bytes"
)
PRED_CKPT_HOST_PEAK_ERR = column(
    "pred_ckpt_save_host_peak_err", RATIO, Agg.PER_RANK, _CKPT_MODEL, "(pred − measured) / measured host peak"
)
# a case's checkpoint figures (fsdpbench/analysis/checkpoint.py), one per case row
CKPT_CASE_BYTES = column("ckpt_case_bytes_written", BYTES, Agg.CASE, _CKPT, "sum over ranks of the files")
PRED_CKPT_CASE_BYTES = column(
    "pred_ckpt_case_bytes", BYTES, Agg.CASE, _CKPT_MODEL, "modelled, sum over ranks"
)
CKPT_RANK0_HOST_PEAK = column(
    "mem_rss_ckpt_save_rank0_peak_bytes", BYTES, Agg.CASE, _CKPT_RSS, "rank 0's RSS peak above its baseline"
)
PRED_CKPT_RANK0_HOST_PEAK = column(
    "pred_ckpt_save_rank0_host_peak_bytes", BYTES, Agg.CASE, _CKPT_MODEL, "modelled, rank 0's host peak"
)
CKPT_CASE_SAVE_S = column("ckpt_case_save_s", SECONDS, Agg.CASE, _CKPT, "max over ranks of the save")
CKPT_CASE_LOAD_S = column("ckpt_case_load_s", SECONDS, Agg.CASE, _CKPT, "max over ranks of the load")
CKPT_ROUND_TRIP_OK = column(
    "ckpt_round_trip_ok", BOOL, Agg.CASE, _CKPT, "every rank's state and loss equal after the load"
)

# ---- the CUDA caching allocator and NVML, predicted beside the measurement ----------------------------
# per rank, modelled: the rank's traced allocation stream replayed through the allocator model
# (fsdpbench.predictors.memory_model.allocator; CUDA cases of a traced run only)
_ALLOC_MODEL = "allocator model (traced stream replayed; modelled)"
NVML_PEAK = SAMPLED_PEAK.of("nvml")
TRACED_ALLOC_ALLOCATED = column(
    "traced_alloc_peak_allocated_bytes", BYTES, Agg.MAX, _ALLOC_MODEL, "predicted max_memory_allocated"
)
TRACED_ALLOC_RESERVED = column(
    "traced_alloc_peak_reserved_bytes", BYTES, Agg.MAX, _ALLOC_MODEL, "predicted max_memory_reserved"
)
TRACED_ALLOC_FRAGMENTATION = column(
    "traced_alloc_fragmentation", RATIO, Agg.MAX, _ALLOC_MODEL, "reserved but free at the allocated peak"
)
TRACED_NVML = column(
    "traced_nvml_peak_bytes",
    BYTES,
    Agg.MAX,
    _ALLOC_MODEL,
    "predicted NVML: reserved + the terms of what the rank loads",
)
TRACED_NVML_CONTEXT = column(
    "traced_nvml_context_bytes",
    BYTES,
    Agg.MAX,
    _ALLOC_MODEL,
    "the NVML terms used besides NCCL's (context, cuDNN, ...)",
)
TRACED_NVML_NCCL = column(
    "traced_nvml_nccl_bytes", BYTES, Agg.MAX, _ALLOC_MODEL, "the NCCL terms used (library, buffers)"
)
ALLOCATOR_ERROR_COLUMNS = {
    column("traced_alloc_peak_allocated_err", RATIO, Agg.MAX, _ALLOC_MODEL, "error vs the allocator"): (
        TRACED_ALLOC_ALLOCATED,
        ALLOC_PEAK_ALLOCATED,
    ),
    column("traced_alloc_peak_reserved_err", RATIO, Agg.MAX, _ALLOC_MODEL, "error vs the allocator"): (
        TRACED_ALLOC_RESERVED,
        ALLOC_PEAK_RESERVED,
    ),
    column("traced_nvml_peak_err", RATIO, Agg.MAX, _ALLOC_MODEL, "error vs NVML"): (TRACED_NVML, NVML_PEAK),
}
TRACED_ALLOC_ALLOCATED_ERR, TRACED_ALLOC_RESERVED_ERR, TRACED_NVML_ERR = ALLOCATOR_ERROR_COLUMNS
ERROR_COLUMNS.update(ALLOCATOR_ERROR_COLUMNS)
ALLOCATOR_PREDICTION_COLUMNS = (
    TRACED_ALLOC_ALLOCATED,
    TRACED_ALLOC_RESERVED,
    TRACED_ALLOC_FRAGMENTATION,
    TRACED_NVML,
    TRACED_NVML_CONTEXT,
    TRACED_NVML_NCCL,
    *ALLOCATOR_ERROR_COLUMNS,
)

# ---- docs/measurements.md: the table of every column, generated from the declarations -----------------
DOCS_BEGIN = "<!-- columns: generated by `python -m fsdpbench.core.schema --write-docs`; do not edit -->"
DOCS_END = "<!-- end of columns -->"


def docs_table() -> str:
    """The markdown table of every declared column (a family is one row)."""
    lines = ["| column | unit | per case | source | what |", "| --- | --- | --- | --- | --- |"]
    seen: set[str] = set()
    for col in COLUMNS.values():
        if col.family:
            if col.family in seen:
                continue
            seen.add(col.family)
            fam = FAMILIES[col.family]
            name = f"`{fam.label}` ({', '.join(fam.members)})"
        else:
            name = f"`{col.name}`"
        lines.append(f"| {name} | {col.unit} | {col.agg.value} | {col.source} | {col.doc} |")
    return "\n".join(lines)


def documented_columns(markdown: str) -> set[str]:
    """The column names the generated table in ``markdown`` documents (members of its families too)."""
    start, end = markdown.find(DOCS_BEGIN), markdown.find(DOCS_END)
    if start < 0 or end < start:
        return set()
    out: set[str] = set()
    for row in markdown[start:end].splitlines()[3:]:
        cell = row.split("|")[1] if row.startswith("|") else ""
        name = re.search(r"`([^`]+)`", cell)
        members = re.search(r"\(([^)]*)\)", cell)
        if not name:
            continue
        if members and "<" in name.group(1):
            pattern = re.sub(r"<[a-z]+>", "{}", name.group(1))
            out.update(pattern.format(m.strip()) for m in members.group(1).split(","))
        else:
            out.add(name.group(1))
    return out


def write_docs(path: Path) -> bool:
    """Put the generated table between the markers in ``path``; True when the file changed."""
    text = path.read_text()
    start, end = text.index(DOCS_BEGIN), text.index(DOCS_END)
    new = text[:start] + DOCS_BEGIN + "\n\n" + docs_table() + "\n\n" + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    docs = Path(__file__).resolve().parents[2] / "docs" / "measurements.md"
    if sys.argv[1:] == ["--write-docs"]:
        print(f"{docs}: {'rewritten' if write_docs(docs) else 'up to date'}")
    else:
        print(docs_table())
