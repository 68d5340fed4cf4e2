"""A sweep survives its ranks, its user and its input: each fault of docs/reliability.md's table,
caused for real (SIGKILL, SIGINT, a second run) or mocked where the machine cannot be made to
fail safely (a full disk). Every test checks that no process is left behind."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest

from fsdpbench.cli import build_parser
from fsdpbench.core.case import Case
from fsdpbench.core.rundir import RunDirError, RunLock, check_inside
from fsdpbench.engine.rank_result import CaseOutcome, RankResult
from fsdpbench.metrics.timing import StepTimes
from fsdpbench.pipeline.launch import _clear_case_dir
from fsdpbench.pipeline.runner import run_cases
from fsdpbench.pipeline.scenario import load_scenario
from fsdpbench.store.results import RunStore, load_results
from tests.helpers import FAULTS, assert_all_gone, repo_pythonpath, run, tiny_case, wait_until
from tests.helpers import REPO as ROOT

SMALL = (
    "{model: decoder-tiny, batch_size: 2, seq_len: 16, warmup_steps: 1, steps: 2, device: cpu, backend: gloo}"
)
START_TIMEOUT_S = 240  # a fresh orchestrator imports torch and starts a fork server: slow on a shared machine


def run_cli(*argv: str) -> int:
    args = build_parser().parse_args(["run", *argv])
    return args._main(args)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (the fork server, the ranks)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rank_phase(case_dir: Path, rank: int) -> str | None:
    try:
        return json.loads((case_dir / f"rank{rank}.json").read_text()).get("phase")
    except (OSError, ValueError):
        return None


# ---- a rank dies -------------------------------------------------------------------------------


@pytest.mark.slow
def test_rank_sigkill_mid_step_names_the_signal_and_phase_and_the_sweep_goes_on(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run")
    killed = tiny_case(strategy=f"{FAULTS}:SigkillRank1InTimedSteps", world_size=2)
    fine = tiny_case(strategy="zero3", world_size=2)
    meta: dict = {"env": {}}
    frame = run_cases([killed, fine], [], store, meta)
    rows = frame[frame.case_id == killed.case_id]
    error = rows["case_error"].iloc[0]
    # the cause is rank 1's signal, not rank 0's consequent "Connection reset" (which may follow)
    assert error.startswith("rank 1 killed by SIGKILL (signal 9)"), error
    assert "in phase timed without a Python exception" in error
    assert set(rows["status"]) == {"failed"}
    assert rows.set_index("rank").loc[1, "exit_code"] == -signal.SIGKILL
    assert set(frame.loc[frame.case_id == fine.case_id, "status"]) == {"ok"}
    assert meta["status"] == "complete"


@pytest.mark.slow
def test_out_of_memory_on_one_rank_is_recorded_as_oom(tmp_path: Path) -> None:
    outcome = run(tiny_case(strategy=f"{FAULTS}:OomOnRank1", world_size=2), tmp_path)
    assert outcome.status == "oom"
    assert outcome.error.startswith("rank 1 in setup: OutOfMemoryError: injected: CUDA out of memory"), (
        outcome.error
    )
    assert_all_gone(outcome.pids)


# ---- the user: Ctrl-C, SIGKILL of the orchestrator, a second run -------------------------------


def write_hang_scenario(tmp_path: Path, with_ok_case: bool) -> tuple[Path, Case]:
    strategies = (["ddp"] if with_ok_case else []) + [f"{FAULTS}:HangOnRank1InTimedSteps"]
    path = tmp_path / "hang.yaml"
    path.write_text(
        f"name: hang\ndefaults: {SMALL}\nsweep:\n  world_size: [2]\n  strategy: {json.dumps(strategies)}\n"
    )
    hang = load_scenario(path, allow_plugins=True).cases[-1]
    return path, hang


def wait_for_the_hang(proc: subprocess.Popen, case_dir: Path) -> list[int]:
    """Wait until the hang case's rank 1 is in its timed steps; return the orchestrator's descendants."""
    wait_until(lambda: rank_phase(case_dir, 1) == "timed", START_TIMEOUT_S, "the hang case", poll_s=0.2)
    family = descendants(proc.pid)
    assert len(family) >= 3  # fork server and two ranks
    return family


def start_orchestrator(scenario: Path, out: Path, *, ignoring_sigint: bool = False) -> subprocess.Popen:
    """``fsdpbench run`` in its own process group (as a terminal's foreground job is); with
    ``ignoring_sigint``, started with SIGINT ignored, as a script's background job is."""
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(ROOT)}

    def prepare() -> None:
        if ignoring_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fsdpbench",
            "run",
            str(scenario),
            "--out",
            str(out),
            "--no-report",
            "--allow-plugins",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=prepare,
    )


class HangingRun(NamedTuple):
    proc: subprocess.Popen
    scenario: Path
    out: Path
    family: list[int]  # the orchestrator's descendants: fork server and ranks


@contextmanager
def hanging_run(tmp_path: Path, *, with_ok_case: bool, ignoring_sigint: bool = False) -> Iterator[HangingRun]:
    """`fsdpbench run` in a subprocess, held in the hang case's timed steps; killed on the way out if
    it still runs."""
    scenario, hang = write_hang_scenario(tmp_path, with_ok_case)
    out = tmp_path / "run"
    proc = start_orchestrator(scenario, out, ignoring_sigint=ignoring_sigint)
    try:
        yield HangingRun(proc, scenario, out, wait_for_the_hang(proc, out / "cases" / hang.case_id))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (its SigIgn mask, /proc/PID/status)."""
    status = (Path("/proc") / str(pid) / "status").read_text()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    return bool(mask & (1 << (signal.SIGINT - 1)))


# FSDPBENCH_CTRL_C_REPEAT=20: each Ctrl-C test 20 times in this run of the suite (how the issue asks
# for it to be shown: 20 passes in a row inside the full suite, where it once failed 3 runs in 5)
CTRL_C_ATTEMPTS = range(int(os.environ.get("FSDPBENCH_CTRL_C_REPEAT", "1")))


@pytest.mark.slow
@pytest.mark.parametrize("attempt", CTRL_C_ATTEMPTS)
def test_ctrl_c_stops_the_ranks_keeps_results_marks_interrupted_exits_130(
    tmp_path: Path, attempt: int
) -> None:
    with hanging_run(tmp_path, with_ok_case=True) as hung:
        proc, out = hung.proc, hung.out
        # a second run on the same --out is refused while this one holds it, and deletes nothing
        before = sorted(p.name for p in (out / "cases").iterdir())
        assert run_cli(str(hung.scenario), "--out", str(out), "--allow-plugins") == 2
        assert sorted(p.name for p in (out / "cases").iterdir()) == before
        # the ranks (and the fork server) leave Ctrl-C to the orchestrator, which stops them itself:
        # the interrupted case is then never stored as a rank's failure
        assert all(ignores_sigint(pid) for pid in hung.family if Path(f"/proc/{pid}").exists())

        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: finished cases are stored in") and last.endswith("--resume"), last
    assert "Traceback" not in err, err
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    kept = load_results(out)
    assert set(kept["strategy"]) == {"ddp"} and set(kept["status"]) == {"ok"}
    assert_all_gone(hung.family)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", CTRL_C_ATTEMPTS)
def test_three_ctrl_c_within_1_5_s_stop_the_run_once_without_a_traceback(
    tmp_path: Path, attempt: int
) -> None:
    # the second and third Ctrl-C land while the ranks are stopped and run.json is written, and later
    # in multiprocessing's exit hooks, which printed a KeyboardInterrupt traceback after the resume line
    with hanging_run(tmp_path, with_ok_case=False) as hung:
        for _ in range(3):
            os.killpg(hung.proc.pid, signal.SIGINT)
            time.sleep(0.5)
        _, err = hung.proc.communicate(timeout=60)
    assert hung.proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1].endswith("--resume"), err
    assert json.loads((hung.out / "run.json").read_text())["status"] == "interrupted"
    assert_all_gone(hung.family)


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_stops_a_run_that_was_started_with_sigint_ignored(tmp_path: Path) -> None:
    # a script's background job inherits SIGINT ignored; Python then installs no KeyboardInterrupt
    # handler, and before fsdpbench installed its own the ranks died of the SIGINT while the
    # orchestrator waited on them until the case's timeout
    with hanging_run(tmp_path, with_ok_case=False, ignoring_sigint=True) as hung:
        os.killpg(hung.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        _, err = hung.proc.communicate(timeout=60)
    assert hung.proc.returncode == 130, err
    assert err.strip().splitlines()[-1].endswith("--resume")
    assert json.loads((hung.out / "run.json").read_text())["status"] == "interrupted"
    assert_all_gone(hung.family)


@pytest.mark.slow
def test_sigkill_of_the_orchestrator_leaves_no_process_and_no_lock(tmp_path: Path) -> None:
    with hanging_run(tmp_path, with_ok_case=False) as hung:
        hung.proc.kill()
        hung.proc.wait()
    assert_all_gone(hung.family)
    RunLock(hung.out).acquire()  # the kernel released the dead run's lock: --resume can start


# ---- the machine: a full disk, an unwritable directory -----------------------------------------


def fake_launch(case: Case, case_dir: Path, twin: Case | None = None) -> CaseOutcome:
    """A case 'run' without processes: an empty, checked case directory and one ok rank."""
    _clear_case_dir(case_dir)
    (case_dir / "rank0.json").write_text("{}")
    rank = RankResult(rank=0, status="ok", phase="done", timed=StepTimes(times_ms=[1.0]))
    return CaseOutcome(status="ok", ranks=[rank], wall_s=0.1)


def two_case_scenario(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(
        f"name: s\ndefaults: {SMALL}\nsweep: {{strategy: [ddp, zero3], world_size: [2]}}\n{extra}"
    )
    return path


def test_disk_full_is_one_line_leaves_no_temporary_file_and_resume_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr("fsdpbench.pipeline.runner.launch_case", fake_launch)
    import fsdpbench.core.rundir as rundir
    import fsdpbench.store.results as results

    real_write, parquet_writes, full = results.write_atomically, [0], [False]

    def write_until_full(path, data):  # the first case and results.parquet are written, then it fills
        if path.suffix == ".parquet":
            parquet_writes[0] += 1
            full[0] = parquet_writes[0] > 2
        return real_write(path, data)

    class FullDisk:
        """A file whose write stores a few bytes, then fails as a full disk does."""

        def __init__(self, fd: int, mode: str) -> None:
            self.file = os.fdopen(fd, mode)

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def write(self, data: bytes) -> int:
            self.file.write(data[:7])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    class OsWithAFullDisk:
        def __getattr__(self, name: str) -> object:
            if name == "fdopen" and full[0]:
                return FullDisk
            return getattr(os, name)

    monkeypatch.setattr(results, "write_atomically", write_until_full)
    monkeypatch.setattr(rundir, "os", OsWithAFullDisk())
    scenario, out = two_case_scenario(tmp_path), tmp_path / "run"
    assert run_cli(str(scenario), "--out", str(out), "--no-report") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cannot write ") and "No space left on device" in err[-1], err
    assert err[-1].endswith(f"--out {out} --resume"), err[-1]
    assert not list(out.rglob("*.tmp")), "temporary files left behind"
    assert len(load_results(out)) == 1  # the case stored before the disk filled is kept

    monkeypatch.setattr(rundir, "os", os)
    assert run_cli(str(scenario), "--out", str(out), "--no-report", "--resume") == 0
    assert set(load_results(out)["strategy"]) == {"ddp", "zero3"}


def test_unwritable_out_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def read_only(self) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self.cases_dir))

    monkeypatch.setattr(RunStore, "create", read_only)
    assert run_cli(str(two_case_scenario(tmp_path)), "--out", str(tmp_path / "run"), "--no-report") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cannot write ") and "Read-only file system" in err[-1], err


def test_a_second_run_on_a_locked_out_refuses(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    out.mkdir()
    with RunLock(out):
        assert run_cli(str(two_case_scenario(tmp_path)), "--out", str(out), "--no-report") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: {out} is in use by another fsdpbench run (pid {os.getpid()}); "
        "wait for it to finish or choose another --out"
    )
    assert not (out / "cases").exists() or not list((out / "cases").iterdir())


def test_resume_never_deletes_a_case_directory_a_live_rank_writes_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("fsdpbench.pipeline.launch._LIVE_RANK_WAIT_S", 0.5)
    case_dir = tmp_path / "cases" / "c"
    case_dir.mkdir(parents=True)
    # a stand-in rank: it holds the case directory's lifeline lock, as a launched rank does
    holds_the_lock = (
        "import sys, time; from pathlib import Path; from fsdpbench.pipeline import lifeline; "
        "lifeline.hold_while_alive(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"
    )
    rank = subprocess.Popen(
        [sys.executable, "-c", holds_the_lock, str(case_dir)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "held"
        (case_dir / "rank0.json").write_text(json.dumps({"rank": 0, "pid": rank.pid}))
        with pytest.raises(
            RuntimeError, match=rf"in use by a live rank process \(pids in its rank files: \[{rank.pid}\]"
        ):
            _clear_case_dir(case_dir)
        assert (case_dir / "rank0.json").exists()
    finally:
        rank.kill()
        rank.wait()
    _clear_case_dir(case_dir)  # its rank is gone: the stale directory is cleared
    assert list(case_dir.iterdir()) == []


def test_a_rank_file_naming_a_live_unrelated_process_does_not_block_its_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the pid was enough: the case was "in use" for good and the run still ended 0 "complete"
    monkeypatch.setattr("fsdpbench.pipeline.launch._LIVE_RANK_WAIT_S", 0.5)
    case_dir = tmp_path / "cases" / "c"
    case_dir.mkdir(parents=True)
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (case_dir / "rank0.json").write_text(json.dumps({"rank": 0, "pid": unrelated.pid}))
        _clear_case_dir(case_dir)
        assert list(case_dir.iterdir()) == [] and unrelated.poll() is None  # cleared; the process untouched
    finally:
        unrelated.kill()
        unrelated.wait()


def test_a_case_whose_directory_a_live_rank_holds_leaves_the_run_incomplete_and_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from fsdpbench.pipeline.launch import CaseDirInUse

    def held(case: Case, case_dir: Path, twin: Case | None = None) -> CaseOutcome:
        if case.strategy == "zero3":
            raise CaseDirInUse(f"{case_dir} is in use by a live rank process")
        return fake_launch(case, case_dir)

    monkeypatch.setattr("fsdpbench.pipeline.runner.launch_case", held)
    out = tmp_path / "run"
    assert run_cli(str(two_case_scenario(tmp_path)), "--out", str(out), "--no-report", "--link", "none") == 1
    assert json.loads((out / "run.json").read_text())["status"] == "incomplete: 1 case(s) not run"
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "1 case(s) not run" in last and last.endswith("--resume")


# ---- the input: error text, values and names that would leave --out ------------------------------


def test_library_error_text_with_markup_is_printed_verbatim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    gloo = "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error"

    def failing_launch(case: Case, case_dir: Path, twin: Case | None = None) -> CaseOutcome:
        _clear_case_dir(case_dir)
        return CaseOutcome(
            status="failed",
            error=f"rank 0 in timed: {gloo}",
            ranks=[RankResult(rank=0, status="failed", error=gloo)],
        )

    monkeypatch.setattr("fsdpbench.pipeline.runner.launch_case", failing_launch)
    assert run_cli(str(two_case_scenario(tmp_path)), "--out", str(tmp_path / "run"), "--no-report") == 1
    captured = capsys.readouterr()
    assert captured.err.count("[/__w/pytorch/pytorch/third_party/gloo") == 2  # both cases, nothing swallowed
    assert "[/" in captured.out  # the summary table too (wrapped to the terminal, the text is all there)


def test_cases_that_are_all_skipped_end_with_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        f"name: s\ndefaults: {SMALL}\ncases: [{{strategy: hsdp, world_size: 3, shard_size: 2}}]\n"
    )
    assert run_cli(str(path), "--out", str(tmp_path / "run"), "--no-report") == 0
    assert "skipped" in capsys.readouterr().out


def test_unsafe_values_never_reach_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # validation refuses these (tests/malformed/); here the layers below are checked on their own
    target = tmp_path / "elsewhere" / "target"
    target.parent.mkdir()
    target.write_text("keep me")
    out = tmp_path / "a" / "b" / "run"
    traversal = "/../../../../../../../../" + str(target.relative_to("/"))
    case = Case(model_args={"vocab": traversal}, strategy="ddp")
    assert "/" not in case.case_id and ".." not in case.case_id
    monkeypatch.setattr("fsdpbench.pipeline.runner.launch_case", fake_launch)
    for attempt in range(2):  # the second run clears the case directory the first one made
        if attempt:  # its stored rows gone (else a fresh run refuses a directory holding stored cases)
            (out / "cases" / f"{case.case_id}.parquet").unlink()
        run_cases([case], [], RunStore(out), {"env": {}})
    assert target.read_text() == "keep me"
    assert [p.parent for p in (out / "cases").iterdir()] == [out / "cases"] * 2
    store = RunStore(out)
    for bad in ("../x", "..", "a/b", "/etc", ".hidden"):
        with pytest.raises(RunDirError):
            store.case_dir(bad)
    (out / "link").symlink_to(target.parent)
    with pytest.raises(RunDirError):
        check_inside(out / "link" / "target", out)


def test_a_scenario_name_cannot_leave_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "s.yaml"
    path.write_text("name: ../../../somewhere\nsweep: {strategy: [ddp]}\n")
    assert run_cli(str(path)) == 2
    assert not (tmp_path.parent.parent / "somewhere").exists() and not (tmp_path / "reports").exists()


def test_a_planted_plugin_is_not_imported_without_allow_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.delenv("FSDPBENCH_ALLOW_PLUGINS", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # even where the module is importable
    marker = tmp_path / "ran"
    (tmp_path / "planted_i12.py").write_text(f"open({str(marker)!r}, 'w').close()\nStrategy = object\n")
    (tmp_path / "innocent.yaml").write_text("name: x\nsweep: {strategy: ['planted_i12:Strategy']}\n")
    assert run_cli("innocent.yaml", "--dry-run") == 2
    assert "--allow-plugins" in capsys.readouterr().err
    assert not marker.exists()
    assert run_cli("innocent.yaml", "--dry-run", "--allow-plugins") == 2  # imported now: not a Strategy
    assert marker.exists()
    assert "is not a fsdpbench.strategies.Strategy subclass" in capsys.readouterr().err
    sys.modules.pop("planted_i12", None)


@pytest.mark.slow
def test_sigterm_to_compare_marks_the_run_interrupted_and_exits_143(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fsdpbench",
            "compare",
            "--world-size",
            "1",
            "--strategies",
            "ddp,zero3",
            "--steps",
            "100000",
            "--link",
            "none",
            "--out",
            str(out),
            "--no-report",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": repo_pythonpath(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_until(
            lambda: rank_phase(next((out / "cases").glob("*"), out), 0) == "timed",
            START_TIMEOUT_S,
            "compare's first case",
            poll_s=0.2,
        )
        family = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert "interrupted" in err.strip().splitlines()[-1]
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    assert_all_gone(family)
