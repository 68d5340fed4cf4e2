"""Nothing fsdpbench writes inside a run directory follows a link planted there (issue 21): the lock and
every atomically written file (run.json, results.parquet, a case's parquet, the report, a rank file)
go through ``rundir.write_atomically`` / ``RunLock``, which never write through a symbolic link."""

from __future__ import annotations

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
