"""Every malformed scenario in tests/malformed/ is rejected before anything runs: exit 2, one line
on stderr naming the file and the field, the expected message (each file's first line), no markup
interpreted, little memory (an anchor bomb is refused before it is expanded)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

import fsdpbench.models  # noqa: F401  (imported before tracing: torch's import is not the file's cost)
from fsdpbench.cli import build_parser
from fsdpbench.strategies import registered

registered()  # loads the strategies (and torch) before tracing, for the same reason

MALFORMED = sorted((Path(__file__).parent / "malformed").glob("*.yaml"))
MAX_TRACED_BYTES = 64 * 2**20  # Python allocations while rejecting one file


def expected_message(path: Path) -> str:
    first = path.read_bytes().split(b"\n", 1)[0].decode()
    assert first.startswith("# expect: "), f"{path.name}: first line must be '# expect: MESSAGE'"
    return first.removeprefix("# expect: ")


def run_cli(*argv: str) -> int:
    args = build_parser().parse_args(["run", *argv])
    return args._main(args)


def test_there_are_at_least_60_malformed_scenarios() -> None:
    assert len(MALFORMED) >= 60


@pytest.mark.parametrize("path", MALFORMED, ids=[p.stem for p in MALFORMED])
def test_malformed_scenario_is_rejected_in_one_line(
    path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FSDPBENCH_ALLOW_PLUGINS", raising=False)
    tracemalloc.start()
    try:
        code = run_cli(str(path), "--dry-run")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {path}: "), lines[0]
    assert expected_message(path) in lines[0], lines[0]
    assert peak < MAX_TRACED_BYTES, f"{peak / 2**20:.0f} MiB traced"


def test_oversized_file_is_refused_unread(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("name: x\nsweep: {strategy: [ddp]}\ndescription: " + "d" * 10_000_000 + "\n")
    assert run_cli(str(path), "--dry-run") == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: longer than 1,000,000 bytes; not a scenario file\n"


def test_bad_override_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert run_cli("scenarios/ci.yaml", "--set", "world_size=true", "--dry-run") == 2
    assert capsys.readouterr().err == "error: --set world_size: Input should be a valid integer\n"


def test_exponent_numbers_are_numbers_in_files_and_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ndefaults: {lr: 3e-4, device: cpu, backend: gloo}\nsweep: {strategy: [ddp]}\n")
    assert run_cli(str(path), "--set", "timeout_s=1e2", "--dry-run") == 0
    from fsdpbench.pipeline.scenario import load_scenario

    case = load_scenario(path).cases[0]
    assert case.lr == 3e-4
