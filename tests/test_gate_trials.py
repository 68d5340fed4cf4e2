"""The gate trial harness's arithmetic: binomial intervals, rates by condition, the table in docs/ci.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.gate_trials import (
    CONDITIONS,
    DOCS_BEGIN,
    DOCS_END,
    clopper_pearson,
    markdown,
    rate_rows,
    replace_between_markers,
    wilson,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "ci.md"


def test_clopper_pearson_agrees_with_scipy_and_by_hand():
    # 0 of 20: the upper bound is 1 - 0.025^(1/20) (the rule of three's exact form)
    assert clopper_pearson(0, 20) == (0.0, pytest.approx(1 - 0.025 ** (1 / 20), abs=1e-9))
    assert clopper_pearson(20, 20) == (pytest.approx(0.025 ** (1 / 20), abs=1e-9), 1.0)
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(1, 20), (17, 20), (19, 20), (5, 7)]:
        low, high = clopper_pearson(k, n)
        assert low == pytest.approx(stats.beta.ppf(0.025, k, n - k + 1), abs=1e-9)
        assert high == pytest.approx(stats.beta.ppf(0.975, k + 1, n - k), abs=1e-9)


def test_wilson_by_hand():
    # 1 of 20, z = 1.96: centre (0.05 + 0.096)/1.192, half 1.96/1.192 * sqrt(0.002375 + 0.0024)
    low, high = wilson(1, 20)
    assert low == pytest.approx(0.00889, abs=1e-4) and high == pytest.approx(0.23613, abs=1e-4)


def test_rates_count_exit_1_per_condition_and_the_table_shows_them():
    records = [
        {"condition": "a", "exit_code": 0, "effect": 0.01, "other_load": 0.02, "launches": 1},
        {"condition": "a", "exit_code": 1, "effect": 0.12, "other_load": 0.03, "launches": 3},
        {"condition": "d20", "exit_code": 1, "effect": 0.2, "other_load": 0.01, "launches": 3},
        {"condition": "d20", "exit_code": 0, "verdict": "not compared", "other_load": 0.7, "launches": 1},
    ]
    rows = {r["condition"].name: r for r in rate_rows(records)}
    assert (rows["a"]["alarms"], rows["a"]["trials"], rows["a"]["relaunched"]) == (1, 2, 1)
    assert rows["d20"]["not_judged"] == 1 and rows["d20"]["effect_range"] == (0.2, 0.2)
    table = markdown(records, "header")
    assert "| (a) unchanged, idle | 1/2 | 50%" in table
    assert "| (d20) +20% work, idle | 1/2 | 50%" in table and "detected ≥ 19/20" in table
    assert [c.name for c in CONDITIONS] == ["a", "b", "c", "d10", "d20", "d10b", "d20b"]


def test_the_table_goes_between_the_markers_of_docs_ci():
    text = DOCS.read_text()
    assert text.count(DOCS_BEGIN) == 1 and text.count(DOCS_END) == 1
    replaced = replace_between_markers(text, "NEW TABLE\n")
    assert DOCS_BEGIN + "\nNEW TABLE\n" + DOCS_END in replaced
    assert replaced.startswith(text[: text.index(DOCS_BEGIN)]) and replaced.endswith(
        text[text.index(DOCS_END) :]
    )
