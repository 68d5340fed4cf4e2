"""Baselines and results files from strangers, and numbers typed at the command line: each test says
which attack it makes and fails on the code before the fix. A bad input is one line naming the file (or
flag) and the field, exit 2 — never a traceback, never exit 1 (which CI reads as a regression), never a
gate that passes because it compared nothing; a file read back is read to a bounded size; a plugin runs
only where its name was allowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

from fsdpbench.analysis.regress import SAMPLED, build_baseline
from fsdpbench.cli import main
from fsdpbench.core import schema
from fsdpbench.core.case import Case
from tests.helpers import REPO, regression_named, repo_pythonpath
from tests.test_regress import DDP, ZERO3, case_rows, run_frame

SAMPLES = [1.0, 1.01, 0.99, 1.0]  # a case's step-time ratios, one per block


def cli(capsys, *argv: object) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    captured = capsys.readouterr()
    return exc.value.code or 0, captured.out + captured.err


def one_line_exit_2(code: int, text: str, *named: str) -> None:
    """The contract for bad input: exit 2, one line starting 'error:', naming what is given."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert code == 2, text
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    for name in named:
        assert name in lines[0], (name, lines[0])


def write_run(path: Path, frame: pd.DataFrame, meta: dict | None = None) -> Path:
    path.mkdir(parents=True)
    frame.to_parquet(path / "results.parquet", index=False)
    (path / "run.json").write_text(
        json.dumps(meta if meta is not None else {"status": "complete", "cases": {}})
    )
    return path


def write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def baseline() -> dict:
    return json.loads(json.dumps(build_baseline(run_frame())))


@pytest.fixture
def regressed_run(tmp_path: Path) -> Path:
    """A run that regresses on every kind: memory ×1.5, step time ×3, losses +10%."""
    frame = run_frame(zero3_peak=(1500, 1500), zero3_ms=150.0, zero3_losses=[7.04, 6.93, 6.82])
    return write_run(tmp_path / "regressed", frame)


# ---- permission for one plugin is not permission for every plugin a file names ----------------------

MYPLUG = "from fsdpbench.strategies.ddp import DDP as MyDDP\n"
EVILPLUG = "import pathlib\npathlib.Path(__file__).with_name('EVIL_RAN').write_text('imported')\n"


def test_a_plugin_named_in_map_strategy_does_not_permit_another_plugin_a_results_file_names(tmp_path):
    """Attack: ``regress --repeat 1 --map-strategy myplug:MyDDP=ddp`` on a results.parquet in which
    another case says ``strategy: evilplug:Evil`` (its id made to match) and a baseline in which that case
    was fast: the case is a suspect, and ``evilplug`` was imported and run by the re-launch."""
    my = Case(strategy="myplug:MyDDP", world_size=2, wrap="none", device="cpu", backend="gloo")
    evil = Case(strategy="evilplug:Evil", world_size=2, device="cpu", backend="gloo")
    extra = {SAMPLED: SAMPLES}
    run = case_rows(my, peak=[2000, 2000], step_ms=20.0, **extra)
    run += case_rows(evil, peak=[1000, 1000], step_ms=50.0, **extra)
    write_run(tmp_path / "r", pd.DataFrame(run))
    base = case_rows(DDP, peak=[2000, 2000], step_ms=20.0, **extra)
    base += case_rows(evil, peak=[1000, 1000], step_ms=50.0, **extra)
    baseline = build_baseline(pd.DataFrame(base))
    baseline["cases"][evil.case_id]["metrics"][SAMPLED] = [x * 1e-6 for x in SAMPLES]  # a suspect
    write_json(tmp_path / "b.json", baseline)
    (tmp_path / "myplug.py").write_text(MYPLUG)
    (tmp_path / "evilplug.py").write_text(EVILPLUG)
    env = {k: v for k, v in os.environ.items() if k != "FSDPBENCH_ALLOW_PLUGINS"}
    env["PYTHONPATH"] = repo_pythonpath(REPO)
    argv = ["regress", "r", "--baseline", "b.json", "--repeat", "1", "--map-strategy", "myplug:MyDDP=ddp"]
    done = subprocess.run(
        [sys.executable, "-P", "-m", "fsdpbench", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not (tmp_path / "EVIL_RAN").exists(), done.stderr
    assert f"not re-measured {evil.case_id}: its strategy evilplug:Evil is a plugin" in done.stderr
    assert done.returncode == 1  # judged on the run's samples: slower than the forged baseline


def test_plugin_permission_is_by_name():
    """The rule the re-launch follows: all plugins, none, or the names given."""
    from fsdpbench.pipeline.scenario import plugin_permitted

    assert plugin_permitted("zero3", False)
    assert plugin_permitted("evilplug:Evil", True)
    assert not plugin_permitted("evilplug:Evil", False)
    assert plugin_permitted("myplug:MyDDP", frozenset({"myplug:MyDDP"}))
    assert not plugin_permitted("evilplug:Evil", frozenset({"myplug:MyDDP"}))


# ---- a case rebuilt from a results file is checked as a scenario's case -------------------------------


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (16, "ddp_n16_"),
        (10**6, "world_size: Input should be less than or equal to 4096"),
        ("2", "world_size"),
    ],
)
def test_a_results_file_whose_case_fields_were_edited_is_refused_before_anything_runs(
    capsys, tmp_path, baseline, value, named
):
    """Attack: results.parquet edited to ``world_size: 16`` in a 2-rank case's rows, then ``regress
    --repeat 1``: 16 ranks were launched and pooled into the 2-rank case's verdict (its fields were read
    back unchecked). Now the case built from the columns must pass the scenario's checks and give the
    row's own case id."""
    frame = run_frame()
    if isinstance(value, str):  # the column of another type
        frame["world_size"] = frame["world_size"].astype(str)
    else:
        frame.loc[frame["strategy"] == "ddp", "world_size"] = value
    run = write_run(tmp_path / "r", frame)
    code, text = cli(
        capsys, "regress", run, "--baseline", write_json(tmp_path / "b.json", baseline), "--repeat", 1
    )
    one_line_exit_2(code, text, "results.parquet", DDP.case_id, named)


def test_the_columns_of_every_stored_case_give_back_its_case():
    """The validated path accepts what fsdpbench writes: every case of the synthetic run, a skipped one
    and an emulated one come back equal from their columns."""
    from fsdpbench.pipeline.scenario import case_from_row

    emulated = Case(strategy="zero3", world_size=8, emulate=True, emulate_ranks=(0, 7), device="cpu")
    for case in (DDP, ZERO3, emulated, Case(model_args={"n_layers": 3}, wrap_classes=("Block",))):
        row = pd.Series(schema.case_to_columns(case))
        assert case_from_row(row, source="x") == case


# ---- one bounded reader, size by reading ---------------------------------------------------------------


def _fifo_feeding(path: Path, n_bytes: int) -> threading.Thread:
    """A FIFO at ``path`` that yields ``n_bytes`` spaces to whoever opens it: ``stat`` says 0 bytes."""
    os.mkfifo(path)

    def feed() -> None:
        try:
            with open(path, "wb") as fifo:
                for _ in range(n_bytes // (1 << 20)):
                    fifo.write(b" " * (1 << 20))
        except OSError:  # the reader stopped at its limit: a broken pipe
            pass

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return thread


def test_a_baseline_that_reads_without_end_is_refused_at_its_limit(capsys, tmp_path, monkeypatch):
    """Attack: ``regress --baseline /dev/zero`` read without end (5.7 GB resident after 47 s): the size
    cap looked at ``stat``, which says 0 for a device or a FIFO. Here a FIFO gives 3 MiB against a
    1 MiB limit (the same reader, a smaller limit, so the old code's endless read is not reproduced)."""
    import fsdpbench.analysis.regress as regress

    monkeypatch.setattr(regress, "MAX_BASELINE_BYTES", 1 << 20)
    run = write_run(tmp_path / "r", run_frame())
    feeder = _fifo_feeding(tmp_path / "b.json", 3 << 20)
    code, text = cli(capsys, "regress", run, "--baseline", tmp_path / "b.json")
    one_line_exit_2(code, text, "b.json", "longer than 1 MiB")
    feeder.join(10)


@pytest.mark.parametrize("name", ["run.json", "results.parquet"])
def test_run_files_that_read_without_end_are_refused_at_their_limit(capsys, tmp_path, monkeypatch, name):
    """Attack: run.json or results.parquet as a FIFO (stat: 0 bytes) feeding more than the limit."""
    import fsdpbench.store.results as results

    monkeypatch.setattr(results, "MAX_RUN_JSON_BYTES", 1 << 20)
    monkeypatch.setattr(results, "MAX_RESULTS_BYTES", 1 << 20)
    run = write_run(tmp_path / "r", run_frame())
    (run / name).unlink()
    feeder = _fifo_feeding(run / name, 3 << 20)
    code, text = cli(capsys, "report", run, "--out", tmp_path / "report.html")
    one_line_exit_2(code, text, name, "longer than 1 MiB")
    feeder.join(10)


def test_a_rank_file_and_a_scenario_are_read_to_their_limit_too(tmp_path, monkeypatch, capsys):
    """Attack: a rank file or a scenario that reads without end (a FIFO; the scenario also /dev/zero)."""
    import fsdpbench.engine.rank_result as rank_result
    from fsdpbench.engine.rank_result import RankResult, rank_file

    monkeypatch.setattr(rank_result, "MAX_RANK_FILE_BYTES", 1 << 20)
    feeder = _fifo_feeding(tmp_path / rank_file(0), 3 << 20)
    assert "longer than 1 MiB" in RankResult.read(tmp_path / rank_file(0), 0).error
    feeder.join(10)
    code, text = cli(capsys, "run", "/dev/zero", "--dry-run")
    one_line_exit_2(code, text, "/dev/zero", "longer than 1,000,000 bytes")


# ---- every count flag is bounded ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (("--repeat", "99999999999999999999"), "--repeat 99999999999999999999: must be from 0 to 100"),
        (("--repeat", "-1"), "--repeat -1: must be from 0 to 100"),
    ],
)
def test_regress_repeat_is_bounded(capsys, tmp_path, baseline, argv, named):
    """Attack: ``regress --repeat 99999999999999999999`` re-launched a suspect case forever."""
    run = write_run(tmp_path / "r", run_frame())
    code, text = cli(capsys, "regress", run, "--baseline", write_json(tmp_path / "b.json", baseline), *argv)
    one_line_exit_2(code, text, named)


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--world-size", "100000000000000000000", "--world-size 100000000000000000000: must be from 1 to"),
        ("--rank", "10000000", "--rank 10000000: must be from 0 to 1,048,575"),
        ("--shard-size", "10000000", "--shard-size 10000000: must be from 1 to 1,048,576"),
        ("--max-world-size", "10000000000000", "--max-world-size 10000000000000: must be from 1 to"),
        ("--nccl-channels", "100000", "--nccl-channels 100000: must be from 0 to 64"),
        ("--jobs", "100000", "--jobs 100000: must be from 0 to 256"),
    ],
)
def test_predict_counts_are_bounded(capsys, flag, value, named):
    """Attack: counts with no upper bound (a rank past the world, 10^20 ranks, 10^5 NCCL channels)."""
    argv = ["predict", "--model", "decoder-small", "--world-size", "4", "--strategy", "zero3"]
    argv = [a for a in argv if a != "--world-size" and a != "4"] if flag == "--world-size" else argv
    code, text = cli(capsys, *argv, flag, value)
    one_line_exit_2(code, text, named)


# ---- a gate that compared nothing has not passed --------------------------------------------------


def _emptied(data: dict, how: str) -> dict:
    if how == "no cases":
        data["cases"] = {}
    for entry in data["cases"].values():
        if how == "all skipped":
            entry["status"] = "skipped"
        if how == "no metrics":
            entry["metrics"] = {}
    return data


@pytest.mark.parametrize("how", ["no cases", "all skipped", "no metrics"])
def test_a_baseline_that_compares_nothing_fails_the_gate(capsys, tmp_path, baseline, regressed_run, how):
    """Attack: a run that regresses (memory ×1.5, losses +10%, time ×3) PASSED against a baseline with
    ``cases: {}``, every case ``status: skipped``, or every case ``metrics: {}`` ("2 new", "0 compared")."""
    path = write_json(tmp_path / "b.json", _emptied(baseline, how))
    code, text = cli(capsys, "regress", regressed_run, "--baseline", path)
    one_line_exit_2(code, text, "b.json", "no metric compared")


def test_every_gate_off_compares_nothing_and_fails(capsys, tmp_path, baseline, regressed_run):
    """The same bypass from the command line: every kind's gate off."""
    path = write_json(tmp_path / "b.json", baseline)
    off = [a for kind in ("memory", "comm", "time", "loss") for a in ("--threshold", f"{kind}=0.01:off")]
    code, text = cli(capsys, "regress", regressed_run, "--baseline", path, *off)
    one_line_exit_2(code, text, "no metric compared")


def test_the_regressed_run_fails_against_the_real_baseline(capsys, tmp_path, baseline, regressed_run):
    code, text = cli(
        capsys, "regress", regressed_run, "--baseline", write_json(tmp_path / "b.json", baseline)
    )
    assert code == 1 and "FAIL" in text


# ---- a tolerance beyond the stated maximum ------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda d: d["thresholds"]["mem_tracker_peak_bytes"].update(tolerance=1e308), "thresholds.mem_"),
        (lambda d: d["thresholds"]["losses"].update(tolerance="1e308%"), "thresholds.losses"),
        (lambda d: d["thresholds"]["losses"].update(tolerance=1.5), "thresholds.losses"),
        (
            lambda d: next(iter(d["cases"].values())).update(thresholds={"memory": {"tolerance": 1e300}}),
            ".thresholds.memory",
        ),
    ],
)  # fmt: skip
def test_a_tolerance_beyond_the_maximum_is_refused(capsys, tmp_path, baseline, regressed_run, edit, named):
    """Attack: ``tolerance: 1e308`` (and ``"1e308%"``, a case-level ``1e300``) was accepted: PASS."""
    edit(baseline)
    code, text = cli(
        capsys, "regress", regressed_run, "--baseline", write_json(tmp_path / "b.json", baseline)
    )
    one_line_exit_2(code, text, "b.json", named, "beyond the maximum 1 (100%)")


def test_a_command_line_tolerance_beyond_the_maximum_is_refused(capsys, tmp_path, baseline, regressed_run):
    path = write_json(tmp_path / "b.json", baseline)
    code, text = cli(capsys, "regress", regressed_run, "--baseline", path, "--threshold", "memory=1e308")
    one_line_exit_2(code, text, "--threshold 'memory=1e308'", "beyond the maximum")


# ---- one line, never a traceback, never exit 1 for a broken file -----------------------------------


def _first(data: dict) -> dict:
    return next(iter(data["cases"].values()))


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda d: d.update(machine=[1, 2]), "machine: expected a mapping"),
        (lambda d: d.update(provenance="x"), "provenance: expected a mapping"),
        (lambda d: _first(d)["metrics"].update(losses=[]), "metrics.losses: expected a non-empty list"),
        (lambda d: _first(d)["metrics"].update(losses=5.0), "metrics.losses: expected a non-empty list"),
        (lambda d: _first(d)["metrics"].update(mem_tracker_peak_bytes=[1, 2]), "peak_bytes: [1, 2] is not"),
        (lambda d: _first(d)["metrics"].update(mem_tracker_peak_bytes=10**400), "peak_bytes: 1000000"),
        (lambda d: _first(d)["metrics"].update(case_step_time_ms=-5.0), "out of range"),
        (lambda d: _first(d).update(status="great"), "expected {status"),
        (lambda d: _first(d).update(world_size="2"), ".world_size: '2' is not of type int"),
    ],
)  # fmt: skip
def test_a_malformed_baseline_is_one_line_and_exit_2(capsys, tmp_path, baseline, edit, named):
    """Attack: baselines that gave AttributeError/IndexError/TypeError/OverflowError and exit 1 (which
    CI reads as a regression): ``machine: [1,2]``, ``losses: []`` or ``5.0``, a metric ``[1,2]`` or
    ``10**400``."""
    edit(baseline)
    run = write_run(tmp_path / "r", run_frame())
    code, text = cli(capsys, "regress", run, "--baseline", write_json(tmp_path / "b.json", baseline))
    one_line_exit_2(code, text, "b.json", named)


MARKUP = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] [/bold] [/]"


def test_markup_in_case_ids_hostnames_and_errors_is_printed_literally(capsys, tmp_path, baseline):
    """Attack: case ids or hostnames holding ``[/]`` or ``[/bold]`` in a baseline, and a failed case whose
    error holds gloo's ``[/pytorch/…]``: rich's MarkupError in ``regress`` (``--markdown``/``--json``
    written nothing)."""
    baseline["machine"]["hostname"] = "[/bold]"
    baseline["cases"]["[/]" + DDP.case_id] = baseline["cases"][DDP.case_id]
    frame = run_frame()
    failed = frame["strategy"] == "zero3"
    for col, value in (
        ("status", "failed"),
        ("case_status", "failed"),
        ("error", MARKUP),
        ("case_error", MARKUP),
    ):
        frame.loc[failed, col] = value
    run = write_run(tmp_path / "r", frame)
    md, js = tmp_path / "c.md", tmp_path / "r.json"
    path = write_json(tmp_path / "b.json", baseline)
    code, text = cli(capsys, "regress", run, "--baseline", path, "--markdown", md, "--json", js)
    assert code == 1 and "Traceback" not in text and "MarkupError" not in text
    assert "[/]" + DDP.case_id in text and "[/bold]" in text and "[/pytorch/" in text
    assert MARKUP in md.read_text() and json.loads(js.read_text())["passed"] is False


def test_no_module_escapes_markup_but_the_one_rule():
    """Everything printed through rich is escaped by ``core.markup.escape``, the one rule."""
    users = [
        p.relative_to(REPO).as_posix()
        for p in (REPO / "fsdpbench").rglob("*.py")
        if "rich.markup" in p.read_text()
    ]
    assert users == ["fsdpbench/core/markup.py"]


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda f: f.drop(columns=["case_id"]), "no column case_id"),
        (lambda f: f.assign(losses=["6.4"] * len(f)), "column losses, row 0"),
        (lambda f: f.assign(status="great"), "column status, row 0: 'great'"),
        (lambda f: f.assign(model_args="[1"), "column model_args: cannot be read"),
    ],
)  # fmt: skip
def test_a_malformed_results_file_is_one_line_and_exit_2(capsys, tmp_path, baseline, edit, named):
    """Attack: results.parquet without ``case_id`` (KeyError) or with null losses (TypeError), exit 1."""
    run = write_run(tmp_path / "r", edit(run_frame()))
    code, text = cli(capsys, "regress", run, "--baseline", write_json(tmp_path / "b.json", baseline))
    one_line_exit_2(code, text, "results.parquet", named)


@pytest.mark.parametrize("every_case", [True, False])
@pytest.mark.parametrize("losses", [[float("nan")] * 3, [6.4, float("nan"), 6.2]])
def test_nan_losses_in_the_run_are_a_changed_loss_not_a_pass(capsys, tmp_path, baseline, losses, every_case):
    """Attack: results.parquet with NaN losses (Parquet gives a column of all-NaN lists back as nulls):
    TypeError, exit 1. A diverged run's NaN loss is a measurement, and it differs from the baseline's:
    a NaN compared as no larger than any tolerance, which would pass."""
    frame = run_frame(zero3_losses=losses)
    if every_case:
        frame["losses"] = [losses] * len(frame)
    run = write_run(tmp_path / "r", frame)
    code, text = cli(capsys, "regress", run, "--baseline", write_json(tmp_path / "b.json", baseline))
    assert (
        code == 1 and regression_named(text, ZERO3.case_id, "losses", "changed") and "Traceback" not in text
    )


@pytest.mark.parametrize(
    ("meta", "named"),
    [({"emulation": [1, 2]}, "field 'emulation' has type list"),
     ({"cases": {"x": "y"}}, "field cases.x has type str")],
)  # fmt: skip
def test_a_run_json_of_the_wrong_shape_inside_is_one_line(capsys, tmp_path, meta, named):
    """Attack: run.json ``{"emulation": [1,2]}`` + ``report`` (AttributeError); ``{"cases": {"x": "y"}}``."""
    run = write_run(tmp_path / "r", run_frame(), meta)
    code, text = cli(capsys, "report", run, "--out", tmp_path / "report.html")
    one_line_exit_2(code, text, "run.json", named)


SCENARIO = """
name: tiny
defaults: {model: mlp-tiny, strategy: ddp, world_size: 1, device: cpu, batch_size: 2, warmup_steps: 0,
           steps: 1, memory_steps: 0, profile_steps: 0}
sweep: {wrap: [none]}
"""


def _fsdpbench(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=repo_pythonpath(REPO))
    return subprocess.run(
        [sys.executable, "-m", "fsdpbench", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_resume_refuses_a_run_json_whose_case_records_are_not_objects(tmp_path):
    """Attack: run.json ``{"cases": {"x": "y"}}`` + ``run --resume``: the cases ran, then a traceback,
    run.json left ``running``. Now refused before anything runs."""
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.json").write_text('{"cases": {"x": "y"}}')
    done = _fsdpbench(tmp_path, "run", "s.yaml", "--out", "r", "--resume", "--no-report", "--link", "none")
    one_line_exit_2(done.returncode, done.stderr, "run.json", "field cases.x has type str")
    assert not (tmp_path / "r" / "cases").exists()


def test_resume_refuses_a_foreign_case_file_before_anything_runs(tmp_path):
    """Attack: a readable case file of a foreign schema in ``cases/`` + ``--resume``: pyarrow's
    ArrowTypeError after the cases ran. Now the stored case's columns are checked as a case first."""
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "r" / "cases").mkdir(parents=True)
    frame = pd.DataFrame(case_rows(DDP, peak=[1, 1], step_ms=1.0)).astype({"world_size": str})
    frame.to_parquet(tmp_path / "r" / "cases" / f"{DDP.case_id}.parquet", index=False)
    done = _fsdpbench(tmp_path, "run", "s.yaml", "--out", "r", "--resume", "--no-report", "--link", "none")
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert (
        errors[0].startswith("error: ")
        and f"{DDP.case_id}.parquet" in errors[0]
        and "world_size" in errors[0]
    )
    assert not (tmp_path / "r" / "cases" / DDP.case_id).exists()  # nothing ran


def test_an_unreadable_foreign_case_file_is_one_line_and_the_run_says_why(tmp_path):
    """Attack: an unreadable foreign ``cases/*.parquet`` in the run directory: a traceback after the first
    case (results.parquet could not be refreshed), run.json left ``running``."""
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "r" / "cases").mkdir(parents=True)
    (tmp_path / "r" / "cases" / "foreign.parquet").write_bytes(b"PAR1 not parquet")
    done = _fsdpbench(tmp_path, "run", "s.yaml", "--out", "r", "--no-report", "--link", "none")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: ") and "foreign.parquet" in done.stderr
    status = json.loads((tmp_path / "r" / "run.json").read_text())["status"]
    assert status.startswith("failed: ") and "foreign.parquet" in status


def test_collect_with_an_integer_beyond_int64_fails_only_that_case(tmp_path):
    """Attack: ``run --collect`` of a rank file whose ``params`` has 4000 digits: OverflowError when the
    case's rows were stored."""
    from fsdpbench.pipeline.launch import collect_case
    from fsdpbench.store.results import RunStore, build_rows
    from tests.test_rank_records import _record

    case = Case(model="mlp-tiny", strategy="ddp", world_size=1, device="cpu")
    data = _record(0).to_json()
    data["params"] = 10**4000
    (tmp_path / "rank0.json").write_text(json.dumps(data))
    outcome = collect_case(case, tmp_path)
    assert outcome.status == "failed" and "rank0.json: field 'params'" in outcome.error
    store = RunStore(tmp_path / "run")
    store.create()
    store.write_case(case.case_id, build_rows(case, outcome, {}))  # stored: no OverflowError


def test_an_override_of_null_is_the_fields_default(capsys):
    """Attack: ``run --dry-run --emulate --set emulate_ranks=null``: TypeError. A null is the default,
    as in a scenario's ``defaults``."""
    code, text = cli(
        capsys,
        "run",
        REPO / "scenarios" / "quickstart.yaml",
        "--dry-run",
        "--emulate",
        "--set",
        "emulate_ranks=null",
    )
    assert code == 0 and "_emulated_" in text and "Traceback" not in text


# ---- numbers finite and in range wherever they enter -------------------------------------------------


@pytest.mark.parametrize(
    ("link", "named"),
    [
        ("alpha_us=nan,busbw_GBps=10", "alpha_us: nan is not a finite number"),
        ("alpha_us=1,busbw_GBps=inf", "busbw_GBps: inf is not a finite number"),
        ("alpha_us=1,busbw_GBps=5e-324", "busbw_GBps: 5e-324 is out of range"),
        ("alpha_us=1e400,busbw_GBps=10", "alpha_us: inf is not a finite number"),
    ],
)
@pytest.mark.parametrize("verb", ["run", "predict"])
def test_a_link_that_is_not_finite_and_in_range_is_refused(capsys, link, named, verb):
    """Attack: ``--link alpha_us=nan`` / ``inf`` / ``5e-324`` / ``1e400`` accepted by run and predict; an
    inf link stored ``case_model_step_time_ms = inf``."""
    if verb == "run":
        argv = ["run", REPO / "scenarios" / "quickstart.yaml", "--dry-run", "--link", link]
    else:
        argv = ["predict", "--model", "decoder-tiny", "--world-size", "2", "--method", "emulated"]
        argv += ["--device", "cpu", "--link", link]
    code, text = cli(capsys, *argv)
    one_line_exit_2(code, text, f"--link '{link}'", named)


def test_a_cached_probe_with_an_infinite_link_is_measured_again(tmp_path):
    """A run directory's ``comm_probe/gloo_n2.json`` is a cache read back: an inf or NaN link in it, or
    a link planted there, is not used."""
    from fsdpbench.pipeline.comm_probe import _cached_probe

    path = tmp_path / "gloo_n2.json"
    good = {
        "link": {"name": "gloo", "alpha_us": 50.0, "busbw_GBps": 1.0, "per_kind": [["all_reduce", 40.0, 2.0]]}
    }
    path.write_text(json.dumps(good))
    assert _cached_probe(path) == good
    for alpha, busbw in ((float("inf"), 1.0), (50.0, float("nan")), (50.0, 1e-300)):
        path.write_text(json.dumps({"link": {"name": "gloo", "alpha_us": alpha, "busbw_GBps": busbw}}))
        assert _cached_probe(path) is None
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps(good))
    assert _cached_probe(path) is None


# ---- the expansion is bounded in time ---------------------------------------------------------------


def test_exclude_rules_times_points_past_the_bound_are_refused(tmp_path, capsys):
    """Attack: 10,000 sweep points × 33,000 ``exclude`` rules in a 462 KB file (both size limits
    respected): ``--dry-run`` still running after 120 s. Rules over as many different sets of keys as
    the bound allows per point are refused in one line (here 1,001 × 1,000 points)."""
    keys = ["seed", "steps", "warmup_steps", "memory_steps", "profile_steps", "bare_steps", "time_blocks"]
    keys += ["prefetch", "time_block_steps", "lr", "timeout_s", "nvml_interval_s"]
    import itertools

    key_sets = [c for r in (1, 2, 3, 4, 5) for c in itertools.combinations(keys, r)][:1001]
    rules = "\n".join("  - {" + ", ".join(f"{k}: 1" for k in ks) + "}" for ks in key_sets)
    path = tmp_path / "s.yaml"
    path.write_text(
        "name: many-rules\ndefaults: {model: mlp-tiny, strategy: ddp, world_size: 1, device: cpu}\n"
        f"sweep:\n  batch_size: {list(range(1, 41))}\n  seq_len: {list(range(1, 26))}\nexclude:\n{rules}\n"
    )
    code, text = cli(capsys, "run", path, "--dry-run")
    one_line_exit_2(code, text, "s.yaml", "exclude: 1,001 rules (1,001 sets of keys) × 1,000 sweep points")


def test_exclude_rules_are_matched_through_an_index_as_the_rules_read():
    """33,000 rules over one set of keys cost one look-up per point, and drop exactly the points a
    rule-by-rule reading drops (lists of values, model arguments and list-valued fields included)."""
    from fsdpbench.pipeline.scenario import _Exclusion, _matches

    rules = [{"seed": i} for i in range(33_000)]
    rules += [{"batch_size": [2, 3], "model_args.n_layers": 4}, {"wrap_classes": [["Block"]]}]
    rules += [{"seq_len": list(range(40))} | {"steps": list(range(40))}]  # 1,600 combinations: kept as a rule
    exclusion = _Exclusion(rules)
    assert exclusion.checks_per_point == 4
    points = [
        {"seed": 7},
        {"seed": 40_000},
        {"batch_size": 3, "model_args": {"n_layers": 4}},
        {"batch_size": 3, "model_args": {"n_layers": 5}},
        {"wrap_classes": ["Block"]},
        {"wrap_classes": ["Other"]},
        {"seq_len": 5, "steps": 39},
        {"seq_len": 5, "steps": 40},
        {"seed": True},  # YAML's true equals 1, as it did rule by rule
    ]
    expected = [any(_matches(r, p) for r in rules) for p in points]
    assert (
        [exclusion.matches(p) for p in points]
        == expected
        == [True, False, True, False, True, False, True, False, True]
    )
