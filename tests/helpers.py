"""Helpers shared by the tests: tiny cases and their runs, waiting, process checks, trace events."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdpbench.core.case import Case
from fsdpbench.engine.rank_result import CaseOutcome
from fsdpbench.pipeline.launch import launch_case
from fsdpbench.pipeline.lifeline import pid_alive

# tests of CPU semantics pin CPU ranks explicitly, so a machine with a GPU runs the same cases
CPU: dict[str, str] = {"device": "cpu", "backend": "gloo"}
# tests that need a GPU: `-m cuda` selects them, and elsewhere they are skipped with this reason
NO_CUDA_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False on this machine)"
CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA_REASON)]


# this checkout's root: the tests run its fsdpbench, scenarios and docs
REPO = Path(__file__).resolve().parents[1]


def repo_pythonpath(root: Path) -> str:
    """PYTHONPATH for a subprocess that must import this checkout's fsdpbench: the checkout first, then
    what the caller's PYTHONPATH already holds (packages installed with ``pip --target`` stay importable)."""
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)


def requires_cuda(test: Callable) -> Callable:
    """Mark one test as a GPU test (see CUDA_ONLY for a whole module)."""
    for mark in CUDA_ONLY:
        test = mark(test)
    return test


TINY: dict[str, Any] = dict(
    model="decoder-tiny",
    batch_size=2,
    seq_len=16,
    warmup_steps=1,
    steps=2,
    memory_steps=1,
    timeout_s=300,  # a bound for a hung case on a busy machine, not a speed: tiny cases take seconds
    **CPU,
)


def made_once(fixture: Callable) -> Callable:
    """Under ``@pytest.fixture(scope="module" or "session")``: a fixture costly enough (real runs) that
    the tests using it go to one test process, which makes it once (tests/conftest.py)."""
    fixture.made_once = True  # type: ignore[attr-defined]
    return fixture


def tiny_case(**fields: Any) -> Case:
    """A decoder-tiny case small enough for a unit test (a second or two per case)."""
    return Case(**{**TINY, **fields})


def run(case: Case, tmp_path: Path) -> CaseOutcome:
    """The case launched for real, in ``tmp_path / case_id``."""
    return launch_case(case, tmp_path / case.case_id)


def run_with_predictions(case: Case, tmp_path: Path) -> Any:
    """The result rows of a case that ran ok, with the analytic prediction beside them (pred_* columns)."""
    from fsdpbench.pipeline.runner import add_predictions
    from fsdpbench.store.results import build_rows

    outcome = run(case, tmp_path)
    assert outcome.status == "ok", outcome.error
    return add_predictions(case, build_rows(case, outcome, {}))


def global_losses(outcome: CaseOutcome) -> list[float]:
    """Mean of the ranks' local losses per step: the loss over the global batch."""
    per_rank = [r.losses for r in outcome.ranks]
    return [sum(step) / len(step) for step in zip(*per_rank)]


def reference_losses(world_size: int, tmp_path: Path, batch_size: int = 2) -> list[float]:
    """Per-step losses of ddp on one rank over the global batch of ``world_size`` ranks of ``batch_size``."""
    ref = run(tiny_case(strategy="ddp", world_size=1, batch_size=batch_size * world_size), tmp_path)
    assert ref.status == "ok", ref.error
    return global_losses(ref)


# the plugin strategies that fail on purpose (module:Class names in a case's strategy)
FAULTS = "tests.plugins.faults"


# how long a test waits for what it asserts will happen (a thread's tick, a process's exit) before it
# fails: a bound on a busy machine's delay, not a speed asserted; a test that passes waits no longer than
# the event takes
EVENTUALLY_S = 120.0


def wait_until(
    predicate: Callable[[], bool],
    timeout_s: float = EVENTUALLY_S,
    what: str = "the condition",
    *,
    poll_s: float = 0.002,
) -> None:
    """Poll ``predicate`` until it holds; fail the test naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def assert_all_gone(pids: list[int], within_s: float = EVENTUALLY_S) -> None:
    """Every process in ``pids`` exits (a zombie counts as gone), waited for up to ``within_s``."""
    assert pids, "no process ids recorded"
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


@contextmanager
def one_rank_gloo(threads: int | None = None) -> Iterator[None]:
    """A 1-rank gloo group in this process (and ``threads`` intra-op threads), undone afterwards.
    Tests only: in fsdpbench proper, only the worker creates process groups."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    excepthook = sys.excepthook  # init_process_group prefixes it with "[rank0]" and never restores it
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        torch.set_num_threads(old_threads)


def trace_event(
    name: str,
    ts: float,
    dur: float,
    tid: int = 1,
    *,
    cat: str = "cpu_op",
    pid: int = 1,
    dims: list | None = None,
    types: list | None = None,
    **args: Any,
) -> dict[str, Any]:
    """A complete ("X") event of a Chrome trace as torch.profiler writes it; ``dims``/``types`` are its
    recorded shapes ("Input Dims", "Input type")."""
    if dims is not None:
        args["Input Dims"] = dims
    if types is not None:
        args["Input type"] = types
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def regression_named(out: str, case_id: str, metric: str, verdict: str) -> bool:
    """``regress`` printed a ``REGRESSION <case name> (<hash>) <metric>: <verdict>`` line followed by the
    line ``case <case_id>`` (the baseline's id; ``(ran as <id>)`` after it for a mapped strategy); a line
    wrapped at 80 columns is read as one."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("REGRESSION "):
            continue
        following = [x.strip() for x in lines[i + 1 : i + 4]]
        head = " ".join([line, *following[:2]])
        ids = [x for x in following if x.startswith("case ")]
        if f") {metric}: {verdict}" in head and ids and ids[0].split()[1] == case_id:
            return True
    return False
