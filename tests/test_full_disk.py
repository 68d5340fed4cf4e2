"""A full disk is one case's failure, in one line, never the run's; a checkpoint that fails for any reason
is removed unless the case keeps it (docs/reliability.md).

The disk is made full without mounting anything (a test does not change the machine): in the rank
processes, a plugin strategy gives the files under ``checkpoint/`` 64 KiB of room, then fails their
writes with ENOSPC (``tests/plugins/faults.fill_checkpoints_after``), or sets ``RLIMIT_FSIZE`` to 0 so
that no file of the rank can grow (EFBIG, as a full disk's ENOSPC); in the orchestrator, its writer
raises ENOSPC. The same four checkpoint methods on a real 30 MB tmpfs (``unshare -m``, a private mount):
docs/reliability.md."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from fsdpbench.core.case import Case
from fsdpbench.core.rundir import CHECKPOINT_DIR
from fsdpbench.pipeline import launch
from fsdpbench.pipeline.runner import run_cases
from fsdpbench.store.results import RunStore, load_results
from tests.helpers import CPU, FAULTS, assert_all_gone, run

CKPT = dict(
    model="mlp",
    model_args={"width": 256, "depth": 2},
    warmup_steps=1,
    steps=1,
    memory_steps=1,
    profile_steps=0,
    batch_size=2,
    timeout_s=120,
    world_size=2,
    **CPU,
)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dcp", "dcp_async", "full", "sharded"])
def test_a_full_disk_while_saving_a_checkpoint_fails_that_case_in_one_line_removes_it_and_the_sweep_goes_on(
    method: str, tmp_path: Path
) -> None:
    """Attacks: a disk that fills while a checkpoint is saved (it was a torch-elastic traceback, exit 1,
    run.json left ``running``, the partial checkpoint kept and the later cases never run). Wanted: that
    case ``failed`` with one line, its partial checkpoint removed, the next case run, run.json
    ``complete`` naming the failure."""
    store = RunStore(tmp_path / "run")
    full = Case(**CKPT, strategy=f"{FAULTS}:DiskFullInCheckpoint", checkpoint=method)
    fine = Case(**{**CKPT, "model_args": {"width": 32, "depth": 1}}, strategy="ddp")
    meta: dict = {"env": {}}
    frame = run_cases([full, fine], [], store, meta)

    error = frame[frame.case_id == full.case_id]["case_error"].iloc[0]
    assert error.startswith("rank ")
    assert " in checkpoint: CheckpointSaveError: no space left while saving " in error
    assert f"the checkpoint ({method}) in " in error and "\n" not in error, error
    assert not (store.case_dir(full.case_id) / CHECKPOINT_DIR).exists()  # the partial checkpoint is gone
    assert list(store.case_dir(full.case_id).glob("*.reserve")) == []
    assert set(frame[frame.case_id == fine.case_id]["case_status"]) == {"ok"}
    run_json = json.loads((store.run_dir / "run.json").read_text())
    assert run_json["status"] == "complete"
    assert run_json["cases"][full.case_id]["status"] == "failed"
    assert run_json["cases"][fine.case_id]["status"] == "ok"


@pytest.mark.slow
def test_a_rank_killed_while_saving_leaves_no_partial_checkpoint(tmp_path: Path) -> None:
    """Attacks: ``kill -9`` of a rank in the middle of its save (the case failed, but its partial
    checkpoint stayed although ``keep_checkpoints`` is false)."""
    case = Case(**CKPT, strategy=f"{FAULTS}:SigkillRank1InCheckpoint", checkpoint="dcp")
    outcome = run(case, tmp_path)
    assert outcome.status == "failed"
    assert "rank 1 killed by SIGKILL (signal 9)" in outcome.error and "in phase checkpoint" in outcome.error
    assert_all_gone(outcome.pids)
    assert not (tmp_path / case.case_id / CHECKPOINT_DIR).exists()


@pytest.mark.slow
def test_a_rank_with_no_room_even_for_its_rank_file_fails_its_case_in_one_line(tmp_path: Path) -> None:
    """Attacks: a rank whose every write fails (no room for its rank file, nor for torch's launcher's
    error file, which was left empty: a JSONDecodeError traceback out of the orchestrator). Wanted: the
    case ``failed`` with one line that says why, and the run goes on."""
    small = {**CKPT, "model_args": {"width": 32, "depth": 1}}
    case = Case(**small, strategy=f"{FAULTS}:NoRoomForRankFilesOnRank1")
    outcome = run(case, tmp_path)
    assert outcome.status == "failed"
    assert outcome.error.startswith("rank 1 in phase setup: no space left on device"), outcome.error
    assert "\n" not in outcome.error
    assert_all_gone(outcome.pids)


def test_an_empty_error_file_of_torchs_launcher_is_a_failed_rank_not_a_traceback() -> None:
    """Attacks: torch's launcher reads a failed rank's error file after stopping the ranks and raised
    ``JSONDecodeError`` on an empty one (a full disk when the rank wrote it), out of the sweep. Wanted:
    the ranks that exited with a code of their own are the failures."""

    class Proc:
        def __init__(self, exitcode: int | None) -> None:
            self.exitcode = exitcode

    class Context:
        class _pc:  # noqa: N801 — the launcher's attribute
            processes = [Proc(1), Proc(None)]  # rank 0 failed, rank 1 waits for it

        def wait(self, timeout: float) -> None:
            self._pc.processes[1].exitcode = -15  # the launcher stops the others, then reads the file
            raise json.JSONDecodeError("Expecting value", "", 0)

    result, own_exits = launch._wait(Context(), timeout_s=5, n_ranks=2)
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: 1}
    assert own_exits == {0: 1}


def test_a_rank_file_is_written_on_a_full_disk_from_the_ranks_reserve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attacks: the disk fills while a rank runs, so the record that says so could not be written (the
    rank died with an unrecorded OSError). Wanted: the rank gives back the space it set aside when it
    started (``rundir.DiskReserve``) and its record is written."""
    from fsdpbench.engine import worker

    recorder = worker.RankRecorder(tmp_path, 1)
    assert [p.stat().st_size for p in tmp_path.glob(".*.reserve")] == [1 << 20]
    real_write = worker.write_atomically

    def full_until_the_reserve_is_given_back(path: Path, data: bytes, root: Path | None = None) -> None:
        if list(tmp_path.glob(".*.reserve")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, data)

    monkeypatch.setattr(worker, "write_atomically", full_until_the_reserve_is_given_back)
    recorder.update(status="failed", error="OSError: [Errno 28] No space left on device")
    assert json.loads((tmp_path / "rank1.json").read_text())["error"].endswith("No space left on device")
    assert list(tmp_path.glob(".*.reserve")) == []


@pytest.mark.slow
def test_a_case_whose_rows_find_no_space_is_not_stored_and_the_sweep_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attacks: the disk full when the orchestrator stores a case's rows (the run stopped there). Wanted:
    that case ``not stored`` in one warning line, the next case run and stored, the run ``incomplete``;
    ``--resume`` runs the case again."""
    from fsdpbench.store import results

    first = Case(**{**CKPT, "model_args": {"width": 32, "depth": 1}}, strategy="ddp")
    second = Case(**{**CKPT, "model_args": {"width": 32, "depth": 1}}, strategy="zero3")
    real_write = results.atomic_write_parquet

    def full_for_the_first_case(path: Path, frame: object) -> None:
        if path.name == f"{first.case_id}.parquet":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, frame)

    monkeypatch.setattr(results, "atomic_write_parquet", full_for_the_first_case)
    store, meta = RunStore(tmp_path / "run"), {"env": {}}
    run_cases([first, second], [], store, meta)
    assert store.completed_ids() == {second.case_id}
    run_json = json.loads((store.run_dir / "run.json").read_text())
    assert run_json["status"] == "incomplete: 1 case(s) not run"
    assert run_json["cases"][first.case_id]["status"] == "not stored"
    assert run_json["cases"][first.case_id]["error"].startswith("no space left on device to store its rows")

    monkeypatch.setattr(results, "atomic_write_parquet", real_write)
    run_cases([first, second], [], store, meta, resume=True)
    assert set(load_results(store.run_dir)["case_id"]) == {first.case_id, second.case_id}
