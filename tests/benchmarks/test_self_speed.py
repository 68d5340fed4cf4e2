"""How fast fsdpbench itself is, whole process (pytest-benchmark): a change that slows the tool shows.

    FSDPBENCH_BENCH_SELF=1 python -m pytest tests/benchmarks/test_self_speed.py -q -s --benchmark-enable \\
        [--benchmark-autosave]

Each benchmark times one ``python -m fsdpbench …`` command from process start to exit, as a user waits
for it, ``FSDPBENCH_BENCH_SELF_ROUNDS`` times (default 5; pytest-benchmark's median is the figure):

- ``predict`` analytic, llama-7b ZeRO-3 on 64 ranks (no torch imported: tests/test_predict_fast.py);
- ``predict --method traced``, llama-7b ZeRO-3 on 64 ranks and llama-70b on 1024 ranks (bf16, batch 1,
  sequence 2048 and 1024);
- ``report`` and ``regress`` over a synthetic run of 10,000 cases (the report's synthetic cases,
  fsdpbench/report/synthetic.py, copied under distinct ids: ~29,000 rank rows); ``regress`` over its
  finished cases only, against a baseline written from the same run;
- ``run scenarios/quickstart.yaml`` (13 cases, minutes; one round unless the rounds are set).

Nothing is asserted about time (docs/results/self-speed.md has the figures, the machine and its load); each
test asserts that the command did its job. Run it on an idle machine: other work moves every number.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

SWITCH = "FSDPBENCH_BENCH_SELF"
ROUNDS = int(os.environ.get("FSDPBENCH_BENCH_SELF_ROUNDS", "5"))
ROOT = Path(__file__).resolve().parents[2]
N_CASES = 10_000

pytestmark = pytest.mark.skipif(
    os.environ.get(SWITCH) != "1", reason=f"fsdpbench's own speed, whole processes: set {SWITCH}=1 (minutes)"
)


def fsdpbench(*argv: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """``python -m fsdpbench ARGV`` from this checkout, its output captured (a pipe, as in CI)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    return subprocess.run(
        [sys.executable, "-m", "fsdpbench", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def timed(benchmark, *argv: str, rounds: int = ROUNDS, expect: int = 0) -> subprocess.CompletedProcess:
    """Benchmark one command's whole-process wall time; its last run's result, checked for ``expect``."""
    last: list[subprocess.CompletedProcess] = []

    def once() -> None:
        last[:] = [fsdpbench(*argv)]

    benchmark.pedantic(once, rounds=rounds, iterations=1, warmup_rounds=0)
    proc = last[0]
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-2000:]
    benchmark.extra_info.update(command="fsdpbench " + " ".join(argv), load_average=os.getloadavg())
    return proc


def test_predict_analytic_llama_7b_on_64(benchmark):
    proc = timed(benchmark, "predict", "--model", "llama-7b", "--world-size", "64", "--strategy", "zero3")
    assert "peak on the device" in proc.stdout


@pytest.mark.parametrize(
    ("model", "world_size", "seq_len"), [("llama-7b", 64, 2048), ("llama-70b", 1024, 1024)]
)
def test_predict_traced(benchmark, model, world_size, seq_len):
    argv = ("predict", "--model", model, "--world-size", str(world_size), "--strategy", "zero3")
    argv += ("--precision", "bf16", "--seq-len", str(seq_len), "--method", "traced")
    proc = timed(benchmark, *argv)
    assert "traced (tracker)" in proc.stdout


def write_large_synthetic_run(run_dir: Path, n_cases: int = N_CASES, *, ok_only: bool = False) -> Path:
    """A run directory of ``n_cases`` synthetic cases: the report's synthetic cases (``ok_only``: less
    the failed and the skipped one, as a baseline must be), copied under distinct case ids;
    results.parquet and run.json, as ``consolidate`` leaves them."""
    from fsdpbench.core.schema import OK, STATUS
    from fsdpbench.report.synthetic import synthetic_results, write_synthetic_run
    from fsdpbench.store.results import RunStore

    write_synthetic_run(run_dir, timelines=False)  # run.json (and 13 cases' files)
    base = synthetic_results()
    if ok_only:
        base = base[base[STATUS] == OK]
    ids = list(dict.fromkeys(base["case_id"]))
    copies = -(-n_cases // len(ids))
    frames = []
    for i in range(copies):
        frame = base.copy()
        frame["case_id"] = frame["case_id"].str.replace("_000000", f"_{i:06d}", regex=False)
        frames.append(frame)
    rows = pd.concat(frames, ignore_index=True)
    keep = list(dict.fromkeys(rows["case_id"]))[:n_cases]
    rows = rows[rows["case_id"].isin(keep)].reset_index(drop=True)
    rows.to_parquet(RunStore(run_dir).run_dir / "results.parquet", index=False)
    return run_dir


@pytest.fixture(scope="module")
def large_run(tmp_path_factory) -> Path:
    run = write_large_synthetic_run(tmp_path_factory.mktemp("large") / "run")
    assert pd.read_parquet(run / "results.parquet")["case_id"].nunique() == N_CASES
    return run


@pytest.fixture(scope="module")
def large_ok_run(tmp_path_factory) -> Path:
    run = write_large_synthetic_run(tmp_path_factory.mktemp("large_ok") / "run", ok_only=True)
    assert pd.read_parquet(run / "results.parquet")["case_id"].nunique() == N_CASES
    return run


def test_report_over_10000_cases(benchmark, large_run):
    out = large_run / "report.html"
    timed(benchmark, "report", str(large_run), "--out", str(out))
    assert out.stat().st_size > 0


def test_regress_over_10000_cases(benchmark, large_ok_run):
    """Against a baseline written from the same run: every case compared, none regressed."""
    baseline = large_ok_run.parent / "baseline.json"
    wrote = fsdpbench("regress", str(large_ok_run), "--write-baseline", str(baseline))
    assert wrote.returncode == 0, wrote.stderr[-2000:]
    timed(benchmark, "regress", str(large_ok_run), "--baseline", str(baseline))


def test_quickstart(benchmark, tmp_path):
    """A fresh run directory each round (a run does not write into another run's directory)."""
    rounds = int(os.environ.get("FSDPBENCH_BENCH_SELF_ROUNDS", "1"))
    done: list[subprocess.CompletedProcess] = []

    def once() -> None:
        done.append(fsdpbench("run", "scenarios/quickstart.yaml", "--out", str(tmp_path / f"qs{len(done)}")))

    benchmark.pedantic(once, rounds=rounds, iterations=1, warmup_rounds=0)
    assert all(p.returncode == 0 for p in done), done[-1].stderr[-2000:]
    assert "13 cases" in done[-1].stderr + done[-1].stdout
    benchmark.extra_info.update(
        command="fsdpbench run scenarios/quickstart.yaml", load_average=os.getloadavg()
    )
