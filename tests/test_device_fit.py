"""The searches of the allocator model (predictors/device_fit.py), on a stand-in fit whose
answer is known, so that the search itself is checked, not the traces (tests/test_predict_cli.py runs it
for real): it ends on the edge, and traces few batches, none twice."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fsdpbench.core.case import Case
from fsdpbench.predictors.device_fit import TRACED_MAX_BATCH, DeviceFit, DeviceModel, batch_text
from fsdpbench.predictors.memory_model.nvml import JobLoads, nvml_terms

DEVICE = 80 * 2**30
CASE = Case(model="decoder-small", world_size=4, strategy="zero3", device="cuda", backend="nccl")


def stand_in(
    monkeypatch: pytest.MonkeyPatch, need: Callable[[int], int], analytic: Callable[[int], int]
) -> list[int]:
    """A DeviceModel whose allocator need is ``need(batch)`` (fits: ≤ DEVICE), whose analytic need is
    ``analytic(batch)`` (never above ``need``) and whose case asked has batch 1; returns the batches the
    allocator model was asked about (each one a trace), in order."""
    tried: list[int] = []

    def fit(self: DeviceModel, case: Case, device_memory: int) -> DeviceFit:
        tried.append(case.batch_size)
        needed = need(case.batch_size)
        fits = needed <= device_memory
        return DeviceFit(device_memory, fits, "stand-in", device_memory - needed, needed if fits else None)

    def analytic_largest_batch(self: DeviceModel, case: Case, limit: int, *, max_batch: int = 1 << 20) -> int:
        fitting = [b for b in range(1, 20_000) if analytic(b) <= limit]
        return min(max(fitting), max_batch) if fitting else None  # type: ignore[return-value]

    monkeypatch.setattr(DeviceModel, "fit", fit)
    monkeypatch.setattr(DeviceModel, "analytic_largest_batch", analytic_largest_batch)
    monkeypatch.setattr(DeviceModel, "analytic_needed", lambda self, case: analytic(case.batch_size))
    monkeypatch.setattr(DeviceModel, "allocator_needed", lambda self, case: need(case.batch_size))
    terms = nvml_terms(JobLoads(nccl_communicators=1, nccl_peers=True))
    monkeypatch.setattr(DeviceModel, "terms", lambda self, case: terms)
    return tried


def test_an_affine_need_is_found_with_two_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    # the allocator adds a fixed 2 GiB to the analytic need: the guess from the case asked is the edge
    need = lambda b: 32 * 2**30 + b * 7_340_033  # noqa: E731 — states + batch × activations
    tried = stand_in(monkeypatch, need, analytic=lambda b: need(b) - 2 * 2**30)
    best = DeviceModel().largest_batch(CASE, DEVICE, max_batch=1 << 20)  # the search, not its limit
    assert need(best) <= DEVICE < need(best + 1)  # the exact edge
    assert best == (DEVICE - 32 * 2**30) // 7_340_033
    assert tried == [best, best + 1]  # the guess fits, one more does not


def test_an_overhead_growing_with_the_batch_walks_down_to_the_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    # fragmentation grows with the batch: the guess from batch 1's overhead is too large
    need = lambda b: 30 * 2**30 + b * 8_000_000  # noqa: E731
    tried = stand_in(monkeypatch, need, analytic=lambda b: 30 * 2**30 + b * 7_000_000)
    best = DeviceModel().largest_batch(CASE, DEVICE, max_batch=1 << 20)  # the search, not its limit
    assert need(best) <= DEVICE < need(best + 1)
    assert len(tried) <= 24 and len(set(tried)) == len(tried)  # never asked twice


def test_a_need_that_is_not_affine_still_ends_on_an_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    # the allocator's segments make the need a staircase, and not monotonic at a step's edge
    def need(b: int) -> int:
        stairs = 30 * 2**30 + (b // 64) * 64 * 9_000_000
        return stairs + (2**30 if b % 64 == 63 else 0)  # every 64th batch opens a segment the next closes

    tried = stand_in(monkeypatch, need, analytic=lambda b: 30 * 2**30 + b * 8_000_000)
    best = DeviceModel().largest_batch(CASE, DEVICE, max_batch=1 << 20)  # the search, not its limit
    assert need(best) <= DEVICE < need(best + 1)
    assert len(tried) <= 24 and len(set(tried)) == len(tried)  # never asked twice


def test_nothing_fits_when_batch_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    tried = stand_in(monkeypatch, lambda b: DEVICE + b, analytic=lambda b: DEVICE // 2 + b)
    assert DeviceModel().largest_batch(CASE, DEVICE) is None
    assert tried[-1] == 1 and len(set(tried)) == len(tried)


def test_the_search_traces_no_batch_past_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """An edge past TRACED_MAX_BATCH: the answer is the limit (read "or more"), no larger batch traced."""
    need = lambda b: 32 * 2**30 + b * 7_340_033  # noqa: E731 — fits up to ~7,000 sequences
    tried = stand_in(monkeypatch, need, need)
    assert need(TRACED_MAX_BATCH + 1) <= DEVICE
    assert DeviceModel().largest_batch(CASE, DEVICE) == TRACED_MAX_BATCH
    assert max(tried) == TRACED_MAX_BATCH
    assert batch_text(TRACED_MAX_BATCH) == "4096 or more (the search traces no larger batch)"
    assert batch_text(12) == "12" and batch_text(None) == "none"


def world_stand_in(
    monkeypatch: pytest.MonkeyPatch,
    first_fitting: int | None,
    analytic_answer: int,
    *,
    answer_under_overhead: int | None = 32,
) -> list[int]:
    """A DeviceModel on which world sizes from ``first_fitting`` up fit (none: none does), whose analytic
    search answers ``analytic_answer`` under the device memory and ``answer_under_overhead`` under it less
    the allocator model's overhead on the case asked (1 GiB); returns the world sizes traced, in order."""
    import fsdpbench.predictors.memory_model.search as search

    tried: list[int] = []

    def fit(self: DeviceModel, case: Case, device_memory: int) -> DeviceFit:
        tried.append(case.world_size)
        fits = first_fitting is not None and case.world_size >= first_fitting
        return DeviceFit(device_memory, fits, "stand-in", 1 if fits else -1, None)

    def analytic_search(case: Case, predict: object, limit: int, **_: object) -> int | None:
        return analytic_answer if limit == DEVICE else answer_under_overhead

    monkeypatch.setattr(DeviceModel, "fit", fit)
    monkeypatch.setattr(DeviceModel, "analytic_needed", lambda self, case: DEVICE + 2**30)
    monkeypatch.setattr(DeviceModel, "allocator_needed", lambda self, case: DEVICE + 2 * 2**30)
    monkeypatch.setattr(search, "smallest_world_size", analytic_search)
    return tried


@pytest.mark.parametrize("first_fitting", [32, 64, 1024, 65536])
def test_the_smallest_world_size_is_bisected_between_the_analytic_answer_and_the_largest(
    monkeypatch: pytest.MonkeyPatch, first_fitting: int
) -> None:
    tried = world_stand_in(monkeypatch, first_fitting, analytic_answer=32)
    assert DeviceModel().smallest_world_size(CASE, DEVICE, max_world_size=65536) == first_fitting
    # 12 candidates (32 … 65536): the analytic answer, the largest, then bisection — never all twelve
    assert tried[:2] == ([32] if first_fitting == 32 else [32, 65536])
    assert len(tried) <= 2 + 4 and len(set(tried)) == len(tried)


def test_no_world_size_when_the_largest_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    tried = world_stand_in(monkeypatch, None, analytic_answer=32)
    assert DeviceModel().smallest_world_size(CASE, DEVICE, max_world_size=65536) is None
    assert tried == [32, 65536]


def test_world_sizes_keep_the_shard_multiple(monkeypatch: pytest.MonkeyPatch) -> None:
    tried = world_stand_in(monkeypatch, 64, analytic_answer=2)
    assert DeviceModel().smallest_world_size(CASE, DEVICE, max_world_size=256, multiple=8) == 64
    assert all(n % 8 == 0 for n in tried)


@pytest.mark.parametrize("first_fitting", [None, 64, 65536])
def test_the_largest_world_size_first_where_the_allocator_overhead_leaves_none(
    monkeypatch: pytest.MonkeyPatch, first_fitting: int | None
) -> None:
    # what ZeRO-1 keeps whole does not shrink with the world: under the overhead the allocator model
    # added to the case asked no world size fits analytically, so the largest is traced first
    tried = world_stand_in(monkeypatch, first_fitting, analytic_answer=32, answer_under_overhead=None)
    assert DeviceModel().smallest_world_size(CASE, DEVICE, max_world_size=65536) == first_fitting
    assert tried[0] == 65536
    if first_fitting is None:
        assert tried == [65536]  # one trace where the analytic answer first would take two
    assert len(tried) <= 1 + 4 and len(set(tried)) == len(tried)


def test_a_limit_the_stream_never_reaches_changes_no_figure() -> None:
    """fit() takes the replay with no limit (made once per case) where its reserved peak stays under the
    budget: the replay under the limit gives the same figures."""
    model = DeviceModel()
    case = Case(model="decoder-tiny", strategy="zero3", world_size=4, device="cuda", backend="nccl")
    stream, _ = model.stream(case)
    terms = model.terms(case)
    unlimited = stream.replay(model.conf, runtime=model.runtime)
    for spare in (0, 2**20, 2**30):  # the budget at the reserved peak, a MiB and a GiB above it
        device = terms.total + unlimited.peak_reserved + spare
        fit = model.fit(case, device)
        limited = stream.replay(model.conf, runtime=model.runtime, limit=device - terms.total)
        assert limited == unlimited and limited.oom is None and limited.num_alloc_retries == 0
        assert fit.fits and fit.needed_bytes == terms.nvml_bytes(limited.peak_reserved)
        assert fit.margin_bytes == spare and fit.retries == 0
    assert not model.fit(case, terms.total + unlimited.peak_allocated - 1).fits  # under it: replayed there
