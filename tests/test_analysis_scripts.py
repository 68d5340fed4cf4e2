"""The scripts under analysis/ that the README and the docs tell users to run, run as they say (on a
small case): analysis/emulate_cost.py (docs/emulation.md) read the rank's record as a dict, which it no
longer is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpbench.core.case import Case
from fsdpbench.predictors.memory_model import predict_memory
from tests.helpers import REPO, repo_pythonpath


def run_script(script: str, *argv: str) -> subprocess.CompletedProcess:
    """``python analysis/SCRIPT ARGV`` from the repository's root, as the docs show it."""
    return subprocess.run(
        [sys.executable, f"analysis/{script}", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": repo_pythonpath(REPO)},
        timeout=300,
    )


def test_check_model_runs_as_the_readme_says(one_case_run: Path) -> None:
    done = run_script("check_model.py", str(one_case_run), "--traced", "--terms")
    assert done.returncode == 0, done.stderr
    assert "measured/predicted MiB at the peak: params" in done.stdout
    assert "1 rows; worst |error|" in done.stdout and "peak (traced)" in done.stdout


@pytest.mark.slow
def test_gloo_loop_spin_runs_as_the_docs_say_and_shows_each_gloo_threads_cpu_and_wait() -> None:
    # one policy, 2 repetitions: the script's own work is the same for each (the policies are
    # hosttuning/threads.py's, tested in tests/test_threads.py)
    done = run_script("gloo_loop_spin.py", "--pairs", "1", "--policies", "as-is", "--reps", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split("  queued")[0] for line in lines if line.startswith("pair ")] == ["pair 0 loop as-is "]
    # the as-is pair's fastest and slowest bursts, each rank's gloo threads by name: CPU / run-queue wait
    ranks = [line for line in lines if line.startswith("      rank ")]
    assert len(ranks) == 4 and all("gloo_tcp_loop " in r and "pt_gloo_runloop " in r for r in ranks)


@pytest.mark.slow
def test_emulate_cost_runs_as_the_docs_say_and_reports_the_emulated_rank() -> None:
    done = run_script(
        "emulate_cost.py", "--model", "decoder-tiny", "--world-size", "4", "--strategy", "zero3", "--tracked"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert ": rank 0 of 4, emulated on cpu, " in lines[0] and "batch 1 x seq 64, fp32" in lines[0]
    assert any(line.startswith("  emulated step time (compute only, 1 step, no warm-up): ") for line in lines)
    # the tracked step's peak, the emulated rank's live tensors, is the analytic model's within 0.01% (the
    # script runs no warm-up step; the model's goldens are exact for cases with one)
    (peak_line,) = [line for line in lines if line.startswith("  tracker peak (live tensors, memory step): ")]
    measured = int(peak_line.rsplit("(", 1)[1].removesuffix(" B)").replace(",", ""))
    case = Case(model="decoder-tiny", strategy="zero3", world_size=4, batch_size=1, seq_len=64, emulate=True)
    assert measured == pytest.approx(predict_memory(case, rank=0).peak_bytes, rel=1e-4)
    assert peak_line.split(": ", 1)[1] == f"{measured / 1e9:.3f} GB ({measured:,} B)"
