"""Reproduce Table 1 of the ZeRO paper (Rajbhandari et al., 2020) from fsdpbench's memory model.

    python analysis/zero_table1.py                         # the table, predicted vs printed, and the verdict
    python analysis/zero_table1.py --csv tests/data/zero_paper_table1.csv

Per-device model-state memory in GB (1e9 bytes) for Ψ = 7.5B, 128B, 1T parameters on N = 1…1024 GPUs,
mixed-precision Adam (``--precision mixed``: b_p = b_g = 2, K = 12), ZeRO stages os (zero1),
os+g (zero2), os+g+p (zero3). The predictions come from ``predict_memory`` with only a parameter count,
exactly as ``fsdpbench predict --params Ψ --precision mixed --optimizer adam`` computes them.

"Matches to its printed rounding": the paper prints each value with d decimals (d read from the printed
text: 1.88 → 2, 41.3 → 1, 4187 → 0). A prediction x matches the printed p when p equals x rounded
half-up to d decimals *or* x truncated to d decimals — the paper truncates some values (4187.5 → 4187,
2218.75 → 2218, 513.5 → 513), rounds others (1.875 → 1.88, 41.25 → 41.3). Anything else is a mismatch.
"""

from __future__ import annotations

import argparse
import csv
import sys
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal
from pathlib import Path

from fsdpbench.core.case import Case
from fsdpbench.predictors.memory_model import ModelFacts, predict_memory

STAGES = {"os": "zero1", "os_g": "zero2", "os_g_p": "zero3"}
DEFAULT_CSV = Path(__file__).resolve().parents[1] / "tests" / "data" / "zero_paper_table1.csv"


def predicted_gb(params: float, dp_degree: int, strategy: str) -> float:
    """Model states per device in GB, from the memory model with only Ψ known."""
    case = Case(
        model="decoder",
        strategy=strategy,
        world_size=dp_degree,
        precision="mixed",
        optimizer="adam",
        device="cuda",
        backend="nccl",
    )
    return predict_memory(case, facts=ModelFacts.from_count(int(params))).model_states_bytes / 1e9


def matches_printed(predicted: float, printed: str) -> bool:
    """True when ``printed`` is ``predicted`` rounded half-up or truncated to the printed decimals."""
    p = Decimal(printed.strip())
    quantum = Decimal(1).scaleb(p.as_tuple().exponent)  # 1.88 → 0.01; 4187 → 1
    x = Decimal(repr(predicted))
    return p in (x.quantize(quantum, ROUND_HALF_UP), x.quantize(quantum, ROUND_DOWN))


def read_table(path: Path) -> list[dict[str, str]]:
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def compare(path: Path) -> list[dict[str, object]]:
    """One record per printed cell: Ψ, N, stage, printed, predicted, match."""
    out = []
    for row in read_table(path):
        params, n = float(row["params"]), int(row["dp_degree"])
        for column, strategy in STAGES.items():
            pred = predicted_gb(params, n, strategy)
            out.append(
                {
                    "params": params,
                    "dp_degree": n,
                    "stage": column,
                    "strategy": strategy,
                    "printed": row[column],
                    "predicted_gb": pred,
                    "match": matches_printed(pred, row[column]),
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--csv", default=str(DEFAULT_CSV), help=f"the reference table (default: {DEFAULT_CSV})"
    )
    args = parser.parse_args(argv)
    path = Path(args.csv)
    if not path.exists():
        print(f"error: {path}: no such file (the ZeRO Table 1 reference CSV; pass --csv)", file=sys.stderr)
        return 2
    records = compare(path)
    print(f"{'Ψ':>8} {'N':>5}  " + "  ".join(f"{c + ' (' + s + ')':>25}" for c, s in STAGES.items()))
    by_row: dict[tuple[float, int], list[dict[str, object]]] = {}
    for r in records:
        by_row.setdefault((r["params"], r["dp_degree"]), []).append(r)
    for (params, n), cells in by_row.items():
        text = "  ".join(
            f"{c['printed']:>9} vs {c['predicted_gb']:>10.6g} {'ok' if c['match'] else 'NO':>2}"
            for c in cells
        )
        print(f"{params:>8.3g} {n:>5}  {text}")
    bad = [r for r in records if not r["match"]]
    print(f"\n{len(records) - len(bad)}/{len(records)} cells match the paper's printed rounding")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
