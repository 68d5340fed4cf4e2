"""Cases named as a person tells them apart: the strategy, the ranks and only what differs among the
cases shown (``wrap=size(1e5)``, ``prefetch=2``), never only the hashed case id, which names files.
The terminal (progress lines, the run summary, compare, regress) and the report use these.

    from fsdpbench.analysis.names import case_labels
    case_labels(cases)      # ['zero3 n4 size(1e5)', 'zero3 n4 size(1e6)', ...]
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from fsdpbench.core.case import wrap_text
from fsdpbench.core.schema import CASE_ID, RUN

# configuration columns that may vary in a scenario (besides strategy and world size); a case's label
# names those that do
AXES = (
    "model",
    "model_args",
    "shard_size",
    "wrap",
    "prefetch",
    "precision",
    "optimizer",
    "batch_size",
    "seq_len",
    "activation_checkpointing",
    "compile",
    "cpu_offload",
    "backward_prefetch",
    "forward_prefetch",
    "limit_all_gathers",
    "strategy_args",
    "host_tuning",
    "mode",
)


def declared_strategy(name: Any) -> Any:
    """The class of a strategy (what it declares of itself), or None for a plugin this process has
    not loaded (the report imports none)."""
    from fsdpbench.strategies import find_strategy

    return find_strategy(str(name))


def shard_label(row: Any) -> str:
    """'shard=N' for a case of a strategy that shards within shard groups (HSDP), else ''."""
    declared = declared_strategy(row.get("strategy"))
    if declared is None or not declared.sharding.over_shard_group or not present(row.get("shard_size")):
        return ""
    return axis_text("shard_size", row.get("shard_size"))


# axes that a strategy normalises (DDP has no wrap, only HSDP a shard size): only variation within a
# strategy counts
_PER_STRATEGY_AXES = ("wrap", "shard_size")


def axis_values(cases: pd.DataFrame, axis: str) -> pd.Series:
    """The cases' values on an axis as a person tells them apart: the wrap policy with its parameter
    (``size(1e5)``, core.case.wrap_text), every other axis its column."""
    if axis != "wrap":
        return cases[axis]
    return pd.Series(
        [
            wrap_text(r.get("wrap"), r.get("wrap_min_params"), r.get("wrap_classes"))
            for _, r in cases.iterrows()
        ],
        index=cases.index,
        dtype=object,
    )


def varying_axes(cases: pd.DataFrame, axes: tuple[str, ...] = AXES) -> list[str]:
    """The configuration columns that take more than one value among these cases."""
    out = []
    for axis in axes:
        if axis not in cases:
            continue
        values = axis_values(cases, axis)
        if axis in _PER_STRATEGY_AXES and "strategy" in cases:
            varies = any(sub.astype(str).nunique() > 1 for _, sub in values.groupby(cases["strategy"]))
        else:
            varies = values.astype(str).nunique(dropna=False) > 1
        if varies:
            out.append(axis)
    return out


def axis_text(axis: str, value: Any) -> str:
    if axis == "model_args":
        try:
            args = json.loads(value) if isinstance(value, str) else dict(value)
        except (TypeError, ValueError):
            return str(value)
        return ",".join(f"{k}={v}" for k, v in sorted(args.items())) or "default args"
    if axis == "shard_size":
        return f"shard={int(value)}" if present(value) else ""
    if axis == "prefetch":
        return f"prefetch={value}"
    if axis in ("precision", "model"):
        return str(value)
    if axis == "mode":  # a plot with real and emulated cases names the emulated ones
        return "emulated" if value == "emulated" else "real"
    if isinstance(value, (bool, np.bool_)):
        return axis if value else f"no {axis}"
    return f"{axis}={value}"


def case_labels(cases: pd.DataFrame) -> list[str]:
    """Short unique labels: strategy, ranks and only the axes that vary (and the run when several)."""
    axes = varying_axes(cases)
    several_runs = RUN in cases and cases[RUN].nunique() > 1
    shown = {a: axis_values(cases, a).tolist() for a in axes}
    labels = []
    for i, (_, r) in enumerate(cases.iterrows()):
        parts = [
            str(r.get("strategy")),
            f"n{int(r['world_size'])}" if present(r.get("world_size")) else "n?",
        ]
        if "shard_size" not in axes and shard_label(r):
            parts.append(shard_label(r))
        parts += [
            t for t in (axis_text(a, shown[a][i]) for a in axes if not _unused(a, r.get("strategy"))) if t
        ]
        if several_runs:
            parts.append(f"[{r[RUN]}]")
        labels.append(" ".join(parts))
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):  # still equal (e.g. a field outside AXES): add the id's hash
        if label in seen:
            labels[i] = f"{label} ({id_tail(cases.iloc[i][CASE_ID])})"
        seen[label] = i
    return labels


def _unused(axis: str, strategy: Any) -> bool:
    """An axis that this strategy does not use (DDP/ZeRO-1 have no wrap), so its label leaves it out."""
    declared = declared_strategy(strategy)
    return axis == "wrap" and declared is not None and not declared.uses_wrap


def present(value: Any) -> bool:
    """A value that is there (not None/NaN)."""
    try:
        return value is not None and not pd.isna(value)
    except (TypeError, ValueError):
        return False


def case_names(cases: Any) -> dict[str, str]:
    """Each case's label among these cases (``Case`` objects: a sweep before it runs), by case id."""
    cases = list(cases)
    if not cases:
        return {}
    frame = pd.DataFrame([{**c.to_dict(), CASE_ID: c.case_id} for c in cases])
    return dict(zip(frame[CASE_ID], case_labels(frame), strict=True))


def id_tail(case_id: Any) -> str:
    """The hash that ends a case id: what tells its directory (``cases/<id>/``) apart, in six characters."""
    return str(case_id).rsplit("_", 1)[-1]
