"""``with_active_module_peaks`` (fsdpbench/metrics/tracker.py) makes the trackers' per-op peak update look
only at the running modules instead of walking every tracked module: the same numbers, module by module
and in total, as PyTorch's own method, on a real step and on a traced one. ``with_total_peak_only`` (what
a trace uses) keeps the same total peak."""

from __future__ import annotations

import copy

import pytest
import torch

import fsdpbench.metrics.tracker as tracker_module
from fsdpbench.core.case import Case
from fsdpbench.models import build_model
from fsdpbench.predictors.traced import estimate


def _tracked_step(fast: bool | str) -> tuple[dict, dict]:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = build_model("decoder-tiny")
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    if fast == "total":
        tracker_module.with_total_peak_only(tracker)
    elif fast:
        tracker_module.with_active_module_peaks(tracker)
    tokens = torch.randint(0, 256, (2, 32))
    model(tokens).float().mean().backward()  # the optimizer state exists before the tracked step
    optimizer.step()
    optimizer.zero_grad()
    with tracker:
        model(tokens).float().mean().backward()
        optimizer.step()
    per_module = {
        stats.mod_fqn: (copy.deepcopy(stats.local_peak), copy.deepcopy(stats.snapshots))
        for stats in tracker.memory_tracking.values()
    }
    return per_module, copy.deepcopy(tracker._peak_mem_snap)


def test_per_module_and_total_peaks_equal_pytorchs_own_update():
    fast_modules, fast_peak = _tracked_step(fast=True)
    slow_modules, slow_peak = _tracked_step(fast=False)
    assert len(fast_modules) > 10  # every block and layer was tracked
    assert fast_peak == slow_peak
    assert fast_modules == slow_modules
    _, total_only_peak = _tracked_step(fast="total")
    assert total_only_peak == slow_peak and sum(next(iter(slow_peak.values())).values()) > 0


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_a_traced_prediction_is_the_same_with_and_without_it(strategy, monkeypatch):
    case = Case(model="decoder-tiny", strategy=strategy, world_size=8, batch_size=2, seq_len=64, device="cpu")
    fast = estimate(case).to_dict()
    monkeypatch.setattr(tracker_module, "with_active_module_peaks", lambda tracker: tracker)
    monkeypatch.setattr(tracker_module, "with_total_peak_only", lambda tracker: tracker)
    slow = estimate(case).to_dict()
    for timing in ("wall_s", "peak_rss_bytes"):  # how long and how much host memory the trace took
        fast.pop(timing, None), slow.pop(timing, None)
    assert fast == slow
