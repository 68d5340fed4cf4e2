"""Measured rows of fsdpbench's own runs on the reference H100 (``../shared/reference/gpu-h100-2026-11-27``):
each row's case and what it measured at each layer — tracker, allocator, NVML — in the order the run ran
them. ``tests/data/gpu_h100_fsdpbench_runs.json`` holds them; it was written by

    PYTHONPATH=$PWD python tests/gpu_reference_rows.py --write tests/data/gpu_h100_fsdpbench_runs.json \\
        --commit <commit>

and is what the allocator and NVML tests, and ``fsdpbench check``'s report tests, read. Each row also
carries the traced predictor's figures for its case (``traced``: what ``run --traced`` records beside a
CUDA case, columns ``traced_*``), predicted on the writing machine with the code of ``predicted_at``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "gpu-h100-2026-11-27"
RUNS = {
    "emulated_decoder": "emulated_decoder_results.parquet",  # run --emulate, traced: true
    "gpu_step_time": "gpu_step_time_results.parquet",  # one real rank, NCCL
}
DATA = Path(__file__).parent / "data" / "gpu_h100_fsdpbench_runs.json"


def measured_columns() -> tuple[str, ...]:
    from fsdpbench.core import schema

    return (
        schema.TRACKER_PEAK,
        schema.ALLOC_PEAK_ALLOCATED,
        schema.ALLOC_PEAK_RESERVED,
        schema.ALLOC_RETRIES,
        schema.NVML_PEAK,
        schema.DEVICE_NAME,
        schema.TORCH_VERSION,
    )


def extract(reference: Path = REFERENCE) -> dict[str, Any]:
    import pandas as pd

    from fsdpbench.core.schema import case_from_columns

    rows = []
    for run, name in RUNS.items():
        frame = pd.read_parquet(reference / name)
        for order, (_, row) in enumerate(frame.iterrows()):
            measured = {c: (row[c].item() if hasattr(row[c], "item") else row[c]) for c in measured_columns()}
            case = case_from_columns(row).to_dict()
            rows.append({"run": run, "order": order, "case": case, "measured": measured})
    return {"source": str(reference.name), "rows": rows}


def traced_columns_of(case_dict: dict[str, Any]) -> dict[str, Any]:
    """The traced_* columns ``run --traced`` would record for rank 0 of this case."""
    from fsdpbench.core import schema
    from fsdpbench.core.case import Case
    from fsdpbench.predictors.device_fit import DeviceModel

    case = Case.from_dict(case_dict)
    memory = DeviceModel.for_case(case, fsdpbench_run=True).memory(case)
    return {
        schema.TRACED_PEAK: memory.tracked_peak,
        schema.TRACED_ALLOC_ALLOCATED: memory.allocated_peak,
        schema.TRACED_ALLOC_RESERVED: memory.reserved_peak,
        schema.TRACED_NVML: memory.nvml_peak,
    }


def load() -> list[dict[str, Any]]:
    """The stored rows: run, order in it, case (``Case.to_dict``), measured columns."""
    return json.loads(DATA.read_text())["rows"]


if __name__ == "__main__":
    out = Path(sys.argv[sys.argv.index("--write") + 1])
    data = extract()
    data["predicted_at"] = sys.argv[sys.argv.index("--commit") + 1]
    for row in data["rows"]:
        row["traced"] = traced_columns_of(row["case"])
    out.write_text(json.dumps(data, indent=1) + "\n")
