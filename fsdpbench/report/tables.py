"""Tables of the report and of ``fsdpbench compare``: strategies side by side, every case, the verdict.

Computed here as plain data (numbers and their text); ``page.py`` renders HTML, ``commands/compare.py``
renders a rich table.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from fsdpbench.analysis.frame import (
    BREAKDOWN_MEASURED,
    breakdown_frames,
    has_values,
    is_reference_strategy,
)
from fsdpbench.core.formatting import fmt_bytes, fmt_compute, fmt_harness_overhead, fmt_pct, fmt_throughput
from fsdpbench.core.numbers import number
from fsdpbench.core.schema import (
    ACHIEVED_TFLOPS,
    ALLOC_PEAK_ALLOCATED,
    ALLOC_PEAK_RESERVED,
    COMM_BUSBW,
    COMM_BYTES,
    COMM_PRED_TOTAL,
    COMM_TIME,
    COMM_TOTAL,
    ERROR,
    FAILED_STATUSES,
    HARNESS_OVERHEAD_RATIO,
    MODEL_CHECKABLE,
    MODEL_EXPOSED_COMM,
    MODEL_LINK,
    MODEL_STEP_ERR,
    MODEL_STEP_TIME,
    MODEL_UNCHECKED_REASON,
    NVML_PEAK,
    OK,
    OVERLAP_EXPOSED,
    OVERLAP_RATIO,
    PEER_COLUMNS,
    PLACEMENT,
    PRED_MODEL_STATES,
    PRED_MODEL_STATES_ERR,
    PRED_PARAMS_HOST,
    PRED_PEAK,
    PRED_PEAK_ERR,
    RUN,
    SAMPLED_PEAK,
    STATUS,
    STEP_TIME,
    STEP_TIME_P10,
    STEP_TIME_P90,
    THROUGHPUT_SAMPLES,
    TRACED_ALLOC_ALLOCATED,
    TRACED_ALLOC_ALLOCATED_ERR,
    TRACED_ALLOC_RESERVED,
    TRACED_ALLOC_RESERVED_ERR,
    TRACED_NVML,
    TRACED_NVML_ERR,
    TRACED_PEAK,
    TRACED_PEAK_ERR,
    TRACKER_MODEL_STATES,
    TRACKER_PEAK,
    VENDOR_MODEL_STATES,
    VENDOR_MODEL_STATES_ERR,
    WALL_S,
)
from fsdpbench.metrics.timing import STARVED_CPU_SHARE, starved, starved_note
from fsdpbench.report.data import axis_text, case_labels, ok_cases

TIE_TOLERANCE = 0.005  # values within 0.5% of the best are all winners


@dataclass(kw_only=True)
class CompareRow:
    """One metric across the compared cases: text per case, and which case wins (None: no winner)."""

    metric: str
    text: dict[str, str]
    values: dict[str, float | None] = field(default_factory=dict)
    better: str | None = None  # "low" | "high" | None
    winners: list[str] = field(default_factory=list)


def _winners(values: Mapping[str, float | None], better: str | None) -> list[str]:
    vals: dict[str, float] = {k: v for k, v in values.items() if v is not None}
    if better is None or len(vals) < 2:
        return []
    best = min(vals.values()) if better == "low" else max(vals.values())
    if all(abs(v - best) <= TIE_TOLERANCE * max(abs(best), 1e-12) for v in vals.values()):
        return []  # everyone equal: no winner
    return [k for k, v in vals.items() if abs(v - best) <= TIE_TOLERANCE * max(abs(best), 1e-12)]


def _sum_cols(row: pd.Series, cols: tuple[str, ...]) -> float | None:
    vals = [v for v in (number(row.get(c)) for c in cols if c in row.index) if v is not None]
    return sum(vals) if vals else None


def _column_value(col: str) -> Callable[[pd.Series], float | None]:
    return lambda r: number(r.get(col))


def _cell(frame: pd.DataFrame, column: str) -> Callable[[pd.Series], float | None]:
    """A case's value in a frame indexed by the cases' labels."""
    return lambda r: number(frame.at[r["label"], column])


def _formatted(template: str) -> Callable[[pd.Series, Any], str]:
    return lambda r, v: "—" if v is None else template.format(v)


def _bytes_beside(predicted: pd.DataFrame | None, column: str) -> Callable[[pd.Series, Any], str]:
    """Measured bytes, and the prediction for the same case beside them when there is one."""

    def text(r: pd.Series, v: Any) -> str:
        beside = f" / {fmt_bytes(number(predicted.at[r['label'], column]))}" if predicted is not None else ""
        return fmt_bytes(v) + beside

    return text


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
        timed: bool = False,
    ) -> None:
        """between_ranks: a communication metric, which a 1-rank case does not have (said so, not '—');
        timed: a figure of the timed steps, which a case with starved steps shows, marked, but neither
        wins nor loses."""
        alone = {k for k, r in cols.items() if between_ranks and _one_rank(r)}
        values = {k: None if k in alone else value_fn(r) for k, r in cols.items()}
        if all(v is None for v in values.values()) and not alone:
            return
        text = {k: NO_COMM if k in alone else fmt(r, values[k]) for k, r in cols.items()}
        hungry = {k for k, r in cols.items() if timed and starved(r)}
        for k in hungry:
            note = starved_note(cols[k])
            text[k] += "" if note in text[k] else f" [{note}]"
        compared = {k: v for k, v in values.items() if k not in hungry}
        rows.append(
            CompareRow(
                metric=metric, text=text, values=values, better=better, winners=_winners(compared, better)
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

    rows.append(CompareRow(metric=STATUS, text={k: str(r.get(STATUS)) for k, r in cols.items()}))
    add(
        "peak / rank: measured / predicted",
        lambda r: number(r.get(TRACKER_PEAK)),
        mem_pair(PRED_PEAK, PRED_PEAK_ERR),
        "low",
    )
    add(
        "model states: measured / predicted",
        lambda r: number(r.get(TRACKER_MODEL_STATES)),
        mem_pair(PRED_MODEL_STATES, PRED_MODEL_STATES_ERR),
        "low",
    )
    measured, predicted, _ = breakdown_frames(cases)
    measured.index = list(cols)  # by label, as the cases
    if predicted is not None:
        predicted.index = list(cols)
    for group in BREAKDOWN_MEASURED:
        add(f"  {group} at peak", _cell(measured, group), _bytes_beside(predicted, group), None)
    # the allocator model's predictions (a traced run of a CUDA case) beside the allocator and NVML
    for col, name, pred, err in (
        (
            ALLOC_PEAK_ALLOCATED,
            "allocator peak allocated",
            TRACED_ALLOC_ALLOCATED,
            TRACED_ALLOC_ALLOCATED_ERR,
        ),
        (ALLOC_PEAK_RESERVED, "allocator peak reserved", TRACED_ALLOC_RESERVED, TRACED_ALLOC_RESERVED_ERR),
        (NVML_PEAK, "NVML peak (GPU)", TRACED_NVML, TRACED_NVML_ERR),
        (SAMPLED_PEAK.of("rss"), "RSS peak (process)", None, None),
    ):
        predicted_here = pred is not None and pred in cases and bool(cases[pred].notna().any())
        label = f"{name}: measured / predicted" if predicted_here else name
        fmt = mem_pair(pred, err) if pred is not None and predicted_here else (lambda r, v: fmt_bytes(v))
        add(label, _column_value(col), fmt, "low")
    if _any_offload(cases):
        add(
            "params on host (CPU offload): measured / predicted",
            lambda r: number(r.get(PLACEMENT.of("host"))),
            lambda r, v: f"{fmt_bytes(v)} / {fmt_bytes(number(r.get(PRED_PARAMS_HOST)))}",
            None,
        )
    add("step time (p10–p90)", lambda r: number(r.get(STEP_TIME)), _fmt_step, "low", timed=True)
    # a model's estimate on a link the run may not have: shown beside the measurement, never a winner
    add("step time, modelled (error)", _checked_model, _fmt_modelled, None)
    add(
        "throughput",
        lambda r: number(r.get(THROUGHPUT_SAMPLES)),
        lambda r, v: fmt_throughput(r),
        "high",
        timed=True,
    )
    # on CPU ranks MFU is not meaningful: said in the row, never a winner
    add("MFU, achieved TFLOP/s", lambda r: number(r.get(ACHIEVED_TFLOPS)), lambda r, v: fmt_compute(r), None)
    if has_values(cases, HARNESS_OVERHEAD_RATIO):  # only with a bare loop (bare_steps)
        add(
            "harness overhead (timed / bare step − 1)",
            lambda r: number(r.get(HARNESS_OVERHEAD_RATIO)),
            lambda r, v: fmt_harness_overhead(r),
            None,
        )
    add(
        "comm / step / rank: measured / predicted",
        _comm_total,
        lambda r, v: (
            fmt_bytes(v)
            + (
                f" / {fmt_bytes(number(r.get(COMM_PRED_TOTAL)))}"
                if number(r.get(COMM_PRED_TOTAL)) is not None
                else ""
            )
        ),
        "low",
        True,
    )
    add("bus bandwidth (nccl-tests busbw)", _busbw_total, _fmt_busbw, "high", True)
    for metric, col, text, better in (
        ("exposed comm", OVERLAP_EXPOSED, "{:.1f} ms", "low"),
        ("overlap", OVERLAP_RATIO, "{:.0%}", "high"),
    ):
        add(
            metric,
            _column_value(col),
            _formatted(text),
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
    measured = [(number(r.get(COMM_BUSBW.of(k))), number(r.get(COMM_TIME.of(k)))) for k in _BUSBW_KINDS]
    pairs = [(b, t) for b, t in measured if b is not None and t]
    return sum(b * t for b, t in pairs) / sum(t for _, t in pairs) if pairs else None


def _fmt_busbw(r: pd.Series, v: Any) -> str:
    if v is None:
        return "—"
    parts = [
        f"{short} {number(r.get(COMM_BUSBW.of(k))):.2f}"
        for k, short in _BUSBW_KINDS.items()
        if number(r.get(COMM_BUSBW.of(k))) is not None
    ]
    return f"{v:.2f} GB/s ({', '.join(parts)})"


def _fmt_step(r: pd.Series, v: Any) -> str:
    if v is None:
        return "—"
    p10, p90 = number(r.get(STEP_TIME_P10)), number(r.get(STEP_TIME_P90))
    note = starved_note(r)
    return (
        f"{v:.1f} ms"
        + (f" ({p10:.0f}–{p90:.0f})" if p10 is not None and p90 is not None else "")
        + (f" [{note}]" if note else "")
    )


def _model_checked(r: pd.Series) -> bool:
    """The model describes this case's measurement (MODEL_CHECKABLE; absent: rows from before it)."""
    flag = r.get(MODEL_CHECKABLE)
    return flag is None or bool(pd.isna(flag)) or bool(flag)


# The step-time model is checked against the median of a case's few timed steps, to ±10 %
# (docs/step-time-model.md). Where the steps themselves spread wider than that band (p10–p90 over 20 % of
# their median: on CPU ranks gloo's collectives have a fast and a slow mode), the median can land
# anywhere in it: the error is then as much the steps' as the model's, and the report says so.
UNSTEADY_STEPS_SPREAD = 0.20


def steps_spread(r: pd.Series) -> float | None:
    """The case's timed steps' p10–p90 as a fraction of their median; None where not recorded."""
    lo, hi, median = (number(r.get(c)) for c in (STEP_TIME_P10, STEP_TIME_P90, STEP_TIME))
    if lo is None or hi is None or not median:
        return None
    return (hi - lo) / median


def unsteady_steps(r: pd.Series) -> bool:
    """Whether the case's timed steps spread wider than UNSTEADY_STEPS_SPREAD of their median."""
    spread = steps_spread(r)
    return spread is not None and spread > UNSTEADY_STEPS_SPREAD


def _checked_model(r: pd.Series) -> float | None:
    """The modelled step time where it is a prediction the run can check; else None (the glance
    table then shows why not, never the number)."""
    return number(r.get(MODEL_STEP_TIME)) if _model_checked(r) else None


def _fmt_modelled(r: pd.Series, v: Any) -> str:
    """Modelled step time with its error against the measured one, and the exposed communication;
    where the model cannot be checked, why not (and, outside the glance table, the figure, marked)."""
    if not _model_checked(r):
        reason = str(r.get(MODEL_UNCHECKED_REASON) or "not checkable")
        return f"unchecked ({reason})" if v is None else f"{v:.1f} ms, unchecked ({reason})"
    if v is None:
        return "—"
    err = number(r.get(MODEL_STEP_ERR))
    exposed = number(r.get(MODEL_EXPOSED_COMM))
    link = str(r.get(MODEL_LINK) or "").split(" (")[0]
    return (
        f"{v:.1f} ms"
        + (f" on {link}" if link else "")
        + (f" ({fmt_pct(err)})" if err is not None else "")
        + (f", exposed comm {exposed:.1f} ms" if exposed is not None else "")
        + (f"; measured steps spread {steps_spread(r):.0%} (p10–p90)" if unsteady_steps(r) else "")
    )


def _comm_total(r: pd.Series) -> float | None:
    total = number(r.get(COMM_TOTAL))
    if total is not None:
        return total
    return _sum_cols(r, COMM_BYTES.names)  # each kind's bytes sent


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
        if RUN in cases and cases[RUN].nunique() > 1:
            title += f" [{first[RUN]}]"
        out.append((title, group))
    return out


# settings a group title may name (ranks, device and backend are in its ranks label, the model always)
_TITLE_KEYS = tuple(k for k in PEER_COLUMNS if k not in (RUN, "world_size", "model", "device", "backend"))


def _differs(groups: list[pd.DataFrame], key: str) -> bool:
    return len({str(g.iloc[0].get(key)) for g in groups}) > 1


def verdict_lines(cases: pd.DataFrame) -> list[str]:
    """Per group at the same world size: least memory per rank and fastest, against DDP."""
    lines = []
    for title, group in glance_groups(ok_cases(cases)):  # labels inside a group name only what differs
        parts = []
        by_label = group.set_index("label")
        if has_values(group, TRACKER_PEAK):
            peaks = {str(k): x for k, v in by_label[TRACKER_PEAK].items() if (x := number(v)) is not None}
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
        hungry = [str(k) for k, r in by_label.iterrows() if starved(r)]
        if has_values(group, STEP_TIME):
            times = {
                str(k): x
                for k, v in by_label[STEP_TIME].items()
                if (x := number(v)) is not None and str(k) not in hungry
            }
        if has_values(group, STEP_TIME) and len(times) >= 2:
            best = _winners(times, "low")
            slowest = max(times, key=times.__getitem__)
            if best:
                ratio = times[slowest] / times[best[0]]
                parts.append(
                    f"fastest: {' = '.join(best)} ({times[best[0]]:.1f} ms/step; slowest {slowest} "
                    f"is {ratio:.1f}× slower)"
                )
            else:
                parts.append(f"step time equal for all ({times[slowest]:.1f} ms)")
        if hungry:
            parts.append(
                f"not compared on step time, their steps starved of CPU: {', '.join(hungry)} "
                f"(CPU time under {STARVED_CPU_SHARE:.0%} of their fair share of the cores)"
            )
        if parts:
            lines.append(f"{title} — " + "; ".join(parts))
    return lines


def model_error_lines(cases: pd.DataFrame) -> list[str]:
    """Per scenario: the step-time model's mean absolute percentage error and worst case over the
    cases where it can be checked, and how many it cannot be checked on (and why)."""
    if MODEL_STEP_TIME not in cases and MODEL_UNCHECKED_REASON not in cases:
        return []
    lines = []
    ok = ok_cases(cases)
    by = ok.groupby("scenario", sort=False, dropna=False) if "scenario" in ok else [("", ok)]
    for scenario, group in by:
        modelled = group.get(MODEL_STEP_TIME, pd.Series(index=group.index, dtype=float)).notna()
        reasons = group.get(MODEL_UNCHECKED_REASON, pd.Series(index=group.index, dtype=object))
        group = group[modelled | reasons.fillna("").astype(str).ne("")]
        if group.empty:
            continue
        checked = group[group.apply(_model_checked, axis=1)]
        errs = pd.to_numeric(checked.get(MODEL_STEP_ERR, pd.Series(dtype=float)), errors="coerce").dropna()
        parts = []
        if len(errs):
            worst = errs.abs().idxmax()
            parts.append(
                f"modelled vs measured step time over {len(errs)} case(s): mean absolute error "
                f"{errs.abs().mean():.1%}, worst {errs[worst]:+.1%} ({checked.at[worst, 'label']})"
            )
            unsteady = int(checked.loc[errs.index].apply(unsteady_steps, axis=1).sum())
            if unsteady:
                parts.append(
                    f"{unsteady} of them with measured steps spread over {UNSTEADY_STEPS_SPREAD:.0%} "
                    "of their median (p10–p90), wider than the ±10 % the model is checked to"
                )
        unchecked = group[~group.apply(_model_checked, axis=1)]
        if len(unchecked):
            reasons = sorted({str(x) for x in unchecked.get(MODEL_UNCHECKED_REASON, pd.Series()).dropna()})
            parts.append(
                f"{len(unchecked)} case(s) not checked, no modelled figure shown as a prediction: "
                + "; ".join(reasons)
            )
        if parts:
            lines.append(f"step-time model, {scenario}: " + "; ".join(parts))
    return lines


def case_table(cases: pd.DataFrame, metas: dict[str, dict[str, Any]] | None = None) -> pd.DataFrame:
    """Every case (failed and skipped too) with its key metrics, predictions and errors, as display text."""
    metas = metas or {}
    out = []
    for _, r in cases.iterrows():
        launch = (metas.get(r.get(RUN), {}).get("cases") or {}).get(r["case_id"], {})
        status = str(r.get(STATUS))
        note = str(r.get(ERROR) or "")
        out.append(
            {
                "case": r.get("label"),
                "case_id": r["case_id"],
                STATUS: status,
                "ranks": r.get("ranks_label"),
                "step time (p10–p90)": _fmt_step(r, number(r.get(STEP_TIME))),
                "step time modelled": _fmt_modelled(r, number(r.get(MODEL_STEP_TIME))),
                "step time modelled, error": fmt_pct(r.get(MODEL_STEP_ERR)),
                "throughput": fmt_throughput(r),
                "MFU, achieved TFLOP/s": fmt_compute(r),
                "peak measured (tracker)": fmt_bytes(number(r.get(TRACKER_PEAK))),
                "peak predicted": fmt_bytes(number(r.get(PRED_PEAK))),
                "peak error": fmt_pct(r.get(PRED_PEAK_ERR)),
                # the traced predictor beside the analytic one (runs with traced predictions)
                "peak traced": fmt_bytes(number(r.get(TRACED_PEAK))),
                "traced error": fmt_pct(r.get(TRACED_PEAK_ERR)),
                "model states measured": fmt_bytes(number(r.get(TRACKER_MODEL_STATES))),
                "model states predicted": fmt_bytes(number(r.get(PRED_MODEL_STATES))),
                "model states error": fmt_pct(r.get(PRED_MODEL_STATES_ERR)),
                # DeepSpeed's own estimator (ds_zero2/3 only; docs/deepspeed.md explains its terms)
                "model states, DeepSpeed's estimate": fmt_bytes(number(r.get(VENDOR_MODEL_STATES))),
                "DeepSpeed estimate error": fmt_pct(r.get(VENDOR_MODEL_STATES_ERR)),
                "comm / step": fmt_bytes(_comm_total(r)),
                "overlap": "—" if number(r.get(OVERLAP_RATIO)) is None else f"{r[OVERLAP_RATIO]:.0%}",
                "wall (s)": "—" if number(launch.get(WALL_S)) is None else f"{launch[WALL_S]:.1f}",
                "note": note if status != OK else "",
                "_failed": status in FAILED_STATUSES,
            }
        )
        if has_values(cases, HARNESS_OVERHEAD_RATIO):  # with a bare loop: the harness's own cost
            out[-1]["harness overhead"] = fmt_harness_overhead(r)
        if _any_offload(cases):  # host memory apart from device memory: where the parameters live
            out[-1]["params on host: measured / predicted"] = (
                f"{fmt_bytes(number(r.get(PLACEMENT.of('host'))))} / "
                f"{fmt_bytes(number(r.get(PRED_PARAMS_HOST)))}"
            )
    return _without_empty_columns(pd.DataFrame(out))


# columns a case table keeps even when no case has a value in them
_ALWAYS = ("case", "case_id", STATUS, "ranks", "_failed")
_EMPTY = ("—", "", "None", "nan")  # cells without a value


def _without_empty_columns(table: pd.DataFrame) -> pd.DataFrame:
    """The table less the columns no case has a value in (DeepSpeed's estimate in a run without
    DeepSpeed, traced figures in a run without the traced predictor): they would only widen it."""
    empty = [c for c in table if c not in _ALWAYS and table[c].astype(str).isin(_EMPTY).all()]
    return table.drop(columns=empty)


def traced_origin(metas: list[dict[str, Any]]) -> str | None:
    """Where a report's traced predictions came from, in words (None: no run has them): ``--traced`` on
    the command line, or the scenario's ``traced: true`` (``run`` takes either; ``compare`` the flag)."""
    origins = []
    for meta in metas:
        if "traced" not in (meta.get("predictions") or ()):
            continue
        flag = "--traced" in shlex.split(str(meta.get("command") or ""))
        origin = "--traced on the command line" if flag else "the scenario's traced: true"
        if origin not in origins:
            origins.append(origin)
    return " or ".join(origins) or None


def _any_offload(cases: pd.DataFrame) -> bool:
    return "cpu_offload" in cases and bool(cases["cpu_offload"].fillna(False).astype(bool).any())
