"""The turns between a case's ranks and its compute twin's (fsdpbench/hosttuning/baton.py): never two
groups computing at once, the twin's set-up after the case's warm-up, and a failing or silent twin
that does not hold the case up. Ranks are threads here, on the store the orchestrator serves."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fsdpbench.hosttuning import baton as baton_mod
from fsdpbench.hosttuning.baton import CASE, TWIN, Baton, BatonBroken


def _baton(port: int, role: str, rank: int, world: int, steps: int, timeout_s: float = 20.0) -> Baton:
    # the spec as the launcher passes it to a rank, in the rank entry's arguments
    spec = baton_mod.baton_spec(port, role, world, steps, timeout_s)
    assert baton_mod.spec_role(spec) == role
    turns = Baton.from_spec(spec, rank)
    assert turns is not None
    return turns


def test_no_spec_is_no_turns() -> None:
    assert Baton.from_spec("", 0) is None and baton_mod.spec_role("") is None


def _run_groups(
    world: int,
    steps: int,
    twin_fails_at: int | None = None,
    twin_silent_at: int | None = None,
    case_limit_s: float = 20.0,
    twin_limit_s: float = 20.0,
    failing_twin_ranks: tuple[int, ...] | None = None,
) -> tuple[list[tuple[str, str, int]], dict[str, Any]]:
    """Case and twin 'ranks' as threads, the worker's calls in its order; the events in time order. The
    outcome holds which case ranks waited out a turn (``case_waited_out``: a case rank that does
    abandons the turns) and who ended the turns (``broken``, the store's record; None if nobody)."""
    store = baton_mod.serve()
    events: list[tuple[str, str, int]] = []  # (what, role, turn)
    lock = threading.Lock()
    outcome: dict[str, Any] = {}
    warmed = threading.Barrier(world)  # the worker's dist.barrier() before the timed steps

    def note(what: str, role: str, turn: int) -> None:
        with lock:
            events.append((what, role, turn))

    def case_rank(rank: int) -> None:
        b = _baton(store.port, CASE, rank, world, steps, timeout_s=case_limit_s)
        note("warmed", CASE, -1)
        warmed.wait()
        b.twin_may_start()
        b.ready()
        for i in range(steps):
            b.take_turn()
            note("start", CASE, i)
            time.sleep(0.01)
            note("end", CASE, i)
            b.pass_turn()
        b.finish()
        note("done", CASE, steps)
        if b.broken:  # only a case rank's own wait past its limit breaks its baton
            with lock:
                outcome.setdefault("case_waited_out", []).append(rank)

    def twin_rank(rank: int) -> None:
        b = _baton(store.port, TWIN, rank, world, steps, timeout_s=twin_limit_s)
        try:
            b.wait_to_start()
            note("setup", TWIN, -1)
            b.ready()
            for i in range(steps):
                if i == twin_fails_at and (failing_twin_ranks is None or rank in failing_twin_ranks):
                    raise RuntimeError("the twin fails")
                if i == twin_silent_at:
                    time.sleep(10)  # hangs: the case must not wait for it past its limit
                b.take_turn()
                note("start", TWIN, i)
                time.sleep(0.01)
                note("end", TWIN, i)
                b.pass_turn()
        except BatonBroken as exc:  # a RuntimeError too: told apart first
            outcome[f"twin{rank}"] = str(exc)
        except RuntimeError:
            b.abandon()  # what worker.run_rank does for a failing rank
            outcome[f"twin{rank}"] = "failed"

    threads = [threading.Thread(target=case_rank, args=(r,)) for r in range(world)]
    threads += [threading.Thread(target=twin_rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads[:world]:
        t.join(30)
    assert not any(t.is_alive() for t in threads[:world]), "a case rank never finished"
    outcome.setdefault("case_waited_out", [])
    outcome["broken"] = store.get("broken").decode() if store.check(["broken"]) else None
    return events, outcome


def test_the_groups_take_turns_step_by_step_and_never_compute_at_once() -> None:
    events, outcome = _run_groups(world=2, steps=4)
    assert outcome["case_waited_out"] == [] and outcome["broken"] is None  # every turn given in time
    running: dict[str, int] = {CASE: 0, TWIN: 0}
    order: list[tuple[str, int]] = []
    for what, role, turn in events:
        if what == "start":
            running[role] += 1
            assert running[CASE if role == TWIN else TWIN] == 0, events  # the other group is not computing
            if not order or order[-1] != (role, turn):
                order.append((role, turn))
        elif what == "end":
            running[role] -= 1
    # case step 0 (both ranks), twin step 0, case step 1, ... and the twin's last step before the case
    # goes on to its next phases
    assert order == [(role, i) for i in range(4) for role in (CASE, TWIN)]
    # the twin set up only once the case had warmed up, and the case ended after the twin's last step
    whats = [(w, r) for w, r, _ in events]
    assert whats.index(("setup", TWIN)) > max(i for i, x in enumerate(whats) if x == ("warmed", CASE))
    last_twin_end = max(i for i, e in enumerate(events) if e[:2] == ("end", TWIN))
    assert min(i for i, e in enumerate(events) if e[0] == "done") > last_twin_end


def test_a_failing_twin_gives_the_case_every_turn_at_once() -> None:
    events, outcome = _run_groups(world=2, steps=4, twin_fails_at=1)
    assert outcome["twin0"] == outcome["twin1"] == "failed"
    assert [t for w, r, t in events if (w, r) == ("start", CASE)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # no wait for turns the twin will never give: the twin ended the turns, no case rank waited one out
    assert outcome["broken"].startswith("twin rank") and outcome["case_waited_out"] == []


def test_the_other_twin_ranks_stop_when_one_fails_and_never_compute_beside_the_case() -> None:
    # twin rank 1 fails at its step 1; rank 0 would go on, given turns by the case's ranks that no
    # longer wait for the twin: it must stop at its next turn instead of computing beside them
    events, outcome = _run_groups(world=2, steps=4, twin_fails_at=1, failing_twin_ranks=(1,))
    assert outcome["twin1"] == "failed"
    assert "the turns are over" in outcome["twin0"] and "abandoned" in outcome["twin0"]
    assert [t for w, r, t in events if (w, r) == ("start", TWIN)] == [0, 0]  # turn 0 only, both ranks
    assert [t for w, r, t in events if (w, r) == ("start", CASE)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert outcome["broken"] == "twin rank 1" and outcome["case_waited_out"] == []


def test_a_silent_twin_ends_the_turns_after_the_limit_and_the_case_goes_on() -> None:
    events, outcome = _run_groups(world=1, steps=3, twin_silent_at=1, case_limit_s=1.0)
    # the case waited once, for its limit, then went on alone (the twin still hangs)
    assert [t for w, r, t in events if (w, r) == ("start", CASE)] == [0, 1, 2]
    assert outcome["case_waited_out"] == [0] and outcome["broken"] == "case rank 0"


def test_the_twin_rank_gives_up_when_its_turn_does_not_come() -> None:
    store = baton_mod.serve()
    twin = _baton(store.port, TWIN, 0, 1, 2, timeout_s=0.2)
    with pytest.raises(BatonBroken, match="no twin_start within 0.2 s"):
        twin.wait_to_start()
    case = _baton(store.port, CASE, 0, 1, 2, timeout_s=0.2)
    case.take_turn()  # the twin abandoned: every case turn is given
    assert store.get("broken") == b"twin rank 0"


@pytest.mark.slow
def test_a_twin_that_fails_beside_the_case_costs_the_case_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real case with a twin that cannot build its model: the case ends well without waiting out a
    turn (the failing twin ended the turns itself), and the twin's failure is in its own rank file,
    not the case's."""
    from fsdpbench.core.schema import FAILED, OK
    from fsdpbench.engine.rank_result import RankResult
    from fsdpbench.pipeline.launch import launch_case
    from tests.helpers import tiny_case

    stores: list[Any] = []  # the launcher's baton store, kept to read who ended the turns
    serve = baton_mod.serve
    monkeypatch.setattr(baton_mod, "serve", lambda: stores.append(serve()) or stores[-1])
    case = tiny_case(strategy="ddp", world_size=1, steps=3)
    broken_twin = case.replace(model="no-such-model")
    outcome = launch_case(case, tmp_path / "case", twin=broken_twin)
    assert outcome.status == OK and outcome.ranks[0].status == OK
    assert len(outcome.ranks[0].timed.times_ms) == 3  # type: ignore[union-attr]
    (store,) = stores
    assert store.get("broken") == b"twin rank 0"  # not "case rank 0": the case never waited out a turn
    twin = RankResult.read(tmp_path / "case" / "compute_twin" / "rank0.json", 0)
    assert twin.status == FAILED and "no-such-model" in (twin.error or "")
