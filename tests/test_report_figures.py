"""The report's figures and tables, built from synthetic frames with known numbers (no browser)."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from fsdpbench.report import build_panels, write_report
from fsdpbench.report.data import build_case_frame, load_runs, ranks_label
from fsdpbench.report.figures import (
    KEY_GROUP,
    build_memory_breakdown_panel,
    build_memory_scaling_panel,
    build_memory_timeline_panel,
)
from fsdpbench.report.figures_perf import (
    build_comm_bytes_panel,
    build_overlap_panel,
    build_speedup_panel,
    build_step_time_panel,
    build_sweep_panels,
    build_tradeoff_panel,
)
from fsdpbench.report.panel import describe_ranks
from fsdpbench.report.synthetic import (
    ACTIVATIONS_BYTES,
    FAIL_ERROR,
    PEAK_PREDICTION_ERR,
    PSI,
    SKIP_REASON,
    TEMP_BYTES,
    case_id_of,
    synthetic_cases,
    synthetic_results,
    synthetic_timeline,
    write_synthetic_run,
)
from fsdpbench.report.tables import case_table, compare_rows, glance_groups, verdict_lines

MiB = 2.0**20


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    return synthetic_results().assign(run="syn")


@pytest.fixture(scope="module")
def cases(rows: pd.DataFrame) -> pd.DataFrame:
    return build_case_frame(rows)


def _case(
    cases: pd.DataFrame, strategy: str, n: int, prefetch: int = 0, precision: str = "fp32"
) -> pd.Series:
    sel = cases[
        (cases["strategy"] == strategy)
        & (cases["world_size"] == n)
        & (cases["prefetch"] == prefetch)
        & (cases["precision"] == precision)
        & (cases["status"] == "ok")
    ]
    assert len(sel) == 1, sel
    return sel.iloc[0]


def _traces(fig, name: str, group: str | None = None) -> list:
    """The traces named ``name`` (or, in the memory-scaling figure, whose ``meta`` says so), of ``group``."""
    return [t for t in fig.data if name in (t.name, t.meta) and (group is None or t.legendgroup == group)]


# --- the case frame -----------------------------------------------------------------------------------------


def test_case_frame_one_row_per_case_with_slowest_rank_time_and_largest_rank_memory(cases):
    assert len(cases) == len(synthetic_cases()) == 13
    assert cases["status"].value_counts().to_dict() == {"ok": 11, "failed": 1, "skipped": 1}
    z3 = _case(cases, "zero3", 4)
    # slowest rank is rank 3: base 150 ms × (1 + 0.3) + 3
    assert z3["step_time_ms"] == pytest.approx(150 * 1.3 + 3)
    assert z3["step_time_p10_ms"] == pytest.approx(0.9 * (150 * 1.3 + 3))
    assert z3["step_time_p90_ms"] == pytest.approx(1.2 * (150 * 1.3 + 3))
    # largest peak is rank 3 (1 KiB more temp than rank 0 per rank index); its categories add up to it
    assert z3["peak_rank"] == 3
    states = 16 * PSI / 4
    unsharded = 4 * PSI / 2
    assert z3["mem_tracker_peak_bytes"] == states + unsharded + ACTIVATIONS_BYTES + TEMP_BYTES + 3 * 1024
    assert z3["mem_tracker_peak_temp_bytes"] == TEMP_BYTES + 3 * 1024
    assert z3["mem_tracker_model_states_bytes"] == states
    assert z3["pred_peak_err"] == pytest.approx(PEAK_PREDICTION_ERR)
    # communication: mean over ranks; text columns stay text
    assert z3["comm_all_gather_bytes"] == pytest.approx(2 * 3 / 4 * 4 * PSI)
    assert z3["overlap_exposed_comm_ms"] == pytest.approx(12.0)


def test_case_frame_computes_the_error_when_the_memory_model_did_not(rows):
    cases = build_case_frame(rows.drop(columns=["pred_peak_err", "pred_model_states_err"]))
    z2 = _case(cases, "zero2", 2)
    assert z2["pred_peak_err"] == pytest.approx(PEAK_PREDICTION_ERR)
    assert z2["pred_model_states_err"] == pytest.approx(0.0)


def test_failed_and_skipped_cases_keep_their_reason(cases):
    failed = cases[cases["status"] == "failed"].iloc[0]
    skipped = cases[cases["status"] == "skipped"].iloc[0]
    assert failed["error"] == FAIL_ERROR and skipped["error"] == SKIP_REASON
    assert np.isnan(failed["step_time_ms"]) if "step_time_ms" in failed else True


def test_labels_name_only_what_varies_and_leave_wrap_out_for_ddp(cases):
    labels = dict(zip(cases["case_id"], cases["label"]))
    assert (
        labels[
            case_id_of(
                {"strategy": "ddp", "world_size": 2, "wrap": "none", "prefetch": 0, "precision": "fp32"}
            )
        ]
        == "ddp n2 prefetch=0 fp32"
    )
    assert (
        labels[
            case_id_of(
                {"strategy": "zero3", "world_size": 4, "wrap": "block", "prefetch": 1, "precision": "fp32"}
            )
        ]
        == "zero3 n4 wrap=block prefetch=1 fp32"
    )
    assert cases["label"].is_unique


def test_a_cpu_rank_is_never_called_a_gpu():
    assert ranks_label(4, "cpu", "gloo") == "4 CPU ranks (gloo)"
    assert ranks_label(1, "cpu", "gloo") == "1 CPU rank (gloo)"
    assert ranks_label(4, "cuda", "nccl") == "4 GPUs (NCCL)"
    gpu = pd.DataFrame({"device": ["cuda"], "backend": ["nccl"], "device_name": ["NVIDIA H100"]})
    cpu = pd.DataFrame({"device": ["cpu"], "backend": ["gloo"], "device_name": ["CPU: X (2 cores)"]})
    assert describe_ranks(gpu) == "GPUs (NCCL): NVIDIA H100"
    assert (
        describe_ranks(cpu).startswith("CPU ranks (gloo)")
        and "GPU" not in describe_ranks(cpu).split(" for ")[0]
    )


# --- memory figures -----------------------------------------------------------------------------------------


def test_memory_scaling_draws_measured_markers_and_predicted_lines_per_strategy(cases):
    panel = build_memory_scaling_panel(cases)
    fig = panel.figure
    assert fig is not None and panel.missing is None
    groups = sorted(dict.fromkeys(t.legendgroup for t in fig.data if t.legendgroup != KEY_GROUP))
    assert groups == [
        "ddp prefetch=0 fp32",
        "zero2 prefetch=0 fp32",
        "zero3 prefetch=0 bf16",
        "zero3 prefetch=0 fp32",
        "zero3 prefetch=1 fp32",
    ]
    (meas,) = _traces(fig, "measured peak", "zero3 prefetch=0 fp32")
    assert meas.mode == "markers" and list(meas.x) == [1, 2, 4]
    expected = [_case(cases, "zero3", n)["mem_tracker_peak_bytes"] / MiB for n in (1, 2, 4)]
    assert list(meas.y) == pytest.approx(expected)
    (states,) = _traces(fig, "measured model states", "zero3 prefetch=0 fp32")
    assert list(states.y) == pytest.approx(
        [16 * PSI / n / MiB for n in (1, 2, 4)]
    )  # (4+K)Ψ/N, K=8 (AdamW fp32)
    (analytic,) = _traces(fig, "analytic peak", "zero3 prefetch=0 fp32")
    assert analytic.mode == "lines" and analytic.line.dash == "solid"
    assert list(analytic.y) == pytest.approx([v * (1 + PEAK_PREDICTION_ERR) for v in expected])
    (analytic_states,) = _traces(fig, "analytic model states", "zero3 prefetch=0 fp32")
    assert analytic_states.line.dash == "dash"
    assert not _traces(fig, "traced peak")
    assert "tracker (live tensors from PyTorch's memory trackers)" in panel.caption
    assert "CPU ranks (gloo)" in panel.caption
    assert any("traced prediction not in this run" in n for n in panel.notes)
    assert fig.layout.xaxis.title.text == "world size N (ranks)"


def test_memory_scaling_draws_traced_lines_when_the_columns_exist(cases):
    traced = cases.assign(traced_peak_bytes=cases["mem_tracker_peak_bytes"] * 0.97)
    panel = build_memory_scaling_panel(traced)
    (line,) = _traces(panel.figure, "traced peak", "ddp prefetch=0 fp32")
    assert line.line.dash == "dot" and len(line.y) == 3
    assert not any("traced" in n for n in panel.notes)


def test_memory_scaling_legend_has_one_entry_per_series_and_a_key(cases):
    """Not six entries per series (30 that scroll, hsdp off-screen): one per series, then what marks mean."""
    both = cases.assign(
        traced_peak_bytes=cases["pred_peak_bytes"], traced_model_states_bytes=cases["pred_model_states_bytes"]
    )
    fig = build_memory_scaling_panel(both).figure
    shown = [t for t in fig.data if t.showlegend is not False]
    series = [t.name for t in shown if t.legendgroup != KEY_GROUP]
    assert series == [
        "ddp prefetch=0 fp32",
        "zero2 prefetch=0 fp32",
        "zero3 prefetch=0 fp32",
        "zero3 prefetch=1 fp32",
        "zero3 prefetch=0 bf16",
    ] or sorted(series) == sorted(
        dict.fromkeys(t.legendgroup for t in fig.data if t.legendgroup != KEY_GROUP)
    )
    assert len(series) == 5 and all(t.meta == "measured peak" for t in shown if t.legendgroup != KEY_GROUP)
    key = [t.name for t in shown if t.legendgroup == KEY_GROUP]
    assert key == [
        "measured peak",
        "measured model states",
        "analytic peak",
        "analytic model states",
        "traced peak",
        "traced model states",
    ]
    assert len(shown) == 11 and fig.layout.legend.groupclick == "togglegroup"


def test_a_traced_line_on_the_analytic_one_stays_visible(cases):
    """Traced = analytic to the byte (as in the quickstart): the traced line has markers of its own, drawn
    after (above) the analytic line, and a dash of its own."""
    same = cases.assign(traced_peak_bytes=cases["pred_peak_bytes"])
    fig = build_memory_scaling_panel(same).figure
    group = "zero3 prefetch=0 fp32"
    (analytic,) = _traces(fig, "analytic peak", group)
    (traced,) = _traces(fig, "traced peak", group)
    (measured,) = _traces(fig, "measured peak", group)
    assert list(traced.y) == list(analytic.y)
    assert "markers" in traced.mode and traced.marker.symbol not in (
        analytic.marker.symbol,
        measured.marker.symbol,
    )
    assert traced.line.dash != analytic.line.dash
    assert list(fig.data).index(traced) > list(fig.data).index(analytic)


def test_memory_scaling_without_predictions_keeps_the_measurement_and_says_why(cases):
    bare = cases.drop(columns=[c for c in cases if c.startswith("pred_")])
    panel = build_memory_scaling_panel(bare)
    assert {t.meta for t in panel.figure.data} == {"measured peak", "measured model states", None}
    assert any(n.startswith("analytic prediction not in this run") for n in panel.notes)


def test_memory_figures_without_tracker_columns_say_not_measured(cases):
    bare = cases.drop(columns=[c for c in cases if c.startswith("mem_tracker")])
    for build in (build_memory_scaling_panel, build_memory_breakdown_panel, build_tradeoff_panel):
        panel = build(bare)
        assert panel.figure is None and panel.missing.startswith("not measured in this run")


def test_memory_breakdown_stacks_categories_measured_beside_predicted(cases):
    panel = build_memory_breakdown_panel(cases)
    fig = panel.figure
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == [
        "params",
        "grads",
        "optimizer state",
        "activations",
        "unsharded params/grads + comm buffers",
        "other",
    ]
    n_ok = int((cases["status"] == "ok").sum())
    assert all(len(t.x) == 2 * n_ok for t in bars) and all(t.orientation == "h" for t in bars)
    labels = list(bars[0].y[0])
    kinds = list(bars[0].y[1])
    i = labels.index("zero3 n4 wrap=block prefetch=0 fp32")
    assert kinds[i] == "measured" and kinds[i + 1] == "predicted"
    by_name = {t.name: t for t in bars}
    assert by_name["params"].x[i] == pytest.approx(4 * PSI / 4 / MiB)
    assert by_name["optimizer state"].x[i] == pytest.approx(8 * PSI / 4 / MiB)
    assert by_name["unsharded params/grads + comm buffers"].x[i] == pytest.approx(4 * PSI / 2 / MiB)
    assert by_name["other"].x[i] == pytest.approx((TEMP_BYTES + 3 * 1024) / MiB)
    # the model's grads term is the resting value: the grads at the predicted peak are what the other
    # terms leave
    z3 = _case(cases, "zero3", 4)
    named = (4 + 8) * PSI / 4 + 4 * PSI / 2 + ACTIVATIONS_BYTES + TEMP_BYTES
    assert by_name["grads"].x[i + 1] == pytest.approx((z3["pred_peak_bytes"] - named) / MiB)
    assert by_name["other"].x[i + 1] == pytest.approx(TEMP_BYTES / MiB)
    assert sum(t.x[i + 1] for t in bars) == pytest.approx(z3["pred_peak_bytes"] / MiB)  # the bar is the peak
    assert any("predicted grads at the peak" in n for n in panel.notes)
    (totals,) = [t for t in fig.data if t.type == "scatter"]
    assert totals.mode == "text" and sum("(+5.0%)" in t for t in totals.text) == n_ok
    assert "tracker" in panel.caption and "peak" in panel.caption


def test_memory_breakdown_uses_predicted_categories_at_the_peak_when_the_model_writes_them(cases):
    at_peak = cases.assign(
        pred_peak_params_bytes=1.0 * MiB,
        pred_peak_grads_bytes=2.0 * MiB,
        pred_peak_inputs_bytes=0.5 * MiB,
        pred_peak_all_gather_bytes=0.25 * MiB,
    )
    panel = build_memory_breakdown_panel(at_peak)
    by_name = {t.name: t for t in panel.figure.data if t.type == "bar"}
    assert by_name["params"].x[1] == pytest.approx(1.0) and by_name["grads"].x[1] == pytest.approx(2.0)
    assert by_name["activations"].x[1] == pytest.approx(0.5)  # inputs count as activations, as in the model
    assert by_name["unsharded params/grads + comm buffers"].x[1] == pytest.approx(0.25)
    assert not any("predicted grads at the peak" in n for n in panel.notes)


def test_memory_breakdown_without_predictions_shows_measured_only(cases):
    bare = cases.drop(columns=[c for c in cases if c.startswith("pred_")])
    panel = build_memory_breakdown_panel(bare)
    bars = [t for t in panel.figure.data if t.type == "bar"]
    assert len(bars) == 6 and all(len(t.x) == int((cases["status"] == "ok").sum()) for t in bars)
    assert panel.notes and "prediction not in this run" in panel.notes[0]


def test_memory_timeline_one_line_per_rank_a_menu_per_case_and_phase_bands(cases):
    ok = [c for c in synthetic_cases() if c["status"] == "ok"]
    timelines = pd.concat([synthetic_timeline(c) for c in ok], ignore_index=True).assign(run="syn")
    panel = build_memory_timeline_panel(cases, timelines)
    fig = panel.figure
    assert len(fig.data) == sum(c["world_size"] for c in ok)
    first = cases[cases["status"] == "ok"].iloc[0]
    assert [t.visible for t in fig.data].count(True) == first["world_size"]
    assert len(fig.layout.updatemenus[0].buttons) == len(ok)
    assert [a.text for a in fig.layout.annotations] == ["warmup", "timed", "memory"]
    assert len(fig.layout.shapes) == 3
    assert "RSS" in panel.caption


def test_memory_timeline_absent_says_why(cases):
    panel = build_memory_timeline_panel(cases, pd.DataFrame())
    assert panel.figure is None and "timeline.parquet" in panel.missing


# --- time, communication, sweeps ----------------------------------------------------------------------------


def test_step_time_bars_with_p10_p90_whiskers_and_throughput(cases):
    panel = build_step_time_panel(cases)
    fig = panel.figure
    ddp_time = [t for t in fig.data if t.name == "ddp" and t.yaxis == "y"][0]
    ddp = cases[(cases["strategy"] == "ddp") & (cases["status"] == "ok")]
    assert list(ddp_time.y) == pytest.approx(list(ddp["step_time_ms"]))
    assert list(ddp_time.error_y.array) == pytest.approx(list(0.2 * ddp["step_time_ms"]))
    assert list(ddp_time.error_y.arrayminus) == pytest.approx(list(0.1 * ddp["step_time_ms"]))
    ddp_thr = [t for t in fig.data if t.name == "ddp" and t.yaxis == "y2"][0]
    assert list(ddp_thr.y) == pytest.approx(list(ddp["global_batch_size"] / (ddp["step_time_ms"] / 1e3)))
    assert "2 warm-up + 5 timed steps" in panel.caption and "p10–p90" in panel.caption
    assert "CPU ranks (gloo)" in panel.caption


def test_speedup_relative_to_ddp_at_the_same_world_size(cases):
    panel = build_speedup_panel(cases)
    bars = {x: y for t in panel.figure.data for x, y in zip(t.x, t.y)}
    z3 = _case(cases, "zero3", 4)
    ddp = _case(cases, "ddp", 4)
    assert bars[z3["label"]] == pytest.approx(ddp["step_time_ms"] / z3["step_time_ms"])
    assert "ddp n4 prefetch=0 fp32" not in bars  # DDP is the reference, not a bar
    bf16 = _case(cases, "zero3", 4, precision="bf16")["label"]
    assert bf16 not in bars and bf16 in panel.notes[0]  # no DDP bf16 case to compare with


def test_comm_bytes_stacked_by_collective_with_the_analytic_total(cases):
    panel = build_comm_bytes_panel(cases)
    fig = panel.figure
    assert [t.name for t in fig.data] == [
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "no communication",
        "analytic total",
    ]
    labels = list(fig.data[0].x)
    i = labels.index(_case(cases, "zero3", 4)["label"])
    assert fig.data[0].y[i] == pytest.approx(2 * 3 / 4 * 4 * PSI / MiB)  # ZeRO-3: two all-gathers
    j = labels.index(_case(cases, "ddp", 2)["label"])
    assert fig.data[2].y[j] == pytest.approx(2 * 1 / 2 * 4 * PSI / MiB)  # all-reduce 2(N-1)/N·S
    assert "(N−1)/N·S" in panel.caption


def test_one_rank_cases_read_no_communication_where_their_bar_would_be(cases):
    fig = build_comm_bytes_panel(cases).figure
    (label,) = _traces(fig, "no communication")
    one_rank = [r["label"] for _, r in cases.iterrows() if r["status"] == "ok" and r["world_size"] == 1]
    assert list(label.x) == one_rank and len(one_rank) == 3
    assert set(label.text) == {"no communication (1 rank)"} and label.mode == "text"
    for bars in fig.data[:3]:  # their bars are empty: the label is what a reader sees there
        assert all(y == 0 for x, y in zip(bars.x, bars.y) if x in one_rank)


def test_tradeoff_keys_colour_and_shape_in_the_legend_without_overprinted_labels(cases):
    fig = build_tradeoff_panel(cases).figure
    points = [t for t in fig.data if t.legendgroup == "strategy"]
    key = [t for t in fig.data if t.legendgroup == "world_size"]
    assert [t.name for t in points] == ["ddp", "zero2", "zero3"]
    assert all(t.mode == "markers" and t.text is None for t in points)  # no "n1" beside each marker
    assert [t.name for t in key] == ["N = 1", "N = 2", "N = 4"]
    shape = {t.name: t.marker.symbol for t in key}
    (zero3,) = [t for t in points if t.name == "zero3"]
    n = [int(label.split(" n")[1].split()[0]) for label in zero3.customdata]
    assert list(zero3.marker.symbol) == [shape[f"N = {k}"] for k in n]
    assert len(set(shape.values())) == 3


def test_comm_and_overlap_absent_say_not_measured(cases):
    bare = cases.drop(columns=[c for c in cases if c.startswith(("comm_", "overlap_"))])
    assert build_comm_bytes_panel(bare).missing.startswith("not measured in this run")
    assert build_overlap_panel(bare).missing.startswith("not measured in this run")


def test_overlap_bars_and_ratio(cases):
    panel = build_overlap_panel(cases)
    by_name = {t.name: t for t in panel.figure.data}
    labels = list(by_name["exposed communication"].x)
    i = labels.index(_case(cases, "zero2", 4)["label"])
    assert by_name["exposed communication"].y[i] == pytest.approx(12.0)
    assert by_name["communication"].y[i] == pytest.approx(30.0)
    assert by_name["overlap ratio"].y[i] == pytest.approx(0.6)
    assert "gloo" in panel.caption


def test_sweep_views_for_the_axes_the_run_varies(cases):
    panels = build_sweep_panels(cases)
    assert [p.key for p in panels] == [
        "sweep_prefetch",
        "sweep_precision",
    ]  # wrap=whole failed: no wrap sweep
    fig = panels[0].figure
    (mem,) = [t for t in fig.data if t.xaxis == "x"]
    assert list(mem.x) == ["0", "1"]
    assert list(mem.y) == pytest.approx(
        [_case(cases, "zero3", 4, prefetch=p)["mem_tracker_peak_bytes"] / MiB for p in (0, 1)]
    )
    one_axis = cases[(cases["prefetch"] == 0) & (cases["precision"] == "fp32")]
    (none,) = build_sweep_panels(one_axis)
    assert none.figure is None and "does not vary" in none.missing


# --- tables -------------------------------------------------------------------------------------------------


def test_compare_rows_mark_the_winner_per_metric(cases):
    n4 = cases[
        (cases["world_size"] == 4)
        & (cases["prefetch"] == 0)
        & (cases["precision"] == "fp32")
        & (cases["status"] == "ok")
    ]
    rows = {r.metric: r for r in compare_rows(n4)}
    z3, ddp = _case(cases, "zero3", 4)["label"], _case(cases, "ddp", 4)["label"]
    assert rows["peak / rank: measured / predicted"].winners == [z3]
    assert rows["step time (p10–p90)"].winners == [ddp]
    assert rows["throughput"].winners == [ddp]
    assert rows["overlap"].winners == []  # all 60%: a tie has no winner
    modelled = n4.assign(model_step_time_ms=range(10, 10 + len(n4)))
    (row,) = [r for r in compare_rows(modelled) if r.metric == "step time, modelled (error)"]
    assert len(set(row.values.values())) == len(n4) and row.winners == []  # a model picks no winner
    assert rows["peak / rank: measured / predicted"].text[z3].endswith(f"({PEAK_PREDICTION_ERR * 100:+.1f}%)")


def test_verdict_names_least_memory_and_fastest_per_world_size(cases):
    lines = verdict_lines(cases)
    assert lines[0].startswith("1 CPU rank (gloo), decoder-syn, fp32 — peak memory per rank equal for all")
    n4 = [x for x in lines if x.startswith("4 CPU ranks (gloo), decoder-syn, fp32") and "vs DDP" in x][0]
    assert "least memory per rank: zero3 n4 prefetch=0" in n4 and "fastest: ddp n4" in n4
    groups = glance_groups(cases)  # n1, n2, n4 fp32 (prefetch and the failed case too); bf16 and n8 are alone
    assert [len(g) for _, g in groups] == [3, 3, 5]


def test_case_table_lists_failed_and_skipped_cases_with_reasons(cases):
    table = case_table(cases)
    assert len(table) == 13
    failed = table[table["status"] == "failed"].iloc[0]
    skipped = table[table["status"] == "skipped"].iloc[0]
    assert failed["note"] == FAIL_ERROR and failed["_failed"]
    assert skipped["note"] == SKIP_REASON
    z3 = table[table["case"] == _case(cases, "zero3", 4)["label"]].iloc[0]
    assert z3["peak error"] == "+5.0%"
    assert "params on host: measured / predicted" not in table  # no offloaded case, no column
    assert "peak traced" not in table  # a run without --traced
    traced = case_table(cases.assign(traced_peak_bytes=2 * MiB, traced_peak_err=-0.0125))
    assert set(traced["peak traced"]) == {"2.00 MiB"} and set(traced["traced error"]) == {"-1.2%"}


def test_offloaded_cases_show_host_parameters_measured_beside_predicted(cases):
    off = cases.assign(
        cpu_offload=cases["strategy"] == "zero3",
        mem_placement_params_host_bytes=3 * MiB,
        pred_params_host_bytes=4 * MiB,
    )
    table = case_table(off)
    assert set(table["params on host: measured / predicted"]) == {"3.00 MiB / 4.00 MiB"}
    rows = {r.metric: r for r in compare_rows(off.head(3).assign(label=["a", "b", "c"]))}
    assert rows["params on host (CPU offload): measured / predicted"].text["a"] == "3.00 MiB / 4.00 MiB"


# --- the page -----------------------------------------------------------------------------------------------


def test_write_report_is_self_contained_with_every_figure(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "syn")
    path = write_report([run_dir])
    assert path == run_dir / "report.html"
    page = path.read_text()
    assert page.count("plotly.js v") >= 1 and page.count('<script type="text/javascript">') == 1
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=", page)  # nothing fetched from anywhere
    data = load_runs([run_dir])
    panels = build_panels(data)
    drawn = [p.key for p in panels if p.figure is not None]
    assert drawn == [
        "memory_scaling",
        "tradeoff",
        "memory_breakdown",
        "memory_timeline",
        "step_time",
        "speedup",
        "comm_bytes",
        "overlap",
        "sweep_prefetch",
        "sweep_precision",
    ]
    for key in drawn:
        assert f'id="fig-{key}"' in page
    assert f'data-figures-expected="{len(drawn)}"' in page
    figure_json = re.findall(
        r'<script type="application/json" class="figure-data"[^>]*>(.*?)</script>', page, re.S
    )
    assert len(figure_json) == len(drawn)
    assert all(json.loads(s.replace("<\\/", "</"))["data"] for s in figure_json)
    assert FAIL_ERROR in page and SKIP_REASON in page  # failed and skipped cases with their reason
    assert "synthetic run" in page and "made-up numbers" in page  # environment block from run.json


def test_report_of_a_run_without_new_columns_says_what_is_missing(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "syn", timelines=False)
    frame = pd.read_parquet(run_dir / "results.parquet")
    keep = [c for c in frame if not c.startswith(("comm_", "overlap_", "pred_"))]
    frame[keep].to_parquet(run_dir / "results.parquet", index=False)
    page = write_report([run_dir], tmp_path / "out.html").read_text()
    for key in ("memory_timeline", "comm_bytes", "overlap"):
        assert f'data-missing="{key}"' in page
    assert "analytic prediction not in this run" in page
    assert 'id="fig-memory_scaling"' in page


def test_several_runs_are_overlaid_with_run_labels(tmp_path):
    a = write_synthetic_run(tmp_path / "a" / "run", timelines=False)
    b = write_synthetic_run(tmp_path / "b" / "run", timelines=False)
    data = load_runs([a, b])
    assert data.cases["run"].nunique() == 2 and len(data.cases) == 26
    assert data.cases["label"].is_unique and data.cases["label"].str.contains(r"\[a/run\]").sum() == 13
    path = write_report([a, b], tmp_path / "both.html")
    assert path.exists() and "a/run" in path.read_text()


def _case_table_html(tmp_path, command: str, traced: bool) -> str:
    from fsdpbench.report.page import render_case_table

    data = load_runs([write_synthetic_run(tmp_path / "syn", timelines=False)])
    if traced:
        data.cases = data.cases.assign(traced_peak_bytes=2 * MiB, traced_peak_err=-0.0125)
    data.runs[0].meta.update(command=command, predictions=["analytic", "traced"] if traced else ["analytic"])
    return render_case_table(data)


def _headers(html: str) -> list[str]:
    return re.findall(r"<th[^>]*>(.*?)</th>", html)


def test_every_case_table_has_no_empty_columns_and_traced_beside_analytic(tmp_path):
    html = _case_table_html(tmp_path, "fsdpbench run scenarios/quickstart.yaml", traced=True)
    headers = _headers(html)
    assert not [h for h in headers if "DeepSpeed" in h]  # no ds_* case in the run: every cell was "—"
    i = headers.index("peak error")
    assert headers[i + 1 : i + 3] == ["peak traced", "traced error"]
    assert headers[i - 2 : i] == ["peak measured (tracker)", "peak predicted"]


def test_every_case_caption_says_where_the_traced_predictions_came_from(tmp_path):
    scenario = _case_table_html(tmp_path / "a", "fsdpbench run scenarios/quickstart.yaml", traced=True)
    assert "asked for by the scenario&#x27;s traced: true" in scenario and "--traced" not in scenario
    flag = _case_table_html(tmp_path / "b", "fsdpbench compare --world-size 2 --traced", traced=True)
    assert "asked for by --traced on the command line" in flag
    none = _case_table_html(tmp_path / "c", "fsdpbench run scenarios/ci.yaml", traced=False)
    assert "no traced predictions" in none and "peak traced" not in _headers(none)


def test_a_case_whose_steps_were_starved_is_marked_and_neither_wins_nor_loses(cases):
    # ddp n4 is the fastest: starved (its CPU time a tenth of its wall time), it is not named
    n4 = (cases["world_size"] == 4) & (cases["prefetch"] == 0) & (cases["precision"] == "fp32")
    ddp = _case(cases, "ddp", 4)["label"]
    starved = cases.assign(step_cpu_share=[0.1 if r["label"] == ddp else 1.0 for _, r in cases.iterrows()])
    line = [x for x in verdict_lines(starved) if x.startswith("4 CPU ranks (gloo), decoder-syn, fp32")][0]
    assert "fastest: ddp" not in line and "fastest: zero2 n4 prefetch=0" in line
    assert "not compared on step time, their steps starved of CPU: ddp n4 prefetch=0 " in line
    rows = {r.metric: r for r in compare_rows(starved[n4 & (starved["status"] == "ok")])}
    assert ddp not in rows["step time (p10–p90)"].winners and rows["step time (p10–p90)"].winners
    assert ddp not in rows["throughput"].winners
    assert "[starved: CPU 10% of wall]" in rows["step time (p10–p90)"].text[ddp]
    table = case_table(starved)
    assert "starved: CPU 10% of wall" in table[table["case"] == ddp].iloc[0]["step time (p10–p90)"]
    # on a GPU rank the host waits for the device by design: the share marks nothing
    gpu = starved.assign(device="cuda")
    assert not any("starved" in x for x in verdict_lines(gpu))


def test_two_size_wraps_are_told_apart_by_their_least_parameters_in_labels_and_the_sweep():
    from fsdpbench.core import schema
    from fsdpbench.core.case import Case
    from fsdpbench.report.data import case_labels
    from fsdpbench.report.figures_perf import build_sweep_panels

    tutorial = [
        Case(strategy="fsdp1_full", world_size=2, wrap="whole"),
        Case(strategy="fsdp1_full", world_size=2, wrap="size", wrap_min_params=100),
        Case(strategy="fsdp1_full", world_size=2, wrap="size", wrap_min_params=100_000),
        Case(strategy="ddp", world_size=2),
    ]
    cases = pd.DataFrame(
        [
            {**schema.case_to_columns(c), "case_id": c.case_id, "status": "ok"}
            | {"mem_tracker_peak_bytes": 1000 + i, "step_time_ms": 10.0 + i}
            for i, c in enumerate(tutorial)
        ]
    )
    labels = case_labels(cases)
    assert labels[:3] == [
        "fsdp1_full n2 wrap=whole",
        "fsdp1_full n2 wrap=size(100)",
        "fsdp1_full n2 wrap=size(1e5)",
    ]
    assert labels[3] == "ddp n2"  # DDP has no wrap: none named, and no hash needed anywhere
    (panel,) = build_sweep_panels(cases)
    xs = [list(t.x) for t in panel.figure.data]
    assert xs[0] == ["whole", "size(100)", "size(1e5)"]  # three x positions, not ['whole','size','size']
