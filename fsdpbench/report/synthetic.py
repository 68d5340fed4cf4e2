"""A made-up run with every results column and known numbers, for tests and for trying the report.

These are *not* measurements: the scenario is called ``synthetic`` and says so. Memory follows the
(P+G+K)·Ψ/N model exactly (fp32 AdamW: 4 + 4 + 8 bytes per parameter); the "measured" peak is the
model-state bytes plus fixed activation/temp terms, and each prediction is off by a known error.

    python -c "from fsdpbench.report.synthetic import write_synthetic_run as w; w('/tmp/syn')"
    fsdpbench report /tmp/syn
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pandas as pd

from fsdpbench.core.schema import (
    CASE_ERROR,
    CASE_STEP_TIME,
    COMM_BYTES,
    COMM_PRED_TOTAL,
    COMM_TOTAL,
    COMMIT,
    ERROR,
    FAILED,
    HOSTNAME,
    OK,
    OVERLAP_COMM,
    OVERLAP_EXPOSED,
    OVERLAP_RATIO,
    PRED_ACTIVATIONS,
    PRED_COMM_BUFFERS,
    PRED_GRADS,
    PRED_MODEL_STATES,
    PRED_MODEL_STATES_ERR,
    PRED_OPTIM,
    PRED_PADDING,
    PRED_PARAMS,
    PRED_PEAK,
    PRED_PEAK_ERR,
    PRED_TEMP,
    PRED_UNSHARDED,
    RANK,
    SAMPLED_PEAK,
    SKIPPED,
    STATUS,
    STEP_TIME,
    STEP_TIME_P10,
    STEP_TIME_P90,
    THROUGHPUT_SAMPLES,
    TORCH_VERSION,
    TRACKER_MODEL_STATES,
    TRACKER_PEAK,
    WALL_S,
    tracker_peak_column,
)
from fsdpbench.metrics.comm import analytic_comm_bytes
from fsdpbench.store.results import RunStore
from fsdpbench.strategies import REFERENCE_STRATEGY, registered

PSI = 1_000_000  # parameters
ACTIVATIONS_BYTES = 2 * 2**20
TEMP_BYTES = 2**19
PEAK_PREDICTION_ERR = 0.05  # every analytic peak is 5% above the measured one
BASE_STEPS_MS = (100.0, 120.0, 150.0)  # of the three strategies, in order
SKIP_REASON = "needs 8 GPUs, 0 visible"
FAIL_ERROR = "RuntimeError: synthetic failure for the report test"


@functools.cache
def synthetic_strategies() -> dict[str, Any]:
    """The strategies of the made-up run by name: the reference, then the strategies FSDPMemTracker
    tracks that shard over every rank, in the registry's order (ZeRO-2, then ZeRO-3)."""
    fsdp2 = [
        s for s in registered().values() if s.memory_tracker == "fsdp2" and not s.sharding.over_shard_group
    ]
    return {s.name: s for s in [registered()[REFERENCE_STRATEGY], *fsdp2]}


def _case(strategy: str, n: int, **kw: Any) -> dict[str, Any]:
    return dict(
        strategy=strategy,
        world_size=n,
        prefetch=kw.get("prefetch", 0),
        precision=kw.get("precision", "fp32"),
        wrap=kw.get("wrap", "block") if synthetic_strategies()[strategy].uses_wrap else "none",
        status=kw.get(STATUS, OK),
    )


def synthetic_cases() -> list[dict[str, Any]]:
    names = list(synthetic_strategies())
    resharded = names[-1]
    cases = [_case(s, n) for n in (1, 2, 4) for s in names]
    cases += [
        _case(resharded, 4, prefetch=1),
        _case(resharded, 4, precision="bf16"),
        _case(resharded, 4, wrap="whole", status=FAILED),
        _case(REFERENCE_STRATEGY, 8, status=SKIPPED),
    ]
    return cases


def case_id_of(c: dict[str, Any]) -> str:
    return f"{c['strategy']}_n{c['world_size']}_syn_{c['wrap']}_pf{c['prefetch']}_{c['precision']}_b4_000000"


def _memory(c: dict[str, Any]) -> dict[str, float]:
    n = c["world_size"]
    half = c["precision"] == "bf16"
    sharding = synthetic_strategies()[c["strategy"]].sharding
    # at the peak, parameters kept unsharded from forward to backward are whole
    params_sharded = sharding.params and not sharding.params_unsharded_fwd_to_bwd
    params = 4 * PSI / (n if params_sharded else 1)
    grads = 4 * PSI / (n if sharding.grads else 1)
    optim = 8 * PSI / (n if sharding.optim else 1)
    unsharded = 4 * PSI / 2 * (1 + c["prefetch"]) if sharding.params and n > 1 else 0.0
    acts = ACTIVATIONS_BYTES / (2 if half else 1)
    return dict(
        params=params, grads=grads, optim=optim, params_unsharded=unsharded, activations=acts, temp=TEMP_BYTES
    )


def synthetic_results() -> pd.DataFrame:
    """Rows (case × rank) with every column the report reads, including those still being added."""
    rows = []
    for c in synthetic_cases():
        base = dict(
            case_id=case_id_of(c),
            scenario="synthetic",
            model="decoder-syn",
            model_args="{}",
            params=PSI,
            n_units=4,
            optimizer="adamw",
            batch_size=4,
            global_batch_size=4 * c["world_size"],
            seq_len=64,
            warmup_steps=2,
            timed_steps=5,
            backend="gloo",
            device="cpu",
            device_name="CPU: synthetic (2 cores)",
            torch_version="2.13.0+cpu",
            commit="synthetic",
            hostname="synthetic",
            shard_size=None,
            activation_checkpointing=False,
            compile=False,
            cpu_offload=False,
            case_status=c[STATUS],
            case_error={FAILED: FAIL_ERROR, SKIPPED: SKIP_REASON}.get(c[STATUS], ""),
            **{k: c[k] for k in ("strategy", "world_size", "wrap", "prefetch", "precision")},
        )
        if c[STATUS] == SKIPPED:
            rows.append({**base, RANK: -1, STATUS: SKIPPED, ERROR: SKIP_REASON})
            continue
        for rank in range(c["world_size"]):
            row = {**base, RANK: rank, STATUS: c[STATUS], ERROR: base[CASE_ERROR]}
            if c[STATUS] == OK:
                row.update(_measured(c, rank))
            rows.append(row)
    return pd.DataFrame(rows)


def _measured(c: dict[str, Any], rank: int) -> dict[str, Any]:
    n, strategies = c["world_size"], synthetic_strategies()
    base_step_ms = BASE_STEPS_MS[list(strategies).index(c["strategy"])]
    mem = _memory(c)
    peak = sum(mem.values()) + rank * 1024  # the last rank holds 1 KiB more, so "largest rank" is defined
    step = base_step_ms * (1 + 0.1 * (n - 1)) * (0.8 if c["precision"] == "bf16" else 1.0) + rank
    states = mem["params"] + mem["grads"] + mem["optim"]
    analytic = analytic_comm_bytes(strategies[c["strategy"]].sharding, 4 * PSI, n)
    comm = {kind: analytic[kind] for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")}
    row: dict[str, Any] = {
        STEP_TIME: step,
        STEP_TIME_P10: 0.9 * step,
        STEP_TIME_P90: 1.2 * step,
        CASE_STEP_TIME: base_step_ms * (1 + 0.1 * (n - 1)) * (0.8 if c["precision"] == "bf16" else 1.0)
        + n
        - 1,
        TRACKER_PEAK: peak,
        TRACKER_MODEL_STATES: states,
        SAMPLED_PEAK.of("rss"): peak + 100 * 2**20,
        PRED_PARAMS: mem["params"],
        PRED_GRADS: mem["grads"],
        PRED_OPTIM: mem["optim"],
        PRED_ACTIVATIONS: mem["activations"],
        PRED_UNSHARDED: mem["params_unsharded"],
        PRED_COMM_BUFFERS: 0.0,
        PRED_PADDING: 0.0,
        PRED_TEMP: TEMP_BYTES,
        PRED_MODEL_STATES: states,
        PRED_MODEL_STATES_ERR: 0.0,
        OVERLAP_COMM: 10.0 * (n - 1),
        OVERLAP_EXPOSED: 4.0 * (n - 1),
        OVERLAP_RATIO: 0.6 if n > 1 else 0.0,
        COMM_PRED_TOTAL: sum(comm.values()),
        COMM_TOTAL: sum(comm.values()),
    }
    # the analytic peak of the largest rank is PEAK_PREDICTION_ERR above its measurement
    row[PRED_PEAK] = (sum(mem.values()) + (n - 1) * 1024) * (1 + PEAK_PREDICTION_ERR)
    row[PRED_PEAK_ERR] = PEAK_PREDICTION_ERR
    for cat in ("params", "params_unsharded", "grads", "optim", "activations", "temp"):
        row[tracker_peak_column(cat)] = mem[cat] + (rank * 1024 if cat == "temp" else 0)
    for kind, value in comm.items():
        row[COMM_BYTES.of(kind)] = value
    row[THROUGHPUT_SAMPLES] = 4 * n / (row[CASE_STEP_TIME] / 1e3)
    return row


def synthetic_timeline(c: dict[str, Any]) -> pd.DataFrame:
    """One sample every 10 ms per rank: 0.2 s warm-up, 0.5 s timed, 0.3 s memory-tracked."""
    out = []
    peak = sum(_memory(c).values())
    for rank in range(c["world_size"]):
        for i in range(100):
            t = i / 100
            phase = "warmup" if t < 0.2 else ("timed" if t < 0.7 else "memory")
            out.append(
                dict(
                    case_id=case_id_of(c),
                    rank=rank,
                    t_s=t,
                    phase=phase,
                    source="rss",
                    bytes=100 * 2**20 + peak * (0.5 + 0.5 * ((i % 10) / 9)),
                )
            )
    return pd.DataFrame(out)


def write_synthetic_run(run_dir: str | Path, *, timelines: bool = True) -> Path:
    """A run directory (results, run.json, timelines) made of synthetic numbers; returns it."""
    store = RunStore(run_dir)
    store.create()
    frame = synthetic_results()
    for case_id, rows in frame.groupby("case_id", sort=False):
        store.write_case(str(case_id), rows.reset_index(drop=True))
    if timelines:
        for c in synthetic_cases():
            if c[STATUS] == OK:
                path = store.case_dir(case_id_of(c))
                path.mkdir(parents=True, exist_ok=True)
                synthetic_timeline(c).to_parquet(path / "timeline.parquet", index=False)
    text = "name: synthetic\ndescription: made-up numbers for the report's tests (not measurements)\n"
    store.write_run_json(
        {
            "scenario": {
                "name": "synthetic",
                "description": "made-up numbers for the report's tests (not measurements)",
                "path": None,
                "text": text,
                "overrides": {},
            },
            "command": "fsdpbench.report.synthetic.write_synthetic_run",
            STATUS: "complete",
            "started": "2026-01-01T00:00:00+00:00",
            "ended": "2026-01-01T00:01:00+00:00",
            "env": {
                TORCH_VERSION: "2.13.0+cpu",
                COMMIT: "synthetic",
                HOSTNAME: "synthetic",
                "cpu": "synthetic",
                "cpu_count": 2,
                "gpus": [],
                "backends": {"gloo": True, "nccl": False, "mpi": False},
                "cuda_available": False,
                "cuda_reason": "synthetic run",
                "nvml_available": False,
                "nvml_reason": "synthetic run",
            },
            SKIPPED: [
                {"case_id": case_id_of(c), "reason": SKIP_REASON}
                for c in synthetic_cases()
                if c[STATUS] == SKIPPED
            ],
            "cases": {
                case_id_of(c): {
                    STATUS: c[STATUS],
                    WALL_S: 2.0,
                    "spawn_s": 0.1,
                    "steps_s": 1.5,
                    "overhead_s": 0.5,
                }
                for c in synthetic_cases()
                if c[STATUS] != SKIPPED
            },
        }
    )
    return Path(run_dir)
