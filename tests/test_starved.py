"""A case whose steps are starved of CPU (here: a strategy that sleeps before every forward, so its
steps' wall time holds time no thread of the rank ran) says so in the terminal, the summary and the
report, and wins or loses no step-time comparison."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from fsdpbench.cli import build_parser
from fsdpbench.metrics.timing import STARVED_CPU_SHARE, StepTimes, starved
from fsdpbench.report.data import load_runs
from fsdpbench.report.tables import compare_rows, verdict_lines

PLUGINS = Path(__file__).parent / "plugins"
SLEEPY = "regressions:SleepyZero3"


def test_the_cpu_share_of_the_timed_steps_marks_them_starved_on_cpu_only():
    columns = StepTimes(times_ms=[100.0, 300.0], cpu_ms=[50.0, 50.0]).to_columns()
    assert columns["step_cpu_share"] == 0.25
    assert starved({"device": "cpu", **columns}) and not starved({"device": "cuda", **columns})
    assert not starved({"device": "cpu", "step_cpu_share": STARVED_CPU_SHARE})
    assert "step_cpu_share" not in StepTimes(times_ms=[1.0]).to_columns()  # a file from before it


def test_ranks_that_outnumber_the_cores_take_turns_and_are_not_starved_for_it():
    """4 ranks on 2 cores: each rank's fair share is half a core, so a share of 0.3 is its turn, not
    starvation; at 0.2 (under half of half a core) it is starved. One rank per core: the full threshold."""
    four_on_two = {"device": "cpu", "world_size": 4, "cpus": 2}
    assert not starved({**four_on_two, "step_cpu_share": 0.3})
    assert starved({**four_on_two, "step_cpu_share": 0.2})
    two_on_two = {"device": "cpu", "world_size": 2, "cpus": 2}
    assert starved({**two_on_two, "step_cpu_share": 0.3})
    assert starved({**two_on_two, "cpus": 16, "step_cpu_share": 0.3})  # more cores than ranks: one each
    # not recorded (a file from before it, NaN in a frame, nonsense): one core each, as before
    for cpus in (None, float("nan"), 0, -2):
        assert starved({**four_on_two, "cpus": cpus, "step_cpu_share": 0.3})


@pytest.mark.slow
def test_a_sleeping_strategy_is_flagged_and_left_out_of_the_verdicts(tmp_path, capsys):
    sys.path.insert(0, str(PLUGINS))  # the ranks get this sys.path from the fork server
    try:
        (tmp_path / "s.yaml").write_text(
            "name: starved\ndefaults: {model: decoder-tiny, world_size: 2, warmup_steps: 1, steps: 3,"
            f" device: cpu, backend: gloo}}\nsweep:\n  strategy: {json.dumps(['zero3', SLEEPY])}\n"
        )
        out = tmp_path / "run"
        args = build_parser().parse_args(
            ["run", str(tmp_path / "s.yaml"), "--out", str(out), "--no-report", "--allow-plugins"]
            + ["--link", "none"]
        )
        assert args._main(args) == 0
    finally:
        sys.path.remove(str(PLUGINS))
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    flat = " ".join(printed.split())  # a line wrapped at the console's width read as one
    # on a busy machine the plain case may be starved too: only the sleeping one is certain to be
    line = r"SleepyZero3 n2 [0-9a-f]{6} [\d.]+ ms/step starved: CPU \d+% of wall: not compared"
    assert re.search(line, flat)  # the case's own terminal line
    assert flat.count("starved") >= 2  # and the summary's row
    cases = load_runs([out]).cases
    sleepy = cases[cases["strategy"].astype(str).str.contains("SleepyZero3")]
    assert starved(sleepy.iloc[0])
    (verdict,) = verdict_lines(cases)
    assert "slowest" not in verdict or "SleepyZero3" not in verdict.split("slowest")[1].split(";")[0]
    assert "not compared on step time, their steps starved of CPU" in verdict
    rows = {r.metric: r for r in compare_rows(cases)}
    assert rows["step time (p10–p90)"].winners == []  # one case left to compare: no winner, no loser
