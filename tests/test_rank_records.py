"""Rank records end to end: the worker writes a ``RankResult``, the launcher reads it back as
one (``RankResult.read``), and every later stage works on the typed record. A rank file is input from a
stranger (a crashed rank, another run, a hand edit): the reader names the file and the field, and the
rank counts as one that wrote nothing usable; it never raises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdpbench.core.case import Case
from fsdpbench.core.schema import FAILED, OK, RUNNING
from fsdpbench.engine.rank_result import NO_RESULT, RankResult, Setup, rank_file
from fsdpbench.metrics.timing import StepTimes
from fsdpbench.pipeline.launch import collect_case


def _record(rank: int = 0) -> RankResult:
    return RankResult(
        rank=rank,
        pid=123,
        status=OK,
        phase="done",
        setup=Setup(params=10, n_units=2, mode="real", threads=1, init_pg_s=0.5, setup_s=1.0, samplers={}),
        warmup=StepTimes(times_ms=[9.0, 5.0]),
        timed=StepTimes(times_ms=[4.0, 6.0, 5.0]),
        losses=[2.5, 2.25],
        wall_s=3.0,
    )


def _write(tmp_path: Path, data: object, rank: int = 0) -> Path:
    path = tmp_path / rank_file(rank)
    path.write_text(json.dumps(data))
    return path


def test_a_record_survives_its_file_field_by_field(tmp_path):
    rec = _record(1)
    back = RankResult.read(_write(tmp_path, rec.to_json(), 1), 1)
    assert back == rec
    assert back.step_time_ms() == 5.0 and back.ended and not back.failed_itself
    assert back.to_columns()["first_step_ms"] == 9.0


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ([], "a JSON object expected, got list"),
        ({"rank": 1}, "field 'rank' is 1, expected 0"),
        ({"rank": True}, "field 'rank' is True"),
        ({"rank": 0, "status": 7}, "field 'status' has type int"),
        ({"rank": 0, "status": "exploded"}, "field 'status' is 'exploded'"),
        ({"rank": 0, "pid": "123"}, "field 'pid' has type str"),
        ({"rank": 0, "losses": ["x"]}, "field 'losses' holds a value that is not a number"),
        ({"rank": 0, "step_times_ms": [1.0, -2.0]}, "field 'step_times_ms' holds a time"),
        ({"rank": 0, "memory": [1]}, "field 'memory' has type list"),
    ],
)
def test_a_malformed_rank_file_is_a_rank_that_wrote_nothing_usable(tmp_path, data, named):
    rec = RankResult.read(_write(tmp_path, data), 0)
    assert (rec.rank, rec.status, rec.phase) == (0, None, "start")
    assert rec.error.startswith("rank0.json: ") and named in rec.error


def test_unreadable_deep_infinite_and_linked_files_are_named_too(tmp_path):
    path = tmp_path / rank_file(0)
    path.write_text("[" * 200_000 + "]" * 200_000)
    assert "rank0.json: " in RankResult.read(path, 0).error
    path.write_text('{"rank": 0, "step_times_ms": [Infinity]}')
    assert "holds a time that is not a finite number" in RankResult.read(path, 0).error
    path.write_text("{not json")
    assert "not JSON" in RankResult.read(path, 0).error
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(_record().to_json()))
    path.unlink()
    path.symlink_to(target)
    assert "symbolic link" in RankResult.read(path, 0).error
    assert RankResult.read(tmp_path / rank_file(5), 5).error == NO_RESULT


def test_a_diverged_loss_is_a_measurement_not_a_broken_file(tmp_path):
    data = _record().to_json() | {"losses": [float("nan")]}
    path = tmp_path / rank_file(0)
    path.write_text(json.dumps(data))  # json spells it NaN
    rec = RankResult.read(path, 0)
    assert rec.status == OK and rec.losses and rec.losses[0] != rec.losses[0]


def test_collect_names_the_broken_rank_and_fails_only_its_case(tmp_path):
    case = Case(model="mlp-tiny", strategy="zero2", world_size=2)
    _write(tmp_path, _record(0).to_json(), 0)
    _write(tmp_path, {"rank": 1, "status": "ok", "step_times_ms": "fast"}, 1)
    outcome = collect_case(case, tmp_path)
    assert outcome.status == FAILED
    assert outcome.error == "rank 1 in start: rank1.json: field 'step_times_ms' has type str"
    assert [r.rank for r in outcome.ranks] == [0, 1] and outcome.ranks[0].status == OK


def test_a_running_record_has_not_ended():
    rec = RankResult(rank=0)
    assert rec.status == RUNNING and not rec.ended
    assert RankResult.missing(0).where() == f"rank 0 in start: {NO_RESULT}"


def test_the_case_rows_carry_the_ranks_global_losses_and_the_slowest_median():
    from fsdpbench.engine.rank_result import CaseOutcome
    from fsdpbench.store.results import build_rows

    case = Case(model="mlp-tiny", strategy="zero2", world_size=2)
    ranks = [_record(0), _record(1)]
    ranks[1].losses = [2.75, 2.5]
    ranks[1].timed = StepTimes(times_ms=[7.0, 8.0, 9.0])
    rows = build_rows(case, CaseOutcome(status=OK, ranks=ranks, wall_s=4.0), {})
    assert list(rows["rank"]) == [0, 1]
    assert rows["losses"][0] == [2.625, 2.375] and rows["loss_final"][0] == 2.375  # the ranks' mean
    assert list(rows["step_time_ms"]) == [5.0, 8.0] and rows["case_step_time_ms"][0] == 8.0
