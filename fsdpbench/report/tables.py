"""Tables of the report and of ``fsdpbench compare``: strategies side by side, every case, the verdict.

Computed here as plain data (numbers and their text); ``page.py`` renders HTML, ``commands/compare.py``
renders a rich table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from fsdpbench.analysis.frame import (
    BREAKDOWN_MEASURED,
    breakdown_frames,
    has_values,
    is_reference_strategy,
    number,
)
from fsdpbench.formatting import fmt_bytes, fmt_pct
from fsdpbench.report.data import axis_text, case_labels, ok_cases
from fsdpbench.schema import (
    FAILED_STATUSES,
    MEASURED_ALLOC_ALLOCATED,
    MEASURED_ALLOC_RESERVED,
    MEASURED_NVML,
    OK,
    PEER_COLUMNS,
    STEP_TIME,
    TRACED_ALLOC_ALLOCATED,
    TRACED_ALLOC_ALLOCATED_ERR,
    TRACED_ALLOC_RESERVED,
    TRACED_ALLOC_RESERVED_ERR,
    TRACED_NVML,
    TRACED_NVML_ERR,
    TRACKER_MODEL_STATES,
    TRACKER_PEAK,
)

TIE_TOLERANCE = 0.005  # values within 0.5% of the best are all winners


@dataclass(kw_only=True)
class CompareRow:
    """One metric across the compared cases: text per case, and which case wins (None: no winner)."""

    metric: str
    text: dict[str, str]
    values: dict[str, float] = field(default_factory=dict)
    better: str | None = None  # "low" | "high" | None
    winners: list[str] = field(default_factory=list)


def _winners(values: dict[str, float], better: str | None) -> list[str]:
    vals = {k: v for k, v in values.items() if v is not None}
    if better is None or len(vals) < 2:
        return []
    best = min(vals.values()) if better == "low" else max(vals.values())
    if all(abs(v - best) <= TIE_TOLERANCE * max(abs(best), 1e-12) for v in vals.values()):
        return []  # everyone equal: no winner
    return [k for k, v in vals.items() if abs(v - best) <= TIE_TOLERANCE * max(abs(best), 1e-12)]


def _sum_cols(row: pd.Series, cols: tuple[str, ...]) -> float | None:
    vals = [number(row.get(c)) for c in cols if c in row.index]
    vals = [v for v in vals if v is not None]
    return sum(vals) if vals else None


def compare_rows(cases: pd.DataFrame) -> list[CompareRow]:
    """Metrics as rows, cases (by label) as columns: memory by category measured / predicted, time, comm."""
    cols = {r["label"]: r for _, r in cases.iterrows()}
    rows: list[CompareRow] = []

    def add(
        metric: str,
        value_fn: Callable[[pd.Series], float | None],
        fmt: Callable[[pd.Series, Any], str],
        better: str | None,
        between_ranks: bool = False,
    ) -> None:
        """between_ranks: a communication metric, which a 1-rank case does not have (said so, not '—')."""
        alone = {k for k, r in cols.items() if between_ranks and _one_rank(r)}
        values = {k: None if k in alone else value_fn(r) for k, r in cols.items()}
        if all(v is None for v in values.values()) and not alone:
            return
        text = {k: NO_COMM if k in alone else fmt(r, values[k]) for k, r in cols.items()}
        rows.append(
            CompareRow(
                metric=metric, text=text, values=values, better=better, winners=_winners(values, better)
            )
        )

    def mem_pair(pred_col: str, err_col: str | None) -> Callable[[pd.Series, Any], str]:
        def fmt(r: pd.Series, v: Any) -> str:
            pred = number(r.get(pred_col))
            if pred is None:
                return fmt_bytes(v)
            err = f" ({fmt_pct(r.get(err_col))})" if err_col and number(r.get(err_col)) is not None else ""
            return f"{fmt_bytes(v)} / {fmt_bytes(pred)}{err}"

        return fmt

    rows.append(CompareRow(metric="status", text={k: str(r.get("status")) for k, r in cols.items()}))
    add(
        "peak / rank: measured / predicted",
        lambda r: number(r.get(TRACKER_PEAK)),
        mem_pair("pred_peak_bytes", "pred_peak_err"),
        "low",
    )
    add(
        "model states: measured / predicted",
        lambda r: number(r.get(TRACKER_MODEL_STATES)),
        mem_pair("pred_model_states_bytes", "pred_model_states_err"),
        "low",
    )
    measured, predicted, _ = breakdown_frames(cases)
    measured.index = list(cols)  # by label, as the cases
    if predicted is not None:
        predicted.index = list(cols)
    for group in BREAKDOWN_MEASURED:
        add(
            f"  {group} at peak",
            lambda r, g=group: number(measured.at[r["label"], g]),
            lambda r, v, g=group: (
                fmt_bytes(v)
                + (f" / {fmt_bytes(number(predicted.at[r['label'], g]))}" if predicted is not None else "")
            ),
            None,
        )
    # the allocator model's predictions (a --traced run of a CUDA case) beside the allocator and NVML
    for col, name, pred, err in (
        (
            MEASURED_ALLOC_ALLOCATED,
            "allocator peak allocated",
            TRACED_ALLOC_ALLOCATED,
            TRACED_ALLOC_ALLOCATED_ERR,
        ),
        (
            MEASURED_ALLOC_RESERVED,
            "allocator peak reserved",
            TRACED_ALLOC_RESERVED,
            TRACED_ALLOC_RESERVED_ERR,
        ),
        (MEASURED_NVML, "NVML peak (GPU)", TRACED_NVML, TRACED_NVML_ERR),
        ("mem_rss_peak_bytes", "RSS peak (process)", None, None),
    ):
        predicted_here = pred is not None and pred in cases and cases[pred].notna().any()
        label = f"{name}: measured / predicted" if predicted_here else name
        fmt = mem_pair(pred, err) if predicted_here else (lambda r, v: fmt_bytes(v))
        add(label, lambda r, c=col: number(r.get(c)), fmt, "low")
    if _any_offload(cases):
        add(
            "params on host (CPU offload): measured / predicted",
            lambda r: number(r.get("mem_placement_params_host_bytes")),
            lambda r, v: f"{fmt_bytes(v)} / {fmt_bytes(number(r.get('pred_params_host_bytes')))}",
            None,
        )
    add("step time (p10–p90)", lambda r: number(r.get(STEP_TIME)), _fmt_step, "low")
    # a model's estimate on a link the run may not have: shown beside the measurement, never a winner
    add("step time, modelled (error)", lambda r: number(r.get("model_step_time_ms")), _fmt_modelled, None)
    add(
        "throughput",
        lambda r: number(r.get("throughput_samples_s")),
        lambda r, v: "—" if v is None else f"{v:.1f} samples/s",
        "high",
    )
    add(
        "comm / step / rank: measured / predicted",
        _comm_total,
        lambda r, v: (
            fmt_bytes(v)
            + (
                f" / {fmt_bytes(number(r.get('comm_pred_total_bytes')))}"
                if number(r.get("comm_pred_total_bytes")) is not None
                else ""
            )
        ),
        "low",
        True,
    )
    add("bus bandwidth (nccl-tests busbw)", _busbw_total, _fmt_busbw, "high", True)
    for metric, col, text, better in (
        ("exposed comm", "overlap_exposed_comm_ms", "{:.1f} ms", "low"),
        ("overlap", "overlap_ratio", "{:.0%}", "high"),
    ):
        add(
            metric,
            lambda r, c=col: number(r.get(c)),
            lambda r, v, t=text: "—" if v is None else t.format(v),
            better,
            between_ranks=True,
        )
    return rows


NO_COMM = "no communication between ranks"
_BUSBW_KINDS = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}


def _one_rank(r: pd.Series) -> bool:
    return number(r.get("world_size")) == 1


def _busbw_total(r: pd.Series) -> float | None:
    """The case's bus bandwidth over all its collectives: bytes-weighted by time (Σ busbw·t / Σ t)."""
    pairs = [(number(r.get(f"comm_{k}_busbw_gbs")), number(r.get(f"comm_{k}_time_ms"))) for k in _BUSBW_KINDS]
    pairs = [(b, t) for b, t in pairs if b is not None and t]
    return sum(b * t for b, t in pairs) / sum(t for _, t in pairs) if pairs else None


def _fmt_busbw(r: pd.Series, v: Any) -> str:
    if v is None:
        return "—"
    parts = [
        f"{short} {number(r.get(f'comm_{k}_busbw_gbs')):.2f}"
        for k, short in _BUSBW_KINDS.items()
        if number(r.get(f"comm_{k}_busbw_gbs")) is not None
    ]
    return f"{v:.2f} GB/s ({', '.join(parts)})"


def _fmt_step(r: pd.Series, v: Any) -> str:
    if v is None:
        return "—"
    p10, p90 = number(r.get("step_time_p10_ms")), number(r.get("step_time_p90_ms"))
    return f"{v:.1f} ms" + (f" ({p10:.0f}–{p90:.0f})" if p10 is not None and p90 is not None else "")


def _fmt_modelled(r: pd.Series, v: Any) -> str:
    """Modelled step time with its error against the measured one, and the exposed communication."""
    if v is None:
        return "—"
    err = number(r.get("model_step_err"))
    exposed = number(r.get("model_exposed_comm_ms"))
    link = str(r.get("model_link") or "").split(" (")[0]
    return (
        f"{v:.1f} ms"
        + (f" on {link}" if link else "")
        + (f" ({fmt_pct(err)})" if err is not None else "")
        + (f", exposed comm {exposed:.1f} ms" if exposed is not None else "")
    )


def _comm_total(r: pd.Series) -> float | None:
    total = number(r.get("comm_total_bytes"))
    if total is not None:
        return total
    return _sum_cols(
        r,
        tuple(
            c
            for c in r.index
            if c.startswith("comm_")
            and c.endswith("_bytes")
            and c not in ("comm_total_bytes", "comm_pred_total_bytes")
        ),
    )


def glance_groups(cases: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Cases that differ only in strategy/wrap/prefetch (same world size and settings), ≥ 2 per group."""
    keys = [k for k in PEER_COLUMNS if k in cases]
    groups = [
        g
        for _, g in (cases.groupby(keys, sort=False, dropna=False) if keys else [(None, cases)])
        if len(g) >= 2
    ]
    # a title names the precision, and every other setting that tells this group from the others
    named = [k for k in _TITLE_KEYS if k in cases and (k == "precision" or _differs(groups, k))]
    out = []
    for group in groups:
        group = group.assign(label=case_labels(group))  # only what differs inside the group
        first = group.iloc[0]
        parts = [str(first.get("ranks_label", "")), str(first.get("model", ""))]
        parts += [t for t in (axis_text(k, first.get(k)) for k in named) if t]
        title = ", ".join(p for p in parts if p)
        if "run" in cases and cases["run"].nunique() > 1:
            title += f" [{first['run']}]"
        out.append((title, group))
    return out


# settings a group title may name (ranks, device and backend are in its ranks label, the model always)
_TITLE_KEYS = tuple(k for k in PEER_COLUMNS if k not in ("run", "world_size", "model", "device", "backend"))


def _differs(groups: list[pd.DataFrame], key: str) -> bool:
    return len({str(g.iloc[0].get(key)) for g in groups}) > 1


def verdict_lines(cases: pd.DataFrame) -> list[str]:
    """Per group at the same world size: least memory per rank and fastest, against DDP."""
    lines = []
    for title, group in glance_groups(ok_cases(cases)):  # labels inside a group name only what differs
        parts = []
        by_label = group.set_index("label")
        if has_values(group, TRACKER_PEAK):
            peaks = {k: number(v) for k, v in by_label[TRACKER_PEAK].items()}
            best = _winners(peaks, "low")
            if not best:
                parts.append(f"peak memory per rank equal for all ({fmt_bytes(next(iter(peaks.values())))})")
            else:
                ddp = group[is_reference_strategy(group)]
                vs = ""
                if len(ddp) and not is_reference_strategy(by_label.loc[best]).any():
                    d = float(ddp[TRACKER_PEAK].iloc[0])
                    vs = f", {(peaks[best[0]] - d) / d:+.0%} vs DDP's {fmt_bytes(d)}"
                parts.append(
                    f"least memory per rank: {' = '.join(best)} ({fmt_bytes(peaks[best[0]])} "
                    f"tracker peak{vs})"
                )
        if has_values(group, STEP_TIME):
            times = {k: number(v) for k, v in by_label[STEP_TIME].items()}
            best = _winners(times, "low")
            slowest = max((k for k in times if times[k] is not None), key=lambda k: times[k])
            if best:
                ratio = times[slowest] / times[best[0]]
                parts.append(
                    f"fastest: {' = '.join(best)} ({times[best[0]]:.1f} ms/step; slowest {slowest} "
                    f"is {ratio:.1f}× slower)"
                )
            else:
                parts.append(f"step time equal for all ({times[slowest]:.1f} ms)")
        if parts:
            lines.append(f"{title} — " + "; ".join(parts))
    return lines


def case_table(cases: pd.DataFrame, metas: dict[str, dict[str, Any]] | None = None) -> pd.DataFrame:
    """Every case (failed and skipped too) with its key metrics, predictions and errors, as display text."""
    metas = metas or {}
    out = []
    for _, r in cases.iterrows():
        launch = (metas.get(r.get("run"), {}).get("cases") or {}).get(r["case_id"], {})
        status = str(r.get("status"))
        note = str(r.get("error") or "")
        out.append(
            {
                "case": r.get("label"),
                "case_id": r["case_id"],
                "status": status,
                "ranks": r.get("ranks_label"),
                "step time (p10–p90)": _fmt_step(r, number(r.get(STEP_TIME))),
                "step time modelled": _fmt_modelled(r, number(r.get("model_step_time_ms"))),
                "throughput": "—"
                if number(r.get("throughput_samples_s")) is None
                else f"{r['throughput_samples_s']:.1f} samples/s",
                "peak measured (tracker)": fmt_bytes(number(r.get(TRACKER_PEAK))),
                "peak predicted": fmt_bytes(number(r.get("pred_peak_bytes"))),
                "peak error": fmt_pct(r.get("pred_peak_err")),
                "model states measured": fmt_bytes(number(r.get(TRACKER_MODEL_STATES))),
                "model states predicted": fmt_bytes(number(r.get("pred_model_states_bytes"))),
                "model states error": fmt_pct(r.get("pred_model_states_err")),
                # DeepSpeed's own estimator (ds_zero2/3 only; docs/deepspeed.md explains its terms)
                "model states, DeepSpeed's estimate": fmt_bytes(number(r.get("ds_est_model_states_bytes"))),
                "DeepSpeed estimate error": fmt_pct(r.get("ds_est_model_states_err")),
                "comm / step": fmt_bytes(_comm_total(r)),
                "overlap": "—" if number(r.get("overlap_ratio")) is None else f"{r['overlap_ratio']:.0%}",
                "wall (s)": "—" if number(launch.get("wall_s")) is None else f"{launch['wall_s']:.1f}",
                "note": note if status != OK else "",
                "_failed": status in FAILED_STATUSES,
            }
        )
        if "traced_peak_bytes" in cases and cases["traced_peak_bytes"].notna().any():  # run with --traced
            out[-1]["peak traced"] = fmt_bytes(number(r.get("traced_peak_bytes")))
            out[-1]["traced error"] = fmt_pct(r.get("traced_peak_err"))
        if _any_offload(cases):  # host memory apart from device memory: where the parameters live
            out[-1]["params on host: measured / predicted"] = (
                f"{fmt_bytes(number(r.get('mem_placement_params_host_bytes')))} / "
                f"{fmt_bytes(number(r.get('pred_params_host_bytes')))}"
            )
    return pd.DataFrame(out)


def _any_offload(cases: pd.DataFrame) -> bool:
    return "cpu_offload" in cases and bool(cases["cpu_offload"].fillna(False).astype(bool).any())
