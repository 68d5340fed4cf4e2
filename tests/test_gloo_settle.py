"""engine/gloo_settle.py: a synchronous collective returns only once the thread that ran it has let go of
its tensors, as gloo's worker thread does a little after the caller's wait; collectives whose thread
holds on past the limit stop being waited for. The real-ranks case it was made for is
tests/test_own_model.py::test_it_is_emulated_as_the_real_rank_measures (its peak differed between runs)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import pytest
import torch

from fsdpbench.engine import gloo_settle
from fsdpbench.engine.gloo_settle import _Settler

HOLD_S = 0.2  # how long the stand-in for gloo's thread keeps the work after the caller returned


def use_count(t: torch.Tensor) -> int:
    return gloo_settle._use_count(t.untyped_storage())


class Gloo:
    """A collective that hands its work to a thread which keeps it until ``release`` is set."""

    def __init__(self, tracker: Any = None, hold_s: float | None = HOLD_S) -> None:
        self.tracker, self.release, self.threads = tracker, threading.Event(), []
        self.hold_s = hold_s
        self.staged: weakref.ref | None = None

    def collective(self, tensor: torch.Tensor, async_op: bool = False) -> None:
        staged = tensor.clone()  # the work's own copy, seen by the tracker as it appears
        if self.tracker is not None:
            self.tracker.track(staged)
        self.staged = weakref.ref(staged.untyped_storage())
        work = [tensor.view(-1), staged]

        def worker(work: list[torch.Tensor]) -> None:
            self.release.wait(self.hold_s)
            work.clear()

        thread = threading.Thread(target=worker, args=(work,))
        thread.start()
        self.threads.append(thread)
        del work, staged

    def join(self) -> None:
        self.release.set()
        for thread in self.threads:
            thread.join()


class Tracker:
    """The tracker's table of live storages: a record and a weak reference per storage."""

    def __init__(self) -> None:
        self._WINFO: dict[int, tuple[object, weakref.ref]] = {}

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        self._WINFO[id(st)] = (object(), weakref.ref(st))


@pytest.fixture
def gloo():
    made: list[Gloo] = []

    def make(**kwargs: Any) -> Gloo:
        made.append(Gloo(**kwargs))
        return made[-1]

    yield make
    for g in made:
        g.join()


def test_a_collective_returns_once_its_thread_has_let_go_of_the_tensor(gloo):
    g, t = gloo(), torch.zeros(64)
    before = use_count(t)
    _Settler(tracker=None).wrap(g.collective)(t)
    assert use_count(t) == before
    assert g.staged is not None and g.staged() is None


def test_unwrapped_the_thread_still_holds_it_as_the_call_returns(gloo):
    """The race settling removes: without it the caller goes on while the work is alive."""
    g, t = gloo(hold_s=None), torch.zeros(64)
    before = use_count(t)
    g.collective(t)
    assert use_count(t) == before + 1
    assert g.staged is not None and g.staged() is not None


def test_it_waits_for_the_tensors_the_tracker_saw_appear(gloo):
    tracker = Tracker()
    g, t = gloo(tracker=tracker), torch.zeros(64)
    _Settler(tracker).wrap(g.collective)(t)
    [(_, ref)] = tracker._WINFO.values()
    assert ref() is None


def test_an_asynchronous_collective_is_left_as_it_is(gloo):
    g, t = gloo(hold_s=None), torch.zeros(64)
    before = use_count(t)
    _Settler(tracker=None).wrap(g.collective)(t, async_op=True)
    assert use_count(t) == before + 1


def test_a_thread_that_holds_on_past_the_limit_ends_the_waiting(gloo, monkeypatch, capsys):
    monkeypatch.setattr(gloo_settle, "SETTLE_LIMIT_S", 0.05)
    settler = _Settler(tracker=None)
    g, t = gloo(hold_s=None), torch.zeros(64)
    settled = settler.wrap(g.collective)
    settled(t)
    assert settler.gave_up and use_count(t) > 1
    assert "gloo kept the tensors of collective for 0.05 s" in capsys.readouterr().err
    before = use_count(t)
    settled(t)  # not waited for: its work is still held as it returns
    assert use_count(t) == before + 1


def test_the_patch_is_undone():
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in gloo_settle.COLLECTIVES if hasattr(dist, name)}
    with gloo_settle.collectives_settled(tracker=None):
        assert all(getattr(dist, name) is not fn for name, fn in originals.items())
    assert all(getattr(dist, name) is fn for name, fn in originals.items())
