"""The harness's footprint: the bare loop interleaved with the timed steps, and nothing left
installed by the memory tracker or the profiler to slow the steps after them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fsdpbench.metrics.harness import instruments_left_installed, interleaved_blocks, request_cupti_teardown


def test_bare_blocks_interleave_with_timed_blocks_in_balanced_order():
    assert interleaved_blocks(20, 20) == [
        ("timed", 5),
        ("bare", 5),
        ("bare", 5),
        ("timed", 5),
        ("timed", 5),
        ("bare", 5),
        ("bare", 5),
        ("timed", 5),
    ]
    assert interleaved_blocks(5, 0) == [("timed", 5)]  # no bare loop: the timed phase as it always was
    assert interleaved_blocks(5, 7) == [
        ("timed", 2),
        ("bare", 2),
        ("bare", 2),
        ("timed", 1),
        ("timed", 1),
        ("bare", 2),
        ("bare", 1),
        ("timed", 1),
    ]
    for timed, bare in ((1, 1), (3, 20), (20, 3), (7, 7)):
        blocks = interleaved_blocks(timed, bare)
        assert (
            sum(n for k, n in blocks if k == "timed") == timed
            and sum(n for k, n in blocks if k == "bare") == bare
        )


def test_cupti_teardown_is_requested_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    request_cupti_teardown()
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    request_cupti_teardown()
    assert os.environ["TEARDOWN_CUPTI"] == "0"


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_tracker_and_profiler_leave_nothing_installed(strategy, one_rank_gloo_group, tmp_path: Path):
    from torch.utils._python_dispatch import TorchDispatchMode

    from fsdpbench.core.case import Case
    from fsdpbench.engine.parallel import build_parallel
    from fsdpbench.engine.step import rank_batch, train_step
    from fsdpbench.metrics.profiled import profile_steps
    from fsdpbench.metrics.tracker import build_tracker

    case = Case(
        model="decoder-tiny",
        strategy=strategy,
        world_size=1,
        batch_size=2,
        seq_len=16,
        device="cpu",
        backend="gloo",
    )
    parallel = build_parallel(case, torch.device("cpu"), rank=0)
    model, optimizer = parallel.model, parallel.optimizer
    hooks_before = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    def step(i: int) -> None:
        train_step(parallel, rank_batch(case, 0, i, torch.device("cpu")))

    step(0)
    assert instruments_left_installed() == []
    with build_tracker(model, optimizer, parallel.strategy):
        assert instruments_left_installed()  # it does see an installed instrument
        step(1)
    with profile_steps(torch.device("cpu"), tmp_path / "trace.json.gz"):
        step(2)
    assert instruments_left_installed() == []
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == hooks_before

    class Leftover(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Leftover():
        assert instruments_left_installed() == ["1 dispatch mode(s)"]


def test_the_profiled_steps_trace_is_written_in_the_case_directory_only(tmp_path: Path, monkeypatch):
    """The Chrome trace goes to ``trace_rank0.json.gz`` by way of a plain file beside it, never through
    the system's temporary directory (torch's own .gz export writes its JSON there first)."""
    import tempfile

    from fsdpbench.metrics.profiled import profile_steps
    from fsdpbench.metrics.trace import Trace

    def refused(*args, **kwargs):
        raise AssertionError("a temporary file outside the case directory")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refused)
    monkeypatch.setattr(tempfile, "mkstemp", refused)
    case_dir = tmp_path / "case"
    case_dir.mkdir()
    with profile_steps(torch.device("cpu"), case_dir / "trace_rank0.json.gz"):
        torch.ones(64, 64) @ torch.ones(64, 64)
    assert [p.name for p in case_dir.iterdir()] == ["trace_rank0.json.gz"]
    names = {e.get("name") for e in Trace.load(case_dir / "trace_rank0.json.gz").events}
    assert "aten::mm" in names
