"""The regression gate: baseline round trip, each verdict on synthetic runs with known answers,
and — marked slow — real runs with deliberate regressions (tests/plugins/regressions.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest

from fsdpbench.analysis.regress import (
    BaselineError,
    Threshold,
    apply_strategy_map,
    build_baseline,
    compare,
    load_baseline,
    parse_threshold,
    resolve_threshold,
    write_baseline,
)
from fsdpbench.cli import build_parser
from fsdpbench.core import schema
from fsdpbench.core.case import Case
from fsdpbench.core.schema import RUN_CASE_ID
from tests.helpers import made_once, regression_named

PLUGINS = Path(__file__).parent / "plugins"
MACHINE = {"hostname": "ci-host", "device_name": "CPU: test (2 cores)", "torch_version": "2.13.0+cpu"}
DDP = Case(strategy="ddp", world_size=2, wrap="none", device="cpu", backend="gloo")
ZERO3 = Case(strategy="zero3", world_size=2, device="cpu", backend="gloo")
LOSSES = [6.4, 6.3, 6.2]


def case_rows(case: Case, *, peak: list[int], step_ms: float, losses=LOSSES, status="ok", error="", **extra):
    """One row per rank, with the real configuration columns of a results table."""
    rows = []
    for rank, p in enumerate(peak):
        rows.append(
            {
                **schema.case_to_columns(case),
                **MACHINE,
                "rank": rank,
                "status": status,
                "error": error,
                "case_status": status,
                "case_error": error,
                "mem_tracker_peak_bytes": p,
                "mem_tracker_model_states_bytes": 500,
                "mem_tracker_peak_buffers_bytes": 0,
                "case_step_time_ms": step_ms,
                "losses": list(losses),
                **extra,
            }
        )
    return rows


def run_frame(
    *, ddp_ms=20.0, zero3_ms=50.0, zero3_peak=(1000, 1000), zero3_losses=LOSSES, tuning="none", **extra
):
    rows = case_rows(DDP.replace(host_tuning=tuning), peak=[2000, 2000], step_ms=ddp_ms) + case_rows(
        ZERO3.replace(host_tuning=tuning), peak=list(zero3_peak), step_ms=zero3_ms, losses=zero3_losses
    )
    frame = pd.DataFrame(rows)
    for key, value in extra.items():
        frame[key] = value
    return frame


@pytest.fixture
def baseline():
    return json.loads(json.dumps(build_baseline(run_frame())))  # as it would be after a file round trip


def verdicts(result) -> dict[tuple[str, str], str]:
    return {(d.case_id, d.metric): d.verdict for d in result.differences}


# ---- the baseline -------------------------------------------------------------------------------


def test_a_case_comes_back_from_its_columns_with_its_case_id(tmp_path):
    cases = [
        DDP,
        ZERO3,
        Case(strategy="hsdp", world_size=4, shard_size=2, model_args={"n_layers": 3}),
        Case(
            strategy="zero2", wrap="classes", wrap_classes=("Block", "Embed"), strategy_args={"x": 1}, lr=3e-4
        ),
    ]
    for case in cases:
        row = pd.DataFrame([schema.case_to_columns(case)]).iloc[0]  # through pandas, as read from Parquet
        assert schema.case_from_columns(row).case_id == case.case_id
    # all the cases in one Parquet file: shard_size (None beside 2) comes back as a float column
    path = tmp_path / "rows.parquet"
    pd.DataFrame([schema.case_to_columns(c) for c in cases]).to_parquet(path)
    back = [schema.case_from_columns(r) for _, r in pd.read_parquet(path).iterrows()]
    assert [c.case_id for c in back] == [c.case_id for c in cases]
    assert back[2].shard_size == 2 and isinstance(back[2].shard_size, int) and back[0].shard_size is None


def test_baseline_holds_largest_rank_ratio_and_provenance(tmp_path):
    frame = run_frame(zero3_peak=(1000, 1300), commit="abc123", backend="gloo", device="cpu")
    path = tmp_path / "b.json"
    write_baseline(path, build_baseline(frame, {"env": {"cpu": "test"}, "command": "fsdpbench run x"}))
    text = path.read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=1, sort_keys=True) + "\n"  # sorted keys: reviewable diffs
    z = data["cases"][ZERO3.case_id]
    assert z["metrics"]["mem_tracker_peak_bytes"] == 1300  # the largest rank
    assert z["metrics"]["step_time_ratio"] == 2.5 and z["time_reference"] == DDP.case_id
    assert "step_time_ratio" not in data["cases"][DDP.case_id]["metrics"]  # the reference itself
    assert data["provenance"]["commit"] == "abc123" and data["provenance"]["torch_version"] == "2.13.0+cpu"
    assert data["machine"] == MACHINE
    assert data["thresholds"]["mem_tracker_peak_bytes"] == {"tolerance": 0.01, "gate": "fail"}
    assert load_baseline(path)["thresholds"]["step_time_ratio"] == Threshold(tolerance=0.25)


def test_baseline_refuses_failed_cases():
    frame = pd.DataFrame(
        case_rows(DDP, peak=[1, 1], step_ms=1.0, status="failed", error="RuntimeError: boom")
    )
    with pytest.raises(BaselineError, match="RuntimeError: boom"):
        build_baseline(frame)


def test_load_baseline_errors_name_the_file_and_field(tmp_path):
    path = tmp_path / "b.json"
    path.write_text("{}")
    with pytest.raises(BaselineError, match="not a fsdpbench baseline"):
        load_baseline(path)
    data = build_baseline(run_frame())
    data["cases"][DDP.case_id]["metrics"]["mem_bogus_bytes"] = 1
    write_baseline(path, data)
    with pytest.raises(
        BaselineError, match=rf"cases\.{DDP.case_id}\.metrics.*'mem_bogus_bytes'.*allowed: memory"
    ):
        load_baseline(path)


# ---- verdicts -----------------------------------------------------------------------------------


def test_unchanged_run_passes(baseline):
    result = compare(baseline, run_frame())
    assert result.passed and set(result.records["verdict"]) == {"ok"}
    assert result.machine_matches and not result.notes


def test_times_under_another_host_tuning_are_not_comparable_and_the_rest_is_gated(baseline):
    assert {c["host_tuning"] for c in baseline["cases"].values()} == {"none"}  # each case says its own
    pinned = run_frame(tuning="pin", ddp_ms=20.0, zero3_ms=80.0)  # ids differ; zero3 "slower" by 60%
    result = compare(baseline, pinned)
    rec = result.records
    assert result.passed and set(rec["case_id"]) == {DDP.case_id, ZERO3.case_id}  # no "missing", no "new"
    assert set(rec[RUN_CASE_ID]) == {
        DDP.replace(host_tuning="pin").case_id,
        ZERO3.replace(host_tuning="pin").case_id,
    }
    times = rec[rec["kind"] == "time"]
    assert not times.empty and set(times["verdict"]) == {"not comparable"} and not times["fails"].any()
    assert set(times["note"]) == {"host tuning differs (baseline: none, now: pin)"}
    assert set(rec[rec["kind"] != "time"]["verdict"]) == {"ok"}  # memory, communication, losses: gated
    assert result.notes == [
        "not comparable: host tuning differs in 2 case(s) (baseline: none, now: pin): their step times are "
        "not compared, their memory, communication and losses are; to compare times, run with --set "
        "host_tuning=none or re-write the baseline (docs/ci.md)"
    ]
    # a memory regression under another tuning still fails
    worse = compare(baseline, run_frame(tuning="pin", zero3_peak=(1000, 1100)))
    assert not worse.passed and [d.metric for d in worse.failures] == ["mem_tracker_peak_bytes"]
    # and the same tuning on both sides is compared as before, whatever the tuning
    pinned_baseline = json.loads(json.dumps(build_baseline(run_frame(tuning="pin"))))
    assert compare(pinned_baseline, run_frame(tuning="pin")).passed
    assert not compare(pinned_baseline, run_frame(tuning="pin", zero3_ms=80.0)).passed


def test_the_renderers_print_the_not_comparable_verdicts_and_the_tuning_note(baseline):
    """Host tuning's verdicts are data in the DifferenceReport; the table, Markdown and JSON print them."""
    from fsdpbench.commands.regress import build_table, render_markdown, to_json, verdict_line

    report = compare(baseline, run_frame(tuning="pin", zero3_ms=80.0))
    differs = [d for d in report.differences if d.verdict == "not comparable"]
    assert differs and {d.kind for d in differs} == {"time"} and not any(d.fails for d in differs)
    assert {d.note for d in differs} == {"host tuning differs (baseline: none, now: pin)"}
    assert report.verdict_counts()["not comparable"] == len(differs)
    assert f"{len(differs)} not comparable" in verdict_line(report).splitlines()[-1]
    markdown = render_markdown(report, {}, "b.json", "run")
    assert "> not comparable: host tuning differs in 2 case(s) (baseline: none, now: pin)" in markdown
    assert markdown.count("not comparable | host tuning differs (baseline: none, now: pin) |") == len(differs)
    table = build_table(report, "b.json", "run")
    assert table.row_count == len(report.differences)
    data = to_json(report, "b.json", "run")
    assert data["notes"] == report.notes and data["passed"] is True
    assert sum(r["verdict"] == "not comparable" for r in data["records"]) == len(differs)


def test_a_baseline_from_before_tuning_was_recorded_is_read_as_its_launcher_tuned(baseline):
    # then every CPU rank was pinned, and its gloo loops idled where gloo_loops_idle says so
    for entry in baseline["cases"].values():
        del entry["host_tuning"]
    baseline["provenance"].update(device="cpu", gloo_loops_idle=False)
    untuned = compare(baseline, run_frame())
    assert untuned.passed and "(baseline: pin, now: none)" in untuned.notes[0]
    assert set(untuned.records[untuned.records["kind"] == "time"]["verdict"]) == {"not comparable"}
    pinned = compare(baseline, run_frame(tuning="pin", zero3_ms=80.0))  # as it was measured: compared
    assert not pinned.notes and not pinned.passed
    assert {d.case_id for d in pinned.failures} == {ZERO3.case_id}  # the baseline's id, not the run's
    baseline["provenance"]["gloo_loops_idle"] = True
    assert "(baseline: pin-idle-loops, now: pin)" in compare(baseline, run_frame(tuning="pin")).notes[0]
    baseline["provenance"]["gloo_loops_idle"] = "yes"  # a stranger's file: only true is true
    assert not compare(baseline, run_frame(tuning="pin")).notes
    baseline["provenance"]["device"] = "cuda"  # GPU ranks were never tuned
    assert not compare(baseline, run_frame()).notes


def test_a_run_from_before_tuning_was_recorded_is_read_as_its_launcher_tuned(baseline):
    legacy = run_frame().drop(columns=["host_tuning"]).assign(gloo_loops_idle=0)
    assert "(baseline: none, now: pin)" in compare(baseline, legacy).notes[0]
    assert (
        "(baseline: none, now: pin-idle-loops)"
        in compare(baseline, legacy.assign(gloo_loops_idle=1)).notes[0]
    )


def test_a_baselines_host_tuning_must_be_one_fsdpbench_knows(tmp_path):
    data = build_baseline(run_frame())
    data["cases"][DDP.case_id]["host_tuning"] = "turbo"
    path = tmp_path / "b.json"
    write_baseline(path, data)
    with pytest.raises(
        BaselineError, match=rf"cases\.{DDP.case_id}\.host_tuning: 'turbo'; expected one of none, pin"
    ):
        load_baseline(path)


def test_memory_over_tolerance_on_one_rank_fails_naming_case_and_metric(baseline):
    result = compare(baseline, run_frame(zero3_peak=(1000, 1011)))  # +1.1% on rank 1 > 1%
    assert not result.passed
    fail = result.failures[0]
    assert (fail.case_id, fail.metric, fail.verdict) == (ZERO3.case_id, "mem_tracker_peak_bytes", "regressed")
    assert fail.change == pytest.approx(0.011)
    assert compare(baseline, run_frame(zero3_peak=(1000, 1009))).passed  # +0.9%: within 1%


def test_memory_improvement_passes_unless_strict(baseline):
    frame = run_frame(zero3_peak=(900, 900))
    loose, strict = compare(baseline, frame), compare(baseline, frame, strict=True)
    assert loose.passed and verdicts(loose)[(ZERO3.case_id, "mem_tracker_peak_bytes")] == "improved"
    assert not strict.passed and "update the baseline" in strict.failures[0].note


def test_category_from_zero_is_a_regression(baseline):
    frame = run_frame()
    frame.loc[frame["strategy"] == "zero3", "mem_tracker_peak_buffers_bytes"] = 4
    result = compare(baseline, frame)
    fail = result.failures[0]
    assert (fail.metric, fail.baseline, fail.now) == ("mem_tracker_peak_buffers_bytes", 0, 4)
    assert math.isinf(fail.change)


def test_step_time_is_gated_as_a_ratio_within_the_run(baseline):
    # the whole machine 1.5x slower: the ratio is unchanged; the absolute time regressed (same machine)
    slower = verdicts(compare(baseline, run_frame(ddp_ms=30.0, zero3_ms=75.0)))
    assert slower[(ZERO3.case_id, "step_time_ratio")] == "ok"
    assert slower[(ZERO3.case_id, "case_step_time_ms")] == "regressed"
    # on another machine the absolute time is not compared at all
    other = compare(baseline, run_frame(ddp_ms=30.0, zero3_ms=75.0, hostname="elsewhere"))
    assert other.passed and not other.machine_matches
    assert verdicts(other)[(ZERO3.case_id, "case_step_time_ms")] == "not compared"
    assert "hostname: ci-host → elsewhere" in other.notes[0]
    # only zero3 slower: its ratio to ddp regressed (2.5 → 3.25, +30% > 25%)
    result = compare(baseline, run_frame(zero3_ms=65.0, hostname="elsewhere"))
    fail = result.failures[0]
    assert (fail.case_id, fail.metric) == (ZERO3.case_id, "step_time_ratio")
    assert fail.change == pytest.approx(0.3) and DDP.case_id in fail.note
    # a warn gate reports it without failing
    warned = compare(baseline, run_frame(zero3_ms=65.0, hostname="elsewhere"), gates={"time": "warn"})
    assert warned.passed and verdicts(warned)[(ZERO3.case_id, "step_time_ratio")] == "warn"


def test_harness_overhead_is_gated_on_the_same_machine_when_the_baseline_has_it(baseline):
    assert all(
        "harness_overhead_ratio" not in c["metrics"] for c in baseline["cases"].values()
    )  # no bare loop
    with_bare = json.loads(json.dumps(build_baseline(run_frame(harness_overhead_ratio=1.04))))
    assert with_bare["cases"][ZERO3.case_id]["metrics"]["harness_overhead_ratio"] == 1.04
    same = verdicts(compare(with_bare, run_frame(harness_overhead_ratio=1.05)))
    assert same[(ZERO3.case_id, "harness_overhead_ratio")] == "ok"
    costlier = compare(with_bare, run_frame(harness_overhead_ratio=1.40))  # +34.6% > 25%
    assert (
        verdicts(costlier)[(ZERO3.case_id, "harness_overhead_ratio")] == "regressed" and not costlier.passed
    )
    other = compare(with_bare, run_frame(harness_overhead_ratio=1.40, hostname="elsewhere"))
    assert verdicts(other)[(ZERO3.case_id, "harness_overhead_ratio")] == "not compared" and other.passed


def test_changed_loss_fails_in_either_direction(baseline):
    for delta in (+1e-3, -1e-3):
        result = compare(baseline, run_frame(zero3_losses=[6.4, 6.3, 6.2 + delta]))
        fail = result.failures[0]
        assert (fail.metric, fail.verdict) == ("losses", "changed")
        assert fail.change == pytest.approx(1e-3 / 6.2)
    assert compare(baseline, run_frame(zero3_losses=[6.4, 6.3, 6.2 + 1e-6])).passed  # float noise
    assert not compare(baseline, run_frame(zero3_losses=[6.4, 6.3])).passed  # fewer steps


def test_missing_failed_and_new_cases(baseline):
    zero2 = Case(strategy="zero2", world_size=2, device="cpu", backend="gloo")
    ddp_only = pd.DataFrame(case_rows(DDP, peak=[2000, 2000], step_ms=20.0))
    missing = compare(baseline, ddp_only)
    assert verdicts(missing)[(ZERO3.case_id, "case")] == "missing" and not missing.passed

    failed = pd.DataFrame(
        case_rows(DDP, peak=[2000, 2000], step_ms=20.0)
        + case_rows(ZERO3, peak=[0, 0], step_ms=float("nan"), status="timeout", error="timed out after 120 s")
    )
    result = compare(baseline, failed)
    fail = result.failures[0]
    assert (fail.case_id, fail.verdict) == (ZERO3.case_id, "failed") and "timed out after 120 s" in fail.note

    new = pd.concat([run_frame(), pd.DataFrame(case_rows(zero2, peak=[1, 1], step_ms=1.0))])
    result = compare(baseline, new)
    assert result.passed and verdicts(result)[(zero2.case_id, "case")] == "new"


def test_thresholds_precedence_and_parsing(baseline):
    assert parse_threshold("memory=2%") == ("memory", Threshold(tolerance=0.02))
    assert parse_threshold("step_time_ratio=0.5:warn") == (
        "step_time_ratio",
        Threshold(tolerance=0.5, gate="warn"),
    )
    for bad in ("memory", "mem_bogus=1%", "memory=lots", "memory=1%:sometimes"):
        with pytest.raises(BaselineError):
            parse_threshold(bad)
    cli, case, top = (
        {"memory": Threshold(tolerance=0.05)},
        {"mem_tracker_peak_bytes": Threshold(tolerance=0.02)},
        {},
    )
    assert resolve_threshold("mem_tracker_peak_bytes", [cli, case, top]).tolerance == 0.05
    assert resolve_threshold("mem_tracker_peak_bytes", [{}, case, top]).tolerance == 0.02
    assert resolve_threshold("losses", [{}, {}, {}]).tolerance == 1e-4
    # a per-case threshold in the baseline file loosens only that case
    baseline["cases"][ZERO3.case_id]["thresholds"] = {"mem_tracker_peak_bytes": Threshold(tolerance=0.05)}
    assert compare(baseline, run_frame(zero3_peak=(1030, 1030))).passed


def test_strategy_map_matches_a_plugin_to_the_baseline_strategy(baseline):
    plugin = ZERO3.replace(strategy="regressions:ParamCopyZero3")
    frame = pd.DataFrame(
        case_rows(DDP, peak=[2000, 2000], step_ms=20.0) + case_rows(plugin, peak=[1500, 1500], step_ms=50.0)
    )
    mapped = apply_strategy_map(frame, {"regressions:ParamCopyZero3": "zero3"})
    assert set(mapped["case_id"]) == {DDP.case_id, ZERO3.case_id}
    fail = compare(baseline, mapped).failures[0]
    assert (fail.case_id, fail.metric, fail.run_case_id) == (
        ZERO3.case_id,
        "mem_tracker_peak_bytes",
        plugin.case_id,
    )
    with pytest.raises(BaselineError, match="not in the run"):
        apply_strategy_map(frame, {"zero9": "zero3"})
    both = pd.concat([frame, pd.DataFrame(case_rows(ZERO3, peak=[1000, 1000], step_ms=50.0))])
    with pytest.raises(BaselineError, match=f"would both be compared as {ZERO3.case_id}"):
        apply_strategy_map(both, {"regressions:ParamCopyZero3": "zero3"})


# ---- the command ----------------------------------------------------------------------------------


def cli(*argv: str) -> int:
    args = build_parser().parse_args(["regress", *map(str, argv)])
    return args._main(args)


def write_run(path: Path, frame: pd.DataFrame) -> Path:
    path.mkdir(parents=True)
    frame.to_parquet(path / "results.parquet", index=False)
    return path


def test_command_writes_baseline_then_gates(tmp_path, capsys):
    base = tmp_path / "baseline.json"
    assert cli(write_run(tmp_path / "a", run_frame()), "--write-baseline", base) == 0
    assert cli(write_run(tmp_path / "b", run_frame()), "--baseline", base) == 0
    assert "PASS" in capsys.readouterr().out

    bad = write_run(tmp_path / "c", run_frame(zero3_peak=(1000, 1100)))
    md, js = tmp_path / "comment.md", tmp_path / "regress.json"
    assert cli(bad, "--baseline", base, "--markdown", md, "--json", js) == 1
    out = capsys.readouterr().out
    assert regression_named(out, ZERO3.case_id, "mem_tracker_peak_bytes", "regressed") and "FAIL" in out
    assert "fsdpbench regress: FAIL" in md.read_text() and ZERO3.case_id in md.read_text()
    report = json.loads(js.read_text())
    assert report["passed"] is False
    assert [r["metric"] for r in report["records"] if r["fails"]] == ["mem_tracker_peak_bytes"]
    # a looser threshold on the command line lets it pass
    assert cli(bad, "--baseline", base, "--threshold", "memory=20%") == 0


def test_command_bad_input_exits_2(tmp_path, capsys):
    assert cli(tmp_path / "nothing", "--baseline", tmp_path / "none.json") == 2
    assert "cannot read baseline" in capsys.readouterr().err
    assert (
        cli(
            write_run(tmp_path / "a", run_frame()),
            "--write-baseline",
            tmp_path / "b.json",
            "--threshold",
            "speed=1%",
        )
        == 2
    )
    assert "unknown metric 'speed'" in capsys.readouterr().err


# ---- real runs with deliberate regressions (tests/plugins/regressions.py) -------------------------

SCENARIO = """
name: regress-test
defaults: {{model: decoder-tiny, world_size: 2, warmup_steps: 1, steps: 3, device: cpu, backend: gloo}}
sweep:
  strategy: {strategies}
"""


def run_scenario(tmp: Path, name: str, strategies: list[str]) -> Path:
    (tmp / f"{name}.yaml").write_text(SCENARIO.format(strategies=json.dumps(strategies)))
    out = tmp / name
    args = build_parser().parse_args(
        # --link none: regress reads no modelled step time (no gloo probe, no compute twins)
        ["run", str(tmp / f"{name}.yaml"), "--out", str(out), "--no-report", "--allow-plugins"]
        + ["--link", "none"]
    )
    assert args._main(args) == 0
    return out


@pytest.fixture(scope="module")
def plugin_path():
    # the rank processes get this sys.path from the fork server's launch data (see regressions.py)
    sys.path.insert(0, str(PLUGINS))
    yield
    sys.path.remove(str(PLUGINS))


@pytest.fixture(scope="module")
@made_once
def real_baseline(tmp_path_factory, plugin_path):
    tmp = tmp_path_factory.mktemp("regress")
    run = run_scenario(tmp, "base", ["ddp", "zero3"])
    assert cli(run, "--write-baseline", tmp / "baseline.json") == 0
    return tmp, tmp / "baseline.json"


@pytest.mark.slow
def test_unchanged_rerun_passes(real_baseline, capsys):
    tmp, base = real_baseline
    rerun = run_scenario(tmp, "rerun", ["ddp", "zero3"])
    capsys.readouterr()
    # time only warns here: a re-run on a busy 2-core machine may be 50% slower; memory and
    # losses are deterministic and must match
    assert (
        cli(rerun, "--baseline", base, "--time-gate", "warn", "--strict", "--json", tmp / "rerun.json") == 0
    )
    records = pd.DataFrame(json.loads((tmp / "rerun.json").read_text())["records"])
    memory, loss = records[records["kind"] == "memory"], records[records["kind"] == "loss"]
    assert len(memory) == 2 * 14 and (memory["change"] == 0).all()  # 12 categories, peak, model states
    assert len(loss) == 2 and (loss["change"] < 1e-6).all()  # the baseline keeps 7 significant digits


@pytest.mark.slow
def test_extra_param_copy_fails_on_memory(real_baseline, capsys):
    tmp, base = real_baseline
    run = run_scenario(tmp, "copy", ["ddp", "regressions:ParamCopyZero3", "regressions:HiddenParamCopyZero3"])
    capsys.readouterr()
    code = cli(
        run,
        "--baseline",
        base,
        "--map-strategy",
        "regressions:ParamCopyZero3=zero3",
        "--time-gate",
        "warn",
        "--json",
        tmp / "copy.json",
    )
    out = capsys.readouterr().out
    assert code == 1
    zero3_id = ZERO3.replace(warmup_steps=1, steps=3).case_id
    assert regression_named(out, zero3_id, "mem_tracker_peak_bytes", "regressed")
    records = pd.DataFrame(json.loads((tmp / "copy.json").read_text())["records"]).set_index(
        ["case_id", "metric"]
    )
    buffers = records.loc[(zero3_id, "mem_tracker_peak_buffers_bytes")]
    assert (buffers["baseline"], buffers["now"]) == (0, 172_352 * 4)  # a full fp32 copy of decoder-tiny
    assert set(records[records["fails"]].index.get_level_values("metric")) == {
        "mem_tracker_peak_bytes",
        "mem_tracker_peak_buffers_bytes",
    }
    # the same copy in a plain attribute is invisible to the tracker: a known blind spot (docs/ci.md)
    frame = pd.read_parquet(run / "results.parquet")
    hidden = frame[frame["strategy"] == "regressions:HiddenParamCopyZero3"]["mem_tracker_peak_bytes"].max()
    assert hidden == json.loads(base.read_text())["cases"][zero3_id]["metrics"]["mem_tracker_peak_bytes"]
    hidden_id = frame[frame["strategy"] == "regressions:HiddenParamCopyZero3"]["case_id"].iloc[0]
    assert records.loc[(hidden_id, "case"), "verdict"] == "new"  # reported, not failed


@pytest.mark.slow
def test_sleep_per_step_fails_on_step_time_ratio(real_baseline, capsys):
    tmp, base = real_baseline
    run = run_scenario(tmp, "sleepy", ["ddp", "regressions:SleepyZero3"])
    capsys.readouterr()
    code = cli(
        run,
        "--baseline",
        base,
        "--map-strategy",
        "regressions:SleepyZero3=zero3",
        "--json",
        tmp / "sleepy.json",
    )
    out = capsys.readouterr().out
    assert code == 1
    zero3_id = ZERO3.replace(warmup_steps=1, steps=3).case_id
    assert regression_named(out, zero3_id, "step_time_ratio", "regressed")
    records = pd.DataFrame(json.loads((tmp / "sleepy.json").read_text())["records"])
    mine = records[records["case_id"] == zero3_id]
    assert mine[mine["kind"].isin(["memory", "loss"])]["verdict"].eq("ok").all()  # only time moved


def test_the_renderers_print_a_difference_report_built_by_hand():
    """The comparison is data (DifferenceReport); the table, Markdown and JSON are drawn from it alone."""
    from fsdpbench.analysis.regress import DifferenceReport, MetricDifference
    from fsdpbench.commands.regress import build_table, render_markdown, to_json, verdict_line

    regressed = MetricDifference(
        case_id="c1",
        metric="mem_tracker_peak_bytes",
        kind="memory",
        baseline=100,
        now=110,
        change=0.1,
        tolerance=0.01,
        gate="fail",
        verdict="regressed",
        fails=True,
        note="",
        run_case_id="c1",
    )
    same = MetricDifference(
        case_id="c2",
        metric="comm_total_bytes",
        kind="comm",
        baseline=7,
        now=7,
        change=0.0,
        tolerance=0.01,
        gate="fail",
        verdict="ok",
        fails=False,
        note="",
        run_case_id="c2",
        mode="emulated",
    )
    report = DifferenceReport(differences=[regressed, same], machine_matches=True, notes=["a note"])
    assert not report.passed and report.failures == [regressed] and report.notable() == [regressed]
    assert report.verdict_counts() == {"ok": 1, "regressed": 1}
    assert verdict_line(report) == (
        "REGRESSION c1 mem_tracker_peak_bytes: regressed (100 B → 110 B, +10.00%)\n"
        "FAIL: 2 compared (1 ok, 1 regressed)"
    )
    markdown = render_markdown(report, {}, "b.json", "run")
    assert markdown.startswith("### ❌ fsdpbench regress: FAIL\n") and "> a note" in markdown
    assert "| c1 | mem_tracker_peak_bytes | 100 B | 110 B | +10.00% | 1% fail | regressed ✗ |  |" in markdown
    assert "| c2 [emulated] | comm_total_bytes | 7 B | 7 B | +0.00% | 1% fail | ok |  |" in markdown
    assert build_table(report, "b.json", "run").row_count == 2
    record = to_json(report, "b.json", "run")["records"][0]
    assert record == {
        "case_id": "c1",
        "metric": "mem_tracker_peak_bytes",
        "kind": "memory",
        "baseline": 100,
        "now": 110,
        "change": 0.1,
        "tolerance": 0.01,
        "gate": "fail",
        "verdict": "regressed",
        "fails": True,
        "note": "",
        "run_case_id": "c1",
        "effect_low": None,
        "effect_high": None,
        "p_value": None,
        "mode": "real",
    }


def test_the_terminal_shows_the_verdict_first_and_only_what_changed_at_80_columns(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "80")  # rich's console width, as in a CI log
    base = tmp_path / "base.json"
    assert cli(write_run(tmp_path / "a", run_frame()), "--write-baseline", base) == 0
    capsys.readouterr()
    bad = write_run(tmp_path / "c", run_frame(zero3_peak=(1000, 1100)))
    assert cli(bad, "--baseline", base, "--json", tmp_path / "all.json") == 1
    text = capsys.readouterr().out
    lines = text.splitlines()
    # the verdict first, the case by its name (what tells it from the run's others) and its id's hash,
    # then its id on a line of its own
    tail = ZERO3.case_id.rsplit("_", 1)[-1]
    assert lines[0].startswith(f"REGRESSION zero3 n2 ({tail}) mem_tracker_peak_bytes: regressed (1,000 B")
    assert lines[2] == f"  case {ZERO3.case_id}" and lines[3].startswith("FAIL: ")
    assert regression_named(text, ZERO3.case_id, "mem_tracker_peak_bytes", "regressed")
    assert max(len(x) for x in lines) <= 80  # every line, the table's and the verdict's
    table = [x for x in lines if x[:1] in "┏┃┡│└━┗╇"]
    assert table and f"zero3 n2 ({tail})" in text
    assert "ddp n2" not in "".join(table)  # DDP's metrics did not move: none of its rows is shown
    records = json.loads((tmp_path / "all.json").read_text())["records"]
    unchanged = len(records) - sum(r["verdict"] != "ok" or (r["change"] or 0) != 0 for r in records)
    assert unchanged > 0 and f"{unchanged} metric(s) unchanged and within tolerance, not shown" in " ".join(
        lines
    )
