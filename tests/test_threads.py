"""The host tuning of CPU ranks (fsdpbench/hosttuning): opt-in per case; compute threads one per core of
their own, gloo's loop threads under SCHED_IDLE, and a refusal where this torch cannot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fsdpbench.core.case import HOST_TUNINGS, Case
from fsdpbench.engine.intra_op import rank_threads
from fsdpbench.hosttuning import threads
from fsdpbench.hosttuning.threads import GLOO_LOOP_THREAD, gloo_names_its_loop, rank_cores
from tests.helpers import REPO, repo_pythonpath, tiny_case

NAMED_LOOPS = pytest.mark.skipif(
    not gloo_names_its_loop(), reason=f"this torch's gloo does not name its loop thread {GLOO_LOOP_THREAD}"
)


def test_each_rank_gets_its_own_cores_in_order_and_none_when_they_must_share() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    for world in range(1, len(allowed) + 1):
        per = len(allowed) // world
        got = [rank_cores(r, world) for r in range(world)]
        assert got == [allowed[r * per : (r + 1) * per] for r in range(world)]
        assert all(len(c) == rank_threads(world) for c in got) or len(allowed) != os.cpu_count()
        assert not set(got[0]) & set().union(*got[1:])  # no core shared between ranks
    assert rank_cores(0, len(allowed) + 1) == []  # more ranks than cores: they share, nothing to pin


def _in_a_fresh_process(code: str, env: dict[str, str] | None = None) -> Any:
    """Run ``code`` in a fresh Python (``env``: its environment, default this one's) with the repository
    importable; the JSON it printed last. Threads' policies and cores set there stay there."""
    env = {**(os.environ if env is None else env), "PYTHONPATH": repo_pythonpath(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding two threads needs two cores")
def test_the_main_thread_and_the_intra_op_thread_are_bound_one_per_core() -> None:
    # in a fresh process: binding threads here would bind this test process's (tests never change
    # the machine, nor the process other tests run in)
    code = (
        "import json, os, torch\n"
        "from fsdpbench.hosttuning.threads import pin_compute_threads\n"
        "torch.set_num_threads(2)\n"
        "cores = sorted(os.sched_getaffinity(0))[:2]\n"
        "tids = pin_compute_threads(cores)\n"
        "print(json.dumps([[t, sorted(os.sched_getaffinity(t))] for t in tids]))\n"
    )
    pinned = _in_a_fresh_process(code, {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    cores = sorted(os.sched_getaffinity(0))[:2]
    assert len(pinned) == 2, pinned  # the main thread and libgomp's one worker
    assert [c for _, c in pinned] == [[cores[0]], [cores[1]]]
    assert len({t for t, _ in pinned}) == 2


@pytest.mark.slow
def test_a_default_run_tunes_nothing_and_says_so(one_case_run: Path) -> None:
    from fsdpbench.store.results import load_results

    frame = load_results(one_case_run)
    assert list(frame["host_tuning"]) == ["none"]
    # its threads where the scheduler puts them: none bound, no gloo thread idled or bound
    assert list(frame["cores"]) == [""] and list(frame["threads"]) == [rank_threads(1)]
    assert list(frame["gloo_loops_idle"]) == [0] and list(frame["gloo_threads_bound"]) == [0]
    run_json = json.loads((one_case_run / "run.json").read_text())
    assert run_json["host_tuning"] == f"none: {HOST_TUNINGS['none']}"
    assert "gloo_loop_policy" not in run_json
    from fsdpbench.report.data import load_runs
    from fsdpbench.report.page import render_environment

    row = '<tr><th class="l">host tuning</th><td class="l">none: CPU ranks as the machine runs them'
    assert row in render_environment(load_runs([one_case_run]))  # the report's environment section


def test_a_run_json_says_each_tuning_and_how_many_cases_ran_with_it() -> None:
    from fsdpbench.pipeline.runner import host_tuning_record

    assert host_tuning_record([tiny_case(host_tuning="pin")] * 2) == f"pin: {HOST_TUNINGS['pin']}"
    mixed = host_tuning_record([tiny_case(), tiny_case(host_tuning="pin"), tiny_case()])
    assert mixed == f"none (2 cases): {HOST_TUNINGS['none']}; pin (1 case): {HOST_TUNINGS['pin']}"


@pytest.mark.parametrize(
    ("tuning", "pin", "idle"), [("none", False, False), ("pin", True, False), ("pin-idle-loops", True, True)]
)
def test_a_ranks_hooks_do_what_its_cases_tuning_says_and_nothing_by_default(tuning, pin, idle) -> None:
    from fsdpbench.hosttuning.hooks import HostHooks

    hooks = HostHooks.for_case(tiny_case(host_tuning=tuning), "", rank=0)
    assert (hooks.pin, hooks.idle_loops, hooks.baton) == (pin, idle, None)  # "": no turns with a twin


def test_tuning_is_refused_in_one_line_where_it_cannot_apply(monkeypatch) -> None:
    from fsdpbench.hosttuning.threads import check_host_tuning

    assert check_host_tuning(tiny_case()) is None  # none: nothing to apply, anywhere
    assert check_host_tuning(Case(device="cuda", backend="nccl", host_tuning="pin")) == (
        "host_tuning pin tunes CPU ranks; a cuda case runs with none"
    )
    monkeypatch.setattr(threads, "gloo_names_its_loop", lambda: False)  # as torch 2.11's gloo
    import torch

    assert check_host_tuning(tiny_case(host_tuning="pin")) is None  # pinning needs no gloo thread's name
    assert check_host_tuning(tiny_case(host_tuning="pin-idle-loops")) == (
        f"host_tuning pin-idle-loops: the gloo of torch {torch.__version__} does not name its TCP loop "
        "thread 'gloo_tcp_loop', so it cannot be told from gloo's other threads (use pin or none)"
    )


def test_a_scenario_asking_for_a_tuning_this_torch_cannot_apply_skips_its_cases_saying_why(
    monkeypatch,
) -> None:
    from fsdpbench.pipeline.scenario import parse_scenario

    monkeypatch.setattr(threads, "gloo_names_its_loop", lambda: False)
    text = (
        "name: t\ndefaults: {model: decoder-tiny, device: cpu}\nsweep: {strategy: [ddp], world_size: [2]}\n"
    )
    scenario = parse_scenario(text, overrides={"host_tuning": "pin-idle-loops"})
    assert scenario.cases == [] and len(scenario.skipped) == 1
    assert scenario.skipped[0].reason.startswith("host_tuning pin-idle-loops: the gloo of torch")
    assert "_host-pin-idle-loops_" in scenario.skipped[0].case.case_id  # the tuning is in the id


def test_whether_gloo_names_its_loop_is_what_a_real_group_shows_and_leaves_no_thread() -> None:
    # in a fresh process: the check makes a gloo device; the group after it shows what a rank would find
    code = (
        "import json, os, time, torch.distributed as dist\n"
        "from fsdpbench.hosttuning.threads import GLOO_LOOP_THREAD, LOOP_NAMING_WAIT_S, _threads_named, "
        "gloo_names_its_loop\n"
        "named = gloo_names_its_loop()\n"
        "left = len(_threads_named(GLOO_LOOP_THREAD))\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())\n"
        "dist.barrier()\n"
        # a group of one may not have run its loop thread yet, which names itself when it first runs: as
        # long as a rank waits for it (threads.idle_gloo_loops)
        "deadline = time.monotonic() + LOOP_NAMING_WAIT_S\n"
        "while not _threads_named(GLOO_LOOP_THREAD) and time.monotonic() < deadline:\n"
        "    time.sleep(0.001)\n"
        "print(json.dumps([named, left, len(_threads_named(GLOO_LOOP_THREAD))]))\n"
    )
    named, left, in_a_group = _in_a_fresh_process(code)
    assert left == 0  # the check's device and its loop thread are gone
    assert named == (in_a_group == 1)


def test_a_rank_never_idles_fewer_loops_than_its_groups_without_saying_so(monkeypatch) -> None:
    from fsdpbench.hosttuning.threads import idle_gloo_loops

    monkeypatch.setattr(threads, "_gloo_groups", lambda: 2)
    monkeypatch.setattr(threads, "_threads_named", lambda name: [])  # as in torch 2.11's gloo
    monkeypatch.setattr(threads, "LOOP_NAMING_WAIT_S", 0.01)
    with pytest.raises(RuntimeError, match="0 thread\\(s\\) named 'gloo_tcp_loop' for 2 gloo group\\(s\\)"):
        idle_gloo_loops()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@NAMED_LOOPS
def test_every_groups_gloo_loop_thread_and_only_it_goes_idle(tmp_path: Path) -> None:
    # in a fresh process: a policy set here would stay with this test process's threads
    code = (
        "import json, os, torch.distributed as dist\n"
        "from fsdpbench.hosttuning.threads import idle_gloo_loops\n"
        f"store = dist.FileStore({str(tmp_path / 'store')!r}, 1)\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, store=store)\n"
        "dist.new_group([0])\n"
        "idled = idle_gloo_loops()\n"
        "policies = {}\n"
        "for tid in os.listdir('/proc/self/task'):\n"
        "    name = open(f'/proc/self/task/{tid}/comm').read().strip()\n"
        "    policies.setdefault(name, []).append(os.sched_getscheduler(int(tid)))\n"
        "print(json.dumps([idled, policies]))\n"
    )
    idled, policies = _in_a_fresh_process(code)
    assert idled == 2  # the default group's and the new group's: a loop thread each
    assert policies.pop(GLOO_LOOP_THREAD) == [os.SCHED_IDLE] * 2
    assert policies and all(p == os.SCHED_OTHER for ps in policies.values() for p in ps)  # the rest untouched


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: every thread is on it already")
def test_binding_to_the_ranks_cores_takes_in_the_default_groups_gloo_threads_and_only_those_beyond() -> None:
    # in a fresh process: affinities set here would stay with this test process's threads. As a CPU
    # rank does: the group first (its gloo threads float), then the pin, then a group made after it
    code = (
        "import json, os, torch, torch.distributed as dist\n"
        "from fsdpbench.hosttuning.threads import bind_to_rank_cores, pin_compute_threads\n"
        "torch.set_num_threads(1)\n"
        "store = dist.HashStore()\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, store=store)\n"
        "allowed = sorted(os.sched_getaffinity(0))\n"
        "tasks = lambda: {int(t) for t in os.listdir('/proc/self/task')}\n"
        "floating = [t for t in tasks() if os.sched_getaffinity(t) == set(allowed)]\n"
        "core = allowed[-1]\n"
        "assert pin_compute_threads([core])\n"
        "before = tasks(); dist.new_group([0]); later = tasks() - before\n"
        "bound = bind_to_rank_cores([core])\n"
        "again = bind_to_rank_cores([core])\n"
        "print(json.dumps([len(floating), bound, again, len(later),\n"
        "    sorted({c for t in tasks() for c in os.sched_getaffinity(t)}), bind_to_rank_cores([])]))\n"
    )
    floating, bound, again, later, cores_used, none = _in_a_fresh_process(code)
    # every thread but the main one floated before the pin (gloo's loop and workers among them); the
    # group made after the pin inherited the main thread's core, so the binding had nothing to do there
    assert later >= 1 and bound == floating - 1 >= 1
    assert again == 0 and none == 0  # bound already; no cores: nothing pinned, nothing bound
    assert len(cores_used) == 1  # every thread of the process on the one core


def test_idle_threads_spin_is_measured_and_none_with_one_thread() -> None:
    # in a fresh process with OpenMP's default wait policy (the suite's is passive: tests/conftest.py)
    code = (
        "import json, torch\n"
        "from fsdpbench.hosttuning.threads import idle_spin_s\n"
        "torch.set_num_threads(1); one = idle_spin_s()\n"
        "torch.set_num_threads(2); two = idle_spin_s(probe_s=0.05)\n"
        "gomp = 'libgomp' in open('/proc/self/maps').read()\n"
        "print(json.dumps([one, two, gomp]))\n"
    )
    one, two, gomp = _in_a_fresh_process(
        code, {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    )
    assert one == 0.0  # one thread: no idle OpenMP thread to spin
    assert 0.0 <= two <= 0.05
    if gomp and len(os.sched_getaffinity(0)) >= 2:
        # libgomp's idle worker spins (300,000 pause loops by default) before it sleeps: it used a core
        # for some of the 50 ms the main thread slept (8.7 ms on this project's 2-core VM)
        assert two > 0.0005
