"""A case's compute without the profiler: its steps timed with collectives that take no time.

The step-time model needs each rank's compute as the timed steps see it. The profiled step cannot
give it: the profiler's cost per recorded op is a large share of a small step (quickstart's 1-rank
DDP on 2 CPU cores: 21 ms profiled, 10 ms timed), and an estimate of that cost per op, calibrated
apart from the step, does not transfer (it once came to 49 ms for a 21 ms step). So the compute is
*timed*, as the timed steps are, and the trace is used only for where the collectives sit.

The **compute twin** of a real case is the same case run emulated (fsdpbench/engine/emulate.py:
the fake process group, every collective returns at once and moves no data), all its ranks started
together so that they compete for the cores as the real ranks do, each with the threads a real rank
gets (``launch._launch_group``: cores // ranks), through the same warm-up and the same timer
(``worker.RankSteps.timed``), no profiler, no tracker. Its timed-step median per rank is that rank's
compute (``model_compute_bare_ms``). An emulated case is its own twin: its timed steps are compute.

A 1-rank case's twin is the case itself, run again without the profiler on its real 1-rank group:
there a "collective" moves nothing between ranks but is still a call into gloo (a local copy, handed
to gloo's thread and waited for), a cost of the compute side that the fake process group would leave
out (ZeRO-1's ~40 per-parameter broadcasts: a third of quickstart's 1-rank step on a loaded machine).

What the twin leaves in or out, against the real step: no gloo work (copies into and out of gloo's
buffers are gloo's, in the α–β time), and the time a rank would wait for a peer is not in it (the
model's simulation adds that from the ranks' traces).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from fsdpbench.core.case import Case
from fsdpbench.core.schema import OK
from fsdpbench.hosttuning.baton import TWIN_DIR

MIN_STEPS = 5  # a median of fewer is one noisy step


def twin_case(case: Case, *, interleaved: bool = False) -> Case:
    """The case as its compute twin runs it: emulated (1 rank: real), every rank, timed steps only.
    ``interleaved`` (started beside the case's ranks, taking turns step by step): as many timed steps
    as the case, one per turn; otherwise at least ``MIN_STEPS``."""
    return case.replace(
        emulate=case.world_size > 1,
        emulate_ranks=tuple(range(case.world_size)),
        warmup_steps=max(case.warmup_steps, 2),
        steps=case.steps if interleaved else max(case.steps, MIN_STEPS),
        memory_steps=0,
        profile_steps=0,
        bare_steps=0,
        time_blocks=0,
        checkpoint="none",
    )


def interleaved_twin(case: Case) -> Case | None:
    """The twin to start beside a real CPU case's ranks (``launch_case(twin=…)``), or None where none
    is: on a GPU (the two would share the device's memory and kernels: it runs after the case), an
    emulated case (its timed steps are compute already), a compiled case (emulation is eager only; at
    1 rank the twin's compilation could outlast the case's wait for its first turn: it runs after the
    case instead)."""
    from fsdpbench.engine.emulate import check_emulation

    if case.emulate or case.compile or case.device.split(":", 1)[0] != "cpu" or not case.steps:
        return None
    twin = twin_case(case, interleaved=True)
    return None if twin.emulate and check_emulation(twin) else twin


def twin_compute_ms(case: Case, out_dir: Path | None = None) -> tuple[dict[int, float], bool]:
    """Each rank's compute per step, ms (the twin's timed-step median), and whether it was timed
    interleaved with the case's steps: the twin started beside the case, if it ended well (its rank
    files in ``<out_dir>/compute_twin``), or else a twin run now, after the case; ({}, False) if that
    failed too or cannot run (compile: emulation is eager only), so the model falls back and says so."""
    from fsdpbench.engine.emulate import check_emulation
    from fsdpbench.engine.rank_result import RankResult, rank_file
    from fsdpbench.pipeline.launch import launch_case

    if out_dir is not None:
        beside = [RankResult.read(out_dir / TWIN_DIR / rank_file(r), r) for r in range(case.world_size)]
        medians = {r.rank: r.step_time_ms() for r in beside if r.status == OK}
        if len(medians) == case.world_size and all(medians.values()):
            return {rank: ms for rank, ms in medians.items() if ms}, True
    twin = twin_case(case)
    if twin.emulate and check_emulation(twin):
        return {}, False
    with tempfile.TemporaryDirectory() as tmp:
        outcome = launch_case(twin, (out_dir or Path(tmp)) / TWIN_DIR, together=True)
    if outcome.status != OK:
        return {}, False
    medians = {r.rank: r.step_time_ms() for r in outcome.ranks}
    return {rank: ms for rank, ms in medians.items() if ms}, False
