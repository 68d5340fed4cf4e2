"""``fsdpbench compare`` and ``fsdpbench report``: arguments, the side-by-side table, one real small run."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
from rich.console import Console

from fsdpbench.cli import build_parser
from fsdpbench.commands.compare import build_compare_table, build_scenario_text
from fsdpbench.pipeline.scenario import parse_scenario
from fsdpbench.report.data import build_case_frame
from fsdpbench.report.synthetic import synthetic_results, write_synthetic_run
from tests.helpers import CPU, REPO, repo_pythonpath


def _args(*argv: str):
    return build_parser().parse_args(["compare", *argv])


def test_compare_builds_one_case_per_strategy_through_the_scenario_code():
    args = _args("--model", "decoder-tiny", "--world-size", "4", "--precision", "bf16", "--steps", "3")
    scenario = parse_scenario(build_scenario_text(args), source="fsdpbench compare", overrides=CPU)
    assert [c.strategy for c in scenario.cases] == ["ddp", "zero2", "zero3"]
    assert {(c.world_size, c.precision, c.steps, c.model) for c in scenario.cases} == {
        (4, "bf16", 3, "decoder-tiny")
    }
    assert scenario.cases[0].wrap == "none" and scenario.cases[2].wrap == "block"  # normalised as in a run
    args = _args("--world-size", "2", "--strategies", "ddp,zero1")
    assert [c.strategy for c in parse_scenario(build_scenario_text(args), overrides=CPU).cases] == [
        "ddp",
        "zero1",
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "nope", "--world-size", "2"], "--model nope: unknown model; allowed:"),
        (["--world-size", "2", "--strategies", "ddp,zero9"], "unknown strategy 'zero9'; allowed:"),
        (["--world-size", "2", "--set", "colour=red"], "--set colour: unknown field; allowed:"),
    ],
)
def test_compare_rejects_bad_arguments_naming_the_flag(argv, message, capsys, tmp_path):
    args = _args(*argv, "--out", str(tmp_path / "out"))
    assert args._main(args) == 2
    assert message in capsys.readouterr().err.replace("\n", " ")
    assert not (tmp_path / "out").exists()  # nothing ran


def test_compare_table_puts_strategies_side_by_side_and_stars_the_winner():
    rows = synthetic_results().assign(run="syn")
    cases = build_case_frame(rows)
    n4 = cases[
        (cases["world_size"] == 4)
        & (cases["prefetch"] == 0)
        & (cases["precision"] == "fp32")
        & (cases["status"] == "ok")
    ].copy()
    from fsdpbench.report.data import case_labels

    n4["label"] = case_labels(n4)
    table = build_compare_table(n4)
    assert [c.header for c in table.columns] == ["metric", "ddp n4", "zero2 n4", "zero3 n4", "winner"]
    console = Console(record=True, width=200)
    console.print(table)
    text = console.export_text()
    peak = next(line for line in text.splitlines() if "peak / rank" in line)
    assert peak.rstrip(" │").endswith("zero3 n4") and "★" in peak
    step = next(line for line in text.splitlines() if "step time" in line)
    assert step.rstrip(" │").endswith("ddp n4")
    assert "(+5.0%)" in text  # predicted beside measured, with the error
    overlap = next(line for line in text.splitlines() if line.startswith("│ overlap"))
    assert overlap.rstrip(" │").endswith("tie")


def test_report_command_writes_the_page_and_rejects_a_non_run(tmp_path, capsys):
    run_dir = write_synthetic_run(tmp_path / "syn", timelines=False)
    args = build_parser().parse_args(["report", str(run_dir), "--out", str(tmp_path / "r.html")])
    assert args._main(args) == 0
    assert f"report:  {tmp_path / 'r.html'}" in capsys.readouterr().out
    assert (tmp_path / "r.html").stat().st_size > 1_000_000  # plotly.js is inside
    args = build_parser().parse_args(["report", str(tmp_path)])
    assert args._main(args) == 2
    assert "not a run directory" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_runs_real_cases_prints_the_table_and_writes_the_report(tmp_path):
    out = tmp_path / "cmp"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdpbench",
            "compare",
            "--model",
            "decoder-tiny",
            "--world-size",
            "2",
            "--strategies",
            "ddp,zero3",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--steps",
            "2",
            "--warmup-steps",
            "1",
            "--set",
            "device=cpu",
            "--set",
            "backend=gloo",
            "--out",
            "cmp",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # paths as short as a user's: a path is printed whole, however long
        env={**os.environ, "PYTHONPATH": repo_pythonpath(REPO), "COLUMNS": "80"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ddp n2" in proc.stdout and "zero3 n2" in proc.stdout and "winner" in proc.stdout
    assert "report:  cmp/report.html" in proc.stdout
    # at 80 columns every line fits: progress, the thread policy, the side-by-side table
    assert max(len(line) for line in (proc.stdout + proc.stderr).splitlines()) <= 80
    policy = "host_tuning none: gloo's and the compute threads under SCHED_OTHER"
    assert policy in " ".join(proc.stderr.split())
    frame = pd.read_parquet(out / "results.parquet")
    assert sorted(frame["strategy"].unique()) == ["ddp", "zero3"] and set(frame["status"]) == {"ok"}
    page = (out / "report.html").read_text()
    assert 'id="fig-memory_scaling"' in page and "name: compare" in page  # the equivalent scenario is kept
    # ZeRO-3 shards the model states over 2 ranks: the tracker sees less than DDP's
    states = frame.groupby("strategy")["mem_tracker_model_states_bytes"].max()
    assert states["zero3"] < states["ddp"]
