"""The results store: one directory per run, one Parquet file per case, written atomically.

    RUN_DIR/
      run.json              scenario, environment, start/end, per-case launch overhead
      results.parquet       one row per case × rank (skipped cases: one row, rank -1)
      cases/<case_id>.parquet
      cases/<case_id>/      what the ranks wrote (rank{R}.json, rank{R}.log), traces

A crash or Ctrl-C loses nothing already measured; ``--resume`` runs only the cases with no file.
"""

from __future__ import annotations

import io
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fsdpbench.core.case import Case
from fsdpbench.core.formats import FORMAT_VERSION, RESULTS, RUN_JSON, FormatVersionError
from fsdpbench.core.readback import ReadBackError, read_bounded, read_json
from fsdpbench.core.rundir import RunLock, check_component, check_inside, write_atomically
from fsdpbench.core.schema import (
    ACHIEVED_TFLOPS,
    BARE_STEP_TIME,
    CASE_ERROR,
    CASE_FIELD_COLUMNS,
    CASE_ID,
    CASE_STATUS,
    CASE_STEP_TIME,
    CASE_WALL_S,
    COMMIT,
    DEVICE_NAME,
    ERROR,
    FLOPS_PER_STEP,
    GLOBAL_BATCH_SIZE,
    HARNESS_OVERHEAD_RATIO,
    HOSTNAME,
    LOSS_FINAL,
    LOSS_FIRST,
    LOSS_SKIPPED_REASON,
    LOSSES,
    MFU,
    MODE,
    N_UNITS,
    OK,
    PARAMS,
    RANK,
    SKIPPED,
    STATUS,
    STATUSES,
    STEP_TIME,
    STEP_TIME_MEAN,
    STEP_TIME_REF_OTHER_LOAD,
    STEP_TIME_REF_RATIOS,
    THROUGHPUT_SAMPLES,
    THROUGHPUT_TOKENS,
    TORCH_VERSION,
    case_to_columns,
)
from fsdpbench.engine.rank_result import CaseOutcome
from fsdpbench.engine.reference import block_ratios, other_load_share, ratio_series

# the columns every results table has, in order (measurements follow): the configuration columns by
# the Case fields they come from (schema.CASE_FIELD_COLUMNS), the rest by their handles
CORE_COLUMNS = [
    CASE_ID,
    *(CASE_FIELD_COLUMNS[f] for f in ("scenario", "strategy", "world_size", "shard_size")),
    RANK,
    *(CASE_FIELD_COLUMNS[f] for f in ("model", "model_args")),
    PARAMS,
    CASE_FIELD_COLUMNS["wrap"],
    N_UNITS,
    *(CASE_FIELD_COLUMNS[f] for f in ("prefetch", "precision", "optimizer", "batch_size")),
    GLOBAL_BATCH_SIZE,
    *(CASE_FIELD_COLUMNS[f] for f in ("seq_len", "warmup_steps", "steps")),
    STATUS,
    ERROR,
    STEP_TIME,
    LOSS_FINAL,
    *(CASE_FIELD_COLUMNS[f] for f in ("backend", "device")),
    MODE,
]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    write_atomically(path, data)


def atomic_write_json(path: Path, obj: Any) -> None:
    write_atomically(path, json.dumps(obj, indent=2, default=str).encode())


def atomic_write_parquet(path: Path, frame: pd.DataFrame) -> None:
    """``frame`` as Parquet, its format version in the file's metadata (beside pandas' own)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(frame, preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **RESULTS.parquet_metadata()})
    buffer = io.BytesIO()  # serialised here, written by write_atomically: no path handed to pyarrow
    pq.write_table(table, buffer)
    write_atomically(path, buffer.getvalue())


def build_rows(case: Case, outcome: CaseOutcome, env: dict[str, Any]) -> pd.DataFrame:
    """One row per rank for a case that ran (whatever its status): each rank's record as its columns
    (``RankResult.to_columns``), with what the case's ranks measured together."""
    base = case_to_columns(case)
    ranks = [rank.to_columns() for rank in outcome.ranks]
    shared = _case_measurement_columns(case, ranks, [rank.losses or [] for rank in outcome.ranks])
    rows = []
    for rank in ranks:
        row = {**base, **rank}
        row[STATUS] = rank[STATUS] or outcome.status
        row[ERROR] = rank[ERROR] or (outcome.error if outcome.status != OK else "")
        row[CASE_STATUS], row[CASE_ERROR] = outcome.status, outcome.error
        row.update(shared)
        row[CASE_WALL_S] = outcome.wall_s
        row.update(_env_columns(env, case))
        row.update(_flops_columns(case, row))
        if row.get(BARE_STEP_TIME) and row.get(STEP_TIME_MEAN):
            row[HARNESS_OVERHEAD_RATIO] = row[STEP_TIME_MEAN] / row[BARE_STEP_TIME]
        rows.append(row)
    return pd.DataFrame(rows)


def _case_measurement_columns(
    case: Case, ranks: list[dict[str, Any]], losses_by_rank: list[list[float]]
) -> dict[str, Any]:
    """What the case's ranks measured together (``ranks``: each rank's columns): the global losses, the
    case's step time (the slowest rank's median), throughput, and the step-time ratios to the reference
    workload."""
    # an emulated rank's loss is of garbage on purpose: not a loss of the case (engine/emulate.py)
    losses = losses_by_rank if not case.emulate else []
    n = min((len(x) for x in losses), default=0)
    global_losses = [statistics.fmean(x[i] for x in losses) for i in range(n)] if n else []
    medians = [r[STEP_TIME] for r in ranks if r.get(STEP_TIME) is not None]
    case_step = max(medians) if len(medians) == len(ranks) and medians else None
    series = [ratio_series(r, case.device) for r in ranks]
    out: dict[str, Any] = {
        LOSSES: global_losses,
        LOSS_FIRST: global_losses[0] if global_losses else None,
        LOSS_FINAL: global_losses[-1] if global_losses else None,
        CASE_STEP_TIME: case_step,
        # per block, vs the in-process reference (engine/reference.py)
        STEP_TIME_REF_RATIOS: block_ratios(
            [s for s, _ in series], [r for _, r in series], case.time_block_steps
        ),
        STEP_TIME_REF_OTHER_LOAD: other_load_share(ranks, case.device),
    }
    if case_step:
        out.update(_throughput_columns(case, case_step))
    if case.emulate:
        from fsdpbench.engine.emulate import WHY_NO_LOSS as why_no_loss

        out[LOSS_SKIPPED_REASON] = why_no_loss
        out[THROUGHPUT_SAMPLES] = out[THROUGHPUT_TOKENS] = None  # compute-only time: not a throughput
    return out


def _throughput_columns(case: Case, case_step_ms: float) -> dict[str, Any]:
    samples_s = case.global_batch_size / (case_step_ms / 1e3)
    tokens_s = samples_s * case.seq_len if _is_sequence(case) else None
    return {THROUGHPUT_SAMPLES: samples_s, THROUGHPUT_TOKENS: tokens_s}


def _flops_columns(case: Case, row: dict[str, Any]) -> dict[str, Any]:
    """Counted FLOPs of a rank's step; achieved TFLOP/s; MFU on GPUs with a known peak."""
    from fsdpbench.metrics.flops import achieved_tflops, mfu, step_flops

    try:
        flops = step_flops(
            case.model, json.dumps(case.model_args, sort_keys=True), case.batch_size, case.seq_len
        )
    except Exception:  # noqa: BLE001 — a model FlopCounterMode cannot run on meta: no FLOPs, no crash
        return {}
    ms = row.get(STEP_TIME)
    return {
        FLOPS_PER_STEP: flops,
        ACHIEVED_TFLOPS: achieved_tflops(flops, ms) if ms else None,
        MFU: mfu(flops, ms, row.get(DEVICE_NAME) or "", case.precision_spec) if ms else None,
    }


def skipped_rows(case: Case, reason: str, env: dict[str, Any]) -> pd.DataFrame:
    row = {**case_to_columns(case), RANK: -1, STATUS: SKIPPED, ERROR: reason}
    row.update(case_status=SKIPPED, case_error=reason, **_env_columns(env, case))
    return pd.DataFrame([row])


def _is_sequence(case: Case) -> bool:
    from fsdpbench.models import resolve_model

    return resolve_model(case.model, case.model_args)[0].is_sequence


def _env_columns(env: dict[str, Any], case: Case) -> dict[str, Any]:
    from fsdpbench.store.env import device_name

    return {
        DEVICE_NAME: device_name(case.device),
        TORCH_VERSION: env.get(TORCH_VERSION),
        COMMIT: env.get(COMMIT),
        HOSTNAME: env.get(HOSTNAME),
    }


class RunStore:
    """Read and write one run directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.cases_dir = self.run_dir / "cases"

    def create(self) -> None:
        self.cases_dir.mkdir(parents=True, exist_ok=True)
        check_inside(self.cases_dir, self.run_dir)

    def lock(self) -> RunLock:
        """The run directory's lock (``with store.lock():``): one run at a time per directory."""
        return RunLock(self.run_dir)

    def case_dir(self, case_id: str) -> Path:
        """Where a case's ranks write; checked to be one safe name inside cases/."""
        return check_inside(self.cases_dir / check_component(case_id), self.cases_dir)

    def write_case(self, case_id: str, rows: pd.DataFrame) -> None:
        """Store one case's rows, then refresh results.parquet (both atomically)."""
        path = check_inside(self.cases_dir / f"{check_component(case_id)}.parquet", self.cases_dir)
        atomic_write_parquet(path, rows)
        self.consolidate()

    def merge_timelines(self, case_id: str) -> None:
        """The ranks' memory timelines (timeline_rank{R}.parquet) as one cases/<id>/timeline.parquet."""
        case_dir = self.case_dir(case_id)
        parts = sorted(case_dir.glob("timeline_rank*.parquet"))
        if parts:
            atomic_write_parquet(case_dir / "timeline.parquet", pd.concat([read_parquet(p) for p in parts]))
            for part in parts:
                part.unlink()

    def completed_ids(self) -> set[str]:
        """The cases stored in full: a case file that is not readable parquet (cut short by a crash, or
        not fsdpbench's) is not done, and --resume measures the case again."""
        return {p.stem for p in self.cases_dir.glob("*.parquet") if _readable_parquet(p)}

    def consolidate(self) -> pd.DataFrame:
        frame = self.load_cases()
        if not frame.empty:
            try:
                atomic_write_parquet(self.run_dir / "results.parquet", frame)
            except OSError:
                raise
            except Exception as exc:  # noqa: BLE001 — pyarrow's ArrowTypeError/ArrowInvalid: columns that disagree
                raise ResultsFileError(
                    f"{self.cases_dir}: the case files cannot be stored as one table, a column differs in "
                    f"type ({type(exc).__name__}: {str(exc)[:200]}); a case file of another run or version?"
                ) from None
        return frame

    def load_cases(self) -> pd.DataFrame:
        files = sorted(self.cases_dir.glob("*.parquet"), key=lambda p: p.stat().st_mtime)
        frames = [read_results_file(p) for p in files]
        frames = [f for f in frames if not f.empty]
        if not frames:
            return pd.DataFrame(columns=CORE_COLUMNS)
        frame = pd.concat(frames, ignore_index=True)
        ordered = [c for c in CORE_COLUMNS if c in frame.columns]
        return frame[ordered + [c for c in frame.columns if c not in ordered]]

    def write_run_json(self, meta: dict[str, Any]) -> None:
        """run.json, its format version first."""
        atomic_write_json(self.run_dir / "run.json", RUN_JSON.stamped(meta))

    def read_run_json(self) -> dict[str, Any]:
        """run.json, checked (input from a stranger): an object whose known fields have their types."""
        path = self.run_dir / "run.json"
        if not path.exists() and not path.is_symlink():
            return {}
        try:
            meta = read_json(path, MAX_RUN_JSON_BYTES, what="run.json", follow_links=False)
        except ReadBackError as exc:
            raise ResultsFileError(str(exc)) from None
        if not isinstance(meta, dict):
            raise ResultsFileError(f"{path}: expected a JSON object, got {type(meta).__name__}")
        try:
            RUN_JSON.check(path, meta.get(FORMAT_VERSION))
        except FormatVersionError as exc:
            raise ResultsFileError(str(exc)) from None
        for field, kind in _RUN_JSON_FIELDS.items():
            if field in meta and not isinstance(meta[field], kind):
                raise ResultsFileError(f"{path}: field {field!r} has type {type(meta[field]).__name__}")
        for field, kind in _RUN_JSON_ENTRIES.items():
            for key, value in (meta.get(field) or {}).items():
                if not isinstance(value, kind):
                    raise ResultsFileError(f"{path}: field {field}.{key} has type {type(value).__name__}")
        return meta


class ResultsFileError(ValueError):
    """A results file fsdpbench reads back is unusable: one line naming the file (and the field)."""


MAX_RUN_JSON_BYTES = 64 << 20
_RUN_JSON_FIELDS: dict[str, type | tuple[type, ...]] = {
    "cases": dict,
    "env": dict,
    STATUS: str,
    "scenario": (str, dict),
    "overrides": dict,
    "predictions": list,
    "emulation": dict,
    "step_time_model": dict,
    "command": str,
    "started": str,
    "host_tuning": str,  # the words of runner.host_tuning_record
    "gloo_loop_policy": str,  # a run's from before cases recorded their host tuning
}
# the mappings of run.json whose every entry is itself of a type (a case's launch record is an object)
_RUN_JSON_ENTRIES: dict[str, type | tuple[type, ...]] = {"cases": dict}


def _readable_parquet(path: Path) -> bool:
    import pyarrow.parquet as pq

    try:
        with open(path, "rb") as file:
            pq.read_metadata(file)
    except Exception:  # noqa: BLE001 — pyarrow raises its own ArrowInvalid, or OSError: unreadable either way
        return False
    return True


def read_parquet(path: Path) -> pd.DataFrame:
    """A parquet file, opened by Python: pyarrow encodes a path as UTF-8 and fails on one that is not
    (a run directory named in another encoding), which the file system itself accepts."""
    with open(path, "rb") as file:
        return pd.read_parquet(file)


def read_results_file(path: Path) -> pd.DataFrame:
    """One parquet file of a run (results.parquet, cases/<id>.parquet), bounded in size (by reading),
    its format version checked, and checked as a results table (``check_results_frame``);
    ResultsFileError if unusable or of a version this fsdpbench does not read."""
    import pyarrow.parquet as pq

    try:
        data = read_bounded(path, MAX_RESULTS_BYTES, what="results file", follow_links=False)
        RESULTS.check_parquet_metadata(path, pq.read_schema(io.BytesIO(data)).metadata)
        frame = pd.read_parquet(io.BytesIO(data))
    except (ReadBackError, FormatVersionError) as exc:
        raise ResultsFileError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 — ArrowInvalid, OSError, ValueError: all mean unusable
        raise ResultsFileError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from None
    check_results_frame(frame, path)
    return frame


MAX_RESULTS_BYTES = 1 << 30  # 10,000 cases × 4096 ranks' rows stay far below it


def check_results_frame(frame: pd.DataFrame, source: str | Path) -> None:
    """A table read back is a results table: its case ids text, its statuses known, its losses and
    step-time samples lists of numbers; ResultsFileError names the file, the column and the row. (The
    configuration columns are checked as a scenario's case where a case is rebuilt from them:
    ``pipeline.scenario.case_from_row``.)"""
    if frame.empty:
        return
    for col in (CASE_ID, STATUS):
        if col not in frame.columns:
            raise ResultsFileError(f"{source}: no column {col}: not a fsdpbench results table")
    bad_id = frame.index[~frame[CASE_ID].map(lambda v: isinstance(v, str) and bool(v))]
    if len(bad_id):
        raise ResultsFileError(f"{source}: column {CASE_ID}, row {bad_id[0]}: not a case id")
    bad_status = frame.index[~frame[STATUS].isin(STATUSES)]
    if len(bad_status):
        value = frame.at[bad_status[0], STATUS]
        raise ResultsFileError(
            f"{source}: column {STATUS}, row {bad_status[0]}: {value!r}; allowed: {', '.join(STATUSES)}"
        )
    for col in (LOSSES, STEP_TIME_REF_RATIOS):
        if col in frame.columns:
            for i, cell in frame[col].items():
                if not _numbers_or_none(cell):
                    raise ResultsFileError(f"{source}: column {col}, row {i}: not a list of numbers")


def _numbers_or_none(cell: Any) -> bool:
    """None, or a list (an array, as Parquet gives it back) of numbers; NaN in it is a number (a
    diverged loss is a measurement), and so is None (Parquet gives an all-NaN list back as nulls)."""
    if cell is None:
        return True
    if isinstance(cell, float):
        return cell != cell  # a missing list comes back as NaN
    if isinstance(cell, (str, bytes)) or not hasattr(cell, "__len__"):
        return False
    numbers = (int, float, np.integer, np.floating)
    return all(v is None or (isinstance(v, numbers) and not isinstance(v, bool)) for v in cell)


def load_results(run_dir: str | Path) -> pd.DataFrame:
    """The results table of a run directory (pandas); ResultsFileError names a file that is unusable."""
    run_dir = Path(run_dir)
    path = run_dir / "results.parquet"
    if path.exists():
        return read_results_file(path)
    return RunStore(run_dir).load_cases()
