"""The CI gate's error rates, measured: how often it fails unchanged code, how often it catches a slowdown.

    FSDPBENCH_BENCH_GATE=1 python -m pytest tests/benchmarks/test_gate_trials.py -q -s -n 0 \\
        [FSDPBENCH_BENCH_GATE_TRIALS=20] [FSDPBENCH_BENCH_GATE_DOCS=docs/ci.md] \\
        [FSDPBENCH_BENCH_GATE_RECORD=trials.json] [FSDPBENCH_BENCH_GATE_CONDITIONS=a,b,c,d10,d20,d10b,d20b]
        [FSDPBENCH_BENCH_GATE_FROM=trials.json]   # only the table, from recorded trials

A trial is what CI does, as ``.ci/run`` does it, on ``tests/benchmarks/gate_trial.yaml`` (ZeRO-3 at 2
ranks on decoder-tiny with the gate's 10 reference-interleaved blocks: a few seconds): ``fsdpbench run
… --no-report --link none``, then ``fsdpbench regress … --baseline B --strict --repeat 2``,
against a baseline written once, at the start, from ``FSDPBENCH_BENCH_GATE_BASELINE_RUNS`` (default 3)
runs on the idle machine (``--write-baseline … --pool …``, as ``baselines/ci.json`` is written). The
conditions (``gate_trials.CONDITIONS``), their trials interleaved so that a drift of the machine hits
each alike:

- (a) unchanged code, idle; (b) unchanged, one core kept busy (``yes > /dev/null``) through the whole
  re-run, ``regress`` and its re-launches included; (c) unchanged, a ``yes`` that starts and stops at
  random moments (on and off 0.5-4 s each) through the re-run;
- (d) ``regressions:Compute10Zero3`` and ``regressions:ComputeZero3`` (10% and 20% more work per step,
  sized on each rank from its own unmodified steps) in zero3's place, gated with
  ``--map-strategy …=zero3``, idle and under (b)'s load.

It prints each condition's rate (a gate that failed: a false alarm for (a)-(c), a detection for (d))
with its 95% Clopper–Pearson and Wilson intervals, writes the table between the markers of
``FSDPBENCH_BENCH_GATE_DOCS`` and every trial's record to ``FSDPBENCH_BENCH_GATE_RECORD``. Nothing is
asserted about the rates (they are the machine's as much as the gate's): run it on an otherwise idle
machine. The load processes are this benchmark's own and are killed when a trial ends, whatever happens.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.benchmarks.gate_trials import CONDITIONS, markdown, rate_rows, replace_between_markers

SWITCH = "FSDPBENCH_BENCH_GATE"
ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tests" / "benchmarks" / "gate_trial.yaml"
REPEAT = 2  # .ci/run's
PLUGINS = {0.10: "regressions:Compute10Zero3", 0.20: "regressions:ComputeZero3"}
INTERMITTENT_S = (0.5, 4.0)  # (c): each on and off period, uniform

pytestmark = pytest.mark.skipif(
    os.environ.get(SWITCH) != "1",
    reason=f"the gate's false-alarm and detection rates, minutes of real runs with load: set {SWITCH}=1",
)


def fsdpbench(*argv: str | Path) -> subprocess.CompletedProcess:
    """``python -m fsdpbench ARGV`` from this checkout, the plugins importable; as a shell runs it (the
    test suite's OMP_WAIT_POLICY removed: .ci/run's gate runs without it)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'plugins'}", COLUMNS="80")
    return subprocess.run(
        [sys.executable, "-m", "fsdpbench", *map(str, argv)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )


class Load:
    """The load beside a trial: none, one ``yes`` throughout, or one that starts and stops at random.
    Its processes end when the ``with`` block does, however it ends."""

    def __init__(self, kind: str, seed: int) -> None:
        self.kind, self.rng = kind, random.Random(seed)
        self.proc: subprocess.Popen | None = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.on_s = 0.0
        self.t0 = 0.0

    def _start(self) -> None:
        if self.proc is None:
            self.proc = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)

    def _end(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _toggle(self) -> None:
        on = False
        while not self.stop.wait(self.rng.uniform(*INTERMITTENT_S)):
            on = not on
            t = time.monotonic()
            if on:
                self._start()
                started = t
            else:
                self._end()
                self.on_s += t - started
        if on:
            self.on_s += time.monotonic() - started

    def __enter__(self) -> Load:
        self.t0 = time.monotonic()
        if self.kind == "busy":
            self._start()
        elif self.kind == "intermittent":
            self.thread = threading.Thread(target=self._toggle, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        if self.kind == "busy":
            self.on_s = time.monotonic() - self.t0
        self._end()

    def on_share(self) -> float:
        return self.on_s / max(time.monotonic() - self.t0, 1e-9)


def run_args(extra: float) -> list[str]:
    args = ["--no-report", "--link", "none"]
    if extra:
        args += ["--set", f"strategy={PLUGINS[extra]}", "--allow-plugins"]
    return args


def write_baseline(work: Path, runs: int) -> Path:
    """The trials' baseline: ``runs`` idle runs of the trial scenario, pooled."""
    dirs = []
    for i in range(runs):
        out = work / f"baseline{i}"
        proc = fsdpbench("run", SCENARIO, "--out", out, *run_args(0.0))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        dirs.append(out)
    path = work / "baseline.json"
    pool = [arg for d in dirs[1:] for arg in ("--pool", str(d))]
    proc = fsdpbench("regress", dirs[0], "--write-baseline", path, *pool)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return path


def one_trial(cond, index: int, baseline: Path, work: Path) -> dict:
    """Run and gate once under the condition; what the gate said about the zero3 case's step time."""
    out = work / f"{cond.name}_{index:02d}"
    regress_json = out / "regress.json"
    gate = ["--baseline", baseline, "--strict", "--repeat", str(REPEAT), "--json", regress_json]
    if cond.extra:
        gate += ["--map-strategy", f"{PLUGINS[cond.extra]}=zero3"]
    start = time.monotonic()
    with Load(cond.load, seed=hash((cond.name, index)) & 0xFFFF) as load:
        ran = fsdpbench("run", SCENARIO, "--out", out, *run_args(cond.extra))
        gated = fsdpbench("regress", out, *gate) if ran.returncode == 0 else ran
        on_share = load.on_share()
    record: dict = {
        "condition": cond.name,
        "trial": index,
        "exit_code": gated.returncode,
        "run_exit_code": ran.returncode,
        "load_on_share": round(on_share, 3),
        "wall_s": round(time.monotonic() - start, 1),
        "verdict_line": next((x for x in gated.stdout.splitlines() if x.startswith(("PASS", "FAIL"))), ""),
        "failures": [x for x in gated.stdout.splitlines() if x.startswith("REGRESSION")],
    }
    if regress_json.exists():
        rows = json.loads(regress_json.read_text())["records"]
        (row,) = [r for r in rows if r["metric"] == "step_time_ref_ratios"] or [{}]
        record.update(
            verdict=row.get("verdict"),
            effect=row.get("change"),
            p_value=row.get("p_value"),
            note=row.get("note"),
        )
    remeasured = out / "remeasured"
    record["launches"] = 1 + (len(list(remeasured.glob("*/repeat*"))) if remeasured.exists() else 0)
    results = out / "results.parquet"
    if results.exists():
        frame = pd.read_parquet(results)
        if "step_time_ref_other_load" in frame:
            load_value = frame["step_time_ref_other_load"].dropna()
            record["other_load"] = float(load_value.iloc[0]) if len(load_value) else None
    return record


def checkout_commit() -> str:
    """This checkout's commit, +dirty when it has changes."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=ROOT).stdout
    return commit + ("+dirty" if dirty else "")


def machine_header(trials: int, conditions: list, commit: str, when: str) -> str:
    import torch

    names = ",".join(c.name for c in conditions)
    return (
        f"`FSDPBENCH_BENCH_GATE=1 FSDPBENCH_BENCH_GATE_TRIALS={trials} "
        f"FSDPBENCH_BENCH_GATE_CONDITIONS={names} "
        "python -m pytest tests/benchmarks/test_gate_trials.py -q -s -n 0` — "
        f"commit {commit}, torch {torch.__version__}, {os.cpu_count()}-core CPU, started {when} UTC"
    )


def test_gate_trials(tmp_path):
    trials = int(os.environ.get(f"{SWITCH}_TRIALS", "20"))
    wanted = os.environ.get(f"{SWITCH}_CONDITIONS")
    conditions = [c for c in CONDITIONS if not wanted or c.name in wanted.split(",")]
    records_path = os.environ.get(f"{SWITCH}_RECORD")
    records: list[dict] = []
    commit, when = checkout_commit(), time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    if os.environ.get(f"{SWITCH}_FROM"):  # the table of recorded trials (an interrupted series), no run
        records = json.loads(Path(os.environ[f"{SWITCH}_FROM"]).read_text())
        trials = max(sum(r["condition"] == c.name for r in records) for c in conditions)
        conditions = [c for c in conditions if any(r["condition"] == c.name for r in records)]
        trials_to_run = 0
        commit, when = records[0]["commit"], records[0]["started"]
    else:
        trials_to_run = trials
        baseline = write_baseline(tmp_path, int(os.environ.get(f"{SWITCH}_BASELINE_RUNS", "3")))
    for index in range(trials_to_run):  # interleaved: trial i of every condition, then trial i + 1
        for cond in conditions:
            record = one_trial(cond, index, baseline, tmp_path)
            record.update(commit=commit, started=when)
            records.append(record)
            print(
                f"{cond.name:5s} {index:2d} exit {record['exit_code']} launches {record['launches']} "
                f"effect {record.get('effect')} other load {record.get('other_load')} "
                f"({record['wall_s']} s) {record.get('note') or ''}",
                flush=True,
            )
            if records_path:  # after every trial: an interrupted series keeps what it measured
                Path(records_path).write_text(json.dumps(records, indent=1) + "\n")
    table = markdown(records, machine_header(trials, conditions, commit, when))
    print("\n" + table)
    docs = os.environ.get(f"{SWITCH}_DOCS")
    if docs:
        path = ROOT / docs
        path.write_text(replace_between_markers(path.read_text(), table))
    assert all(r["run_exit_code"] == 0 for r in records), [r for r in records if r["run_exit_code"]]
    assert rate_rows(records)  # every condition ran
