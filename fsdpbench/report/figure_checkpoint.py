"""The checkpoint figure: per method and strategy, save and load time (left) and rank 0's host peak, measured
(RSS above the training baseline) beside the modelled one (right)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from fsdpbench.core import schema
from fsdpbench.core.formatting import byte_unit
from fsdpbench.report.data import ok_cases, rows_with
from fsdpbench.report.panel import Panel, absent, base_layout, describe_ranks, strategy_color

KEY, TITLE = "checkpoint", "Checkpoint: save/load time and rank 0's host peak, per method"
METHOD = schema.CHECKPOINT_COLUMNS["method"]


def build_checkpoint_panel(cases: pd.DataFrame) -> Panel:
    """Grouped bars per method × world size, one colour per strategy; the modelled host peak as markers."""
    ok = rows_with(ok_cases(cases), schema.CKPT_CASE_SAVE_S)
    if ok.empty or METHOD not in ok:
        return absent(KEY, TITLE, "no case of this run ran a checkpoint phase (the 'checkpoint:' axis)")
    ok = ok.assign(group=[f"{m} · {n} ranks" for m, n in zip(ok[METHOD], ok["world_size"])])
    groups = list(dict.fromkeys(ok.sort_values(["world_size", METHOD])["group"]))
    unit, div = byte_unit(ok[schema.CKPT_RANK0_HOST_PEAK])
    fig = make_subplots(rows=1, cols=2, subplot_titles=("save + load time (s)", f"rank 0 host peak ({unit})"))
    for strategy, sub in ok.groupby("strategy", sort=False):
        color = strategy_color(strategy)
        for col, name, opacity in (
            (schema.CKPT_CASE_SAVE_S, "save", 1.0),
            (schema.CKPT_CASE_LOAD_S, "load", 0.5),
        ):
            fig.add_trace(
                go.Bar(
                    x=sub["group"],
                    y=sub[col],
                    name=f"{strategy} {name}",
                    marker_color=color,
                    opacity=opacity,
                    legendgroup=strategy,
                    offsetgroup=f"{strategy}-{name}",
                    hovertemplate=f"{strategy} %{{x}}<br>{name} %{{y:.3f}} s<extra></extra>",
                ),
                row=1,
                col=1,
            )
        fig.add_trace(
            go.Bar(
                x=sub["group"],
                y=pd.to_numeric(sub[schema.CKPT_RANK0_HOST_PEAK], errors="coerce") / div,
                name=f"{strategy} host peak (RSS, measured)",
                marker_color=color,
                legendgroup=strategy,
                offsetgroup=strategy,
                hovertemplate=f"{strategy} %{{x}}<br>RSS above baseline %{{y:.1f}} {unit}<extra></extra>",
            ),
            row=1,
            col=2,
        )
        fig.add_trace(
            go.Scatter(
                x=sub["group"],
                y=pd.to_numeric(sub[schema.PRED_CKPT_RANK0_HOST_PEAK], errors="coerce") / div,
                name=f"{strategy} host peak (modelled)",
                mode="markers",
                marker=dict(symbol="line-ew-open", size=18, color=color, line=dict(width=3)),
                legendgroup=strategy,
                hovertemplate=f"{strategy} %{{x}}<br>modelled %{{y:.1f}} {unit}<extra></extra>",
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(categoryorder="array", categoryarray=groups, tickangle=-30)
    fig.update_layout(**base_layout(barmode="group", margin=dict(l=70, r=30, t=60, b=140)))
    failed = (
        ok[~ok[schema.CKPT_ROUND_TRIP_OK].astype(bool)] if schema.CKPT_ROUND_TRIP_OK in ok else ok.iloc[0:0]
    )
    caption = (
        "Each case saves after its measured steps, loads into a freshly built model and optimizer, and takes "
        "one more step. Left: wall time of the save and of the load (the slowest rank). Right: rank 0's host "
        "memory during the save, RSS sampled above the training baseline (measured, bars) and the analytic "
        f"model's (modelled, ticks). Ranks: {describe_ranks(ok)}."
    )
    notes = [f"round trip not equal: {', '.join(failed['case_id'])}"] if len(failed) else []
    return Panel(key=KEY, title=TITLE, caption=caption, figure=fig, notes=notes)
