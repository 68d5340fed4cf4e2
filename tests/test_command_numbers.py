"""Numbers on a command line are checked before anything runs: one line naming the option,
exit 2, never an OverflowError or a negative term; and compare applies run's oversubscription check."""

from __future__ import annotations

import pytest

from fsdpbench.cli import main
from fsdpbench.predictors.memory_model.search import parse_bytes

BASE = ("predict", "--model", "decoder-small", "--world-size", "4", "--strategy", "zero3")


def run(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    captured = capsys.readouterr()
    return exc.value.code or 0, " ".join((captured.out + captured.err).split())


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (("predict", "--params", "inf", "--world-size", "8"), "--params inf: must be a parameter count"),
        (("predict", "--params", "nan", "--world-size", "8"), "--params nan: must be a parameter count"),
        ((*BASE, "--device-memory", "1e400GiB"), "larger than any memory"),
        ((*BASE, "--host-memory", "1e30TB"), "larger than any memory"),
        ((*BASE, "--batch-size", "0"), "--batch-size 0: must be from 1 to 1,000,000"),
        ((*BASE, "--batch-size", "-1"), "--batch-size -1: must be from 1"),
        ((*BASE, "--seq-len", "-7"), "--seq-len -7: must be from 1 to 10,000,000"),
        ((*BASE, "--prefetch", "-1"), "--prefetch -1: must be from 0 to 64"),
        ((*BASE, "--rank", "-2"), "--rank -2: must be from 0 to 1,048,575"),
        ((*BASE, "--max-world-size", "0"), "--max-world-size 0: must be from 1 to 1,048,576"),
        ((*BASE, "--nccl-channels", "-1"), "--nccl-channels -1: must be from 0 to 64"),
    ],
)
def test_a_number_out_of_bounds_is_one_line_and_exit_2(capsys, argv, named):
    code, text = run(capsys, *argv)
    assert code == 2 and named in text and "Traceback" not in text


def test_memory_sizes_are_finite_and_bounded():
    assert parse_bytes("80GiB") == 80 * 2**30
    for text in ("1e400GiB", "2EiB", "inf GB"):
        with pytest.raises(ValueError):
            parse_bytes(text)


def test_compare_refuses_more_cpu_ranks_than_run_allows(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    out = tmp_path / "cmp"
    # CPU ranks named: on a GPU machine compare's default device is cuda (then the refusal counts GPUs)
    code, text = run(
        capsys, "compare", "--world-size", "99", "--set", "device=cpu", "--out", str(out), "--no-report"
    )
    assert code == 2 and "world_size: 99 CPU ranks on 2 cores (limit 8" in text
    assert "--allow-oversubscribe" in text and not out.exists()  # nothing started


def test_a_bad_host_tuning_is_one_line_and_exit_2_before_anything_runs(capsys, tmp_path):
    out = tmp_path / "run"
    code, text = run(capsys, "run", "scenarios/ci.yaml", "--set", "host_tuning=yes", "--out", str(out))
    assert code == 2 and text == "error: --set host_tuning: Input should be 'none', 'pin' or 'pin-idle-loops'"
    assert not out.exists()
