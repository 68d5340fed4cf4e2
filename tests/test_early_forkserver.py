"""``run`` and ``compare`` start their fork server before anything else (cli.py, ``launch.start_forkserver``),
so that its imports overlap the orchestrator's own; none where no rank will run; a malformed scenario still
exits 2 at once and leaves no process behind. (A plugin in the current directory with the server started
first: tests/test_remeasure_plugins.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fsdpbench import cli
from fsdpbench.pipeline import launch
from tests.helpers import EVENTUALLY_S, repo_pythonpath
from tests.helpers import REPO as ROOT


@pytest.mark.parametrize(
    ("argv", "starts"),
    [
        (["run", "s.yaml"], True),
        (["run", "s.yaml", "--out", "r", "--resume"], True),
        (["compare", "--world-size", "2"], True),
        (["run", "s.yaml", "--dry-run"], False),
        (["run", "s.yaml", "--dry"], False),  # argparse takes a prefix of an option
        (["run", "s.yaml", "--export-cases=cases"], False),
        (["run", "s.yaml", "--collect"], False),
        (["compare", "-h"], False),
        (["predict", "--model", "llama-7b", "--world-size", "8"], False),
        ([], False),
    ],
)
def test_the_fork_server_starts_first_only_where_ranks_will_run(
    argv: list[str], starts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[bool] = []
    monkeypatch.setattr(launch, "start_forkserver", lambda: started.append(True))
    cli._start_forkserver_if_ranks_will_run(argv)
    assert started == ([True] if starts else [])


def _processes_marked(mark: str, *, in_cmdline: str = "") -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                marked = f"FSDPBENCH_TEST_MARK={mark}".encode() in (entry / "environ").read_bytes()
                if marked and in_cmdline.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _wait_for(condition, within_s: float) -> bool:  # noqa: ANN001 — a callable
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(condition())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_server_runs_while_the_scenario_is_read_and_dies_with_a_malformed_one(tmp_path: Path) -> None:
    # the scenario is a pipe: the orchestrator waits in reading it, with its fork server already started
    scenario = tmp_path / "s.yaml"
    os.mkfifo(scenario)
    mark = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(ROOT), "FSDPBENCH_TEST_MARK": mark}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdpbench", "run", str(scenario), "--out", str(tmp_path / "r")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert _wait_for(lambda: _processes_marked(mark, in_cmdline="forkserver"), 60)
        scenario.write_text("name: bad\ndefaults: {model: decoder-tiny}\nsweep:\n  world_size: [0]\n")
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 2 and err.startswith(f"error: {scenario}: sweep.world_size[0]"), err
    assert not (tmp_path / "r").exists()
    assert _wait_for(lambda: not _processes_marked(mark), EVENTUALLY_S)  # the fork server died with it
