"""Format versions of run.json, baselines and results Parquet files: written, read when known (a file from
before versions: version 0, read), refused in one line naming the file and the version otherwise."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdpbench.analysis.regress import BaselineError, baseline_host_tuning, load_baseline
from fsdpbench.core.formats import BASELINE, FORMAT_VERSION, RESULTS, RUN_JSON, FileFormat, FormatVersionError
from fsdpbench.store.results import (
    ResultsFileError,
    RunStore,
    atomic_write_parquet,
    load_results,
    read_results_file,
)

ROOT = Path(__file__).resolve().parent.parent
CI_BASELINE = ROOT / "baselines" / "ci.json"


def test_a_format_reads_its_versions_and_refuses_the_others_in_one_line() -> None:
    fmt = FileFormat(name="thing", version=3, oldest=1, remedy="make a new one")
    assert [fmt.check("f.json", v) for v in (1, 2, 3)] == [1, 2, 3]
    with pytest.raises(FormatVersionError) as newer:
        fmt.check("f.json", 4)
    assert str(newer.value) == (
        "f.json: thing format_version 4 is newer than this fsdpbench reads (3); read it with the fsdpbench "
        "that wrote it, or upgrade"
    )
    with pytest.raises(FormatVersionError) as older:
        fmt.check("f.json", None)  # no version: written before files carried one
    assert str(older.value) == (
        "f.json: thing format_version 0 is older than this fsdpbench reads (oldest 1); make a new one"
    )
    for bad in (True, "2", 2.0, -1):
        with pytest.raises(FormatVersionError, match=r"^f\.json: format_version .* is not a format version"):
            fmt.check("f.json", bad)


def test_every_file_is_read_from_version_0_and_written_at_its_version() -> None:
    for fmt, version in ((RUN_JSON, 1), (BASELINE, 3), (RESULTS, 1)):
        assert (fmt.version, fmt.oldest) == (version, 0)
        assert fmt.check("x", None) == 0


def test_run_json_carries_its_version_first_and_an_unversioned_one_is_read(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.write_run_json({"status": "done", FORMAT_VERSION: 0})  # a resumed run's old header: re-stamped
    text = (tmp_path / "run.json").read_text()
    assert list(json.loads(text)) == [FORMAT_VERSION, "status"]
    assert json.loads(text)[FORMAT_VERSION] == 1
    (tmp_path / "run.json").write_text(json.dumps({"status": "done"}))
    assert store.read_run_json() == {"status": "done"}


@pytest.mark.parametrize(
    ("version", "said"),
    [
        (2, "run.json format_version 2 is newer than this fsdpbench reads (1)"),
        ("1", "format_version '1' is not"),
    ],
)
def test_run_json_of_an_unknown_version_is_refused(tmp_path: Path, version: object, said: str) -> None:
    (tmp_path / "run.json").write_text(json.dumps({FORMAT_VERSION: version, "status": "done"}))
    with pytest.raises(ResultsFileError) as err:
        RunStore(tmp_path).read_run_json()
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'run.json'}: ") and said in message
    assert "\n" not in message


def test_results_parquet_carries_its_version_in_the_file_metadata(tmp_path: Path) -> None:
    frame = pd.DataFrame({"case_id": ["a", "b"], "rank": [0, 1], "status": ["ok", "ok"]})  # a results table
    atomic_write_parquet(tmp_path / "results.parquet", frame)
    assert pq.read_schema(tmp_path / "results.parquet").metadata[b"format_version"] == b"1"
    assert load_results(tmp_path).equals(frame)
    frame.to_parquet(tmp_path / "old.parquet", index=False)  # before versions: no key, read as it is
    assert read_results_file(tmp_path / "old.parquet").equals(frame)


@pytest.mark.parametrize(
    ("stored", "said"),
    [
        (b"2", "results format_version 2 is newer than this fsdpbench reads (1)"),
        (b"one", "format_version 'one' is not"),
    ],
)
def test_results_parquet_of_an_unknown_version_is_refused(tmp_path: Path, stored: bytes, said: str) -> None:
    table = pa.Table.from_pandas(pd.DataFrame({"case_id": ["a"]}), preserve_index=False)
    table = table.replace_schema_metadata({**table.schema.metadata, b"format_version": stored})
    pq.write_table(table, tmp_path / "results.parquet")
    with pytest.raises(ResultsFileError) as err:
        load_results(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'results.parquet'}: ")
    assert said in message
    assert "\n" not in message


def legacy_copy(path: Path, version: int | None = 1) -> dict:
    """The CI baseline as a version-1 file (or an unversioned one) wrote it: no case names its host
    tuning, the step-time samples a flat list, the provenance of a pinned CPU run with gloo's loops as
    gloo has them."""
    data = json.loads(CI_BASELINE.read_text())
    data.pop(FORMAT_VERSION)
    if version is not None:
        data[FORMAT_VERSION] = version
    data["provenance"].update(device="cpu", gloo_loops_idle=False)
    for entry in data["cases"].values():
        entry.pop("host_tuning", None)
        samples = entry["metrics"].get("step_time_ref_ratios")
        if samples and isinstance(samples[0], list):
            entry["metrics"]["step_time_ref_ratios"] = [x for launch in samples for x in launch]
    path.write_text(json.dumps(data))
    return data


def test_the_ci_baseline_carries_the_current_version_and_an_unversioned_baseline_is_read(
    tmp_path: Path,
) -> None:
    assert json.loads(CI_BASELINE.read_text())[FORMAT_VERSION] == BASELINE.version
    data = legacy_copy(tmp_path / "old.json", version=None)
    assert set(load_baseline(tmp_path / "old.json")["cases"]) == set(data["cases"])


def test_a_baseline_before_version_2_is_read_with_the_host_tuning_its_launcher_applied(
    tmp_path: Path,
) -> None:
    """Versions 0 and 1 name no case's host tuning: a CPU baseline's ranks were pinned, gloo's loop
    threads as gloo has them (its provenance: device cpu, gloo_loops_idle false)."""
    legacy_copy(tmp_path / "v1.json")
    baseline = load_baseline(tmp_path / "v1.json")
    tunings = {baseline_host_tuning(baseline, entry) for entry in baseline["cases"].values()}
    assert tunings == {"pin"}
    assert all("host_tuning" not in entry for entry in baseline["cases"].values())


def test_a_baseline_of_a_newer_version_is_refused_in_one_line_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "newer.json"
    shutil.copy(CI_BASELINE, path)
    data = json.loads(path.read_text())
    data[FORMAT_VERSION] = 4
    path.write_text(json.dumps(data))
    with pytest.raises(
        BaselineError, match=r"baseline format_version 4 is newer than this fsdpbench reads \(3\)"
    ):
        load_baseline(path)
    run = subprocess.run(
        [sys.executable, "-m", "fsdpbench", "regress", str(tmp_path), "--baseline", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "400"},
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "format_version 4" in lines[0]
