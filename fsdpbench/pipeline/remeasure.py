"""``regress --repeat K``: re-measure the cases whose step time looks regressed, then judge them again.

As asv does before it reports a regression: a shared runner has bad minutes, and one measurement of
a case can land in one. Each suspect case (slower than its tolerance, significant or not) is launched
``K`` more times (fresh processes, as in the
run); its step-time samples from every launch join the run's, each launch's kept apart, and the
comparison is made again on the launches (``analysis.timegate``: the launch is the unit of the test).
A real slowdown stays slow in every launch; a bad minute is one launch of several. The other
processes' load is the largest any launch saw: a launch beyond the rated load leaves the case unjudged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd

from fsdpbench.analysis.regress import SAMPLED, DifferenceReport
from fsdpbench.core.schema import HOST_TUNING, OK, RUN_CASE_ID, STEP_TIME_REF_OTHER_LOAD
from fsdpbench.pipeline.scenario import PluginPermission


def suspects(result: DifferenceReport) -> list[tuple[str, str]]:
    """(baseline case id, the run's own id of that case) of each case whose sampled step time looks slower
    by more than its tolerance, significant or not: with few launches a real slowdown is not significant
    yet, and its re-launches are what makes it so (or clears it)."""
    return sorted(
        {
            (d.case_id, d.run_case_id)
            for d in result.differences
            if d.metric == SAMPLED
            and d.gate == "fail"
            and d.change is not None
            and d.tolerance is not None
            and d.change > d.tolerance
        }
    )


def remeasure(
    result: DifferenceReport,
    frame: pd.DataFrame,
    run_frame: pd.DataFrame,
    repeat: int,
    out_dir: Path,
    judge: Callable[[pd.DataFrame], DifferenceReport],
    log: Callable[[str], None] = print,
    *,
    allow_plugins: PluginPermission = False,
) -> DifferenceReport:
    """Re-launch each suspect case ``repeat`` times into ``out_dir``; ``judge`` the frame with its launches.

    ``frame`` is what was compared (strategies mapped); ``run_frame`` the run as it ran (to rebuild
    each case as launched, checked as a scenario's case is, a plugin strategy included: re-launched only
    where ``allow_plugins`` permits that plugin (all, or these names), as ``run`` launched it, its module
    then also searched for in the current directory)."""
    from fsdpbench.analysis.regress import gloo_loops_idle, legacy_host_tuning
    from fsdpbench.pipeline.launch import launch_case
    from fsdpbench.pipeline.scenario import case_from_row, enable_plugin_imports, plugin_permitted
    from fsdpbench.store.results import build_rows

    cases = suspects(result)
    if not cases or repeat <= 0:
        return result
    frame = frame.copy()
    for cid, run_id in cases:
        rows = frame.index[frame[RUN_CASE_ID] == run_id]
        row = run_frame[run_frame["case_id"] == run_id].iloc[0]
        case = case_from_row(row, source=str(out_dir.parent / "results.parquet"))  # its host tuning too
        if HOST_TUNING not in run_frame:  # a run from before cases recorded it: the tuning it ran with
            case = case.replace(host_tuning=legacy_host_tuning(case.device, gloo_loops_idle(run_frame)))
        launches = [list(frame.at[rows[0], SAMPLED])]
        loads = [frame.at[rows[0], STEP_TIME_REF_OTHER_LOAD]] if STEP_TIME_REF_OTHER_LOAD in frame else []
        if not plugin_permitted(case.strategy, allow_plugins):
            log(
                f"not re-measured {cid}: its strategy {case.strategy} is a plugin (module:Class), whose "
                "code runs only when allowed: add --allow-plugins, or name it in --map-strategy "
                "(it is judged on the run's samples)"
            )
            continue
        if ":" in case.strategy:
            enable_plugin_imports()  # before the first launch starts the fork server with this sys.path
        for i in range(repeat):
            outcome = launch_case(case, out_dir / run_id / f"repeat{i + 1}")
            row_again = build_rows(case, outcome, {}).iloc[0]
            again = row_again.get(SAMPLED)
            why = f" ({outcome.error})" if outcome.status != OK and outcome.error else ""
            log(f"re-measured {cid} ({i + 1}/{repeat}): {outcome.status}, {len(again or [])} samples{why}")
            if again is not None and len(again):
                launches.append(list(again))
                loads.append(row_again.get(STEP_TIME_REF_OTHER_LOAD))
        known = [x for x in loads if x is not None and x == x]
        for r in rows:
            frame.at[r, SAMPLED] = launches
            if known and STEP_TIME_REF_OTHER_LOAD in frame:
                frame.at[r, STEP_TIME_REF_OTHER_LOAD] = max(known)
    return judge(frame)
