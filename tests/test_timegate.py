"""The statistical step-time gate: the U test, the verdict, the baseline's samples, --pool and --repeat."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from fsdpbench.metrics.reference import block_ratios, ratio_series
from fsdpbench.regress import SAMPLED, build_baseline, compare
from fsdpbench.timegate import bootstrap_effect, mann_whitney_greater, time_verdict
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
    assert noisy.effect > 0.10 and noisy.p_value > 0.01 and not noisy.regressed
    slow = time_verdict([x * 1.15 for x in BASE], BASE, 0.10)
    assert slow.regressed and slow.effect == pytest.approx(0.15) and slow.low > 0.05
    assert "effect +15.0% (95% CI" in slow.describe() and "Mann–Whitney, n=10 vs 10" in slow.describe()


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
    rank = {"paired_step_ms": [9.0], "paired_ref_ms": [3.0], "paired_step_cpu_ms": [4.0], "paired_ref_cpu_ms": [2.0]}
    assert ratio_series(rank, "cpu") == ([4.0], [2.0])
    assert ratio_series(rank, "cuda") == ([9.0], [3.0])


# ---- in regress: samples in the baseline, the verdict per case, --pool, --repeat -----------------


def sampled_frame(zero3_samples: list[float], ddp_samples: list[float] = BASE, zero3_ms: float = 50.0):
    rows = case_rows(DDP, peak=[2000, 2000], step_ms=20.0, **{SAMPLED: ddp_samples})
    rows += case_rows(ZERO3, peak=[1000, 1000], step_ms=zero3_ms, **{SAMPLED: zero3_samples})
    return pd.DataFrame(rows)


def test_samples_gate_time_and_single_numbers_only_warn():
    zero3 = [x * 2 for x in BASE]
    baseline = json.loads(json.dumps(build_baseline(sampled_frame(zero3))))
    assert baseline["cases"][ZERO3.case_id]["metrics"][SAMPLED] == sorted(zero3)
    # the ratio to the ddp case doubles (the old rule's false alarm); the samples did not move
    result = compare(baseline, sampled_frame(zero3, zero3_ms=100.0))
    rec = result.records.set_index(["case_id", "metric"])
    assert rec.loc[(ZERO3.case_id, "step_time_ratio"), "verdict"] == "warn"
    assert rec.loc[(ZERO3.case_id, SAMPLED), "verdict"] == "ok" and result.passed
    # the samples move by 15%: fails, with effect, interval and p-value
    result = compare(baseline, sampled_frame([x * 1.15 for x in zero3]))
    row = result.records.set_index(["case_id", "metric"]).loc[(ZERO3.case_id, SAMPLED)]
    assert not result.passed and row["verdict"] == "regressed" and row["change"] == pytest.approx(0.15)
    assert row["p_value"] < 0.01 and row["effect_low"] > 0 and "Mann–Whitney" in row["note"]
    # a run without samples: missing, failing
    no_samples = sampled_frame(zero3).drop(columns=[SAMPLED])
    row = compare(baseline, no_samples).records.set_index(["case_id", "metric"]).loc[(ZERO3.case_id, SAMPLED)]
    assert row["verdict"] == "missing" and row["fails"]


def test_pool_joins_samples_of_other_runs(tmp_path):
    base = tmp_path / "b.json"
    a = write_run(tmp_path / "a", sampled_frame(BASE))
    b = write_run(tmp_path / "b", sampled_frame([2.0, 2.0]))
    assert cli(a, "--write-baseline", base, "--pool", b) == 0
    assert json.loads(base.read_text())["cases"][ZERO3.case_id]["metrics"][SAMPLED] == sorted([*BASE, 2.0, 2.0])


def test_repeat_pools_remeasured_samples_before_failing(tmp_path, monkeypatch, capsys):
    """A case that looked 30% slower once is launched again; two normal launches dilute it."""
    import fsdpbench.launch
    import fsdpbench.results

    base = tmp_path / "b.json"
    assert cli(write_run(tmp_path / "a", sampled_frame(BASE)), "--write-baseline", base) == 0
    bad_minute = write_run(tmp_path / "r", sampled_frame([x * 1.3 for x in BASE]))
    launched = []

    def fake_launch(case, case_dir):
        launched.append((case.case_id, case_dir.name))
        return object()

    def fake_rows(case, outcome, env):  # each re-launch measures the baseline's distribution again
        return pd.DataFrame([{SAMPLED: [x * 1.01 for x in BASE]}])

    class Outcome:
        status = "ok"

    monkeypatch.setattr(fsdpbench.launch, "launch_case", lambda c, d: fake_launch(c, d) and Outcome())
    monkeypatch.setattr(fsdpbench.results, "build_rows", fake_rows)
    assert cli(bad_minute, "--baseline", base) == 1  # no repeat: fails
    capsys.readouterr()
    assert cli(bad_minute, "--baseline", base, "--repeat", "2") == 0
    assert launched == [(ZERO3.case_id, "repeat1"), (ZERO3.case_id, "repeat2")]
    assert f"re-measured {ZERO3.case_id} (2/2)" in capsys.readouterr().err
    # a real slowdown stays slow in the re-launches: still fails
    monkeypatch.setattr(fsdpbench.results, "build_rows",
                        lambda c, o, e: pd.DataFrame([{SAMPLED: [x * 1.3 for x in BASE]}]))  # fmt: skip
    assert cli(bad_minute, "--baseline", base, "--repeat", "2") == 1
