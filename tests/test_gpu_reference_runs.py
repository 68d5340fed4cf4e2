"""fsdpbench's own runs on the reference H100 (tests/data/gpu_h100_fsdpbench_runs.json, torch 2.11.0+cu130):
the allocator model against DDP's and ZeRO-1's measured allocator peaks, and NVML's terms against every
row's measured NVML peak. Nothing is fitted to a row: the DDP stream holds the reducer's buckets as
reducer.cpp allocates them, and each NVML term is a named measurement of what a process loads
(predictors/memory_model/nvml.py)."""

from __future__ import annotations

import pytest

from fsdpbench.core import schema
from fsdpbench.core.case import Case
from fsdpbench.predictors.device_fit import DeviceModel
from fsdpbench.predictors.memory_model.nvml import REFERENCE_H100, job_loads, nvml_terms
from tests.gpu_reference_rows import load

ROWS = load()
ALLOCATED_TOLERANCE = 0.02
RESERVED_TOLERANCE = 0.05
NVML_TOLERANCE = 0.03
# the emulated run traced each case (run --traced) in a process that kept its CUDA context on the device
# while the later cases ran: NVML counted it from the second case on (the runner now ends that process
# before the next case). Its size once it had traced an FSDP2 case, measured as the zero3 case's
# NVML − reserved less the first (ddp) case's, both bf16 and emulated, stands in for every later case
# (it measured 0.55 GB while it had traced only ddp: zero1's row)
TRACER_CONTEXT_BYTES = 10_289_086_464 - 8_283_750_400 - (11_182_866_432 - 9_875_488_768)


def _id(row: dict) -> str:
    c = Case.from_dict(row["case"])
    ac = "-ac" if c.activation_checkpointing else ""
    return f"{row['run']}-{c.strategy}-{c.model}-{c.precision}{ac}"


def _other_processes(row: dict) -> int:
    return TRACER_CONTEXT_BYTES if row["run"] == "emulated_decoder" and row["order"] > 0 else 0


REPLICATED = [r for r in ROWS if r["run"] == "emulated_decoder" and r["case"]["strategy"] in ("ddp", "zero1")]


@pytest.mark.parametrize("row", REPLICATED, ids=_id)
def test_ddp_and_zero1_allocator_peaks_match_the_h100(row):
    case = Case.from_dict(row["case"])
    m = row["measured"]
    memory = DeviceModel.for_case(case, fsdpbench_run=True).memory(case)
    assert abs(memory.allocated_peak / m[schema.ALLOC_PEAK_ALLOCATED] - 1) < ALLOCATED_TOLERANCE
    assert abs(memory.reserved_peak / m[schema.ALLOC_PEAK_RESERVED] - 1) < RESERVED_TOLERANCE
    assert memory.allocated_peak >= memory.tracked_peak  # the reducer's buckets are not tensors it tracks
    other = _other_processes(row)
    assert abs((memory.nvml_peak + other) / m[schema.NVML_PEAK] - 1) < NVML_TOLERANCE


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_nvml_terms_over_the_measured_reserved_peak(row):
    """Every row: NVML = measured reserved + the terms of what its process loaded, within 3%."""
    case = Case.from_dict(row["case"])
    m = row["measured"]
    loads = job_loads(case, fsdpbench_run=True)
    loads = type(loads)(**{**_as_dict(loads), "other_processes_bytes": _other_processes(row)})
    predicted = nvml_terms(loads).nvml_bytes(m[schema.ALLOC_PEAK_RESERVED])
    assert abs(predicted / m[schema.NVML_PEAK] - 1) < NVML_TOLERANCE


def test_the_one_rank_nccl_runs_are_each_term_to_the_byte():
    """The one-rank NCCL rows: context + NCCL library (+ cuDNN in bf16) is NVML − reserved, ±2 MiB."""
    for row in (r for r in ROWS if r["run"] == "gpu_step_time"):
        case = Case.from_dict(row["case"])
        m = row["measured"]
        terms = nvml_terms(job_loads(case, fsdpbench_run=True))
        assert set(terms.by_name()) == {"cuda_context", "nccl_library", "profiler", "samplers"} | (
            {"cudnn"} if case.precision == "bf16" else set()
        )
        assert abs(terms.total - (m[schema.NVML_PEAK] - m[schema.ALLOC_PEAK_RESERVED])) <= 2 << 20


def test_a_plain_job_has_no_profiler_or_sampler_terms_and_fsdpbench_measures_them_as_zero():
    case = Case.from_dict(REPLICATED[0]["case"]).replace(emulate=False)
    plain = nvml_terms(job_loads(case)).by_name()
    own = nvml_terms(job_loads(case, fsdpbench_run=True)).by_name()
    assert "profiler" not in plain and "samplers" not in plain
    assert own["profiler"] == own["samplers"] == 0 == REFERENCE_H100.profiler_bytes
    # a lean bf16 process (no NCCL) is the band the reference measured: 1.30–1.32 GB over reserved
    lean = nvml_terms(job_loads(case.replace(emulate=True))).total
    assert 1.30e9 <= lean <= 1.32e9


def _as_dict(loads) -> dict:
    from dataclasses import asdict

    return asdict(loads)
