"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# A test process per core (pytest_xdist_auto_num_workers, below), each starting rank processes: more
# threads than cores, and an OpenMP thread that waits spins for a while before it sleeps, on a core that
# another test's rank needs (2-core CPU, 3 test processes: 455 CPU-seconds in 229 s
# spinning, 424 in 214 s passive). Set before torch loads OpenMP; the test processes, their fork
# servers and ranks inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tests.helpers import REPO, made_once, one_rank_gloo, reference_losses, repo_pythonpath  # noqa: E402  (imports torch: after the line above)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many processes ``-n auto`` (pyproject's addopts) runs the tests in.

    On CPU ranks: as many as the cores. More is slower: the tests' own rank processes already fill
    the cores, and every process beyond them adds CPU time instead of using idle time (2-core CPU,
    idle: 3 processes 228-231 s, 451-461 CPU-seconds; 2 processes 204-216 s, 384-409
    CPU-seconds; serially 286 s, 340 CPU-seconds; docs/results/ci.md). Serial (0) where a CUDA GPU is
    visible, whose memory and NVML readings would be shared with the other processes' tests, and
    where benchmarks are timed (``--benchmark-enable``: pytest-benchmark times nothing beside other
    tests)."""
    import torch

    if config.getoption("benchmark_enable", False) or torch.cuda.is_available():
        return 0
    return os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the group into the test's id
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that share a costly fixture (``helpers.made_once``: real runs, made once per module or
    session) go to one test process (``--dist loadgroup``), which makes it once: spread over the
    processes, each made its own (the session's real run, ``one_case_run``: ~14 CPU-seconds;
    test_measurements' 16 rank processes, test_deepspeed's 3 two-rank DeepSpeed cases). Other tests are
    spread one by one; two such fixtures used by one test put all their tests in one group."""
    group: dict[str, str] = {}  # a shared fixture -> another one of its group (union-find)

    def root(name: str) -> str:
        while group[name] != name:
            group[name] = group[group[name]]
            name = group[name]
        return name

    shared_by_item = [(item, _shared_fixtures(item)) for item in items]
    for _, shared in shared_by_item:
        for name in shared:
            group.setdefault(name, name)
        for other in shared[1:]:
            group[root(other)] = root(shared[0])
    for item, shared in shared_by_item:
        if shared:
            item.add_marker(pytest.mark.xdist_group(root(shared[0])))


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The costly fixtures (``helpers.made_once``) that ``item`` uses."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a test function (a doctest, say)
        return []
    return sorted(
        f"{definition.baseid}::{name}"
        for name, definitions in info.name2fixturedefs.items()
        for definition in definitions[-1:]  # the one the test gets
        if getattr(definition.func, "made_once", False)
    )


@pytest.fixture
def one_rank_gloo_group():
    """A 1-rank gloo group in this process, undone afterwards (tests only)."""
    with one_rank_gloo():
        yield


@pytest.fixture(scope="session")
def reference_2(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Losses of ddp on one rank over the global batch of 2 ranks (the reference of the 2-rank tests)."""
    return reference_losses(2, tmp_path_factory.mktemp("ref2"))


# one real CPU case as `fsdpbench run` writes it: a bare loop (harness overhead), time blocks against the
# reference step, the traced predictor and the step-time model, so that its rows hold every column a CPU
# run writes
ONE_CASE_SCENARIO = """\
name: one_case
traced: true
defaults: {device: cpu, backend: gloo, model: decoder-tiny, batch_size: 2, seq_len: 16, optimizer: adamw,
           precision: fp32, wrap: block,
           warmup_steps: 1, steps: 2, memory_steps: 1, bare_steps: 2, time_blocks: 1, time_block_steps: 2,
           timeout_s: 120}
cases:
  - {strategy: zero2, world_size: 1}
"""


@pytest.fixture(scope="session")
@made_once
def one_case_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory of one real CPU case (ZeRO-2, 1 rank, decoder-tiny), made as the README runs it."""
    root = tmp_path_factory.mktemp("one_case")
    scenario = root / "one_case.yaml"
    scenario.write_text(ONE_CASE_SCENARIO)
    run_dir = root / "run"
    command = [sys.executable, "-m", "fsdpbench", "run", str(scenario), "--out", str(run_dir), "--no-report"]
    # this checkout's fsdpbench, not an installed one
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return run_dir
