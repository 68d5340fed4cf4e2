"""Time, communication and sweep figures of the report (memory figures are in ``figures.py``)."""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from fsdpbench.analysis.frame import has_values, is_reference_strategy, speedups
from fsdpbench.core.case import PRECISIONS, WRAPS
from fsdpbench.core.formatting import byte_unit
from fsdpbench.core.schema import (
    COMM_BYTES,
    COMM_PRED_TOTAL,
    OVERLAP_COMM,
    OVERLAP_EXPOSED,
    OVERLAP_NOTE,
    OVERLAP_RATIO,
    RUN,
    STEP_TIME,
    STEP_TIME_P10,
    STEP_TIME_P90,
    TRACKER_PEAK,
)
from fsdpbench.report.data import axis_text, axis_values, ok_cases, rows_with
from fsdpbench.report.figures import series_key_axes, series_name
from fsdpbench.report.panel import (
    TRACKER_SOURCE,
    Panel,
    absent,
    base_layout,
    describe_ranks,
    ordered_strategies,
    steps_text,
    strategy_color,
)

COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "other")
COMM_COLORS = {
    "all_gather": "#4C78A8",
    "reduce_scatter": "#F58518",
    "all_reduce": "#54A24B",
    "broadcast": "#B279A2",
    "other": "#BAB0AC",
}
# the axes that get their own sweep view when a scenario varies them, with their natural order
# the trade-off figure's marker shape per world size (in order of the sizes in the run)
TRADEOFF_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "x", "star", "hexagon")
SWEEP_AXES = {"wrap": WRAPS, "prefetch": None, "precision": PRECISIONS, "activation_checkpointing": None}


def _timed(cases: pd.DataFrame) -> pd.DataFrame:
    ok = ok_cases(cases)
    return ok[pd.to_numeric(ok[STEP_TIME], errors="coerce").notna()] if STEP_TIME in ok else ok.iloc[0:0]


def _time_caption(ok: pd.DataFrame) -> str:
    return (
        f"median over {steps_text(ok)} (warm-up excluded), of the slowest rank; whiskers p10–p90 of that "
        f"rank's timed steps. Ranks: {describe_ranks(ok)}"
    )


def build_step_time_panel(cases: pd.DataFrame) -> Panel:
    """Step time and throughput per case, with the p10–p90 spread of the slowest rank."""
    title = "Step time and throughput per case"
    ok = _timed(cases)
    if ok.empty:
        return absent(
            "step_time", title, "not measured in this run: no case finished its timed steps (step_time_ms)"
        )
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=("step time (ms)", "throughput (samples/s)"),
    )
    for strategy in ordered_strategies(ok):
        sub = ok[ok["strategy"] == strategy]
        med = sub[STEP_TIME].astype(float)
        p10 = pd.to_numeric(sub.get(STEP_TIME_P10, med), errors="coerce").fillna(med)
        p90 = pd.to_numeric(sub.get(STEP_TIME_P90, med), errors="coerce").fillna(med)
        gbs = sub["global_batch_size"].astype(float)
        bars = dict(x=sub["label"].tolist(), name=strategy, marker_color=strategy_color(strategy))
        bars.update(legendgroup=strategy)
        fig.add_trace(
            _bar_with_whiskers(med, p10, p90, "%{x}<br>median %{y:.1f} ms<extra></extra>", **bars),
            row=1,
            col=1,
        )
        # throughput's whiskers: the step time's p10 is its p90
        fig.add_trace(
            _bar_with_whiskers(
                gbs / (med / 1e3),
                gbs / (p90 / 1e3),
                gbs / (p10 / 1e3),
                "%{x}<br>%{y:.1f} samples/s<extra></extra>",
                showlegend=False,
                **bars,
            ),
            row=2,
            col=1,
        )
    order = ok["label"].tolist()
    fig.update_xaxes(categoryorder="array", categoryarray=order, tickangle=-30)
    fig.update_layout(**base_layout(height=640, barmode="group", margin=dict(l=70, r=30, t=40, b=160)))
    caption = (
        f"Step time (forward + backward + optimizer step, device-synchronised): {_time_caption(ok)}. "
        f"Throughput = global batch / step time, whiskers from the same p10/p90."
    )
    return Panel(key="step_time", title=title, caption=caption, figure=fig)


def _bar_with_whiskers(
    mid: pd.Series, low: pd.Series, high: pd.Series, hovertemplate: str, **bar: Any
) -> go.Bar:
    """Bars at ``mid`` with whiskers down to ``low`` and up to ``high``."""
    return go.Bar(
        y=mid.tolist(),
        error_y=dict(
            type="data",
            symmetric=False,
            array=(high - mid).clip(lower=0).tolist(),
            arrayminus=(mid - low).clip(lower=0).tolist(),
        ),
        hovertemplate=hovertemplate,
        **bar,
    )


def build_speedup_panel(cases: pd.DataFrame) -> Panel:
    """Speed-up (>1) or slow-down (<1) of each case relative to DDP at the same world size."""
    title = "Speed relative to DDP at the same world size"
    ok = _timed(cases)
    if ok.empty:
        return absent("speedup", title, "not measured in this run: no timed case")
    ok = ok.assign(speedup=speedups(ok))[~is_reference_strategy(ok)]
    lonely = ok[ok["speedup"].isna()]["label"].tolist()
    ok = ok[ok["speedup"].notna()]
    if ok.empty:
        return absent(
            "speedup", title, "no DDP case with the same world size and settings to compare with in this run"
        )
    fig = go.Figure()
    for strategy in ordered_strategies(ok):
        sub = ok[ok["strategy"] == strategy]
        fig.add_trace(
            go.Bar(
                x=sub["label"].tolist(),
                y=sub["speedup"].tolist(),
                name=strategy,
                marker_color=strategy_color(strategy),
                text=[f"{v:.2f}×" for v in sub["speedup"]],
                textposition="outside",
                hovertemplate="%{x}<br>%{y:.2f}× DDP's speed<extra></extra>",
            )
        )
    fig.add_hline(
        y=1.0, line=dict(color="#333", dash="dash"), annotation_text="DDP", annotation_position="top left"
    )
    fig.update_xaxes(categoryorder="array", categoryarray=ok["label"].tolist(), tickangle=-30)
    fig.update_layout(
        **base_layout(
            yaxis=dict(title="DDP step time / step time (×)", rangemode="tozero"),
            margin=dict(l=70, r=30, t=40, b=160),
        )
    )
    caption = (
        f"Speed of each case relative to DDP with the same world size and settings: above 1 is faster "
        f"than DDP, below 1 slower. Step times: {_time_caption(ok)}."
    )
    notes = [f"no DDP case with the same world size and settings for: {', '.join(lonely)}"] if lonely else []
    return Panel(key="speedup", title=title, caption=caption, figure=fig, notes=notes)


def build_tradeoff_panel(cases: pd.DataFrame) -> Panel:
    """Peak memory per rank against step time, one marker per case: the lower left wins."""
    title = "Memory vs speed: the trade-off"
    ok = rows_with(_timed(cases), TRACKER_PEAK)
    if ok.empty:
        return absent(
            "tradeoff", title, "not measured in this run: no case with both a step time and a tracker peak"
        )
    unit, div = byte_unit(ok[TRACKER_PEAK])
    fig = go.Figure()
    sizes = sorted({int(n) for n in ok["world_size"]})
    symbol = {n: TRADEOFF_SYMBOLS[i % len(TRADEOFF_SYMBOLS)] for i, n in enumerate(sizes)}
    for strategy in ordered_strategies(ok):
        sub = ok[ok["strategy"] == strategy]
        fig.add_trace(
            go.Scatter(  # no text beside the markers: at equal speed and memory labels overprint ("n1n1")
                x=sub[STEP_TIME].tolist(),
                y=(sub[TRACKER_PEAK] / div).tolist(),
                mode="markers",
                name=strategy,
                legendgroup="strategy",
                legendgrouptitle_text="strategy (colour)",
                marker=dict(
                    color=strategy_color(strategy),
                    size=12,
                    symbol=[symbol[int(n)] for n in sub["world_size"]],
                ),
                customdata=sub["label"].tolist(),
                hovertemplate="%{customdata}<br>%{x:.1f} ms/step"
                f"<br>%{{y:.2f}} {unit} peak<extra></extra>",
            )
        )
    for n in sizes:  # the shapes' key: legend only
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=f"N = {n}",
                legendgroup="world_size",
                legendgrouptitle_text="world size (shape)",
                marker=dict(color="#555", size=12, symbol=symbol[n]),
                hoverinfo="skip",
            )
        )
    fig.update_layout(
        **base_layout(
            xaxis=dict(title="step time (ms), slowest rank's median", rangemode="tozero"),
            yaxis=dict(title=f"peak memory per rank ({unit})", rangemode="tozero"),
        )
    )
    caption = (
        f"Each case once: x = step time ({steps_text(ok)}, slowest rank's median), y = peak per rank "
        f"measured by the {TRACKER_SOURCE} (largest rank). Lower left is better; colour = strategy, "
        f"shape = world size N (both keyed in the legend; hover a marker for its case). "
        f"Ranks: {describe_ranks(ok)}."
    )
    return Panel(key="tradeoff", title=title, caption=caption, figure=fig)


def build_comm_bytes_panel(cases: pd.DataFrame) -> Panel:
    """Bytes each rank sends per step by collective (measured) beside the analytic total."""
    title = "Communication volume per step"
    ok = ok_cases(cases)
    kinds = [
        k
        for k in COMM_KINDS
        if has_values(ok, COMM_BYTES.of(k)) and (ok[COMM_BYTES.of(k)].fillna(0) > 0).any()
    ]
    if not ok.empty and "world_size" in ok and (ok["world_size"] == 1).all():
        return absent(
            "comm_bytes", title, "no communication between ranks: every case ran on one rank (world size 1)"
        )
    if ok.empty or not kinds:
        return absent(
            "comm_bytes",
            title,
            "not measured in this run: no comm_<kind>_bytes columns (communication volume "
            "is read from the profiled step's trace)",
        )
    ok = ok[ok[[COMM_BYTES.of(k) for k in kinds]].notna().any(axis=1)]
    has_pred = has_values(ok, COMM_PRED_TOTAL)
    cols = [COMM_BYTES.of(k) for k in kinds] + ([COMM_PRED_TOTAL] if has_pred else [])
    unit, div = byte_unit(
        [v for c in cols for v in ok[c]] + list(ok[[COMM_BYTES.of(k) for k in kinds]].sum(axis=1))
    )
    labels = ok["label"].tolist()
    fig = go.Figure()
    for kind in kinds:
        fig.add_trace(
            go.Bar(
                x=labels,
                y=(ok[COMM_BYTES.of(kind)].fillna(0) / div).tolist(),
                name=kind,
                marker_color=COMM_COLORS[kind],
                hovertemplate=f"%{{x}}<br>{kind}: %{{y:.2f}} {unit}<extra></extra>",
            )
        )
    _add_silent_ranks(fig, labels, ok["world_size"])
    if has_pred:
        _add_analytic_total(fig, labels, ok[COMM_PRED_TOTAL] / div, unit)
    fig.update_xaxes(categoryorder="array", categoryarray=labels, tickangle=-30)
    fig.update_layout(
        **base_layout(
            barmode="stack",
            yaxis=dict(title=f"bytes sent per rank per step ({unit})"),
            margin=dict(l=70, r=30, t=40, b=160),
        )
    )
    notes = [] if has_pred else ["analytic volume not in this run: no comm_pred_total_bytes column"]
    analytic = "; black bar = analytic volume for the same case" if has_pred else ""
    caption = (
        "Bytes each rank sends per step by collective (ring convention: all-reduce 2(N−1)/N·S, "
        "all-gather/reduce-scatter (N−1)/N·S), measured from the profiled step's trace (mean over ranks)"
        f"{analytic}. Ranks: {describe_ranks(ok)}."
    )
    return Panel(key="comm_bytes", title=title, caption=caption, figure=fig, notes=notes)


def _add_silent_ranks(fig: go.Figure, labels: list[str], world_sizes: pd.Series) -> None:
    """A 1-rank case sends nothing: say so where its bar would be, not an empty slot."""
    silent = [label for label, n in zip(labels, world_sizes, strict=True) if int(n) == 1]
    if not silent:
        return
    fig.add_trace(
        go.Scatter(
            x=silent,
            y=[0] * len(silent),
            mode="text",
            text=["no communication (1 rank)"] * len(silent),
            textposition="top center",
            textfont=dict(color="#555"),
            name="no communication",
            showlegend=False,
            hoverinfo="skip",
        )
    )


def _add_analytic_total(fig: go.Figure, labels: list[str], scaled: pd.Series, unit: str) -> None:
    """The analytic volume of each case: a black bar across its stack."""
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=scaled.tolist(),
            mode="markers",
            name="analytic total",
            marker=dict(symbol="line-ew-open", size=28, color="#000", line=dict(width=3)),
            hovertemplate=f"%{{x}}<br>analytic %{{y:.2f}} {unit}<extra></extra>",
        )
    )


def build_overlap_panel(cases: pd.DataFrame) -> Panel:
    """Communication time, exposed (not hidden) communication time and the overlap ratio per case."""
    title = "Communication hidden under compute"
    ok = ok_cases(cases)
    if ok.empty or not any(has_values(ok, c) for c in (OVERLAP_RATIO, OVERLAP_EXPOSED)):
        return absent(
            "overlap",
            title,
            "not measured in this run: no overlap_* columns (overlap is read from the profiled step's trace)",
        )
    ok = ok[ok[[c for c in (OVERLAP_RATIO, OVERLAP_EXPOSED) if c in ok]].notna().any(axis=1)]
    labels = ok["label"].tolist()
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for col, name, color in (
        (OVERLAP_COMM, "communication", "#9ECAE9"),
        (OVERLAP_EXPOSED, "exposed communication", "#E45756"),
    ):
        if has_values(ok, col):
            fig.add_trace(
                go.Bar(
                    x=labels,
                    y=ok[col].tolist(),
                    name=name,
                    marker_color=color,
                    hovertemplate=f"%{{x}}<br>{name} %{{y:.2f}} ms<extra></extra>",
                ),
                secondary_y=False,
            )
    if has_values(ok, OVERLAP_RATIO):
        fig.add_trace(
            go.Scatter(
                x=labels,
                y=ok[OVERLAP_RATIO].tolist(),
                mode="markers",
                name="overlap ratio",
                marker=dict(symbol="diamond", size=12, color="#222"),
                hovertemplate="%{x}<br>overlap %{y:.0%}<extra></extra>",
            ),
            secondary_y=True,
        )
    fig.update_xaxes(categoryorder="array", categoryarray=labels, tickangle=-30)
    fig.update_yaxes(title_text="time per step (ms)", secondary_y=False, rangemode="tozero")
    fig.update_yaxes(
        title_text="overlap = |comm ∩ compute| / |comm|",
        secondary_y=True,
        range=[0, 1.05],
        tickformat=".0%",
        dtick=0.25,
        showgrid=False,
    )
    fig.update_layout(
        **base_layout(
            barmode="group", margin=dict(l=70, r=70, t=60, b=160), legend=dict(orientation="h", x=0, y=1.08)
        )
    )
    backends = set(ok.get("backend", pd.Series(dtype=str)).dropna())
    what = (
        "on gloo, communication is the gloo work on its own threads, so 'overlap' means concurrent in wall "
        "time"
        if "gloo" in backends
        else "communication = NCCL kernels, compute = all other kernels"
    )
    caption = (
        f"From the profiler trace of one step per rank (mean over ranks): communication time, the part not "
        f"overlapped by compute (exposed), and the overlap ratio (Holistic Trace Analysis's definition); "
        f"{what}. Ranks: {describe_ranks(ok)}."
    )
    notes = list(dict.fromkeys(n for n in ok.get(OVERLAP_NOTE, []) if isinstance(n, str) and n))
    return Panel(key="overlap", title=title, caption=caption, figure=fig, notes=notes)


def swept_axes(cases: pd.DataFrame) -> list[str]:
    """Sweep axes that take more than one value within some strategy (a normalised wrap does not count)."""
    ok = ok_cases(cases)
    out = []
    for axis in SWEEP_AXES:
        if axis in ok and any(
            sub.astype(str).nunique() > 1 for _, sub in axis_values(ok, axis).groupby(ok["strategy"])
        ):
            out.append(axis)
    return out


def _size_key(shown: Any) -> float:
    """Size wraps in order of their least parameters per unit: size(100) before size(2e4)."""
    text = str(shown)
    if text.startswith("size(") and text.endswith(")"):
        try:
            return float(text[5:-1])
        except ValueError:
            return 0.0
    return 0.0


def build_sweep_panels(cases: pd.DataFrame) -> list[Panel]:
    """One view per swept axis (wrap, prefetch, precision, ...): peak memory and step time against it."""
    axes = swept_axes(cases)
    if not axes:
        return [
            Panel(
                key="sweep",
                title="Sweeps: wrap, prefetch, precision",
                caption="",
                missing="this run does not vary wrap granularity, prefetch or precision",
            )
        ]
    return [_sweep_panel(ok_cases(cases), axis) for axis in axes]


def _sweep_panel(ok: pd.DataFrame, axis: str) -> Panel:
    # the x position of a case: its value as a person tells it apart (two size wraps: size(100), size(2e4))
    ok = ok.assign(_shown=axis_values(ok, axis))
    values = _axis_order(ok, axis)
    others = [a for a in series_key_axes(ok) if a != axis]
    several_runs = ok[RUN].nunique() > 1 if RUN in ok else False
    ok = ok.assign(
        _series=[f"{series_name(r, others, several_runs)} n{int(r['world_size'])}" for _, r in ok.iterrows()]
    )
    ok = ok[ok.groupby("_series")["_shown"].transform(lambda s: s.astype(str).nunique()) > 1]
    unit, div = byte_unit(ok.get(TRACKER_PEAK, pd.Series(dtype=float)))
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"peak memory per rank ({unit})", "step time (ms)"))
    for name, sub in ok.groupby("_series", sort=False):
        sub = sub.assign(_x=sub["_shown"].map(lambda v: values.index(v) if v in values else -1)).sort_values(
            "_x"
        )
        x = [axis_text(axis, v) if isinstance(v, bool) else str(v) for v in sub["_shown"]]
        color = strategy_color(sub["strategy"].iloc[0])
        common: dict[str, Any] = dict(
            x=x, mode="lines+markers", name=name, legendgroup=name, line=dict(color=color)
        )
        if has_values(sub, TRACKER_PEAK):
            fig.add_trace(go.Scatter(y=(sub[TRACKER_PEAK] / div).tolist(), **common), row=1, col=1)
        if has_values(sub, STEP_TIME):
            fig.add_trace(go.Scatter(y=sub[STEP_TIME].tolist(), showlegend=False, **common), row=1, col=2)
    cats = [axis_text(axis, v) if isinstance(v, bool) else str(v) for v in values]
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=cats, title_text=axis)
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(**base_layout(height=440))
    caption = (
        f"Peak memory per rank ({TRACKER_SOURCE}, largest rank) and step time ({steps_text(ok)}, slowest "
        f"rank's median) against {axis}, one line per strategy and world size. Ranks: {describe_ranks(ok)}."
    )
    return Panel(key=f"sweep_{axis}", title=f"Sweep: {axis}", caption=caption, figure=fig)


def _axis_order(ok: pd.DataFrame, axis: str) -> list[Any]:
    """The distinct shown values of ``axis`` (column ``_shown``) in the axis's declared order, sizes
    ascending within a kind (size(100) before size(2e4)); sorted when the axis declares no order."""
    order = SWEEP_AXES[axis]
    kind = {shown: v for shown, v in zip(ok["_shown"], ok[axis], strict=True) if v in (order or ())}
    values = list(dict.fromkeys(v for v in ok["_shown"].tolist() if v is not None and v == v))
    if order:
        return sorted((v for v in values if v in kind), key=lambda v: (order.index(kind[v]), _size_key(v)))
    return sorted(values)
