"""The largest-batch search of the allocator model (predictors/device_fit.py), on a stand-in fit whose
answer is known, so that the search itself is checked, not the traces (tests/test_predict_cli.py runs it
for real)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fsdpbench.core.case import Case
from fsdpbench.predictors.device_fit import DeviceFit, DeviceModel
from fsdpbench.predictors.memory_model.nvml import JobLoads, nvml_terms

DEVICE = 80 * 2**30
CASE = Case(model="decoder-small", world_size=4, strategy="zero3", device="cuda", backend="nccl")


def stand_in(monkeypatch: pytest.MonkeyPatch, need: Callable[[int], int], bound: int) -> list[int]:
    """A DeviceModel whose fit is ``need(batch) <= DEVICE`` and whose analytic bound is ``bound``; returns
    the batches it was asked about, in order."""
    import fsdpbench.predictors.memory_model.search as search

    tried: list[int] = []

    def fit(self: DeviceModel, case: Case, device_memory: int) -> DeviceFit:
        tried.append(case.batch_size)
        needed = need(case.batch_size)
        fits = needed <= device_memory
        return DeviceFit(device_memory, fits, "stand-in", device_memory - needed, needed if fits else None)

    monkeypatch.setattr(DeviceModel, "fit", fit)
    monkeypatch.setattr(search, "largest_batch", lambda *a, **k: bound)
    terms = nvml_terms(JobLoads(nccl_communicators=1, nccl_peers=True))
    monkeypatch.setattr(DeviceModel, "terms", lambda self, case: terms)
    return tried


def test_an_affine_need_is_found_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    need = lambda b: 30 * 2**30 + b * 7_340_033  # noqa: E731 — states + batch × activations
    tried = stand_in(monkeypatch, need, bound=12_000)
    best = DeviceModel().largest_batch(CASE, DEVICE)
    assert need(best) <= DEVICE < need(best + 1)  # the exact edge
    assert best == (DEVICE - 30 * 2**30) // 7_340_033
    assert len(tried) <= 15 and len(set(tried)) == len(tried)  # batch 1, then a bisection of 12,001


def test_a_need_that_is_not_affine_still_ends_on_an_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    # the allocator's segments make the need a staircase, and not monotonic at a step's edge
    def need(b: int) -> int:
        stairs = 30 * 2**30 + (b // 64) * 64 * 9_000_000
        return stairs + (2**30 if b % 64 == 63 else 0)  # every 64th batch opens a segment the next closes

    tried = stand_in(monkeypatch, need, bound=9_000)
    best = DeviceModel().largest_batch(CASE, DEVICE)
    assert need(best) <= DEVICE < need(best + 1)
    assert len(tried) <= 16 and len(set(tried)) == len(tried)  # never asked twice


def test_nothing_fits_when_batch_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in(monkeypatch, lambda b: DEVICE + b, bound=100)
    assert DeviceModel().largest_batch(CASE, DEVICE) is None
