"""`fsdpbench run` as a user runs it: progress, summary, results path; --collect for external launchers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fsdpbench.cli import main

pytestmark = pytest.mark.slow

SCENARIO = """
name: mini
description: two tiny cases
defaults: {model: decoder-tiny, batch_size: 2, seq_len: 16, warmup_steps: 1, steps: 2,
           device: cpu, backend: gloo}
sweep: {world_size: [2], strategy: [ddp, zero3]}
cases: [{strategy: hsdp, world_size: 2, shard_size: 3}]
"""


def test_run_writes_results_and_prints_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # the narrowest terminal the output is made for
    monkeypatch.chdir(tmp_path)  # paths as short as a user's: a path is printed whole, however long
    scenario = tmp_path / "mini.yaml"
    scenario.write_text(SCENARIO)
    with pytest.raises(SystemExit) as exit_info:
        # --link none: the modelled step time's columns and lines are tests/test_step_model.py's
        main(["run", "mini.yaml", "--out", "run", "--no-report", "--link", "none"])
    assert exit_info.value.code == 0
    out, err = capsys.readouterr()
    assert "results: run/results.parquet" in out
    assert "skipped hsdp n2" in err and "does not divide world_size=2" in " ".join(err.split())
    # at 80 columns every line fits: the progress lines, the thread policy, the summary table
    assert max(len(line) for line in (out + err).splitlines()) <= 80
    assert "host_tuning none: gloo's and the compute threads under SCHED_OTHER" in " ".join(err.split())
    frame = pd.read_parquet(tmp_path / "run" / "results.parquet")
    assert set(zip(frame.strategy, frame.status)) == {("ddp", "ok"), ("zero3", "ok"), ("hsdp", "skipped")}
    for column in (
        "case_id",
        "strategy",
        "world_size",
        "rank",
        "model",
        "params",
        "wrap",
        "prefetch",
        "precision",
        "optimizer",
        "batch_size",
        "status",
        "error",
        "step_time_ms",
        "loss_final",
        "backend",
        "device",
    ):
        assert column in frame.columns
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["status"] == "complete" and meta["scenario"]["text"] == scenario.read_text()
    assert meta["env"]["torch_version"] and meta["env"]["commit"]
    for case in meta["cases"].values():
        assert case["overhead_s"] == pytest.approx(case["wall_s"] - case["steps_s"], abs=2e-3)
    # the summary names how each time was taken: median of N timed steps after W warm-up, and its spread
    assert "median of 2 timed steps after 1 warm-up, p10–p90" in " ".join(out.split())
    ddp = frame[frame.strategy == "ddp"]
    slowest = ddp.loc[ddp.step_time_ms.idxmax()]
    assert (
        f"{slowest.step_time_ms:.1f} ({slowest.step_time_p10_ms:.0f}–{slowest.step_time_p90_ms:.0f})" in out
    )


def test_malformed_scenario_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text("name: bad\nsweep: {world_size: [0]}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(scenario), "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {scenario}: sweep.world_size[0]: Input should be greater than 0 (got 0)"
        " [parallelism section]"
    )
    assert not (tmp_path / "run").exists()


def test_external_launcher_then_collect(tmp_path: Path) -> None:
    """What a multi-node user does, on one node: export cases, torchrun the worker, collect."""
    scenario = tmp_path / "mini.yaml"
    scenario.write_text(SCENARIO.replace("strategy: [ddp, zero3]", "strategy: [zero3]"))
    with pytest.raises(SystemExit):
        main(["run", str(scenario), "--export-cases", str(tmp_path / "cases")])
    (case_file,) = (tmp_path / "cases").glob("*.json")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "fsdpbench.engine.worker",
        "--case",
        str(case_file),
        "--out",
        str(run_dir / "cases" / case_file.stem),
    ]
    subprocess.run(
        cmd, check=True, capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(scenario), "--out", str(run_dir), "--collect", "--no-report", "--link", "none"])
    assert exit_info.value.code == 0
    frame = pd.read_parquet(run_dir / "results.parquet")
    ran = frame[frame.status != "skipped"]
    assert list(ran["rank"]) == [0, 1] and set(ran["status"]) == {"ok"}
    assert (ran["comm_total_bytes"] > 0).all()
