"""Every file fsdpbench reads back is input from a stranger: a baseline whose numbers are NaN,
inf, strings or lists of them, a forged format marker, an infinite tolerance, a huge or deep file; a
truncated results.parquet or case file; a run.json of the wrong shape. Each is one line naming the file
and the field, exit 2 — and regress never says 1 (a regression) for a broken file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fsdpbench.cli import main
from fsdpbench.store.results import RunStore, load_results
from tests.test_regress import run_frame, write_run


def cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    captured = capsys.readouterr()
    return exc.value.code or 0, " ".join((captured.out + captured.err).split())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = write_run(tmp_path_factory.mktemp("runs") / "run", run_frame())  # ddp and zero3, all ok
    (run / "cases").mkdir()
    for case_id, rows in run_frame().groupby("case_id"):
        rows.to_parquet(run / "cases" / f"{case_id}.parquet", index=False)
    (run / "run.json").write_text(json.dumps({"status": "complete", "cases": {}}))
    return run


@pytest.fixture(scope="module")
def baseline(run_dir, tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("baseline") / "b.json"
    with pytest.raises(SystemExit):
        main(["regress", str(run_dir), "--write-baseline", str(path)])
    return json.loads(path.read_text())


def _first(data: dict) -> tuple[str, dict]:
    cid = next(iter(data["cases"]))
    return cid, data["cases"][cid]["metrics"]


def test_the_untouched_baseline_passes(capsys, run_dir, baseline, tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(baseline))
    assert cli(capsys, "regress", run_dir, "--baseline", path)[0] == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "12", [1.0, float("nan")], None, True])
def test_a_baseline_metric_that_is_not_a_finite_number_is_refused(capsys, run_dir, baseline, tmp_path, bad):
    data = json.loads(json.dumps(baseline))
    cid, metrics = _first(data)
    name = "mem_tracker_peak_bytes" if "mem_tracker_peak_bytes" in metrics else next(iter(metrics))
    metrics[name] = bad
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))  # json spells NaN and Infinity
    code, text = cli(capsys, "regress", run_dir, "--baseline", path)
    assert code == 2 and f"cases.{cid}.metrics.{name}" in text and "not a finite number" in text


def test_nan_losses_do_not_pass_the_gate(capsys, run_dir, baseline, tmp_path):
    data = json.loads(json.dumps(baseline))
    for entry in data["cases"].values():
        if "losses" in entry["metrics"]:
            entry["metrics"]["losses"] = [float("nan")] * len(entry["metrics"]["losses"])
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    assert cli(capsys, "regress", run_dir, "--baseline", path)[0] == 2


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda d: d.update(fsdpbench_baseline=True), "not a fsdpbench baseline"),
        (lambda d: d.update(thresholds={"mem_tracker_peak_bytes": {"tolerance": "inf"}}), "finite number"),
        (lambda d: d.update(cases={str(i): {"status": "ok"} for i in range(10_001)}), "more than 10000"),
    ],
)
def test_forged_markers_infinite_tolerances_and_huge_baselines_are_refused(
    capsys, run_dir, baseline, tmp_path, edit, named
):
    data = json.loads(json.dumps(baseline))
    edit(data)
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    code, text = cli(capsys, "regress", run_dir, "--baseline", path)
    assert code == 2 and named in text


def test_a_deeply_nested_baseline_is_one_line(capsys, run_dir, tmp_path):
    path = tmp_path / "b.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    code, text = cli(capsys, "regress", run_dir, "--baseline", path)
    assert code == 2 and "b.json" in text and "Traceback" not in text


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "copy"))


def test_a_truncated_results_file_is_exit_2_for_regress_and_report(capsys, run_dir, baseline, tmp_path):
    copy = _copy(run_dir, tmp_path)
    data = (copy / "results.parquet").read_bytes()
    (copy / "results.parquet").write_bytes(data[: len(data) // 2])
    path = tmp_path / "b.json"
    path.write_text(json.dumps(baseline))
    code, text = cli(capsys, "regress", copy, "--baseline", path)
    assert code == 2 and "results.parquet: not a readable parquet file" in text  # never 1: not a regression
    code, text = cli(capsys, "report", copy, "--out", tmp_path / "r.html")
    assert code == 2 and "results.parquet: not a readable parquet file" in text


def test_a_truncated_case_file_is_not_done_and_resume_measures_it_again(run_dir, tmp_path):
    copy = _copy(run_dir, tmp_path)
    store = RunStore(copy)
    case_file = sorted((copy / "cases").glob("*.parquet"))[0]
    case_file.write_bytes(case_file.read_bytes()[:100])
    assert case_file.stem not in store.completed_ids()
    assert len(store.completed_ids()) == len(list((copy / "cases").glob("*.parquet"))) - 1


@pytest.mark.parametrize(
    ("content", "named"),
    [("[]", "expected a JSON object, got list"), ('{"cases": []}', "field 'cases' has type list"),
     ('{"status": 7}', "field 'status' has type int"), ("[" * 200_000, "run.json")],
)  # fmt: skip
def test_a_run_json_of_the_wrong_shape_is_one_line(capsys, run_dir, baseline, tmp_path, content, named):
    copy = _copy(run_dir, tmp_path)
    (copy / "run.json").write_text(content)
    path = tmp_path / "b.json"
    path.write_text(json.dumps(baseline))
    code, text = cli(capsys, "regress", copy, "--baseline", path)
    assert code == 2 and named in text and "Traceback" not in text
    code, text = cli(capsys, "report", copy, "--out", tmp_path / "r.html")
    assert code == 2 and named in text
    assert len(load_results(copy)) > 0  # the results themselves are still there
