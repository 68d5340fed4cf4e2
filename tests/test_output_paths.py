"""Output paths are checked before any work, and a write that fails anyway is one line:
`regress --json/--markdown/--write-baseline`, `report --out` and `run --export-cases` pointing at a
directory, under a file, or somewhere that cannot be written give exit 2 and no traceback."""

from __future__ import annotations

import json
import os

import pytest

from fsdpbench.cli import main
from fsdpbench.store.results import load_results
from tests.test_regress import run_frame, write_run


def cli(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    captured = capsys.readouterr()
    return exc.value.code or 0, " ".join((captured.out + captured.err).split())


@pytest.fixture
def run_dir(tmp_path):
    run = write_run(tmp_path / "run", run_frame())
    (run / "run.json").write_text(json.dumps({"status": "complete", "cases": {}}))
    return run


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "plain.txt"
    path.write_text("x")
    return path


@pytest.mark.parametrize("flag", ["--write-baseline", "--json", "--markdown"])
def test_regress_outputs_at_a_directory_or_under_a_file_are_exit_2(capsys, run_dir, a_file, tmp_path, flag):
    base = tmp_path / "b.json"
    assert cli(capsys, "regress", run_dir, "--write-baseline", base)[0] == 0
    extra = () if flag == "--write-baseline" else ("--baseline", base)
    for target, named in ((tmp_path, "is a directory"), (a_file / "out.json", "is a file, not a directory")):
        code, text = cli(capsys, "regress", run_dir, *extra, flag, target)
        assert code == 2 and f"{flag} {target}: " in text and named in text and "Traceback" not in text


def test_a_write_that_fails_anyway_is_one_line_and_exit_2(capsys, run_dir, tmp_path):
    code, text = cli(capsys, "regress", run_dir, "--write-baseline", "/proc/fsdpbench-baseline.json")
    assert code == 2 and text.startswith("error: ") and "Traceback" not in text


def test_report_out_at_a_directory_is_exit_2(capsys, run_dir, tmp_path, a_file):
    for target in (tmp_path, a_file / "r.html"):
        code, text = cli(capsys, "report", run_dir, "--out", target)
        assert code == 2 and f"--out {target}: " in text
    assert cli(capsys, "report", run_dir, "--out", tmp_path / "new" / "r.html")[0] == 0


def test_export_cases_into_a_file_is_exit_2(capsys, a_file, tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\nsweep: {strategy: [ddp]}\n")
    code, text = cli(capsys, "run", scenario, "--export-cases", a_file)
    assert code == 2 and f"--export-cases {a_file}: exists and is not a directory" in text
    assert a_file.read_text() == "x"
    assert cli(capsys, "run", scenario, "--export-cases", tmp_path / "cases")[0] == 0


NOT_UTF8 = os.fsdecode(b"run\xff")  # a name the file system allows and pyarrow and HTML cannot hold


@pytest.mark.parametrize("verb", ["run", "compare"])
def test_an_out_that_is_not_utf8_is_refused_before_any_case_runs(capsys, tmp_path, monkeypatch, verb):
    # it failed after the case ran (UnicodeEncodeError in to_parquet): the measurement was lost and
    # run.json stayed "running"
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\nsweep: {strategy: [ddp]}\n")
    launched = []
    monkeypatch.setattr("fsdpbench.pipeline.runner.launch_case", lambda *a, **k: launched.append(a))
    target = tmp_path / NOT_UTF8
    argv = (scenario,) if verb == "run" else ("--world-size", "1", "--strategies", "ddp")
    code, text = cli(capsys, verb, *argv, "--out", target)
    assert code == 2 and "--out " in text and "is not valid UTF-8" in text and "Traceback" not in text
    assert not launched and not os.path.lexists(target)


def test_a_run_directory_named_in_another_encoding_is_read_and_reported(capsys, tmp_path):
    run = write_run(tmp_path / "made", run_frame()).rename(tmp_path / NOT_UTF8)
    (run / "run.json").write_text(json.dumps({"status": "complete", "cases": {}}))
    assert len(load_results(run)) == len(run_frame())  # pyarrow never sees the path
    code, text = cli(capsys, "report", run)
    assert code == 0, text
    page = (run / "report.html").read_text(encoding="utf-8")
    assert "run\ufffd" in page  # the name shown with U+FFFD where it is not UTF-8
