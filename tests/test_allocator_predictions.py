"""The CUDA caching allocator's peaks, predicted, against one rank measured on a real H100 (every row of
tests/data/gpu_h100_rank_memory.jsonl, torch 2.11.0+cu130, default allocator settings): the step's
allocation stream traced op by op (fake tensors with CUDA's kernel rules), replayed through the allocator
model over the run's first three steps. ``measured_peak_alloc``/``measured_peak_reserved`` are
``torch.cuda.max_memory_allocated()``/``max_memory_reserved()`` over step 3.

Nothing here is fitted to these rows: the allocator's rules are CUDACachingAllocator.cpp's, cuBLAS's
workspace is CublasHandlePool.cpp's default for sm90 (32 MiB per thread that runs matmuls), and the
optimizer state is created where torch.optim creates it (inside the first step). The reference harness ran
torch's default AdamW on CUDA (``foreach``), which the trace reproduces; fsdpbench's own runs use
``foreach=False`` (tests/data/README.md)."""

from __future__ import annotations

import pytest
import torch

from fsdpbench.predictors.memory_model.alloc_stream import AllocStream
from fsdpbench.predictors.traced import estimate
from tests.test_cuda_predictions import ROWS, _case, _row_id

ALLOCATED_TOLERANCE = 0.02
RESERVED_TOLERANCE = 0.05


@pytest.fixture
def foreach_adamw(monkeypatch):
    """The reference harness's optimizer: AdamW with torch's default (foreach) update on CUDA."""
    import fsdpbench.strategies.optim as optim

    def build(params, case):
        return torch.optim.AdamW(params, lr=case.lr, foreach=True)

    monkeypatch.setattr(optim, "build_optimizer", build)


def traced_stream(row: dict) -> AllocStream:
    return estimate(_case(row), record_stream=True).alloc_stream


@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_allocator_peaks_match_the_h100(row, foreach_adamw):
    stats = traced_stream(row).replay()
    assert abs(stats.peak_allocated / row["measured_peak_alloc"] - 1) < ALLOCATED_TOLERANCE
    assert abs(stats.peak_reserved / row["measured_peak_reserved"] - 1) < RESERVED_TOLERANCE
