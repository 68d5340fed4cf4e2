"""Memory figures of the report, built from the case frame (``data.build_case_frame``) and timelines.

Each ``build_*_panel`` returns a ``Panel``: a plotly figure and its caption, or, when the data for
it is absent, no figure and the reason. Nothing here needs a browser. Time and communication
figures are in ``figures_perf.py``.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go

from fsdpbench.analysis.frame import BREAKDOWN_MEASURED, breakdown_frames, has_values, numeric_column
from fsdpbench.core.formatting import byte_unit, fmt_pct
from fsdpbench.core.schema import (
    PEAK_RANK,
    PHASE,
    PRED_MODEL_STATES,
    PRED_MODEL_STATES_ERR,
    PRED_PEAK,
    PRED_PEAK_ERR,
    RANK,
    RUN,
    TRACED_MODEL_STATES,
    TRACED_PEAK,
    TRACED_PEAK_ERR,
    TRACKER_MODEL_STATES,
    TRACKER_PEAK,
    VENDOR_MODEL_STATES,
    VENDOR_MODEL_STATES_ERR,
)
from fsdpbench.report.data import axis_text, ok_cases, rows_with, shard_label, varying_axes
from fsdpbench.report.panel import (
    MEMORY_SOURCES,
    TRACKER_SOURCE,
    Panel,
    absent,
    base_layout,
    describe_ranks,
    strategy_color,
)

BREAKDOWN_COLORS = {
    "params": "#4C78A8",
    "grads": "#F58518",
    "optimizer state": "#54A24B",
    "activations": "#B279A2",
    "unsharded params/grads + comm buffers": "#E45756",
    "other": "#BAB0AC",
}
# (column, what, dash, marker): a traced line often lies on the analytic one, so it has markers of its own
# (drawn last, on top) that show where the lines coincide
_SCALING_LINES: tuple[tuple[str, str, str, str | None], ...] = (
    (PRED_PEAK, "analytic peak", "solid", None),
    (PRED_MODEL_STATES, "analytic model states", "dash", None),
    (TRACED_PEAK, "traced peak", "dot", "x-thin-open"),
    (TRACED_MODEL_STATES, "traced model states", "dashdot", "cross-thin-open"),
)
_MEASURED_MARKS = (  # (column, what, marker symbol, size)
    (TRACKER_PEAK, "measured peak", "circle", 11),
    (TRACKER_MODEL_STATES, "measured model states", "diamond-open", 10),
)
KEY_GROUP = "key"  # the legend's entries that say what each mark and line is, in grey
_KEY_COLOR = "#555"


def series_key_axes(cases: pd.DataFrame) -> list[str]:
    """Axes besides strategy and world size that split the cases into separate lines."""
    return [a for a in varying_axes(cases) if a != "shard_size"]


def series_name(row: Any, axes: list[str], several_runs: bool) -> str:
    parts = [str(row["strategy"]), shard_label(row)]
    parts += [axis_text(a, row.get(a)) for a in axes]
    if several_runs:
        parts.append(f"[{row[RUN]}]")
    return " ".join(p for p in parts if p)


def build_memory_scaling_panel(cases: pd.DataFrame) -> Panel:
    """Per-rank memory vs world size: measured tracker peaks/model states as markers, predictions as lines."""
    title = "Memory per rank vs world size — the (P+G+K)·Ψ/N check"
    ok = rows_with(ok_cases(cases), TRACKER_PEAK)
    if ok.empty or TRACKER_PEAK not in ok:
        return absent(
            "memory_scaling",
            title,
            "not measured in this run: no case finished with a tracker peak (mem_tracker_peak_bytes)",
        )
    value_cols = [TRACKER_PEAK, TRACKER_MODEL_STATES] + [c for c, *_ in _SCALING_LINES]
    unit, div = byte_unit([v for c in value_cols if c in ok for v in ok[c]])
    axes = series_key_axes(ok)
    several_runs = ok[RUN].nunique() > 1 if RUN in ok else False
    names = [series_name(r, axes, several_runs) for _, r in ok.iterrows()]
    ok = ok.assign(_series=names)
    fig = go.Figure()
    for name, sub in ok.groupby("_series", sort=False):
        fig.add_traces(_scaling_traces(sub.sort_values("world_size"), name, unit, div))
    fig.add_traces(_scaling_key(ok))
    sizes = sorted({int(n) for n in ok["world_size"]})
    fig.update_layout(
        **base_layout(
            xaxis=dict(
                title="world size N (ranks)", type="log", tickvals=sizes, ticktext=[str(n) for n in sizes]
            ),
            yaxis=dict(title=f"memory per rank ({unit})", rangemode="tozero"),
            height=620,
            # one entry per series (click: show or hide all its marks), then the key: never 6 per series
            legend=dict(orientation="v", x=1.02, y=1, xanchor="left", groupclick="togglegroup"),
        )
    )
    notes = []
    if not has_values(ok, PRED_PEAK) and not has_values(ok, PRED_MODEL_STATES):
        notes.append("analytic prediction not in this run: no pred_* columns (the memory model did not run)")
    if not any(has_values(ok, c) for c in (TRACED_PEAK, TRACED_MODEL_STATES)):
        notes.append(
            "traced prediction not in this run (no traced_* columns): run with --traced, "
            "or traced: true in the scenario"
        )
    caption = (
        f"Per-rank memory against world size N, one colour per series (the legend names them; the key "
        f"below them, in grey, says what each mark is). Markers are measured by the {TRACKER_SOURCE} in "
        f"the memory-tracked step: ● total at the peak of the largest rank, ◇ model states (params + grads "
        f"+ optimizer state after optimizer.step). Lines are predictions for the same cases: solid = "
        f"analytic peak, dashed = analytic model states (P+G+K)·Ψ/N, dotted with × = traced peak, "
        f"dash-dot with + = traced model states (where a traced line lies on the analytic one, its × and + "
        f"show it). Ranks: {describe_ranks(ok)}."
    )
    return Panel(key="memory_scaling", title=title, caption=caption, figure=fig, notes=notes)


def _scaling_traces(sub: pd.DataFrame, name: str, unit: str, div: float) -> list[go.Scatter]:
    """One series of the scaling figure: measured markers, predicted lines, one legend entry (its measured
    peak, named ``name``) for all of them; each trace's ``meta`` says what it is."""
    color = strategy_color(sub["strategy"].iloc[0])
    traces = []
    for col, what, symbol, size in _MEASURED_MARKS:
        if col == TRACKER_PEAK or has_values(sub, col):
            hover = dict(text=[_scaling_hover(r, unit, div) for _, r in sub.iterrows()], hoverinfo="text")
            traces.append(
                _by_world_size(
                    sub,
                    col,
                    div,
                    mode="markers",
                    name=name if col == TRACKER_PEAK else what,
                    meta=what,
                    legendgroup=name,
                    showlegend=col == TRACKER_PEAK,
                    marker=_mark(color, symbol, size),
                    **(hover if col == TRACKER_PEAK else {}),
                )
            )
    for col, what, dash, line_symbol in _SCALING_LINES:
        if has_values(sub, col):
            pts = sub[sub[col].notna()]
            marker = dict(symbol=line_symbol or "line-ew-open", size=14, color=color)
            traces.append(
                _by_world_size(
                    pts,
                    col,
                    div,
                    mode="lines+markers" if line_symbol or len(pts) == 1 else "lines",
                    name=what,
                    meta=what,
                    legendgroup=name,
                    showlegend=False,
                    line=dict(color=color, dash=dash, width=3 if line_symbol else 2),
                    marker=marker,
                )
            )
    return traces


def _mark(color: str, symbol: str, size: int) -> dict[str, Any]:
    """A measured marker: an open symbol drawn with a 2-px outline in its colour."""
    outline = dict(line=dict(width=2)) if symbol.endswith("-open") else {}
    return dict(color=color, size=size, symbol=symbol, **outline)


def _scaling_key(ok: pd.DataFrame) -> list[go.Scatter]:
    """Legend-only grey entries for the marks and lines the figure draws: what ●, ◇ and each dash mean."""
    key = []
    for col, what, symbol, size in _MEASURED_MARKS:
        if has_values(ok, col):
            marker = _mark(_KEY_COLOR, symbol, size)
            key.append(dict(name=what, mode="markers", marker=marker))
    for col, what, dash, line_symbol in _SCALING_LINES:
        if has_values(ok, col):
            line = dict(color=_KEY_COLOR, dash=dash, width=3 if line_symbol else 2)
            marker = dict(color=_KEY_COLOR, size=12, symbol=line_symbol or "line-ew-open")
            mode = "lines+markers" if line_symbol else "lines"
            key.append(dict(name=what, mode=mode, line=line, marker=marker))
    return [
        go.Scatter(
            x=[None],
            y=[None],
            legendgroup=KEY_GROUP,
            legendgrouptitle_text="key (every colour)",
            hoverinfo="skip",
            **entry,
        )
        for entry in key
    ]


def _by_world_size(rows: pd.DataFrame, column: str, div: float, **scatter: Any) -> go.Scatter:
    """A column (divided by ``div``) against world size."""
    return go.Scatter(x=rows["world_size"].tolist(), y=(rows[column] / div).tolist(), **scatter)


def _scaling_hover(row: Any, unit: str, div: float) -> str:
    lines = [
        f"<b>{row['label']}</b>",
        f"measured peak {row[TRACKER_PEAK] / div:.2f} {unit} (rank {row.get(PEAK_RANK, '?')}, tracker)",
    ]
    if pd.notna(row.get(TRACKER_MODEL_STATES)):
        lines.append(f"measured model states {row[TRACKER_MODEL_STATES] / div:.2f} {unit}")
    for col, what, err in (
        (PRED_PEAK, "analytic peak", PRED_PEAK_ERR),
        (PRED_MODEL_STATES, "analytic model states", PRED_MODEL_STATES_ERR),
        (TRACED_PEAK, "traced peak", TRACED_PEAK_ERR),
        (VENDOR_MODEL_STATES, "DeepSpeed's estimate of model states", VENDOR_MODEL_STATES_ERR),
    ):
        if pd.notna(row.get(col)):
            lines.append(f"{what} {row[col] / div:.2f} {unit} (error {fmt_pct(row.get(err))})")
    return "<br>".join(lines)


def build_memory_breakdown_panel(cases: pd.DataFrame) -> Panel:
    """Stacked bars per case: memory at the peak by category, measured (tracker) beside predicted."""
    title = "Memory breakdown at the peak, per case"
    ok = rows_with(ok_cases(cases), TRACKER_PEAK)
    if ok.empty:
        return absent(
            "memory_breakdown",
            title,
            "not measured in this run: no case finished with tracker memory by category",
        )
    measured, predicted, grads_note = breakdown_frames(ok)
    has_pred = predicted is not None
    labels = ok["label"].tolist()
    kinds = ["measured", "predicted"] if has_pred else ["measured"]
    # horizontal bars, one row per case (and kind), so that long case labels stay readable
    y = [[lab for lab in labels for _ in kinds], [k for _ in labels for k in kinds]] if has_pred else labels
    unit, div = byte_unit(list(ok[TRACKER_PEAK]) + list(numeric_column(ok, PRED_PEAK)))
    fig = go.Figure()
    for group in BREAKDOWN_MEASURED:
        x = []
        for i in range(len(labels)):
            x.append(float(measured[group].iloc[i]) / div)
            if predicted is not None:
                x.append(float(predicted[group].iloc[i]) / div)  # NaN: no prediction for this case
        fig.add_trace(
            go.Bar(
                x=x,
                y=y,
                orientation="h",
                name=group,
                marker_color=BREAKDOWN_COLORS[group],
                hovertemplate=f"%{{y}}<br>{group}: %{{x:.2f}} {unit}<extra></extra>",
            )
        )
    # totals beside the bars: measured, predicted (error); with predictions, y is (case, kind) pairs
    y_case: list[str] = []
    y_kind: list[str] = []
    tx: list[float] = []
    tt: list[str] = []
    for i, (_, row) in enumerate(ok.iterrows()):
        rows = [("measured", row[TRACKER_PEAK], "")]
        if has_pred and pd.notna(row.get(PRED_PEAK)):
            rows.append(("predicted", row[PRED_PEAK], f" ({fmt_pct(row.get(PRED_PEAK_ERR))})"))
        for kind, total, extra in rows:
            y_case.append(labels[i])
            y_kind.append(kind)
            tx.append(total / div)
            tt.append(f" {total / div:.2f}{extra}")
    ty: list[Any] = [y_case, y_kind] if has_pred else y_case
    fig.add_trace(
        go.Scatter(
            x=tx,
            y=ty,
            text=tt,
            mode="text",
            textposition="middle right",
            name="total",
            showlegend=False,
            textfont=dict(size=10),
            hoverinfo="skip",
        )
    )
    n_bars = len(labels) * len(kinds)
    fig.update_layout(
        **base_layout(
            barmode="stack",
            xaxis=dict(title=f"memory per rank at the peak ({unit})", range=[0, max(tx) * 1.2]),
            yaxis=dict(autorange="reversed", type="multicategory" if has_pred else "category"),
            height=max(360, 22 * n_bars + 140),
            margin=dict(l=70, r=30, t=30, b=60),
            legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", traceorder="normal"),
        )
    )
    notes = [grads_note] if grads_note else []
    if not has_pred:
        notes.append("prediction not in this run: no pred_* columns (the memory model did not run)")
    caption = (
        f"Memory of the rank with the largest peak, by category, at the moment of its peak in the "
        f"memory-tracked step; measured = {TRACKER_SOURCE}, predicted = the analytic model for the same case "
        f"(label: predicted peak and its error against the measured peak). DDP's gradient buckets are "
        f"'other' to the tracker and 'comm buffers' to the model. Ranks: {describe_ranks(ok)}."
    )
    return Panel(key="memory_breakdown", title=title, caption=caption, figure=fig, notes=notes)


def build_memory_timeline_panel(cases: pd.DataFrame, timelines: pd.DataFrame) -> Panel:
    """Memory over one run of a case per rank (NVML/RSS/...), phases shaded; a menu picks the case."""
    title = "Memory timeline per rank"
    if timelines is None or timelines.empty or not {"case_id", "t_s", "bytes"} <= set(timelines.columns):
        return absent(
            "memory_timeline",
            title,
            "not measured in this run: no cases/<case_id>/timeline.parquet "
            "(memory was not sampled over time by this run's worker)",
        )
    tl = timelines.copy()
    if RUN not in tl:
        tl[RUN] = cases[RUN].iloc[0] if RUN in cases and len(cases) else RUN
    for col, default in ((RANK, 0), (PHASE, ""), ("source", "sampled")):
        if col not in tl:
            tl[col] = default
    labels = dict(zip(zip(cases.get(RUN, []), cases.get("case_id", [])), cases.get("label", [])))
    keys = [k for k in labels if k in set(zip(tl[RUN], tl["case_id"]))]
    keys += [k for k in dict.fromkeys(zip(tl[RUN], tl["case_id"])) if k not in labels]
    unit, div = byte_unit(tl["bytes"])
    fig = go.Figure()
    owners: list[int] = []
    menus = []
    for i, key in enumerate(keys):
        sub = tl[(tl[RUN] == key[0]) & (tl["case_id"] == key[1])]
        for (rank, source), line in sub.groupby([RANK, "source"], sort=True):
            line = line.sort_values("t_s")
            fig.add_trace(
                go.Scatter(
                    x=line["t_s"].tolist(),
                    y=(line["bytes"] / div).tolist(),
                    mode="lines",
                    visible=i == 0,
                    name=f"rank {rank} · {source}",
                    customdata=line[PHASE].astype(str).tolist(),
                    hovertemplate=f"rank {rank} ({source})<br>t=%{{x:.3f}} s<br>%{{y:.2f}} {unit}"
                    "<br>phase %{customdata}<extra></extra>",
                )
            )
            owners.append(i)
        shapes, notes = _phase_bands(sub)
        menus.append((labels.get(key, key[1]), shapes, notes))
    buttons = [
        dict(
            label=label,
            method="update",
            args=[{"visible": [o == i for o in owners]}, {"shapes": shapes, "annotations": notes}],
        )
        for i, (label, shapes, notes) in enumerate(menus)
    ]
    fig.update_layout(
        **base_layout(
            xaxis=dict(title="time since the rank's sampler started (s)"),
            yaxis=dict(title=f"memory ({unit})"),
            shapes=menus[0][1],
            annotations=menus[0][2],
            margin=dict(l=70, r=30, t=80, b=60),
            showlegend=True,
            updatemenus=[dict(buttons=buttons, direction="down", x=0, xanchor="left", y=1.18, yanchor="top")]
            if len(buttons) > 1
            else [],
        )
    )
    sources = [MEMORY_SOURCES.get(str(s), str(s)) for s in dict.fromkeys(tl["source"])]
    caption = (
        f"Memory of each rank over time while the case ran, sampled by {', '.join(sources)}; shaded bands "
        f"are the worker's phases (rank 0). Pick the case in the menu. Ranks: {describe_ranks(cases)}."
    )
    return Panel(key="memory_timeline", title=title, caption=caption, figure=fig)


def _phase_bands(sub: pd.DataFrame) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Shaded x-ranges and labels for the contiguous phases of the lowest rank."""
    if PHASE not in sub or sub[PHASE].astype(str).eq("").all():
        return [], []
    first = sub[sub[RANK] == sub[RANK].min()].sort_values("t_s")
    phase = first[PHASE].astype(str)
    block = (phase != phase.shift()).cumsum()
    shapes, notes = [], []
    for j, (_, seg) in enumerate(first.groupby(block, sort=True)):
        name = seg[PHASE].iloc[0]
        if not name:
            continue
        x0, x1 = float(seg["t_s"].iloc[0]), float(seg["t_s"].iloc[-1])
        shapes.append(
            dict(
                type="rect",
                xref="x",
                yref="paper",
                x0=x0,
                x1=x1,
                y0=0,
                y1=1,
                layer="below",
                line=dict(width=0),
                fillcolor="#DDE6F2" if j % 2 == 0 else "#F2E6DD",
                opacity=0.6,
            )
        )
        notes.append(
            dict(
                x=(x0 + x1) / 2,
                y=1.0,
                xref="x",
                yref="paper",
                yanchor="bottom",
                text=str(name),
                showarrow=False,
                font=dict(size=10, color="#555"),
            )
        )
    return shapes, notes
