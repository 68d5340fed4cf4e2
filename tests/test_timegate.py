"""The statistical step-time gate: the t test on launches, the U test on blocks, the verdict, the baseline's
samples by launch, --pool and --repeat, and the load beyond which the time is not judged."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from fsdpbench.analysis.regress import SAMPLED, build_baseline, compare
from fsdpbench.analysis.timegate import (
    BLOCKS,
    LAUNCHES,
    MAX_OTHER_LOAD,
    bootstrap_effect,
    mann_whitney_greater,
    t_quantile,
    t_sf,
    time_verdict,
)
from fsdpbench.core.schema import STEP_TIME_REF_OTHER_LOAD
from fsdpbench.engine.reference import block_ratios, other_load_share, ratio_series
from tests.test_regress import DDP, ZERO3, case_rows, cli, write_run

BASE = [1.00, 1.02, 0.98, 1.05, 0.97, 1.01, 0.99, 1.03, 1.00, 0.96]


# ---- the statistics -------------------------------------------------------------------------------


def test_mann_whitney_by_hand():
    # now = {4,5,6} beats base = {1,2,3} in all 9 pairs: U = 9, mean 4.5, var = 3*3/12*7 = 5.25,
    # z = (9 - 4.5 - 0.5)/sqrt(5.25) = 1.7457 -> one-sided p = 0.04043
    assert mann_whitney_greater([4, 5, 6], [1, 2, 3]) == pytest.approx(0.04043, abs=1e-5)
    assert mann_whitney_greater([1, 2, 3], [4, 5, 6]) == pytest.approx(1 - 0.04043 + 0.0, abs=0.03)
    assert mann_whitney_greater([2, 2, 2], [2, 2, 2]) == 1.0  # all tied: no evidence
    assert mann_whitney_greater([], [1.0]) == 1.0


def test_mann_whitney_agrees_with_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    now, base = [1, 1, 2, 2, 3, 3, 3, 4.5], [1, 2, 2, 2, 1, 0, 2.5]
    want = stats.mannwhitneyu(now, base, alternative="greater", method="asymptotic").pvalue
    assert mann_whitney_greater(now, base) == pytest.approx(want, rel=1e-9)


def test_verdict_needs_both_effect_and_significance():
    small = time_verdict([x * 1.05 for x in BASE], BASE, 0.10)  # consistent, but under 10%
    assert small.p_value < 0.05 and not small.regressed
    noisy = time_verdict([0.7, 1.6, 0.9, 1.8], BASE, 0.10)  # median up 25%, 4 wild samples
    assert noisy.effect > 0.10 and noisy.p_value > 0.05 and not noisy.regressed
    slow = time_verdict([x * 1.15 for x in BASE], BASE, 0.10)
    assert slow.regressed and slow.effect == pytest.approx(0.15) and slow.low > 0.05
    assert slow.level == BLOCKS  # one launch on each side: no run-to-run variance to test against
    assert (
        "effect +15.0% (95% CI" in slow.describe()
        and "Mann–Whitney over blocks, n=10 vs 10" in slow.describe()
    )


def test_student_t_agrees_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    for t, df in [(2.0, 3), (0.5, 10), (-1.2, 5), (3.5, 1), (1.7, 30), (0.0, 4)]:
        assert t_sf(t, df) == pytest.approx(stats.t.sf(t, df), rel=1e-9, abs=1e-12)
    assert t_quantile(0.975, 4) == pytest.approx(stats.t.ppf(0.975, 4), rel=1e-9)


def test_launches_are_the_unit_where_there_are_three():
    """Three baseline launches against one: a t test on the launches' log medians, by hand."""
    import math
    import statistics

    base = [[1.0, 1.02, 0.98], [1.04, 1.06, 1.05], [0.97, 0.96, 0.98]]
    now = [[1.25, 1.3, 1.2]]
    v = time_verdict(now, base, 0.10)
    x = [math.log(statistics.median(b)) for b in base]
    diff = math.log(1.25) - statistics.fmean(x)
    se = math.sqrt(sum((a - statistics.fmean(x)) ** 2 for a in x) / 2 * (1 + 1 / 3))
    assert v.level == LAUNCHES and (v.n_now, v.n_base) == (1, 3)
    assert v.effect == pytest.approx(math.exp(diff) - 1)
    assert v.p_value == pytest.approx(t_sf(diff / se, 2))
    assert v.regressed and "t test on launch medians, 1 launch(es) vs 3" in v.describe()
    # the same shift within the launches' own spread is not significant: run-to-run variance counts
    wide = [[level + 0.001 * i for i in range(10)] for level in (0.85, 1.0, 1.12)]
    now = [[1.15 + 0.001 * i for i in range(10)]]
    noisy = time_verdict(now, wide, 0.10)
    assert noisy.effect > 0.10 and noisy.p_value > 0.05 and not noisy.regressed
    # pooled as if independent, the blocks would have called it
    assert mann_whitney_greater(now[0], [y for b in wide for y in b]) < 1e-4


def test_bootstrap_interval_is_seeded_and_brackets_the_effect():
    now = [x * 1.2 for x in BASE]
    assert bootstrap_effect(now, BASE) == bootstrap_effect(now, BASE)
    low, high = bootstrap_effect(now, BASE)
    assert low < 0.2 < high


def test_block_ratios_use_the_slowest_rank_per_pair_and_cpu_time_on_cpu():
    # two ranks, 4 pairs, blocks of 2: block 1 = (12 + 10)/(5 + 6), block 2 = (20 + 10)/(10 + 5)
    steps = [[12, 10, 20, 8], [11, 9, 18, 10]]
    refs = [[5, 6, 10, 5], [4, 5, 9, 4]]
    assert block_ratios(steps, refs, 2) == pytest.approx([22 / 11, 30 / 15])
    assert block_ratios(steps, refs, 3) == pytest.approx([42 / 21])  # an incomplete block is dropped
    rank = {
        "paired_step_ms": [9.0],
        "paired_ref_ms": [3.0],
        "paired_step_cpu_ms": [4.0],
        "paired_ref_cpu_ms": [2.0],
    }
    assert ratio_series(rank, "cpu") == ([4.0], [2.0])
    assert ratio_series(rank, "cuda") == ([9.0], [3.0])


def test_other_load_is_the_machine_less_the_case_median_block():
    # two ranks read the machine 0.9, 0.5 and 0.7 busy in three blocks and used 0.2 each of its cores:
    # others kept 0.5, 0.1, 0.3 of it busy; the median block's 0.3
    ranks = [
        {"paired_block_busy_share": [0.9, 0.5, 0.7], "paired_block_own_share": [0.2, 0.2, 0.2]},
        {"paired_block_busy_share": [0.9, 0.5, 0.7], "paired_block_own_share": [0.2, 0.2, 0.2]},
    ]
    assert other_load_share(ranks, "cpu") == pytest.approx(0.3)
    assert other_load_share(ranks, "cuda") is None  # wall-time ratios on GPUs: judged as they are
    assert other_load_share([{"paired_block_own_share": [0.2]}], "cpu") is None  # not read (not Linux)


# ---- in regress: samples in the baseline, the verdict per case, --pool, --repeat -----------------


def sampled_frame(
    zero3_samples: list[float],
    ddp_samples: list[float] = BASE,
    zero3_ms: float = 50.0,
    tuning: str = "none",
    other_load: float = 0.0,
):
    rows = case_rows(
        DDP.replace(host_tuning=tuning),
        peak=[2000, 2000],
        step_ms=20.0,
        **{SAMPLED: ddp_samples, STEP_TIME_REF_OTHER_LOAD: other_load},
    )
    rows += case_rows(
        ZERO3.replace(host_tuning=tuning),
        peak=[1000, 1000],
        step_ms=zero3_ms,
        **{SAMPLED: zero3_samples, STEP_TIME_REF_OTHER_LOAD: other_load},
    )
    return pd.DataFrame(rows)


def test_samples_gate_time_and_single_numbers_only_warn():
    zero3 = [x * 2 for x in BASE]
    baseline = json.loads(json.dumps(build_baseline(sampled_frame(zero3))))
    assert baseline["cases"][ZERO3.case_id]["metrics"][SAMPLED] == [sorted(zero3)]  # one launch
    # the ratio to the ddp case doubles (the old rule's false alarm); the samples did not move
    result = compare(baseline, sampled_frame(zero3, zero3_ms=100.0))
    rec = result.records.set_index(["case_id", "metric"])
    assert rec.loc[(ZERO3.case_id, "step_time_ratio"), "verdict"] == "warn"
    assert rec.loc[(ZERO3.case_id, SAMPLED), "verdict"] == "ok" and result.passed
    # the samples move by 15%: fails, with effect, interval and p-value
    result = compare(baseline, sampled_frame([x * 1.15 for x in zero3]))
    row = result.records.set_index(["case_id", "metric"]).loc[(ZERO3.case_id, SAMPLED)]
    assert not result.passed and row["verdict"] == "regressed" and row["change"] == pytest.approx(0.15)
    assert row["p_value"] < 0.01 and row["effect_low"] > 0 and "Mann–Whitney over blocks" in row["note"]
    # a run without samples: missing, failing
    no_samples = sampled_frame(zero3).drop(columns=[SAMPLED])
    row = compare(baseline, no_samples).records.set_index(["case_id", "metric"]).loc[(ZERO3.case_id, SAMPLED)]
    assert row["verdict"] == "missing" and row["fails"]


def test_pool_joins_samples_of_other_runs_each_a_launch(tmp_path):
    base = tmp_path / "b.json"
    a = write_run(tmp_path / "a", sampled_frame(BASE))
    b = write_run(tmp_path / "b", sampled_frame([2.0, 2.0]))
    assert cli(a, "--write-baseline", base, "--pool", b) == 0
    assert json.loads(base.read_text())["cases"][ZERO3.case_id]["metrics"][SAMPLED] == [
        sorted(BASE),
        [2.0, 2.0],
    ]


def test_a_baseline_of_the_earlier_method_is_not_comparable_on_time(tmp_path):
    """Format 2 and older: flat samples of process CPU time (gloo's loop spin in): never judged against
    the run's work-CPU samples; memory still is."""
    baseline = json.loads(json.dumps(build_baseline(sampled_frame(BASE))))
    baseline["format_version"] = 2
    baseline["cases"][ZERO3.case_id]["metrics"][SAMPLED] = BASE  # flat, as those versions wrote it
    result = compare(baseline, sampled_frame([x * 2 for x in BASE]))
    row = result.records.set_index(["case_id", "metric"]).loc[(ZERO3.case_id, SAMPLED)]
    assert row["verdict"] == "not comparable" and not row["fails"] and result.passed
    assert any("earlier method" in n or "process CPU time" in n for n in result.notes)


def test_time_is_not_judged_beyond_the_rated_load_and_says_so():
    baseline = json.loads(json.dumps(build_baseline(sampled_frame(BASE))))
    busy = sampled_frame([x * 1.5 for x in BASE], other_load=MAX_OTHER_LOAD + 0.2)
    result = compare(baseline, busy)
    row = result.records.set_index(["case_id", "metric"]).loc[(ZERO3.case_id, SAMPLED)]
    assert row["verdict"] == "not compared" and not row["fails"] and "not judged" in row["note"]
    assert any("step time not judged in 2 case(s)" in n for n in result.notes)
    from fsdpbench.commands.regress import verdict_line

    assert verdict_line(result).startswith("PASS") and "step time not judged in 2 case(s)" in verdict_line(
        result
    )
    # within the rated load the same samples fail
    within = sampled_frame([x * 1.5 for x in BASE], other_load=MAX_OTHER_LOAD - 0.1)
    assert not compare(baseline, within).passed


def test_repeat_judges_the_launches_before_failing(tmp_path, monkeypatch, capsys):
    """A case that looked 30% slower once is launched again; two normal launches: three launches against
    one, whose spread a bad minute belongs to, is not significant."""
    import fsdpbench.pipeline.launch
    import fsdpbench.store.results

    base = tmp_path / "b.json"
    pinned = ZERO3.replace(host_tuning="pin")
    assert cli(write_run(tmp_path / "a", sampled_frame(BASE, tuning="pin")), "--write-baseline", base) == 0
    bad_minute = write_run(tmp_path / "r", sampled_frame([x * 1.3 for x in BASE], tuning="pin"))
    launched, tunings = [], []

    def fake_launch(case, case_dir):
        launched.append((case.case_id, case_dir.name))
        tunings.append(case.host_tuning)  # the run's case, its tuning with it
        return object()

    def fake_rows(case, outcome, env):  # each re-launch measures the baseline's distribution again
        return pd.DataFrame([{SAMPLED: [x * 1.01 for x in BASE]}])

    class Outcome:
        status = "ok"

    monkeypatch.setattr(
        fsdpbench.pipeline.launch, "launch_case", lambda c, d: fake_launch(c, d) and Outcome()
    )
    monkeypatch.setattr(fsdpbench.store.results, "build_rows", fake_rows)
    assert cli(bad_minute, "--baseline", base, "--repeat", "0") == 1  # no repeat: fails
    capsys.readouterr()
    assert cli(bad_minute, "--baseline", base, "--repeat", "2") == 0
    assert launched == [(pinned.case_id, "repeat1"), (pinned.case_id, "repeat2")]
    assert tunings == ["pin", "pin"]  # as in the run, so that the samples pool
    assert f"re-measured {pinned.case_id} (2/2)" in capsys.readouterr().err
    # a real slowdown stays slow in the re-launches: still fails
    monkeypatch.setattr(
        fsdpbench.store.results,
        "build_rows",
        lambda c, o, e: pd.DataFrame([{SAMPLED: [x * 1.3 for x in BASE]}]),
    )
    assert cli(bad_minute, "--baseline", base, "--repeat", "2") == 1


def test_a_slower_case_not_yet_significant_is_re_launched_and_then_fails(tmp_path, monkeypatch):
    """Against a baseline of three launches that spread by ±12%, one launch 25% slower is not significant
    (t test, 2 degrees of freedom): it is re-launched all the same, and three slow launches fail."""
    import fsdpbench.pipeline.launch
    import fsdpbench.store.results

    base = tmp_path / "b.json"
    runs = [
        write_run(tmp_path / f"a{i}", sampled_frame([x * s for x in BASE]))
        for i, s in enumerate((0.88, 1, 1.12))
    ]
    assert cli(runs[0], "--write-baseline", base, "--pool", runs[1], "--pool", runs[2]) == 0
    slow = write_run(tmp_path / "r", sampled_frame([x * 1.25 for x in BASE]))
    baseline = json.loads(base.read_text())
    first = compare(baseline, sampled_frame([x * 1.25 for x in BASE]))
    row = first.records.set_index(["case_id", "metric"]).loc[(ZERO3.case_id, SAMPLED)]
    assert (
        row["change"] > 0.10 and row["p_value"] > 0.05 and row["verdict"] == "ok"
    )  # slower, not yet significant
    launched = []

    class Outcome:
        status = "ok"

    monkeypatch.setattr(
        fsdpbench.pipeline.launch, "launch_case", lambda c, d: launched.append(c) or Outcome()
    )
    monkeypatch.setattr(
        fsdpbench.store.results,
        "build_rows",
        lambda c, o, e: pd.DataFrame([{SAMPLED: [x * 1.25 * (1 + 0.01 * len(launched)) for x in BASE]}]),
    )
    assert cli(slow, "--baseline", base, "--repeat", "2") == 1  # three slow launches against three
    assert len(launched) == 2 and {c.case_id for c in launched} == {ZERO3.case_id}


def test_a_run_from_before_tuning_was_recorded_is_re_measured_as_its_launcher_tuned(tmp_path, monkeypatch):
    import fsdpbench.pipeline.launch
    import fsdpbench.store.results

    base = tmp_path / "b.json"
    assert cli(write_run(tmp_path / "a", sampled_frame(BASE, tuning="pin")), "--write-baseline", base) == 0
    slow = sampled_frame([x * 1.3 for x in BASE]).drop(columns=["host_tuning"]).assign(gloo_loops_idle=0)
    tunings = []

    class Outcome:
        status = "ok"

    monkeypatch.setattr(
        fsdpbench.pipeline.launch, "launch_case", lambda c, d: tunings.append(c.host_tuning) or Outcome()
    )
    monkeypatch.setattr(
        fsdpbench.store.results, "build_rows", lambda c, o, e: pd.DataFrame([{SAMPLED: BASE}])
    )
    assert cli(write_run(tmp_path / "r", slow), "--baseline", base, "--repeat", "2") == 0
    assert tunings == ["pin", "pin"]  # its CPU ranks were pinned then: re-measured pinned
