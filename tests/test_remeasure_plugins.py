"""``regress --repeat K`` re-launches a case of a plugin strategy as ``run --allow-plugins`` launched
it: it once failed to re-measure one ("failed, 0 samples") and said nothing more, because its
module, found in the current directory by the run, was not found by the re-launched ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpbench.analysis.regress import SAMPLED
from fsdpbench.core.schema import STEP_TIME_REF_OTHER_LOAD
from tests.helpers import REPO as ROOT
from tests.helpers import repo_pythonpath

PLUGIN = """
from fsdpbench.strategies.fsdp2 import Zero3


class MyZero3(Zero3):
    '''zero3 as a user's own module would wrap it.'''
"""
SCENARIO = """
name: plug
defaults: {model: decoder-tiny, batch_size: 2, seq_len: 16, warmup_steps: 1, steps: 2, memory_steps: 1,
           profile_steps: 0, time_blocks: 4, time_block_steps: 2, timeout_s: 200}
sweep: {strategy: ["myplug:MyZero3"], world_size: [1]}
"""


def fsdpbench(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """The command as a user's shell runs it from ``cwd``: -P, so the current directory is not on
    sys.path (as for the installed ``fsdpbench`` script; ``python -m`` would put it there)."""
    env = {k: v for k, v in os.environ.items() if k != "FSDPBENCH_ALLOW_PLUGINS"}
    env["PYTHONPATH"] = repo_pythonpath(ROOT)
    return subprocess.run(
        [sys.executable, "-P", "-m", "fsdpbench", *argv], cwd=cwd, env=env, capture_output=True, text=True
    )


def as_if_quiet(run_dir: Path) -> None:
    """The run's other-process load set to none: on a busy machine its time would not be judged (beyond
    the gate's rated load), and this test is about what happens when it is."""
    import pandas as pd

    for path in [run_dir / "results.parquet", *(run_dir / "cases").glob("*.parquet")]:
        frame = pd.read_parquet(path)
        frame[STEP_TIME_REF_OTHER_LOAD] = 0.0
        frame.to_parquet(path, index=False)


@pytest.mark.slow
def test_repeat_re_measures_a_plugin_case_when_allowed_and_says_why_not_otherwise(tmp_path: Path) -> None:
    (tmp_path / "myplug.py").write_text(PLUGIN)
    (tmp_path / "s.yaml").write_text(SCENARIO)
    ran = fsdpbench(
        tmp_path, "run", "s.yaml", "--out", "r", "--allow-plugins", "--no-report", "--link", "none"
    )
    assert ran.returncode == 0, ran.stderr
    assert fsdpbench(tmp_path, "regress", "r", "--write-baseline", "b.json").returncode == 0
    # a baseline a million times faster than the run (every sample below every one of the run's, so the
    # rank test fails however noisy the machine): its one case is a suspect that --repeat re-launches
    baseline = json.loads((tmp_path / "b.json").read_text())
    (case_id,) = baseline["cases"]
    metrics = baseline["cases"][case_id]["metrics"]
    metrics[SAMPLED] = [[x * 1e-6 for x in launch] for launch in metrics[SAMPLED]]
    (tmp_path / "b.json").write_text(json.dumps(baseline))
    as_if_quiet(tmp_path / "r")

    refused = fsdpbench(tmp_path, "regress", "r", "--baseline", "b.json", "--repeat", "1")
    assert refused.returncode == 1  # judged on the run's samples: still slower than the forged baseline
    assert f"not re-measured {case_id}: its strategy myplug:MyZero3 is a plugin" in refused.stderr
    assert "--allow-plugins" in refused.stderr and not (tmp_path / "r" / "remeasured").exists()

    allowed = fsdpbench(tmp_path, "regress", "r", "--baseline", "b.json", "--repeat", "1", "--allow-plugins")
    line = next(x for x in allowed.stderr.splitlines() if x.startswith(f"re-measured {case_id}"))
    assert line == f"re-measured {case_id} (1/1): ok, 4 samples", allowed.stderr  # 4 time blocks
