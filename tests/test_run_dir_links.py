"""Nothing fsdpbench writes inside a run directory follows a link planted there: the lock and every
atomically written file (run.json, results.parquet, a case's parquet, the report, a rank file) go through
``rundir.write_atomically`` / ``RunLock``, the probe's directory and every log through ``rundir.make_dirs``
and ``rundir.open_log``, the checkpoints' files through ``rundir.create_new``; none writes through a
symbolic link. Nor does a run write outside its directory (torch's temporary files) or in the checkout
fsdpbench is installed from."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from fsdpbench.core.rundir import RunDirError, RunLock, write_atomically
from fsdpbench.store.results import atomic_write_json, atomic_write_parquet

SECRET = b"a file the user cares about\n"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


def test_a_lock_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    with pytest.raises(RunDirError, match="symbolic link"):
        RunLock(run).acquire()
    assert victim.read_bytes() == SECRET


@pytest.mark.parametrize(
    ("name", "write"),
    [
        ("run.json", lambda p: atomic_write_json(p, {"status": "running"})),
        ("results.parquet", lambda p: atomic_write_parquet(p, pd.DataFrame({"a": [1]}))),
        ("report.html", lambda p: write_atomically(p, b"<html></html>")),
        ("rank0.json", lambda p: write_atomically(p, b"{}")),
    ],
)
def test_a_temporary_file_that_is_a_link_is_replaced_not_written_through(tmp_path, victim, name, write):
    run = tmp_path / "run"
    run.mkdir()
    (run / f".{name}.tmp").symlink_to(victim)
    write(run / name)
    assert victim.read_bytes() == SECRET
    assert (run / name).is_file() and not (run / name).is_symlink()
    assert not (run / f".{name}.tmp").exists()


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_bytes(b"old")

    class Unserialisable:
        def __str__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write_json(path, {"x": Unserialisable()})
    assert path.read_bytes() == b"old" and not (tmp_path / ".run.json.tmp").exists()


def test_a_fresh_run_into_a_directory_with_another_runs_cases_stops_before_anything_runs(tmp_path, capsys):
    from fsdpbench.cli import main

    out = tmp_path / "run"
    (out / "cases").mkdir(parents=True)
    foreign = pd.DataFrame({"case_id": ["elsewhere"], "status": ["ok"], "step_time_ms": [1.0]})
    foreign.to_parquet(out / "cases" / "elsewhere.parquet")
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "name: s\ndefaults: {model: mlp-tiny, steps: 1, warmup_steps: 1}\nsweep: {strategy: [ddp]}\n"
    )
    with pytest.raises(SystemExit) as exc:
        main(["run", str(scenario), "--out", str(out), "--no-report", "--link", "none"])
    captured = capsys.readouterr()
    err = " ".join((captured.out + captured.err).split())
    assert exc.value.code == 2
    assert "already holds 1 stored case(s) of another run" in err and "--resume" in err
    assert sorted(p.name for p in out.iterdir()) == [".lock", "cases"]  # no run.json: nothing started
    assert pd.read_parquet(out / "cases" / "elsewhere.parquet").equals(foreign)


# ---- links planted where the probe, the logs and the checkpoints write -----------------------------


def _probe(run_dir: Path) -> None:
    """The gloo probe of 2 processes, one repetition (where it writes does not depend on how long)."""
    from fsdpbench.pipeline.comm_probe import probe

    probe(run_dir, 2, reps=1)


@pytest.mark.slow
def test_a_probe_directory_that_is_a_link_is_replaced_not_written_through(tmp_path, victim):
    """Attacks: ``comm_probe/`` planted as a symbolic link to a directory outside the run (the probe
    wrote ``gloo_n2.json`` and its processes' logs there)."""
    outside = victim.parent
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "comm_probe").symlink_to(outside, target_is_directory=True)
    _probe(run_dir)
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt"] and victim.read_bytes() == SECRET
    probe_dir = run_dir / "comm_probe"
    assert probe_dir.is_dir() and not probe_dir.is_symlink()
    names = sorted(p.name for p in probe_dir.iterdir())
    assert names == ["gloo_n2.json", "gloo_n2_rank0.log", "gloo_n2_rank1.log"]


@pytest.mark.slow
def test_a_probe_log_that_is_a_link_is_replaced_not_appended_through(tmp_path, victim):
    """Attacks: ``comm_probe/gloo_n2_rank0.log`` planted as a link (the probe's process appended its
    output through it)."""
    run_dir = tmp_path / "run"
    (run_dir / "comm_probe").mkdir(parents=True)
    log = run_dir / "comm_probe" / "gloo_n2_rank0.log"
    log.symlink_to(victim)
    _probe(run_dir)
    assert victim.read_bytes() == SECRET
    assert log.is_file() and not log.is_symlink()


def _as_the_tracer(log_path: str) -> None:
    from fsdpbench.pipeline.runner import _tracer_process_init

    _tracer_process_init(log_path)
    os.write(1, b"a line of the traced predictor's\n")


def test_the_traced_predictors_log_that_is_a_link_is_replaced_not_appended_through(tmp_path, victim):
    """Attacks: ``traced.log`` planted as a link (the traced predictor's processes appended their output
    through it)."""
    import multiprocessing

    from fsdpbench.pipeline.runner import TRACED_LOG

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / TRACED_LOG).symlink_to(victim)
    context = multiprocessing.get_context("fork")
    process = context.Process(target=_as_the_tracer, args=(str(run_dir / TRACED_LOG),))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert victim.read_bytes() == SECRET
    assert (run_dir / TRACED_LOG).read_bytes() == b"a line of the traced predictor's\n"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dcp", "full", "sharded"])
def test_checkpoint_files_replaced_by_links_as_the_directory_appears_are_not_written_through(
    tmp_path, method
):
    """Attacks: a helper thread plants links named as the checkpoint's files (``__0_0.distcp``,
    ``__1_0.distcp``, ``full.pt``, ``rank0.pt``, ``rank1.pt``) the moment rank 0 makes ``checkpoint/``
    (the ranks wait for it: ``WaitsForLinksBeforeSaving``); their targets outside the run were
    overwritten. Wanted: every target untouched, the checkpoint written and the round trip checked."""
    from fsdpbench.core.case import Case
    from fsdpbench.core.rundir import CHECKPOINT_DIR
    from tests.helpers import CPU, FAULTS, run

    names = ["__0_0.distcp", "__1_0.distcp", "full.pt", "rank0.pt", "rank1.pt"]
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in names:
        (outside / name).write_bytes(SECRET)
    case = Case(
        model="mlp",
        model_args={"width": 64, "depth": 2},
        warmup_steps=1,
        steps=1,
        memory_steps=1,
        profile_steps=0,
        batch_size=2,
        world_size=2,
        strategy=f"{FAULTS}:WaitsForLinksBeforeSaving",
        checkpoint=method,
        keep_checkpoints=True,
        timeout_s=120,
        **CPU,
    )
    case_dir = tmp_path / "run" / case.case_id
    planted: list[str] = []

    def plant() -> None:
        directory = case_dir / CHECKPOINT_DIR
        deadline = time.monotonic() + 120
        while not directory.is_dir() and time.monotonic() < deadline:
            time.sleep(0.001)
        for name in names:
            (directory / name).symlink_to(outside / name)
            planted.append(name)
        (case_dir / "links-planted").touch()

    attacker = threading.Thread(target=plant, daemon=True)
    attacker.start()
    outcome = run(case, tmp_path / "run")
    attacker.join(10)
    assert planted == names
    assert all((outside / name).read_bytes() == SECRET for name in names)
    assert outcome.status == "ok", outcome.error
    assert all(r.checkpoint.state_equal and r.checkpoint.loss_equal for r in outcome.ranks)
    writes = {"dcp": names[:2], "full": ["full.pt"], "sharded": ["rank0.pt", "rank1.pt"]}[method]
    for name in writes:  # the method's own files: written in place of the links
        path = case_dir / CHECKPOINT_DIR / name
        assert path.is_file() and not path.is_symlink() and path.stat().st_size > len(SECRET)


# ---- torch's temporary files, and the install's checkout ------------------------------------------


@pytest.mark.slow
def test_a_run_leaves_nothing_in_the_temporary_directory(tmp_path):
    """Attacks: every run left ``$TMPDIR/torchinductor_<user>`` behind (inductor's cache directory,
    made when the fork server, or the orchestrator's FLOPs counter, imports ``torch._dynamo``), and
    every failed rank a ``$TMPDIR/pytorch-errorfile-*.pickle`` (torch's process starter's). Wanted:
    torch's caches and temporary files under the run directory, and nothing in ``$TMPDIR``."""
    import shutil
    import tempfile

    from tests.helpers import REPO, repo_pythonpath

    # a short path: multiprocessing's fork server binds its socket there (AF_UNIX: 108 bytes at most)
    tmpdir, out = Path(tempfile.mkdtemp(prefix="fsb-")), tmp_path / "run"
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "name: s\ndefaults: {model: mlp-tiny, steps: 1, warmup_steps: 1, world_size: 2, device: cpu, "
        "backend: gloo}\nsweep: {strategy: [ddp, 'tests.plugins.faults:CrashOnRank1']}\n"
    )
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(REPO), "TMPDIR": str(tmpdir)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "fsdpbench", "run", str(scenario), "--out", str(out), "--no-report",
             "--link", "none", "--allow-plugins"],
            capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
        )  # fmt: skip
        left = list(tmpdir.iterdir())
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert proc.returncode == 1, proc.stderr[-2000:]  # the crashing case failed, the other ran
    assert "injected failure on rank 1" in proc.stdout + proc.stderr
    assert left == []
    assert [p for p in out.rglob("torch_cache")] == []  # its temporary parts removed once the ranks ended


def test_the_commit_is_read_without_writing_in_the_installs_checkout(tmp_path, monkeypatch):
    """Attacks: fsdpbench ran ``git status`` inside the checkout it is installed from, which refreshes
    the index there (creating ``.git/index.lock`` and rewriting ``.git/index``). Wanted: the commit and
    '+dirty' read, and the checkout's ``.git`` left as it was."""
    from fsdpbench.store import env
    from tests.helpers import REPO

    repo = tmp_path / "checkout"
    source = repo / Path(env.__file__).resolve().relative_to(REPO)  # where it sits in a checkout
    source.parent.mkdir(parents=True)
    source.write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "one"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    head = [*git, "rev-parse", "--short=12", "HEAD"]
    sha = subprocess.run(head, check=True, capture_output=True, text=True)
    index = repo / ".git" / "index"
    before = index.stat()
    os.utime(source, ns=(before.st_mtime_ns + 10**9, before.st_mtime_ns + 10**9))  # stale in the index
    monkeypatch.setattr(env, "__file__", str(source))
    assert env.project_commit.__wrapped__() == sha.stdout.strip()  # touched, not modified: not dirty
    after = index.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not (repo / ".git" / "index.lock").exists()
    source.write_text("x = 2\n")
    assert env.project_commit.__wrapped__() == sha.stdout.strip() + "+dirty"
    assert index.stat().st_ino == before.st_ino
