"""Shared helpers for tests that run real cases."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpbench.case import Case
from fsdpbench.launch import CaseOutcome, launch_case

# tests of CPU semantics pin CPU ranks explicitly, so a machine with a GPU runs the same cases
CPU: dict[str, str] = {"device": "cpu", "backend": "gloo"}
# tests that need a GPU: `-m cuda` selects them, and elsewhere they are skipped with this reason
NO_CUDA_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False on this machine)"
CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA_REASON)]


def requires_cuda(test: Callable) -> Callable:
    """Mark one test as a GPU test (see CUDA_ONLY for a whole module)."""
    for mark in CUDA_ONLY:
        test = mark(test)
    return test


TINY: dict[str, Any] = dict(
    model="decoder-tiny",
    batch_size=2,
    seq_len=16,
    warmup_steps=1,
    steps=2,
    memory_steps=1,
    timeout_s=90,
    **CPU,
)


def tiny_case(**fields: Any) -> Case:
    """A decoder-tiny case small enough for a unit test (a second or two per case)."""
    return Case(**{**TINY, **fields})


def run(case: Case, tmp_path: Path) -> CaseOutcome:
    outcome = launch_case(case, tmp_path / case.case_id)
    return outcome


def global_losses(outcome: CaseOutcome) -> list[float]:
    """Mean of the ranks' local losses per step: the loss over the global batch."""
    per_rank = [r["losses"] for r in outcome.ranks]
    return [sum(step) / len(step) for step in zip(*per_rank)]
