"""Shared helpers for tests that run real cases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdpbench.case import Case
from fsdpbench.launch import CaseOutcome, launch_case

# tests of CPU semantics pin CPU ranks explicitly, so a machine with a GPU runs the same cases
CPU: dict[str, str] = {"device": "cpu", "backend": "gloo"}
TINY: dict[str, Any] = dict(
    model="decoder-tiny", batch_size=2, seq_len=16, warmup_steps=1, steps=2, memory_steps=1, timeout_s=90, **CPU
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
