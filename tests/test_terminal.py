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


def test_at_80_columns_every_case_id_is_whole_and_no_cell_wraps():
    text, case_ids = _summary(80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text
    for case_id in case_ids:
        assert case_id in lines  # on a line of its own: copy it, find its directory
    # every step-time cell whole, on one line: "161.1 ms (161–161)"
    assert len(re.findall(r"step time \(p10–p90\) \d+\.\d ms \(\d+–\d+\)", text)) == len(case_ids)
    assert "ddp_n1_decoder-base_none_pf0_fp32_b8_4581d4" in lines


def test_a_wide_console_gets_the_table():
    text, case_ids = _summary(250)
    assert "┃ case" in text and "161.1 ms (161–161)" in text
    assert all(any(case_id in line and "│" in line for line in text.splitlines()) for case_id in case_ids)


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
