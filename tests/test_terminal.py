"""What fsdpbench leaves on a terminal: no library log line (the gloo probe's go to the run's logs), a
summary whose every case id is whole at 80 columns, no stale progress line, and a test run without
pytest-benchmark's tables."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from io import StringIO
from types import SimpleNamespace

import pandas as pd
import pytest
from rich.console import Console

from fsdpbench.analysis.summary import print_summary
from fsdpbench.commands.running import case_progress
from fsdpbench.core.schema import CASE_ID, OK
from tests.helpers import REPO as ROOT
from tests.helpers import repo_pythonpath

H100_ROWS = ROOT / "tests" / "data" / "gpu-h100" / "single_gpu_decoder-base_results.parquet"


def test_the_gloo_probe_sends_library_log_lines_to_the_run_directory(tmp_path):
    """C++ log lines (c10d at INFO, as kineto's are) written by the probe processes to fds 1 and 2 land
    in <run dir>/comm_probe/gloo_n2_rank<r>.log; the terminal gets the one line that says what runs."""
    # one repetition of each sequence: where the lines go does not depend on how long the probe measures
    script = "from pathlib import Path; from fsdpbench.pipeline.comm_probe import probe; "
    script += "probe(Path(%r), 2, reps=1)"
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(ROOT), "TORCH_CPP_LOG_LEVEL": "INFO"}
    env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", script % str(run_dir)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == ""
    assert proc.stderr == "probing gloo with 2 processes for the step-time model …\n"
    for rank in (0, 1):
        log = (run_dir / "comm_probe" / f"gloo_n2_rank{rank}.log").read_text()
        assert "[c10d" in log  # the C++ side's lines are there, not on the terminal
    # rank 0's scratch directory for its points was in here, and is gone
    assert sorted(p.name for p in (run_dir / "comm_probe").iterdir()) == [
        "gloo_n2.json",
        "gloo_n2_rank0.log",
        "gloo_n2_rank1.log",
    ]


def _summary(width: int) -> tuple[str, list[str]]:
    rows = pd.read_parquet(H100_ROWS)
    console = Console(file=StringIO(), width=width, color_system=None)
    print_summary(rows, console)
    return console.file.getvalue(), list(dict.fromkeys(rows[CASE_ID]))


@pytest.mark.parametrize("width", [80, 100, 120])
def test_the_summary_is_a_table_that_fits_naming_each_case_by_what_differs(width):
    text, case_ids = _summary(width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "…" not in text
    rows = [line for line in lines if re.search(r"\b[0-9a-f]{6}\s*$", line)]
    assert len(rows) == len(case_ids)  # one row per case, not a block of lines per case
    for case_id, row in zip(case_ids, rows, strict=True):
        strategy, world, *_ = case_id.split("_")
        precision = "bf16" if "_bf16_" in case_id else "fp32"
        # its name (what tells it from the others: the precision here) and its id's hash (its directory)
        assert row.split()[:3] == [strategy, world, precision] and row.rstrip().endswith(case_id[-6:])
        assert re.search(r" \d+\.\d \(\d+–\d+\) ", row)  # the step-time cell whole: "161.1 (161–161)"
    assert "161.1 (161–161)" in text and "58.5%" in text


def test_a_narrow_console_leaves_out_the_throughput_and_a_wide_one_shows_it():
    assert "samples/s" not in _summary(80)[0] and "samples/s" in _summary(120)[0]


def test_a_case_is_named_by_what_tells_it_from_the_others():
    from fsdpbench.analysis.names import case_names
    from fsdpbench.core.case import Case

    size = dict(model="mnist-cnn", strategy="fsdp1_full", world_size=2, wrap="size")
    cases = [
        Case(**size, wrap_min_params=100_000),
        Case(**size, wrap_min_params=20_000),
        Case(model="mnist-cnn", strategy="ddp", world_size=2),
    ]
    assert list(case_names(cases).values()) == [
        "fsdp1_full n2 wrap=size(1e5)",
        "fsdp1_full n2 wrap=size(2e4)",
        "ddp n2",
    ]


def _finish_two_cases(console: Console) -> None:
    rows = pd.DataFrame({"case_step_time_ms": [12.5]})
    with case_progress(console, 2) as (on_start, on_done):
        for i, name in enumerate(("ddp_n1_a", "zero3_n2_b")):
            case = SimpleNamespace(case_id=name, emulate=False, world_size=1, device="cpu")
            on_start(case, i)
            on_done(case, SimpleNamespace(status=OK, error=None), rows)


def test_piped_output_has_the_finished_cases_and_no_progress_frame():
    console = Console(file=StringIO(), width=80, color_system=None)
    _finish_two_cases(console)
    lines = console.file.getvalue().splitlines()
    assert [line.split() for line in lines] == [
        ["ok", "ddp_n1_a", "12.5", "ms/step"],
        ["ok", "zero3_n2_b", "12.5", "ms/step"],
    ]  # nothing after the last case: no frame naming it as if it still ran


def test_on_a_terminal_the_bar_leaves_when_the_cases_are_done():
    console = Console(file=StringIO(), width=80, force_terminal=True, color_system=None)
    _finish_two_cases(console)
    text = console.file.getvalue()
    assert "ddp_n1_a" in text and "zero3_n2_b" in text
    last_frame = text.rsplit("\x1b[2K", 1)[-1]  # what stays after the live display erased its lines
    assert "━" not in last_frame and "2/2" not in last_frame


def test_a_plain_test_run_prints_no_benchmark_table_and_enable_times_them():
    test = "tests/benchmarks/test_predict_speed.py::test_analytic_1t_params_on_4096"
    # in one process (-n 0), with pytest-benchmark on but not timing (addopts), then timing: a test process
    # of a parallel run has pytest-xdist's PYTEST_XDIST_*, which would turn pytest-benchmark off
    outer = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env = {**outer, "PYTHONPATH": repo_pythonpath(ROOT), "COLUMNS": "80"}
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0"]
    plain = subprocess.run(
        [*pytest, test],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert plain.returncode == 0, plain.stdout[-2000:]
    assert "benchmark:" not in plain.stdout and "Mean" not in plain.stdout
    assert max(len(line) for line in plain.stdout.splitlines()) <= 100
    timed = subprocess.run(  # a table needs rounds, not a second of them (pytest-benchmark's default)
        [*pytest, "--benchmark-enable", "--benchmark-max-time=0.05", test],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert timed.returncode == 0, timed.stdout[-2000:]
    assert "benchmark: 1 tests" in timed.stdout and "Mean" in timed.stdout
