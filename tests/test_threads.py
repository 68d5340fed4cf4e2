"""A CPU rank's compute threads, one per core of its own (fsdpbench/hosttuning/threads.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fsdpbench.engine.intra_op import rank_threads
from fsdpbench.hosttuning.threads import GLOO_LOOP_THREAD, rank_cores
from tests.helpers import REPO, repo_pythonpath


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
def test_a_real_runs_ranks_say_which_cores_they_were_bound_to(one_case_run: Path) -> None:
    from fsdpbench.store.results import load_results

    frame = load_results(one_case_run)
    cores, threads = rank_cores(0, 1), rank_threads(1)  # one rank: every core, a thread on each
    expected = ",".join(map(str, cores)) if len(cores) >= threads else ""  # fewer cores allowed: unbound
    assert list(frame["cores"]) == [expected] and list(frame["threads"]) == [threads]
    assert list(frame["gloo_loops_idle"]) == [0]  # as gloo leaves them: the suite pins it (conftest.py)
    run_json = json.loads((one_case_run / "run.json").read_text())
    expected = "gloo's loop threads as gloo leaves them (FSDPBENCH_GLOO_LOOP_IDLE=0)"
    assert run_json["gloo_loop_policy"] == expected
    from fsdpbench.report.data import load_runs
    from fsdpbench.report.page import render_environment

    row = '<tr><th class="l">gloo loop threads</th><td class="l">gloo&#x27;s loop threads as gloo leaves them'
    assert row in render_environment(load_runs([one_case_run]))  # the report's environment section


def _fresh_auto(monkeypatch: pytest.MonkeyPatch, value: str | None) -> list[float]:
    """``GLOO_LOOP_IDLE_ENV`` set to ``value`` (None: unset), no decision made yet in this process; the
    list collects every sample length that ``gloo_loop_policy``'s machine watch is asked for."""
    from fsdpbench.hosttuning import threads

    monkeypatch.setattr(threads, "_auto_policy", [])
    if value is None:
        monkeypatch.delenv(threads.GLOO_LOOP_IDLE_ENV, raising=False)
    else:
        monkeypatch.setenv(threads.GLOO_LOOP_IDLE_ENV, value)
    return []


@pytest.mark.parametrize("value", [None, "", "auto", " auto "])
def test_auto_idles_the_loops_on_an_idle_machine_and_keeps_the_decision(monkeypatch, value) -> None:
    from fsdpbench.hosttuning.threads import BUSY_SAMPLE_S, gloo_loop_idle_wanted, gloo_loop_policy

    asked = _fresh_auto(monkeypatch, value)
    policy = gloo_loop_policy(lambda s: asked.append(s) or 0.03)
    cores = os.cpu_count()
    assert policy.idle
    assert (
        policy.reason == "under SCHED_IDLE, on each pinned rank's own cores "
        f"(auto: other work kept 0.03 of {cores} cores busy as the run started)"
    )
    assert asked == [BUSY_SAMPLE_S]
    # decided once: later calls (each case's launch, the probe) do not watch the machine again
    assert gloo_loop_policy(lambda s: asked.append(s) or 2.0) == policy and gloo_loop_idle_wanted()
    assert asked == [BUSY_SAMPLE_S]
    # a run that starts (pipeline/runner.py) decides again: the machine may be busy now
    again = gloo_loop_policy(lambda s: asked.append(s) or 2.0, anew=True)
    assert not again.idle and gloo_loop_policy() == again and asked == [BUSY_SAMPLE_S] * 2


def test_auto_leaves_the_loops_alone_beside_other_work_or_where_it_cannot_tell(monkeypatch) -> None:
    from fsdpbench.hosttuning.threads import BUSY_CORES_LIMIT, gloo_loop_policy

    _fresh_auto(monkeypatch, None)
    busy = gloo_loop_policy(lambda s: BUSY_CORES_LIMIT + 0.01)
    assert not busy.idle
    assert busy.reason.startswith(
        f"as gloo leaves them (auto: other work kept {BUSY_CORES_LIMIT + 0.01:.2f} of"
    )
    assert "would starve" in busy.reason
    _fresh_auto(monkeypatch, "auto")
    assert gloo_loop_policy(lambda s: BUSY_CORES_LIMIT).idle  # at the limit: still idle
    _fresh_auto(monkeypatch, None)
    unknown = gloo_loop_policy(lambda s: None)
    assert not unknown.idle and "no /proc/stat" in unknown.reason


@pytest.mark.parametrize(("value", "idle"), [("1", True), ("0", False)])
def test_an_explicit_setting_is_obeyed_without_watching_the_machine(monkeypatch, value, idle) -> None:
    from fsdpbench.hosttuning.threads import gloo_loop_policy

    asked = _fresh_auto(monkeypatch, value)
    policy = gloo_loop_policy(lambda s: asked.append(s) or 0.0)
    assert policy.idle is idle and policy.reason.endswith(f"(FSDPBENCH_GLOO_LOOP_IDLE={value})")
    assert asked == []


def test_a_re_launch_follows_its_runs_policy_unless_the_user_set_one(monkeypatch) -> None:
    from fsdpbench.hosttuning import threads
    from fsdpbench.hosttuning.threads import follow_gloo_loop_policy, gloo_loop_idle_wanted

    _fresh_auto(monkeypatch, None)
    monkeypatch.setattr(threads, "busy_cores", lambda s: pytest.fail("the machine was watched"))
    assert follow_gloo_loop_policy(False, "run r").reason == "as gloo leaves them (auto: as in run r)"
    assert not gloo_loop_idle_wanted()  # the run's policy, without watching the machine
    _fresh_auto(monkeypatch, "1")  # the user's setting wins over the run's
    assert follow_gloo_loop_policy(False, "run r").idle and gloo_loop_idle_wanted()


@pytest.mark.parametrize("value", ["yes", "2", "true", "idle"])
def test_any_other_setting_is_refused_by_name(monkeypatch, value) -> None:
    from fsdpbench.hosttuning.threads import gloo_loop_idle_wanted, gloo_loop_setting

    asked = _fresh_auto(monkeypatch, value)
    for read in (gloo_loop_setting, gloo_loop_idle_wanted):
        with pytest.raises(ValueError, match=f"FSDPBENCH_GLOO_LOOP_IDLE='{value}': expected auto, 0 or 1"):
            read()
    assert asked == []


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="/proc/stat is Linux's")
def test_the_runs_own_processes_are_not_other_work() -> None:
    """A child process spins through the sample: the machine counts it, "auto" does not (the run's
    fork server importing torch as the run starts made "auto" see a busy machine)."""
    from fsdpbench.hosttuning.threads import busy_cores, busy_split

    spin = "import time\nend = time.monotonic() + 5\nwhile time.monotonic() < end:\n    pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.1)  # started
        split = busy_split(0.3)
    finally:
        child.kill()
        child.wait()
    assert split is not None
    machine, own = split
    cores = os.cpu_count() or 1
    # the child had a core, or a share of one where other test processes compute beside it
    assert 0.2 <= own <= machine + 0.1 and machine <= cores + 0.01
    other = busy_cores(0.05)
    assert other is not None and 0.0 <= other <= cores + 0.01


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
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


def test_a_ctrl_c_while_auto_watches_the_machine_ends_the_runs_record(tmp_path, monkeypatch) -> None:
    from fsdpbench.hosttuning import threads
    from fsdpbench.pipeline.runner import run_cases
    from fsdpbench.store.results import RunStore
    from tests.helpers import tiny_case

    def interrupted(sample_s: float) -> float:
        raise KeyboardInterrupt

    _fresh_auto(monkeypatch, "auto")
    monkeypatch.setattr(threads, "busy_cores", interrupted)
    store = RunStore(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        run_cases([tiny_case(strategy="ddp", world_size=2)], [], store, {"env": {}}, link="auto")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "interrupted"
    assert not (tmp_path / "run" / "cases").exists() or not any((tmp_path / "run" / "cases").iterdir())


def test_autos_decision_is_recorded_and_printed_in_80_columns(monkeypatch, capsys) -> None:
    from fsdpbench.hosttuning import threads
    from fsdpbench.pipeline.runner import _decide_gloo_loops

    _fresh_auto(monkeypatch, None)
    monkeypatch.setattr(threads, "busy_cores", lambda s: 0.0)
    meta: dict = {}
    _decide_gloo_loops(meta)
    cores = os.cpu_count()
    expected = (
        "gloo's loop threads under SCHED_IDLE, on each pinned rank's own cores "
        f"(auto: other work kept 0.00 of {cores} cores busy as the run started)"
    )
    assert meta["gloo_loop_policy"] == expected
    err = capsys.readouterr().err
    assert " ".join(err.split()) == expected and all(len(line) <= 80 for line in err.splitlines())
    monkeypatch.setenv(threads.GLOO_LOOP_IDLE_ENV, "0")  # the user's own choice: recorded, not printed
    _decide_gloo_loops(meta)
    assert meta["gloo_loop_policy"].endswith("(FSDPBENCH_GLOO_LOOP_IDLE=0)") and capsys.readouterr().err == ""
