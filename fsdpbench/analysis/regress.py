"""Compare a run against a stored baseline, case by case and metric by metric (the CI gate).

    baseline = build_baseline(load_results(run_a), run_meta)     # → small JSON, committed
    result = compare(baseline, load_results(run_b))              # → DifferenceReport: one typed
    result.passed                                                 #   MetricDifference per case × metric;
    # passed is the exit code's contract; commands/regress renders the report as a table, Markdown, JSON

What is compared, and how (docs/ci.md explains why):
- memory / comm bytes (tracker live tensors, exact storage, comm volume): deterministic on CPU, so
  a tight relative tolerance (1%), the largest rank of each case;
- step time: noisy and machine-dependent. The gate is ``step_time_ref_ratios``: per block, the
  case's step time over a fixed reference workload run step by step in the same rank processes
  (``fsdpbench.engine.reference``), compared as distributions — a minimum effect (10%) AND a
  Mann–Whitney U test (``fsdpbench.analysis.timegate``). Single numbers are reported beside it (warn only
  when the samples exist): the ratio to the reference *case* of the same run (the DDP case with the
  same model, batch and world size, or a named calibration case, 25%), and the absolute step time
  when the machine matches;
- losses (global mean per step): a changed loss means the benchmark trains something else, so any
  change beyond 1e-4 relative, in either direction, fails.
A case missing from the run, failed, or skipped where it ran before is a regression; a case
not in the baseline is reported as new. Host tuning (a case's ``host_tuning``) is part of what a step
time is: a run case and a baseline case that differ only in it are the same case, whose memory,
communication and losses are gated and whose times are "not comparable".
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from fsdpbench.analysis.frame import (
    REFERENCE_STRATEGY,
    case_frame,
    case_mode,
    rank_maxima,
    time_references,
)
from fsdpbench.analysis.timegate import ALPHA, MAX_OTHER_LOAD, as_launches, flat
from fsdpbench.core.case import HOST_TUNINGS, NO_HOST_TUNING, PIN, PIN_IDLE_LOOPS
from fsdpbench.core.formats import BASELINE, BASELINE_SAMPLES_BY_LAUNCH, FORMAT_VERSION, FormatVersionError
from fsdpbench.core.numbers import number
from fsdpbench.core.readback import ReadBackError, finite_number, read_json
from fsdpbench.core.schema import (
    ALLOC_PEAK_ALLOCATED,
    CASE_STEP_TIME,
    CKPT_CASE_BYTES,
    CKPT_CASE_LOAD_S,
    CKPT_CASE_SAVE_S,
    CKPT_RANK0_HOST_PEAK,
    COMM_TOTAL,
    COMMIT,
    DEVICE,
    DEVICE_NAME,
    ERROR,
    FAILED,
    GLOO_LOOPS_IDLE,
    HARNESS_OVERHEAD_RATIO,
    HOST_TUNING,
    HOSTNAME,
    LOSSES,
    OK,
    RUN,
    RUN_CASE_ID,
    SKIPPED,
    STATUS,
    STATUSES,
    STEP_TIME_REF_OTHER_LOAD,
    STEP_TIME_REF_RATIOS,
    TORCH_VERSION,
    TRACKER_CATEGORIES,
    TRACKER_MODEL_STATES,
    TRACKER_PEAK,
    case_from_columns,
    tracker_peak_column,
)

# what says a file is a baseline (its value never changes); its layout's version is BASELINE's format_version
BASELINE_MARKER = "fsdpbench_baseline"
KINDS = ("memory", "comm", "time", "loss")
GATES = ("fail", "warn", "off")
FAILING = ("regressed", "changed", "missing", FAILED)
NOT_COMPARABLE = "not comparable"  # a time metric measured under another host tuning, or by another method
NOT_COMPARED = (
    "not compared"  # machine differs; step-time samples taken beyond the load the gate is rated for
)


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricDef:
    """How one metric is gated by default."""

    kind: str  # memory | comm | time | loss
    tolerance: float  # relative
    deterministic: bool = True  # with --strict, an improvement beyond tolerance fails too
    same_machine: bool = False  # compared only when the machine fingerprint matches


_MEM = MetricDef(kind="memory", tolerance=0.01)
METRICS: dict[str, MetricDef] = {
    TRACKER_PEAK: _MEM,
    TRACKER_MODEL_STATES: _MEM,
    **{tracker_peak_column(cat): _MEM for cat in TRACKER_CATEGORIES},
    # CUDA caching allocator (GPU runs only): close to deterministic, not exactly
    ALLOC_PEAK_ALLOCATED: MetricDef(kind="memory", tolerance=0.05, deterministic=False),
    COMM_TOTAL: MetricDef(kind="comm", tolerance=0.01),
    "step_time_ratio": MetricDef(kind="time", tolerance=0.25, deterministic=False),
    CASE_STEP_TIME: MetricDef(kind="time", tolerance=0.25, deterministic=False, same_machine=True),
    # with a bare loop (bare_steps): the harness's own per-step cost, timed / bare − its slowest rank's;
    # MFU is not gated (on a machine it is the step time's inverse; on CPU ranks it is not meaningful)
    HARNESS_OVERHEAD_RATIO: MetricDef(kind="time", tolerance=0.25, deterministic=False, same_machine=True),
    # samples, one per block; the tolerance is the minimum effect (fsdpbench.analysis.timegate)
    STEP_TIME_REF_RATIOS: MetricDef(kind="time", tolerance=0.10, deterministic=False),
    LOSSES: MetricDef(kind="loss", tolerance=1e-4),
    # the checkpoint phase: bytes on disk are deterministic; the RSS spike is sampled, so
    # close to, not exactly, repeatable; save and load time are one sample each, so same machine only
    CKPT_CASE_BYTES: _MEM,
    CKPT_RANK0_HOST_PEAK: MetricDef(kind="memory", tolerance=0.10, deterministic=False),
    CKPT_CASE_SAVE_S: MetricDef(kind="time", tolerance=0.25, deterministic=False, same_machine=True),
    CKPT_CASE_LOAD_S: MetricDef(kind="time", tolerance=0.25, deterministic=False, same_machine=True),
}
# gated metrics a case row holds itself (fsdpbench/analysis/checkpoint.py), not a maximum over ranks
CASE_LEVEL_METRICS = (CKPT_CASE_BYTES, CKPT_RANK0_HOST_PEAK, CKPT_CASE_SAVE_S, CKPT_CASE_LOAD_S)
MACHINE_KEYS = (HOSTNAME, DEVICE_NAME, TORCH_VERSION)
PROVENANCE_KEYS = (TORCH_VERSION, "backend", "device", DEVICE_NAME, COMMIT, HOSTNAME)


# a relative tolerance beyond this lets a metric double (a gate that cannot fail); warn or off says so openly
MAX_TOLERANCE = 1.0
# a metric's largest value: an exabyte, or a step of thirty thousand years in ms; beyond it, a forgery
MAX_METRIC_VALUE = 1e18


class BaselineError(ValueError):
    """A baseline file or a threshold is malformed; the message names the file/field."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Threshold:
    tolerance: float
    gate: str = "fail"


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricDifference:
    """One case × metric of a comparison; ``metric`` "case" is the case itself (missing, failed, new)."""

    case_id: str  # the baseline's id (after --map-strategy)
    metric: str
    kind: str  # memory | comm | time | loss | case
    baseline: Any  # the baseline's value (a median for samples, the last loss; a case row: its status)
    now: Any  # the run's, alike
    change: float | None  # relative; for samples the effect, for losses the largest over steps
    tolerance: float | None
    gate: str | None  # fail | warn | off
    verdict: str  # ok | regressed | improved | changed | missing | failed | warn | new | not compared |
    # not comparable (a time metric measured under another host tuning; its note says which)
    fails: bool
    note: str
    run_case_id: str  # the id the case ran as
    effect_low: float | None = None  # sampled step time: the effect's confidence interval
    effect_high: float | None = None
    p_value: float | None = None  # sampled step time: Mann–Whitney U
    mode: str = "real"  # emulated: one rank alone with a fake process group


@dataclass(kw_only=True)
class DifferenceReport:
    """The comparison as data (rendering is ``commands/regress``'s): every difference, and notes about
    the whole comparison. ``passed`` is the gate's contract."""

    differences: list[MetricDifference]
    machine_matches: bool
    notes: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[MetricDifference]:
        return [d for d in self.differences if d.fails]

    @property
    def passed(self) -> bool:
        return not self.failures

    def notable(self) -> list[MetricDifference]:
        """Failures, warnings, improvements and new cases: what a reader looks at first."""
        return [d for d in self.differences if d.fails or d.verdict in ("warn", "improved", "new")]

    def verdict_counts(self) -> dict[str, int]:
        """How many differences of each verdict, by verdict name."""
        counts: dict[str, int] = {}
        for d in self.differences:
            counts[d.verdict] = counts.get(d.verdict, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def records(self) -> pd.DataFrame:
        """The differences as a table, one row each, a column per field."""
        names = [f.name for f in dataclasses.fields(MetricDifference)]
        return pd.DataFrame([dataclasses.asdict(d) for d in self.differences], columns=names)

    @property
    def n_compared(self) -> int:
        """Metrics actually compared with the baseline's (not a case's presence, not 'not compared')."""
        return sum(1 for d in self.differences if d.metric != "case" and d.verdict != "not compared")


def check_compared(result: DifferenceReport, baseline_path: str | Path) -> None:
    """A gate that compared nothing has not passed: BaselineError (exit 2) when nothing failed and no
    metric of the baseline was compared (its cases empty, all skipped, without metrics, or every gate
    off)."""
    if result.passed and result.n_compared == 0:
        what = ", ".join(f"{n} {v}" for v, n in result.verdict_counts().items()) or "no cases"
        raise BaselineError(
            f"{baseline_path}: cases: no metric compared ({what}); a gate that compares nothing has not "
            "passed: re-write the baseline from a run whose cases are ok"
        )


# ---- thresholds ---------------------------------------------------------------------------------


def parse_threshold(text: str, *, where: str = "--threshold") -> tuple[str, Threshold]:
    """'METRIC=TOL[:GATE]' (METRIC may be a kind: memory, comm, time, loss); TOL as 0.01 or 1%."""
    name, sep, value = text.partition("=")
    tol_text, _, gate = value.partition(":")
    if not sep or not name:
        raise BaselineError(
            f"{where} {text!r}: expected METRIC=TOLERANCE[:GATE], e.g. step_time_ratio=50%:warn"
        )
    check_metric_name(name.strip(), where=f"{where} {text!r}")
    return name.strip(), make_threshold(
        {"tolerance": tol_text.strip(), "gate": gate.strip() or "fail"}, f"{where} {text!r}"
    )


def make_threshold(raw: Any, where: str) -> Threshold:
    if not isinstance(raw, Mapping):
        raise BaselineError(f"{where}: a threshold is {{'tolerance': 0.01, 'gate': 'fail'}}, got {raw!r}")
    tol: Any = raw.get("tolerance")
    if isinstance(tol, bool):
        raise BaselineError(f"{where}: tolerance {tol!r} is not a number (0.01 or 1%)")
    try:
        tol = float(tol.rstrip("%")) / 100 if isinstance(tol, str) and tol.endswith("%") else float(tol)
    except (TypeError, ValueError, OverflowError):
        raise BaselineError(f"{where}: tolerance {_short(tol)} is not a number (0.01 or 1%)") from None
    gate = raw.get("gate", "fail")
    if gate not in GATES or not (0 <= tol < math.inf):
        raise BaselineError(
            f"{where}: gate must be one of {', '.join(GATES)} and tolerance a finite number >= 0 "
            f"(got {_short(raw)})"
        )
    if tol > MAX_TOLERANCE:
        raise BaselineError(
            f"{where}: tolerance {tol:g} is beyond the maximum {MAX_TOLERANCE:g} ({MAX_TOLERANCE:.0%}), "
            "which would let the metric double unnoticed; to stop gating it say so: gate warn or off"
        )
    return Threshold(tolerance=tol, gate=gate)


def check_metric_name(name: str, *, where: str) -> None:
    if name not in METRICS and name not in KINDS:
        raise BaselineError(f"{where}: unknown metric {name!r}; allowed: {', '.join([*KINDS, *METRICS])}")


def default_thresholds() -> dict[str, Threshold]:
    return {name: Threshold(tolerance=m.tolerance) for name, m in METRICS.items()}


def resolve_threshold(metric: str, layers: list[Mapping[str, Threshold]]) -> Threshold:
    """The first layer (highest priority first) naming the metric, or its kind, wins."""
    for layer in layers:
        for key in (metric, METRICS[metric].kind):
            if key in layer:
                return layer[key]
    return Threshold(tolerance=METRICS[metric].tolerance)


# ---- what a run measured, per case ----------------------------------------------------------------


def apply_strategy_map(frame: pd.DataFrame, mapping: Mapping[str, str]) -> pd.DataFrame:
    """Rename strategies (run → baseline) and recompute case ids, so a plugin's cases match the
    baseline cases of the strategy it stands in for; the original id stays in ``run_case_id``."""
    frame = frame.copy()
    frame[RUN_CASE_ID] = frame["case_id"]
    if not mapping:
        return frame
    unknown = set(mapping) - set(frame["strategy"])
    if unknown:
        raise BaselineError(
            f"--map-strategy: {sorted(unknown)} not in the run; its strategies: "
            f"{', '.join(sorted(frame['strategy'].unique()))}"
        )
    for i, row in frame.iterrows():
        if row["strategy"] not in mapping:
            continue
        case = case_from_columns(row)
        if case.case_id != row["case_id"]:
            raise BaselineError(
                f"--map-strategy: case {row['case_id']}: its id cannot be rebuilt from the "
                "results columns (a run from another fsdpbench version?)"
            )
        frame.at[i, "strategy"] = mapping[row["strategy"]]
        frame.at[i, "case_id"] = case.replace(strategy=mapping[row["strategy"]]).case_id
    ids = frame.groupby("case_id")[RUN_CASE_ID].nunique()
    if (ids > 1).any():
        clash = ids[ids > 1].index[0]
        both = sorted(frame.loc[frame["case_id"] == clash, RUN_CASE_ID].unique())
        raise BaselineError(
            f"--map-strategy: {' and '.join(both)} would both be compared as {clash}; "
            "run the plugin in a run of its own"
        )
    return frame


def case_records(frame: pd.DataFrame, reference: str = REFERENCE_STRATEGY) -> dict[str, dict[str, Any]]:
    """Per case (``analysis_frame.case_frame``): status, error, memory/comm maxima over ranks, the case
    step time, losses, step-time samples, and the case its step time is compared with (``reference``)."""
    cases = case_frame(frame.drop(columns=RUN, errors="ignore"))
    gated = [name for name, m in METRICS.items() if m.kind in ("memory", "comm")]
    maxima = rank_maxima(frame, gated)
    refs = time_references(cases, reference)
    loops_idle = gloo_loops_idle(frame)
    out: dict[str, dict[str, Any]] = {}
    for i, case in cases.iterrows():
        cid = case["case_id"]
        out[cid] = {
            STATUS: case[STATUS],
            ERROR: case[ERROR],
            "strategy": case["strategy"],
            "world_size": int(case["world_size"]),
            RUN_CASE_ID: case.get(RUN_CASE_ID, cid),
            "metrics": _measured(case, maxima.loc[cid] if cid in maxima.index else pd.Series())
            if case[STATUS] == OK
            else {},
            "mode": case_mode(case),
            "time_reference": None if refs[i] is None else cases.at[refs[i], "case_id"],
            HOST_TUNING: str(case[HOST_TUNING])
            if HOST_TUNING in case and isinstance(case[HOST_TUNING], str)
            else legacy_host_tuning(str(case.get(DEVICE)), loops_idle),
            "ids_by_tuning": _ids_by_tuning(case),
            STEP_TIME_REF_OTHER_LOAD: number(case.get(STEP_TIME_REF_OTHER_LOAD)),
        }
    return out


def legacy_host_tuning(device: str, loops_idle: bool) -> str:
    """The host tuning of a run or baseline written before fsdpbench recorded it: its launcher pinned every
    CPU rank (where each had a core per thread) and put their gloo loop threads under SCHED_IDLE where the
    ranks' ``gloo_loops_idle`` says so; GPU ranks ran as the machine runs them."""
    if device != "cpu":
        return NO_HOST_TUNING
    return PIN_IDLE_LOOPS if loops_idle else PIN


def _ids_by_tuning(case: pd.Series) -> dict[str, str]:
    """The case's id under each host tuning, everything else the same ({} where its columns do not give
    back its id: a run from another fsdpbench version)."""
    try:
        rebuilt = case_from_columns(case)
    except (TypeError, ValueError):
        return {}
    if rebuilt.case_id != case["case_id"]:
        return {}
    return {tuning: rebuilt.replace(host_tuning=tuning).case_id for tuning in HOST_TUNINGS}


def _measured(case: pd.Series, maxima: pd.Series) -> dict[str, Any]:
    """The gated metrics of one finished case."""
    metrics: dict[str, Any] = {name: int(v) for name, v in maxima.items() if number(v) is not None}
    for name in (CASE_STEP_TIME, HARNESS_OVERHEAD_RATIO):  # the case's (case_frame: its slowest rank's)
        value = number(case.get(name))
        if value is not None:
            metrics[name] = value
    for name in CASE_LEVEL_METRICS:
        value = number(case.get(name))
        if value is not None:
            metrics[name] = int(value) if METRICS[name].kind == "memory" else round(value, 4)
    values = case.get(LOSSES)
    if values is not None and len(values):  # Parquet gives an all-NaN list back as nulls
        metrics[LOSSES] = [math.nan if x is None else float(x) for x in values]
    values = case.get(SAMPLED)  # one launch's blocks, or (regress --repeat) several launches'
    if values is not None and len(values):
        items = list(values)
        nested = all(hasattr(x, "__len__") for x in items)
        metrics[SAMPLED] = as_launches([list(x) for x in items] if nested else items)
    return metrics


def time_ratio(cases: Mapping[str, dict[str, Any]], case_id: str, ref_id: str) -> float | None:
    ref = cases.get(ref_id)
    if not ref or ref[STATUS] != OK:
        return None
    num, den = cases[case_id]["metrics"].get(CASE_STEP_TIME), ref["metrics"].get(CASE_STEP_TIME)
    return num / den if num and den else None


def gloo_loops_idle(frame: pd.DataFrame) -> bool:
    """Whether any of the run's CPU ranks had gloo's loop threads under SCHED_IDLE (a run from before the
    column: as gloo leaves them, the only behaviour there was)."""
    if GLOO_LOOPS_IDLE not in frame:
        return False
    return bool((pd.to_numeric(frame[GLOO_LOOPS_IDLE], errors="coerce").fillna(0) > 0).any())


def machine_of(frame: pd.DataFrame) -> dict[str, str]:
    ok = frame[frame.get(STATUS, pd.Series(OK, index=frame.index)) != SKIPPED]
    row = (ok if not ok.empty else frame).iloc[0]
    return {k: str(row.get(k)) for k in MACHINE_KEYS}


# ---- the baseline file ----------------------------------------------------------------------------


def build_baseline(
    frame: pd.DataFrame,
    run_meta: Mapping[str, Any] | None = None,
    *,
    thresholds: Mapping[str, Threshold] | None = None,
    time_reference: str = REFERENCE_STRATEGY,
    pool: Sequence[pd.DataFrame] = (),
) -> dict[str, Any]:
    """The baseline document for a run: provenance, thresholds, and one entry per case.

    ``pool``: other runs of the same cases, whose step-time samples join this run's, each run's as
    launches of their own."""
    cases = case_records(frame, time_reference)
    for other in pool:
        for cid, c in case_records(other).items():
            if cid in cases and SAMPLED in cases[cid]["metrics"] and SAMPLED in c["metrics"]:
                cases[cid]["metrics"][SAMPLED] += c["metrics"][SAMPLED]
    bad = {
        cid: c[ERROR].splitlines()[0][:200] if c[ERROR] else c[STATUS]
        for cid, c in cases.items()
        if c[STATUS] not in (OK, SKIPPED)
    }
    if bad:
        raise BaselineError(
            "cannot write a baseline from a run with failed cases: "
            + "; ".join(f"{k}: {v}" for k, v in bad.items())
        )
    merged = {**default_thresholds(), **(thresholds or {})}
    return {
        FORMAT_VERSION: BASELINE.version,
        BASELINE_MARKER: 1,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "provenance": _provenance(frame, run_meta or {}),
        "machine": machine_of(frame),
        "time_reference": time_reference,
        "thresholds": {k: dataclasses.asdict(v) for k, v in merged.items()},
        "cases": {cid: _baseline_entry(cid, cases) for cid in cases},
    }


def _baseline_entry(cid: str, cases: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """One case of the baseline: status, strategy, world size, its metrics rounded as stored."""
    c = cases[cid]
    entry: dict[str, Any] = {
        STATUS: c[STATUS],
        "strategy": c["strategy"],
        "world_size": c["world_size"],
        HOST_TUNING: c[HOST_TUNING],
    }
    if c["mode"] == "emulated":  # only then: baselines of real runs stay as they were
        entry["mode"] = "emulated"
    if c[STATUS] == SKIPPED:
        entry["reason"] = c[ERROR]
    rounded = {CASE_STEP_TIME: 3, HARNESS_OVERHEAD_RATIO: 4}
    metrics = {k: (round(v, rounded[k]) if k in rounded else v) for k, v in c["metrics"].items()}
    if LOSSES in metrics:
        metrics[LOSSES] = [float(f"{x:.7g}") for x in metrics[LOSSES]]
    if SAMPLED in metrics:  # by launch (the unit of the time verdict), each sorted: a smaller diff
        metrics[SAMPLED] = [sorted(round(x, 4) for x in launch) for launch in metrics[SAMPLED]]
    ref = c["time_reference"]
    if ref is not None:
        entry["time_reference"] = ref
        ratio = time_ratio(cases, cid, ref)
        if ratio is not None:
            metrics["step_time_ratio"] = round(ratio, 4)
    entry["metrics"] = metrics
    return entry


def _provenance(frame: pd.DataFrame, run_meta: Mapping[str, Any]) -> dict[str, Any]:
    """Where the baseline's numbers come from: the first row's environment and the run's metadata."""
    first = frame.iloc[0]
    env = run_meta.get("env") or {}
    provenance: dict[str, Any] = {
        k: (None if pd.isna(first.get(k)) else str(first.get(k))) for k in PROVENANCE_KEYS
    }
    provenance.update(
        cpu=env.get("cpu"),
        python_version=env.get("python_version"),
        scenario=(run_meta.get("scenario") or {}).get("name") or str(first.get("scenario")),
        run_command=run_meta.get("command"),
        run_started=run_meta.get("started"),
    )
    return provenance


def write_baseline(path: str | Path, baseline: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")


MAX_BASELINE_BYTES = 64 << 20  # ci.json is ~100 KB for 12 cases: room for a 10,000-case study
MAX_BASELINE_CASES = 10_000  # a scenario's own limit (pipeline/scenario.MAX_CASES)


def load_baseline(path: str | Path) -> dict[str, Any]:
    """Read and check a baseline file (input from a stranger: every field of its type, every number
    finite and in range, its size bounded by reading); errors name the file and the field."""
    try:
        data = read_json(path, MAX_BASELINE_BYTES, what="baseline")
    except ReadBackError as exc:
        raise BaselineError(str(exc)) from None
    marker = data.get(BASELINE_MARKER) if isinstance(data, dict) else None
    if type(marker) is not int or marker != 1:  # True == 1 in Python, not here
        raise BaselineError(
            f"{path}: not a fsdpbench baseline ({BASELINE_MARKER}: 1 missing); "
            "write one with: fsdpbench regress RUN_DIR --write-baseline PATH"
        )
    try:
        BASELINE.check(path, data.get(FORMAT_VERSION))
    except FormatVersionError as exc:
        raise BaselineError(str(exc)) from None
    if not isinstance(data.get("cases"), dict):
        raise BaselineError(f"{path}: cases: expected a mapping case_id → entry")
    if len(data["cases"]) > MAX_BASELINE_CASES:
        raise BaselineError(f"{path}: cases: {len(data['cases'])} entries, more than {MAX_BASELINE_CASES}")
    for key in ("machine", "provenance"):
        if not isinstance(data.get(key, {}), dict):
            raise BaselineError(f"{path}: {key}: expected a mapping, got {type(data[key]).__name__}")
    for key, value in data.get("machine", {}).items():
        if not isinstance(value, (str, type(None))):
            raise BaselineError(f"{path}: machine.{key}: expected text, got {_short(value)}")
    if not isinstance(data.get("time_reference", ""), str):
        raise BaselineError(f"{path}: time_reference: expected a strategy or a case id")
    data["thresholds"] = _thresholds_of(data.get("thresholds") or {}, f"{path}: thresholds")
    for cid, entry in data["cases"].items():
        _check_entry(entry, f"{path}: cases.{cid}")
    return data


_ENTRY_TYPES: dict[str, type | tuple[type, ...]] = {
    "strategy": str,
    "world_size": int,
    "time_reference": str,
    "mode": str,
    "reason": (str, type(None)),
    "metrics": dict,
}


def _check_entry(entry: Any, where: str) -> None:
    """One case of a baseline: {status, metrics: {...}}, each known field of its type."""
    if not isinstance(entry, dict) or entry.get(STATUS) not in STATUSES:
        raise BaselineError(f"{where}: expected {{status ({', '.join(STATUSES)}), metrics: {{...}}}}")
    for key, kind in _ENTRY_TYPES.items():
        if key in entry and (isinstance(entry[key], bool) or not isinstance(entry[key], kind)):
            raise BaselineError(f"{where}.{key}: {_short(entry[key])} is not of type {_type_name(kind)}")
    tuning = entry.get(HOST_TUNING, NO_HOST_TUNING)
    if not isinstance(tuning, str) or tuning not in HOST_TUNINGS:  # a list is no key of HOST_TUNINGS
        raise BaselineError(
            f"{where}.{HOST_TUNING}: {_short(entry[HOST_TUNING])}; expected one of {', '.join(HOST_TUNINGS)}"
        )
    for name, value in entry.get("metrics", {}).items():
        check_metric_name(name, where=f"{where}.metrics")
        _check_metric_value(name, value, f"{where}.metrics.{name}")
    entry["thresholds"] = _thresholds_of(entry.get("thresholds") or {}, f"{where}.thresholds")


def _check_metric_value(name: str, value: Any, where: str) -> None:
    """A baseline's metric is a finite number in range, or (losses, time samples) a non-empty list of
    them: a NaN would compare as neither larger nor smaller and pass every gate."""
    if name == SAMPLED and isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        if not all(value):  # samples by launch (BASELINE_SAMPLES_BY_LAUNCH)
            raise BaselineError(f"{where}: a launch without samples; expected non-empty lists of numbers")
        values = [v for launch in value for v in launch]
    elif name in (LOSSES, SAMPLED):
        if not isinstance(value, list) or not value:
            raise BaselineError(f"{where}: expected a non-empty list of numbers, got {_short(value)}")
        values = value
    else:
        values = [value]
    low = None if name == LOSSES else 0.0
    for v in values:
        try:
            finite_number(v, where, low=low, high=MAX_METRIC_VALUE)
        except ReadBackError as exc:
            raise BaselineError(str(exc)) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"… ({len(text)} characters)"


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def _as_thresholds(raw: Any, where: str) -> dict[str, Threshold]:
    """Thresholds as loaded (Threshold) or as in the JSON (dicts)."""
    raw = raw or {}
    if all(isinstance(v, Threshold) for v in raw.values()):
        return dict(raw)
    return _thresholds_of(raw, where)


def _thresholds_of(raw: Any, where: str) -> dict[str, Threshold]:
    if not isinstance(raw, dict):
        raise BaselineError(f"{where}: expected a mapping metric → {{tolerance, gate}}")
    out = {}
    for name, value in raw.items():
        check_metric_name(name, where=where)
        out[name] = make_threshold(value, f"{where}.{name}")
    return out


# ---- the comparison -------------------------------------------------------------------------------


def compare(
    baseline: Mapping[str, Any],
    frame: pd.DataFrame,
    *,
    thresholds: Mapping[str, Threshold] | None = None,
    gates: Mapping[str, str] | None = None,
    strict: bool = False,
) -> DifferenceReport:
    """Every baseline case × metric against the run in ``frame`` (after any strategy mapping).

    ``thresholds`` (metric or kind → Threshold) override the baseline's; ``gates`` (metric or kind →
    fail|warn|off) override only the gate, e.g. ``{"time": "warn"}``; ``strict`` fails a
    deterministic metric that improved beyond its tolerance (the baseline is stale).
    """
    cases = same_case_across_tuning(case_records(frame), baseline["cases"])
    machine_now = machine_of(frame)
    machine_base = baseline.get("machine") or {}
    differs = [k for k in MACHINE_KEYS if str(machine_base.get(k)) != machine_now[k]]
    changes = ", ".join(f"{k}: {machine_base.get(k)} → {machine_now[k]}" for k in differs)
    notes = [f"machine differs ({changes}): absolute step times not compared"] if differs else []
    if TORCH_VERSION in differs:
        notes.append("torch version differs: memory may change with it; re-baseline after an upgrade")
    tunings = tuning_differences(baseline, cases)
    notes += tuning_notes(tunings)
    unjudged, samples_notes = samples_not_judged(baseline, cases)
    notes += samples_notes
    rows: list[MetricDifference] = []
    for cid, entry in sorted(baseline["cases"].items()):
        layers = [
            thresholds or {},
            _as_thresholds(entry.get("thresholds"), f"cases.{cid}.thresholds"),
            _as_thresholds(baseline.get("thresholds"), "thresholds"),
        ]
        now = cases.get(cid)
        rows += _compare_case(
            cid,
            entry,
            now,
            cases,
            layers,
            gates or {},
            strict=strict,
            machine_differs=bool(differs),
            tuning_differs=_tuning_reason(tunings.get(cid)),
            samples_not_judged=unjudged.get(cid),
        )
    for cid in sorted(set(cases) - set(baseline["cases"])):
        rows.append(
            _row(
                cid,
                "case",
                None,
                None,
                None,
                None,
                "new",
                False,
                f"not in the baseline (status {cases[cid][STATUS]}); add it by re-writing the baseline",
                run_case_id=cases[cid][RUN_CASE_ID],
            )
        )
    # which figures are emulated (one rank alone, fake process group): the run's, else the baseline's
    modes = {
        cid: (cases.get(cid) or baseline["cases"].get(cid) or {}).get("mode", "real")
        for cid in {d.case_id for d in rows}
    }
    differences = [dataclasses.replace(d, mode=modes[d.case_id]) for d in rows]
    if any(d.mode == "emulated" for d in differences):
        notes.append("emulated cases: one rank alone with a fake process group; step times are compute only")
    return DifferenceReport(differences=differences, machine_matches=not differs, notes=notes)


def baseline_host_tuning(baseline: Mapping[str, Any], entry: Mapping[str, Any]) -> str:
    """The host tuning a baseline case was measured with: its entry's, or for a baseline written before
    entries recorded it, the tuning its launcher applied then (``legacy_host_tuning``)."""
    if HOST_TUNING in entry:
        return str(entry[HOST_TUNING])
    provenance = baseline.get("provenance")
    provenance = provenance if isinstance(provenance, dict) else {}
    return legacy_host_tuning(str(provenance.get("device")), provenance.get(GLOO_LOOPS_IDLE) is True)


def tuning_differences(
    baseline: Mapping[str, Any], cases: Mapping[str, dict[str, Any]]
) -> dict[str, tuple[str, str]]:
    """(the baseline's host tuning, the run's) of each baseline case the run has under another tuning."""
    pairs = {
        cid: (baseline_host_tuning(baseline, entry), cases[cid][HOST_TUNING])
        for cid, entry in baseline["cases"].items()
        if cid in cases
    }
    return {cid: pair for cid, pair in pairs.items() if pair[0] != pair[1]}


EARLIER_SAMPLES = "the baseline's samples are of an earlier method: re-write the baseline"


def _earlier_samples(baseline: Mapping[str, Any]) -> str:
    """A note when the baseline's step-time samples were measured by an earlier method ('' when not)."""
    version = baseline.get(FORMAT_VERSION) or 0
    has_samples = any(SAMPLED in (e.get("metrics") or {}) for e in baseline["cases"].values())
    if not has_samples or (isinstance(version, int) and version >= BASELINE_SAMPLES_BY_LAUNCH):
        return ""
    return (
        f"not comparable: the baseline's step-time samples (format version {version}) are ratios of "
        "process CPU time, gloo's loop threads' spin included, pooled without their launches; the run's "
        "are of work CPU time (docs/ci.md): step time is not gated; re-write the baseline "
        "(fsdpbench regress RUN_DIR --write-baseline PATH)"
    )


def samples_not_judged(
    baseline: Mapping[str, Any], cases: Mapping[str, dict[str, Any]]
) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """The baseline cases whose step-time samples are not judged, each with (verdict, why), and the notes
    that say so for the whole comparison: every case where the baseline's samples are of an earlier
    method (not comparable), else the cases measured beyond the rated load of other processes (not
    compared)."""
    earlier = _earlier_samples(baseline)
    if earlier:
        return dict.fromkeys(baseline["cases"], (NOT_COMPARABLE, EARLIER_SAMPLES)), [earlier]
    loaded = _overloaded(cases, baseline["cases"])
    if not loaded:
        return {}, []
    note = (
        f"step time not judged in {len(loaded)} case(s): other processes kept more than "
        f"{MAX_OTHER_LOAD:.0%} of the machine's cores busy while their samples were taken, beyond the load "
        "the gate's error rates were measured under (docs/ci.md); their memory, communication and losses "
        "are gated"
    )
    return {cid: (NOT_COMPARED, why) for cid, why in loaded.items()}, [note]


def _overloaded(cases: Mapping[str, dict[str, Any]], baseline_cases: Mapping[str, Any]) -> dict[str, str]:
    """Why each case's step-time samples are not judged: taken while other processes kept more of the
    machine busy than ``MAX_OTHER_LOAD`` (the load the gate is rated for)."""
    out = {}
    for cid in baseline_cases:
        load = (cases.get(cid) or {}).get(STEP_TIME_REF_OTHER_LOAD)
        if load is not None and load > MAX_OTHER_LOAD:
            out[cid] = (
                f"not judged: other processes kept {load:.0%} of the cores busy while it was measured "
                f"(rated up to {MAX_OTHER_LOAD:.0%}, docs/ci.md)"
            )
    return out


def _tuning_reason(pair: tuple[str, str] | None) -> str | None:
    """Why a case's time metrics are not comparable (the note of each), None when they are."""
    return None if pair is None else "host tuning differs (baseline: {}, now: {})".format(*pair)


def same_case_across_tuning(
    cases: dict[str, dict[str, Any]], baseline_cases: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """The run's cases keyed as the baseline's: a run case not in the baseline whose id under another host
    tuning is, and is matched by no other run case, is that baseline case (its own id stays in
    ``run_case_id``), so that the verdict says its times are not comparable instead of one case
    "missing" and another "new"."""
    free = set(baseline_cases) - set(cases)
    out: dict[str, dict[str, Any]] = {}
    for cid, record in cases.items():
        matches = [other for other in record["ids_by_tuning"].values() if other in free]
        key = matches[0] if cid not in baseline_cases and len(matches) == 1 else cid
        free.discard(key)
        out[key] = record
    return out


def tuning_notes(differing: Mapping[str, tuple[str, str]]) -> list[str]:
    """One note per (baseline tuning, run tuning) pair that differs: how many cases, and what to do."""
    groups: dict[tuple[str, str], list[str]] = {}
    for cid, pair in sorted(differing.items()):
        groups.setdefault(pair, []).append(cid)
    notes = []
    for (base, now), cids in groups.items():
        notes.append(
            f"not comparable: host tuning differs in {len(cids)} case(s) (baseline: {base}, now: {now}): "
            "their step times are not compared, their memory, communication and losses are; to compare "
            f"times, run with --set host_tuning={base} or re-write the baseline (docs/ci.md)"
        )
    return notes


SAMPLED = STEP_TIME_REF_RATIOS  # the sampled time metric; the single-number ones only warn beside it


def _row(
    cid, metric, base, now, change, threshold, verdict, fails, note="", *, run_case_id=None, stats=None
) -> MetricDifference:
    return MetricDifference(
        case_id=cid,
        metric=metric,
        kind=METRICS[metric].kind if metric in METRICS else "case",
        baseline=base,
        now=now,
        change=change,
        tolerance=threshold.tolerance if threshold else None,
        gate=threshold.gate if threshold else None,
        verdict=verdict,
        fails=bool(fails),
        note=note,
        run_case_id=run_case_id or cid,
        effect_low=stats.low if stats else None,
        effect_high=stats.high if stats else None,
        p_value=stats.p_value if stats else None,
    )


def _compare_case(
    cid,
    entry,
    now,
    cases,
    layers,
    gates,
    *,
    strict,
    machine_differs,
    tuning_differs=None,
    samples_not_judged=None,
) -> list[MetricDifference]:
    """Every metric of one baseline case against the run's; ``tuning_differs`` (why, or None): its time
    metrics are not comparable; ``samples_not_judged`` ((verdict, why), or None): its step-time samples
    are not judged (a baseline of an earlier method: not comparable; a run beyond the rated load: not
    compared)."""
    if now is None:
        return [_row(cid, "case", entry[STATUS], None, None, None, "missing", True, "case not in the run")]
    if entry[STATUS] == SKIPPED or now[STATUS] != OK:
        error = now[ERROR].splitlines()[0][:200] if now[ERROR] else ""
        if entry[STATUS] == now[STATUS]:
            verdict, note = OK, ""
        elif now[STATUS] == OK:  # skipped in the baseline, runs now
            verdict, note = "new", "was skipped in the baseline; re-write the baseline to gate it"
        else:
            verdict, note = (
                ("missing" if now[STATUS] == SKIPPED else FAILED),
                f"{now[STATUS]} in the run: {error}",
            )
        return [
            _row(
                cid,
                "case",
                entry[STATUS],
                now[STATUS],
                None,
                None,
                verdict,
                verdict in FAILING,
                note,
                run_case_id=now[RUN_CASE_ID],
            )
        ]
    out = []
    metrics_now = dict(now["metrics"])
    ref = entry.get("time_reference")
    if ref:
        metrics_now["step_time_ratio"] = time_ratio(cases, cid, ref)
    for metric, base in sorted(
        entry.get("metrics", {}).items(), key=lambda kv: (KINDS.index(METRICS[kv[0]].kind), kv[0])
    ):
        th = resolve_threshold(metric, layers)
        if (
            metric != SAMPLED
            and METRICS[metric].kind == "time"
            and SAMPLED in entry["metrics"]
            and th.gate == "fail"
        ):
            th = dataclasses.replace(th, gate="warn")  # the samples gate this case's time
        gate = gates.get(metric, gates.get(METRICS[metric].kind))
        th = dataclasses.replace(th, gate=gate) if gate else th
        if th.gate == "off":
            continue
        unjudged = _unjudged(metric, tuning_differs, samples_not_judged)
        if unjudged:
            verdict, why = unjudged
            row = (_typical(base), _typical(metrics_now.get(metric)), None, th, verdict, False, why)
            out.append(_row(cid, metric, *row, run_case_id=now[RUN_CASE_ID]))
            continue
        if metric == SAMPLED:
            *row, stats = _compare_samples(base, metrics_now.get(metric), th)
        else:
            row = _compare_metric(
                metric,
                base,
                metrics_now.get(metric),
                th,
                strict=strict,
                machine_differs=machine_differs,
                ref=ref,
            )
            stats = None
        out.append(_row(cid, metric, *row, run_case_id=now[RUN_CASE_ID], stats=stats))
    return out


def _unjudged(
    metric: str, tuning_differs: str | None, samples_not_judged: tuple[str, str] | None
) -> tuple[str, str] | None:
    """(verdict, why) of a metric that is not judged: a time metric under another host tuning, the
    samples when ``samples_not_judged`` says so; None for a metric that is judged."""
    if tuning_differs and METRICS[metric].kind == "time":
        return NOT_COMPARABLE, tuning_differs
    if metric == SAMPLED and samples_not_judged:
        return samples_not_judged
    return None


def _typical(value: Any) -> Any:
    """A metric's value as its row shows it: samples (of one or more launches) by their median."""
    return statistics.median(flat(value)) if isinstance(value, list) and value else value


def _compare_metric(metric, base, now, th: Threshold, *, strict, machine_differs, ref):
    """(baseline, now, change, threshold, verdict, fails, note) for one metric of one case."""
    m = METRICS[metric]
    if metric == LOSSES:
        return _compare_losses(base, now, th)
    if now is None:
        note = (
            f"reference case {ref} not ok in the run"
            if metric == "step_time_ratio"
            else "not measured in the run"
        )
        return base, None, None, th, "missing", th.gate == "fail", note
    if m.same_machine and machine_differs:
        return base, now, _rel(base, now), th, "not compared", False, "machine differs"
    change = _rel(base, now)
    if change > th.tolerance:
        verdict, fails = ("regressed", True) if th.gate == "fail" else ("warn", False)
    elif change < -th.tolerance:
        verdict = "improved"
        fails = strict and m.deterministic and th.gate == "fail"
    else:
        verdict, fails = OK, False
    note = f"vs {ref}" if metric == "step_time_ratio" else ""
    if verdict == "improved" and m.deterministic:
        note = (note + "; " if note else "") + "update the baseline"
    return base, now, change, th, verdict, fails, note


def _compare_samples(base, now, th: Threshold):
    """The statistical time verdict (analysis.timegate): baseline and now are medians, change the effect."""
    from fsdpbench.analysis.timegate import time_verdict

    if not now:
        return (
            _typical(base),
            None,
            None,
            th,
            "missing",
            th.gate == "fail",
            "no step-time samples in the run (time_blocks: 0?)",
            None,
        )
    v = time_verdict(now, base, th.tolerance)
    if v.regressed:
        verdict, fails = ("regressed", True) if th.gate == "fail" else ("warn", False)
    else:
        verdict, fails = ("improved" if v.effect < -th.tolerance and v.high < 0 else OK), False
    note = v.describe() + (f"; slower by more than {th.tolerance:.0%} and p < {ALPHA}" if v.regressed else "")
    return _typical(base), _typical(now), v.effect, th, verdict, fails, note, v


def _compare_losses(base, now, th: Threshold):
    if not now:
        return base[-1], None, None, th, "missing", th.gate == "fail", "no losses in the run"
    if len(now) != len(base):
        return base[-1], now[-1], None, th, "changed", th.gate == "fail", f"{len(now)} steps vs {len(base)}"
    if not all(math.isfinite(x) for x in now):  # a NaN differs from nothing by more than a tolerance
        return base[-1], now[-1], None, th, "changed", th.gate == "fail", "a loss of the run is not finite"
    change = max(abs(n - b) / max(abs(b), 1e-12) for n, b in zip(now, base))
    bad = change > th.tolerance
    verdict = ("changed" if th.gate == "fail" else "warn") if bad else OK
    note = "max relative difference over steps; a changed loss means a different training run" if bad else ""
    return base[-1], now[-1], change, th, verdict, bad and th.gate == "fail", note


def _rel(base: float, now: float) -> float:
    if base == 0:
        return 0.0 if now == 0 else math.inf
    return (now - base) / abs(base)
