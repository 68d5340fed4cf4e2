"""What every figure function returns, and the wording and units the figures share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from fsdpbench.core.schema import DEVICE_NAME
from fsdpbench.report.data import declared_strategy, strategy_rank

# colours for strategies that declare none (or are not loaded here)
_EXTRA_COLORS = ("#9D755D", "#EECA3B", "#FF9DA6", "#BAB0AC", "#79706E")
TRACKER_SOURCE = "tracker (live tensors from PyTorch's memory trackers)"
MEMORY_SOURCES = {
    "tracker": TRACKER_SOURCE,
    "alloc": "CUDA caching allocator",
    "allocator": "CUDA caching allocator",
    "nvml": "NVML (device memory of the GPU)",
    "rss": "RSS (resident memory of the rank process)",
}


@dataclass(kw_only=True)
class Panel:
    """One section of the report: a figure (or why there is none) and a one-line caption."""

    key: str
    title: str
    caption: str
    figure: Any = None  # plotly.graph_objects.Figure
    missing: str | None = None  # shown instead of the figure: "not measured in this run: <why>"
    notes: list[str] = field(default_factory=list)  # parts of the figure that are absent, and why


def absent(key: str, title: str, missing: str) -> Panel:
    """The panel of a figure that cannot be drawn, saying why."""
    return Panel(key=key, title=title, caption="", missing=missing)


def strategy_color(strategy: str) -> str:
    """The strategy's declared colour, the same in every figure."""
    declared = declared_strategy(strategy)
    if declared is not None and declared.color:
        return declared.color
    return _EXTRA_COLORS[sum(map(ord, str(strategy))) % len(_EXTRA_COLORS)]


def describe_ranks(cases: pd.DataFrame) -> str:
    """Which devices the ranks were, in words: 'CPU ranks (gloo) on CPU: AMD EPYC (2 cores)'."""
    parts = []
    cols = [c for c in ("device", "backend", DEVICE_NAME) if c in cases]
    for key, _ in cases.groupby(cols, dropna=False, sort=False) if cols else []:
        key = dict(zip(cols, key if isinstance(key, tuple) else (key,)))
        device, backend, name = key.get("device"), key.get("backend") or "?", key.get(DEVICE_NAME)
        if device == "cuda":
            text = f"GPUs ({str(backend).upper()})" + (f": {name}" if isinstance(name, str) else "")
        else:
            text = f"CPU ranks ({backend}) standing in for GPUs" + (
                f", on {name}" if isinstance(name, str) else ""
            )
        if text not in parts:
            parts.append(text)
    return "; ".join(parts) or "ranks of unknown device"


def ordered_strategies(cases: pd.DataFrame) -> list[str]:
    names = list(dict.fromkeys(cases["strategy"].dropna())) if "strategy" in cases else []
    return sorted(names, key=strategy_rank)


def steps_text(cases: pd.DataFrame) -> str:
    """'2 warm-up + 5 timed steps' (or 'varies by case')."""
    parts = []
    for col, word in (("warmup_steps", "warm-up"), ("timed_steps", "timed")):
        if col in cases and cases[col].notna().any():
            values = sorted({int(v) for v in cases[col].dropna()})
            parts.append(f"{values[0]} {word}" if len(values) == 1 else f"{values[0]}–{values[-1]} {word}")
    return (" + ".join(parts) + " steps") if parts else "steps not recorded"


def base_layout(**kw: Any) -> dict[str, Any]:
    layout: dict[str, Any] = dict(
        template="plotly_white",
        margin=dict(l=70, r=30, t=40, b=60),
        height=480,
        legend=dict(orientation="v", x=1.02, y=1, xanchor="left"),
        hoverlabel=dict(namelength=-1),
        font=dict(family="DejaVu Sans, Arial, sans-serif", size=12),
    )
    layout.update(kw)
    return layout
