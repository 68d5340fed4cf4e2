"""Check the memory model against a results directory: measured vs predicted, worst cases first.

    python analysis/check_model.py RUN_DIR              # analytic prediction vs the tracker, per case × rank
    python analysis/check_model.py RUN_DIR --traced     # also the traced prediction (fake tensors, same case)
    python analysis/check_model.py RUN_DIR --csv out.csv --top 10 --terms

Measured = PyTorch's live-tensor tracker in the run (``mem_tracker_model_states_bytes`` after
optimizer.step; ``mem_tracker_peak_bytes``). Predicted =
``fsdpbench.predictors.memory_model`` for the same case
and rank (recomputed here, so a run made before a model change is checked against the current model),
and with ``--traced`` ``fsdpbench.predictors.traced``. Errors are (pred − measured) / measured.
``--terms`` prints, for the worst cases, each category at the peak side by side. The tracker files
unsharded gradients, DDP buckets, gloo's staging copies and some reduce-scatter inputs under "temp"
depending on when it first sees them, so those are compared together as "transient". The model's terms
are filed under the tracker's categories by the memory model's own filing (``tracker_filing``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from fsdpbench.core.case import Case
from fsdpbench.core.numbers import relative_error
from fsdpbench.core.schema import (
    OK,
    RANK,
    STATUS,
    TRACKER_MODEL_STATES,
    TRACKER_PEAK,
    case_from_columns,
    tracker_peak_column,
)
from fsdpbench.predictors.memory_model import predict_memory
from fsdpbench.predictors.memory_model.columns import tracker_filing
from fsdpbench.store.results import load_results

TRANSIENT = "transient"  # unsharded grads, temporaries, reduce-scatter buffers, DDP buckets
# the tracker's categories (schema.TRACKER_CATEGORIES) compared, grouped (the model has no buffers or other)
MEASURED_GROUPS = {
    "params": ("params",),
    "optim": ("optim",),
    "grads": ("grads",),
    "params_unsharded": ("params_unsharded",),
    "all_gather": ("all_gather",),
    TRANSIENT: ("grads_unsharded", "temp", "reduce_scatter"),
    "activations": ("activations", "inputs"),
}


def check_run(run_dir: str | Path, *, traced: bool = False) -> pd.DataFrame:
    """One row per measured case × rank: measured, predicted (analytic, and traced) and errors."""
    frame = load_results(run_dir)
    ok = frame[(frame[STATUS] == OK) & frame[TRACKER_PEAK].notna()]
    out = []
    for _, row in ok.iterrows():
        case = _ints(case_from_columns(row))
        rank = int(row[RANK])
        pred = predict_memory(case, rank=rank)
        rec: dict[str, Any] = {
            "case_id": case.case_id,
            "strategy": case.strategy,
            "world_size": case.world_size,
            "rank": rank,
            "model": case.model,
            "precision": case.precision,
            "states_measured": int(row[TRACKER_MODEL_STATES]),
            "states_pred": pred.resting_states_bytes,
            "peak_measured": int(row[TRACKER_PEAK]),
            "peak_pred": pred.peak_bytes,
            "peak_moment": pred.peak_moment,
        }
        rec["states_err"] = relative_error(rec["states_pred"], rec["states_measured"])
        rec["peak_err"] = relative_error(rec["peak_pred"], rec["peak_measured"])
        for group, cats in MEASURED_GROUPS.items():
            rec[f"m:{group}"] = sum(int(row.get(tracker_peak_column(c)) or 0) for c in cats)
        for group, cats in MEASURED_GROUPS.items():
            rec[f"p:{group}"] = sum(_predicted_as_filed(pred).get(c, 0) for c in cats)
        if traced:
            from fsdpbench.predictors.traced import estimate

            est = estimate(case, rank=rank)
            rec["peak_traced"] = est.peak_bytes
            rec["states_traced"] = est.model_states_bytes
            rec["peak_traced_err"] = relative_error(est.peak_bytes, rec["peak_measured"])
            rec["traced_s"] = est.wall_s
        out.append(rec)
    result = pd.DataFrame(out)
    if not result.empty:
        result = result.reindex(result["peak_err"].abs().sort_values(ascending=False).index)
    return result


def _predicted_as_filed(pred: Any) -> dict[str, int]:
    """The model's terms at its peak under the tracker's categories, filed as the pred_peak_<cat>_bytes
    columns are (memory_model.columns.tracker_filing: the one filing, not a copy)."""
    breakdown = pred.peak_breakdown
    return {cat: sum(breakdown.get(c, 0) for c in ours) for cat, ours in tracker_filing(pred).items()}


def _ints(case: Case) -> Case:
    """Integer fields that a Parquet column with missing values stored as floats (shard_size)."""
    fix = {
        f.name: int(getattr(case, f.name))
        for f in dataclasses.fields(case)
        if isinstance(getattr(case, f.name), float) and f.type in ("int", "int | None")
    }
    return case.replace(**fix) if fix else case


def summarize(result: pd.DataFrame) -> dict[str, float]:
    """Worst absolute errors (fractions) over all rows."""
    out = {
        "rows": len(result),
        "max_abs_states_err": float(result["states_err"].abs().max()),
        "max_abs_peak_err": float(result["peak_err"].abs().max()),
    }
    if "peak_traced_err" in result:
        out["max_abs_peak_traced_err"] = float(result["peak_traced_err"].abs().max())
    return out


def _mib(x: Any) -> str:
    return "—" if x is None or x != x else f"{x / 2**20:,.2f}"


def _pct(x: Any) -> str:
    return "—" if x is None or x != x else f"{x * 100:+.2f}%"


def print_report(result: pd.DataFrame, *, top: int | None, terms: bool, file: Any = sys.stdout) -> None:
    traced = "peak_traced" in result
    head = (
        f"{'case':58} {'rank':>4} {'states MiB':>11} {'err':>8} {'peak MiB':>10} {'analytic':>10} {'err':>8}"
    )
    head += f" {'traced':>10} {'err':>8}" if traced else ""
    print(head + "  peak moment (analytic)", file=file)
    rows = result if top is None else result.head(top)
    for _, r in rows.iterrows():
        line = (
            f"{r.case_id[:58]:58} {r['rank']:>4} {_mib(r.states_measured):>11} {_pct(r.states_err):>8} "
            f"{_mib(r.peak_measured):>10} {_mib(r.peak_pred):>10} {_pct(r.peak_err):>8}"
        )
        if traced:
            line += f" {_mib(r.peak_traced):>10} {_pct(r.peak_traced_err):>8}"
        print(line + f"  {r.peak_moment}", file=file)
        if terms:
            diffs = []
            for group in MEASURED_GROUPS:
                m, p = r[f"m:{group}"], r[f"p:{group}"]
                if m or p:
                    diffs.append(f"{group} {_mib(m)}/{_mib(p)}")
            print("      measured/predicted MiB at the peak: " + "; ".join(diffs), file=file)
    s = summarize(result)
    print(
        f"\n{s['rows']} rows; worst |error|: model states {s['max_abs_states_err'] * 100:.2f}%, "
        f"peak (analytic) {s['max_abs_peak_err'] * 100:.2f}%"
        + (f", peak (traced) {s['max_abs_peak_traced_err'] * 100:.2f}%" if traced else ""),
        file=file,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a results directory (fsdpbench run --out DIR)")
    parser.add_argument("--traced", action="store_true", help="also run the traced predictor for every row")
    parser.add_argument("--top", type=int, default=None, help="print only the N worst rows")
    parser.add_argument("--terms", action="store_true", help="print each category at the peak")
    parser.add_argument("--csv", help="write every row to this CSV file")
    args = parser.parse_args(argv)
    if not (Path(args.run_dir) / "results.parquet").exists() and not (Path(args.run_dir) / "cases").exists():
        print(
            f"error: {args.run_dir}: no results.parquet (expected a directory written by fsdpbench run)",
            file=sys.stderr,
        )
        return 2
    result = check_run(args.run_dir, traced=args.traced)
    if result.empty:
        print(f"{args.run_dir}: no measured rows (status ok with a tracker peak)")
        return 1
    print_report(result, top=args.top, terms=args.terms)
    if args.csv:
        result.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
