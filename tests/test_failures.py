"""A rank that crashes, dies or hangs is recorded as that case's failure; the sweep goes on;
no rank process is left behind; nothing already measured is lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpbench.pipeline.runner import run_cases
from fsdpbench.store.results import RunStore, load_results
from tests.helpers import FAULTS, assert_all_gone, run, tiny_case

pytestmark = pytest.mark.slow


def test_exception_on_one_rank_fails_the_case_with_its_error(tmp_path: Path) -> None:
    outcome = run(tiny_case(strategy=f"{FAULTS}:CrashOnRank1", world_size=2), tmp_path)
    assert outcome.status == "failed"
    assert "rank 1" in outcome.error and "RuntimeError: injected failure on rank 1" in outcome.error
    assert outcome.ranks[1].status == "failed" and "Traceback" in (outcome.ranks[1].traceback or "")
    assert_all_gone(outcome.pids)


def test_a_rank_that_dies_without_an_exception_fails_the_case(tmp_path: Path) -> None:
    outcome = run(tiny_case(strategy=f"{FAULTS}:ExitOnRank1", world_size=2), tmp_path)
    assert outcome.status == "failed"
    assert "exit 9" in outcome.error
    assert_all_gone(outcome.pids)


def test_a_hang_past_the_timeout_is_recorded_and_killed(tmp_path: Path) -> None:
    # the limit leaves a busy machine time to bring both ranks to set-up, where rank 1 hangs
    outcome = run(tiny_case(strategy=f"{FAULTS}:HangOnRank1", world_size=2, timeout_s=30), tmp_path)
    assert outcome.status == "timeout"
    assert outcome.error.startswith("timed out after 30 s; ranks stopped in phase: 0:")
    assert "1:setup" in outcome.error
    assert_all_gone(outcome.pids)


def test_sweep_goes_on_after_a_failure_and_resume_runs_only_what_is_missing(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run")
    cases = [
        tiny_case(strategy=f"{FAULTS}:CrashOnRank1", world_size=2),
        tiny_case(strategy="zero3", world_size=2),
    ]
    meta = {"env": {}}
    frame = run_cases(cases, [], store, meta)
    by_case = frame.groupby("case_id")["status"].agg(set)
    assert by_case[cases[0].case_id] == {"failed"}
    assert by_case[cases[1].case_id] == {"ok"}
    assert set(frame.loc[frame.case_id == cases[1].case_id, "rank"]) == {0, 1}
    failed_rows = frame[frame.case_id == cases[0].case_id]
    assert failed_rows["case_error"].str.contains("injected failure").all()
    assert meta["status"] == "complete" and set(meta["cases"]) == {c.case_id for c in cases}

    # an interrupted sweep: one case's file is missing; --resume runs that one only
    (store.cases_dir / f"{cases[1].case_id}.parquet").unlink()
    started: list[str] = []
    run_cases(cases, [], store, {"env": {}}, resume=True, on_start=lambda c, i: started.append(c.case_id))
    assert started == [cases[1].case_id]
    assert set(load_results(store.run_dir)["case_id"]) == {c.case_id for c in cases}
