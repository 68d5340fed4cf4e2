"""``regress --repeat K``: re-measure the cases whose step time looks regressed, then judge them again.

As asv does before it reports a regression: a shared runner has bad minutes, and one measurement of
a case can land in one. Each suspect case is launched ``K`` more times (fresh processes, as in the
run); its step-time samples from every launch are pooled with the run's, and the comparison is made
again on the pooled samples. A real slowdown stays slow in every launch; a bad minute is diluted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd

from fsdpbench.analysis.regress import SAMPLED, DifferenceReport
from fsdpbench.core.schema import OK, RUN_CASE_ID
from fsdpbench.pipeline.scenario import PluginPermission


def suspects(result: DifferenceReport) -> list[str]:
    """Baseline case ids whose sampled step time failed."""
    return sorted({d.case_id for d in result.failures if d.metric == SAMPLED})


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
    """Re-launch each suspect case ``repeat`` times into ``out_dir``; ``judge`` the frame with pooled samples.

    ``frame`` is what was compared (strategies mapped); ``run_frame`` the run as it ran (to rebuild
    each case as launched, checked as a scenario's case is, a plugin strategy included: re-launched only
    where ``allow_plugins`` permits that plugin (all, or these names), as ``run`` launched it, its module
    then also searched for in the current directory)."""
    from fsdpbench.analysis.regress import gloo_loops_idle
    from fsdpbench.hosttuning.threads import follow_gloo_loop_policy
    from fsdpbench.pipeline.launch import launch_case
    from fsdpbench.pipeline.scenario import case_from_row, enable_plugin_imports, plugin_permitted
    from fsdpbench.store.results import build_rows

    cases = suspects(result)
    if not cases or repeat <= 0:
        return result
    follow_gloo_loop_policy(gloo_loops_idle(run_frame), "the run being re-measured")
    frame = frame.copy()
    for cid in cases:
        rows = frame.index[frame["case_id"] == cid]
        run_id = frame.at[rows[0], RUN_CASE_ID]
        row = run_frame[run_frame["case_id"] == run_id].iloc[0]
        case = case_from_row(row, source=str(out_dir.parent / "results.parquet"))
        pooled = list(frame.at[rows[0], SAMPLED])
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
            again = build_rows(case, outcome, {}).iloc[0].get(SAMPLED)
            why = f" ({outcome.error})" if outcome.status != OK and outcome.error else ""
            log(f"re-measured {cid} ({i + 1}/{repeat}): {outcome.status}, {len(again or [])} samples{why}")
            pooled += list(again or [])
        for r in rows:
            frame.at[r, SAMPLED] = pooled
    return judge(frame)
