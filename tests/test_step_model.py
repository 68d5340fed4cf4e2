"""The modelled step time: α–β arithmetic, placement on synthetic timelines and traces with known
answers, the gloo probe's fit, the --link switch, and the model_* columns of a real run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from fsdpbench.core.schema import MODEL_CHECKABLE, MODEL_COMPUTE_BARE, MODEL_UNCHECKED_REASON
from fsdpbench.pipeline.comm_probe import fit_link, in_context_reps_us, in_context_time_us
from fsdpbench.predictors.comm_model import (
    LINK_PRESETS,
    Link,
    LinkError,
    collective_time_us,
    validate_link_spec,
)
from fsdpbench.predictors.step_model import (
    METHOD_NO_IDLE_CORE,
    METHOD_TWIN,
    METHOD_TWIN_INTERLEAVED,
    PlacedCollective,
    StepTimeline,
    build_timeline,
    case_model_columns,
    checkable,
    collective_durations,
    compute_scale,
    no_idle_core,
    shared_placement,
    simulate,
)
from fsdpbench.strategies import get_strategy
from tests.helpers import requires_cuda, trace_event

ZERO3 = get_strategy("zero3").sharding

LINK = Link("test", alpha_us=10.0, busbw_GBps=100.0)  # 100 GB/s = 1e5 bytes per µs


def test_collective_time_is_alpha_plus_bytes_times_nccl_tests_factor_over_busbw() -> None:
    s = 1_000_000  # bytes; S / busbw = 10 µs
    assert collective_time_us(LINK, "all_reduce", s, 4) == pytest.approx(10 + 10 * 2 * 3 / 4)  # 25
    assert collective_time_us(LINK, "all_gather", s, 4) == pytest.approx(10 + 10 * 3 / 4)  # 17.5
    assert collective_time_us(LINK, "reduce_scatter", s, 2) == pytest.approx(10 + 10 * 1 / 2)  # 15
    assert collective_time_us(LINK, "broadcast", s, 8) == pytest.approx(10 + 10)  # factor 1
    assert collective_time_us(LINK, "all_reduce", s, 1) == 0.0  # no peers, no communication
    gloo = Link("gloo", 10.0, 100.0, reduce_scatter_as_all_reduce=True)  # gloo all-reduces a reduce-scatter
    assert collective_time_us(gloo, "reduce_scatter", s, 4) == pytest.approx(25.0)


def test_one_rank_blocking_and_overlapped_collectives_known_answer() -> None:
    # 1000 µs of compute; a blocking all-gather at 0 (100 µs: exposed), then an all-reduce issued at
    # 500 and needed at 700 of compute. It starts at wall 600 (after the first stall), lasts 300,
    # ends at 900, while compute reaches its needed point at wall 800: 100 µs more exposed.
    ag = PlacedCollective("all_gather", payload_bytes=12_000_000, group_size=4, issue_us=0.0, needed_us=0.0)
    ar = PlacedCollective(
        "all_reduce", payload_bytes=19_333_334, group_size=4, issue_us=500.0, needed_us=700.0
    )
    link = Link("l", alpha_us=10.0, busbw_GBps=100.0)
    assert collective_time_us(link, "all_gather", ag.payload_bytes, 4) == pytest.approx(100.0)
    assert collective_time_us(link, "all_reduce", ar.payload_bytes, 4) == pytest.approx(300.0, abs=1e-3)
    (out,) = simulate([StepTimeline(1000.0, (ag, ar))], link)
    assert out["model_step_time_ms"] == pytest.approx(1.2, abs=1e-6)
    assert out["model_compute_ms"] == pytest.approx(1.0)
    assert out["model_comm_ms"] == pytest.approx(0.4, abs=1e-6)
    assert out["model_exposed_comm_ms"] == pytest.approx(0.2, abs=1e-6)
    assert out["model_peer_wait_ms"] == pytest.approx(0.0, abs=1e-9)
    assert out["model_overlap_ratio"] == pytest.approx(0.5, abs=1e-6)


def test_collective_waits_for_the_last_rank_to_issue_it() -> None:
    # two ranks, one blocking collective of 100 µs; rank 1 reaches it 50 µs later than rank 0
    link = Link("l", alpha_us=100.0, busbw_GBps=1.0)
    early = StepTimeline(400.0, (PlacedCollective("all_gather", 0, 2, 100.0, 100.0),))
    late = StepTimeline(400.0, (PlacedCollective("all_gather", 0, 2, 150.0, 150.0),))
    rank0, rank1 = simulate([early, late], link)
    assert rank0["model_step_time_ms"] == pytest.approx(0.55)  # 400 + 50 waiting for rank 1 + 100
    assert rank0["model_peer_wait_ms"] == pytest.approx(0.05)
    assert rank0["model_exposed_comm_ms"] == pytest.approx(0.1)
    assert rank1["model_step_time_ms"] == pytest.approx(0.5)
    assert rank1["model_peer_wait_ms"] == pytest.approx(0.0)


def _gloo_trace() -> dict:
    """A CPU rank's step as the profiler records it (main thread 1, gloo thread 2): compute 0–100,
    a blocking all-gather issued at 100 (FSDP2 on CPU) whose gloo work ends at 400, compute 400–500,
    a reduce-scatter issued at 500 whose gloo work ends at 600, compute 600–700 (the optimizer step
    650–700)."""
    dims = {"Input Dims": [[400], [100]], "Input type": ["float", "float"]}
    rs_dims = {"Input Dims": [[100], [400]], "Input type": ["float", "float"]}
    return {
        "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 4},
        "traceEvents": [
            trace_event("aten::mm", 0, 100, 1),
            trace_event("c10d::_allgather_base_", 100, 10, 1, **dims),
            trace_event("gloo:all_gather", 120, 280, 2, **{"Input Dims": [[100]], "Input type": ["float"]}),
            trace_event("FSDP::all_gather_copy_out", 400, 5, 1, cat="user_annotation"),
            trace_event("aten::mm", 400, 100, 1),
            trace_event("c10d::_reduce_scatter_base_", 500, 10, 1, **rs_dims),
            trace_event("gloo:all_reduce", 510, 90, 2, **{"Input Dims": [[400]], "Input type": ["float"]}),
            trace_event("aten::mm", 600, 50, 1),
            trace_event("Optimizer.step#AdamW.step", 650, 50, 1, cat="user_annotation"),
            trace_event("aten::add_", 650, 50, 1),
        ],
    }


def test_timeline_from_a_gloo_trace_removes_waits_and_places_collectives() -> None:
    timeline = build_timeline(_gloo_trace(), ZERO3, "cpu")
    # the span is 700 µs; waits: 100–400 (the all-gather's end) and 500–600 (the reduce-scatter's)
    assert timeline.waits_removed_us == pytest.approx(400.0)
    assert timeline.compute_us == pytest.approx(300.0)
    ag, rs = timeline.collectives
    assert (ag.kind, ag.payload_bytes, ag.group_size) == ("all_gather", 1600, 4)
    assert (rs.kind, rs.payload_bytes, rs.group_size) == ("reduce_scatter", 1600, 4)
    assert (ag.issue_us, ag.needed_us) == (100.0, 100.0)  # FSDP2 on CPU: blocking
    assert (rs.issue_us, rs.needed_us) == (200.0, 200.0)
    # on a GPU rule set, the all-gather is needed at its copy-out, the reduce-scatter at the optimizer
    gpu_rules = build_timeline(_gloo_trace(), ZERO3, "cuda")  # no kernels: host clock, GPU rules
    assert gpu_rules.collectives[0].needed_us == pytest.approx(100.0)  # copy-out right after the wait
    assert gpu_rules.collectives[1].needed_us == pytest.approx(250.0)  # Optimizer.step at 650 → 250
    # on a 1 GB/s gloo link with α 50 µs: compute 300 + AG (50 + 1200 B·3/4 /1e3) + RS as all-reduce
    link = Link("gloo", 50.0, 1.0, reduce_scatter_as_all_reduce=True)
    (out,) = simulate([timeline], link)
    assert out["model_step_time_ms"] == pytest.approx((300 + 51.2 + 52.4) / 1e3)


def test_bare_compute_scales_every_interval_of_the_profiled_step() -> None:
    # profiled compute 300 µs (waits removed); timed without the profiler: 150 µs. Every interval
    # halves, so the placement keeps its proportions: the reduce-scatter issued at 200 → 100.
    timeline = build_timeline(_gloo_trace(), ZERO3, "cpu", bare_compute_us=150.0)
    assert timeline.compute_us == pytest.approx(150.0)
    assert timeline.scale == pytest.approx(0.5)
    assert timeline.profiler_removed_us == pytest.approx(150.0)
    ag, rs = timeline.collectives
    assert (ag.issue_us, rs.issue_us, rs.needed_us) == pytest.approx((50.0, 100.0, 100.0))
    # two profiled steps in the trace: the bare figure is per step, the trace's compute is for both
    two = build_timeline(_gloo_trace(), ZERO3, "cpu", steps=2, bare_compute_us=75.0)
    assert two.compute_us == pytest.approx(150.0) and two.scale == pytest.approx(0.5)
    # a given scale (another rank's) wins over none; no measurement at all: unscaled
    assert build_timeline(_gloo_trace(), ZERO3, "cpu", scale=0.25).compute_us == pytest.approx(75.0)
    assert compute_scale(300.0, None) == 1.0 and compute_scale(0.0, 10.0) == 1.0


def _one_rank_trace() -> dict:
    """A 1-rank DDP step on gloo: its bucket all-reduce runs over a group of one (a local copy)."""
    dims = {"Input Dims": [[1000]], "Input type": ["float"]}
    return {
        "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 1},
        "traceEvents": [
            trace_event("aten::mm", 0, 400, 1),
            trace_event("c10d::allreduce_", 400, 10, 1, **dims),
            trace_event("gloo:all_reduce", 405, 5, 2, **dims),
            trace_event("aten::mm", 410, 300, 1),
            trace_event("Optimizer.step#AdamW.step", 710, 90, 1, cat="user_annotation"),
            trace_event("aten::add_", 710, 90, 1),
        ],
    }


def test_one_rank_models_no_communication_and_its_compute_exactly() -> None:
    ddp = get_strategy("ddp").sharding
    timeline = build_timeline(_one_rank_trace(), ddp, "cpu", bare_compute_us=500.0)
    assert [c.group_size for c in timeline.collectives] == [1]
    (out,) = simulate([timeline], Link("slow", alpha_us=1e6, busbw_GBps=1e-6))  # any link: no peers
    assert out["model_comm_ms"] == 0.0 and out["model_exposed_comm_ms"] == 0.0
    assert out["model_step_time_ms"] == out["model_compute_ms"] == pytest.approx(0.5)


def test_a_collective_fully_hidden_and_fully_exposed() -> None:
    link = Link("l", alpha_us=100.0, busbw_GBps=1e9)  # every collective 100 µs
    # issued at 100, needed at 900 of 1000 µs compute: hidden, the step is the compute
    hidden = StepTimeline(1000.0, (PlacedCollective("all_reduce", 8, 2, 100.0, 900.0),))
    (out,) = simulate([hidden], link)
    assert out["model_step_time_ms"] == pytest.approx(1.0)
    assert out["model_exposed_comm_ms"] == 0.0 and out["model_overlap_ratio"] == pytest.approx(1.0)
    # needed where issued (a blocking collective): all of it is exposed, the step is compute + 100
    exposed = StepTimeline(1000.0, (PlacedCollective("all_gather", 8, 2, 300.0, 300.0),))
    (out,) = simulate([exposed], link)
    assert out["model_step_time_ms"] == pytest.approx(1.1)
    assert out["model_exposed_comm_ms"] == pytest.approx(0.1)
    assert out["model_overlap_ratio"] == pytest.approx(0.0, abs=1e-12)
    # needed 40 µs after the issue: 60 µs exposed
    part = StepTimeline(1000.0, (PlacedCollective("all_gather", 8, 2, 300.0, 340.0),))
    (out,) = simulate([part], link)
    assert out["model_exposed_comm_ms"] == pytest.approx(0.06)


def test_every_collective_exposed_is_an_overlap_of_zero_not_a_rounding_error_below_it() -> None:
    # three blocking collectives of 0.1 µs each: the exposed intervals summed came to 6e-15 more than
    # the collectives' sum, and the overlap ratio read -6e-15 (a run's column failed its >= 0 check)
    link = Link("l", alpha_us=0.1, busbw_GBps=1e9)
    cols = tuple(PlacedCollective("all_gather", 8, 2, 10.1 * i, 10.1 * i) for i in range(3))
    for serial in (False, True):
        (out,) = simulate([StepTimeline(35.0, cols)], link, serial=serial)
        assert out["model_overlap_ratio"] == 0.0 and out["model_peer_wait_ms"] >= 0.0
        assert out["model_exposed_comm_ms"] == pytest.approx(out["model_comm_ms"])


def test_no_idle_core_serialises_every_collective_with_compute() -> None:
    link = Link("l", alpha_us=100.0, busbw_GBps=1e9)  # every collective 100 µs
    # issued at 100, needed at 900 of 1000 µs: hidden when a core is free for gloo's threads ...
    hidden = StepTimeline(1000.0, (PlacedCollective("all_reduce", 8, 2, 100.0, 900.0),))
    (free,) = simulate([hidden], link)
    assert free["model_step_time_ms"] == pytest.approx(1.0)
    # ... waited for where it is issued when the ranks' threads fill every core: all of it exposed
    (busy,) = simulate([hidden], link, serial=True)
    assert busy["model_step_time_ms"] == pytest.approx(1.1)
    assert busy["model_exposed_comm_ms"] == pytest.approx(0.1) and busy[
        "model_overlap_ratio"
    ] == pytest.approx(0.0)
    # two ranks, two asynchronous collectives (DDP buckets issued at 200 and 300 of the compute
    # clock, rank 1 50 µs later; needed at the optimizer, 900): overlapped, the step is the compute
    buckets = (
        PlacedCollective("all_reduce", 8, 2, 200.0, 900.0),
        PlacedCollective("all_reduce", 8, 2, 300.0, 900.0),
    )
    late = tuple(PlacedCollective(c.kind, 8, 2, c.issue_us + 50.0, c.needed_us) for c in buckets)
    r0, r1 = simulate([StepTimeline(1000.0, buckets), StepTimeline(1000.0, late)], link)
    assert r0["model_step_time_ms"] == pytest.approx(1.0) and r1["model_step_time_ms"] == pytest.approx(1.0)
    s0, s1 = simulate([StepTimeline(1000.0, buckets), StepTimeline(1000.0, late)], link, serial=True)
    # serialised: the first runs 250–350 (from rank 1's issue); rank 0, having issued at 200, computes
    # on until 250 (waiting for a peer costs no core), then both pause for it, 250–350; they issue the
    # second at wall 300 + 100 = 400 and 350 + 100 = 450, it runs 450–550, and both pause again
    assert s0["model_step_time_ms"] == pytest.approx(1.2)  # 1000 + 100 + 100
    assert s0["model_peer_wait_ms"] == pytest.approx(0.0)
    assert s1["model_step_time_ms"] == pytest.approx(1.2)
    # a rank that needs the collective before it starts still waits for its peer there (blocking)
    block0 = StepTimeline(1000.0, (PlacedCollective("all_gather", 8, 2, 200.0, 200.0),))
    block1 = StepTimeline(1000.0, (PlacedCollective("all_gather", 8, 2, 250.0, 250.0),))
    b0, b1 = simulate([block0, block1], link, serial=True)
    assert b0["model_step_time_ms"] == pytest.approx(1.15) and b0["model_peer_wait_ms"] == pytest.approx(0.05)
    assert b1["model_step_time_ms"] == pytest.approx(1.1)
    assert s1["model_exposed_comm_ms"] == pytest.approx(0.2) and s0["model_exposed_comm_ms"] == pytest.approx(
        0.2
    )


def test_cpu_ranks_filling_the_cores_share_one_placement_and_wait_for_no_peer() -> None:
    """One profiled step puts rank 1's blocking all-gathers later than rank 0's by its profiler noise
    (200 against 250, 600 against 640 µs of 1000); the probed link's in-context time already holds the
    waits for a peer, so the ranks share the mean placement: no peer wait, each rank its own compute."""
    link = Link("l", alpha_us=100.0, busbw_GBps=1e9)  # every collective 100 µs
    r0 = StepTimeline(
        1000.0,
        (
            PlacedCollective("all_gather", 8, 2, 200.0, 200.0),
            PlacedCollective("all_gather", 8, 2, 600.0, 600.0),
        ),
    )
    r1 = StepTimeline(
        1000.0,
        (
            PlacedCollective("all_gather", 8, 2, 250.0, 250.0),
            PlacedCollective("all_gather", 8, 2, 640.0, 640.0),
        ),
    )
    as_profiled = simulate([r0, r1], link, serial=True)
    # as profiled: rank 0 waits 50 µs for rank 1 at the first, rank 1 then 10 µs for rank 0 at the second
    assert [o["model_peer_wait_ms"] for o in as_profiled] == pytest.approx([0.05, 0.01])
    s0, s1 = shared_placement([r0, r1])
    assert (
        [c.issue_us for c in s0.collectives]
        == pytest.approx([225.0, 620.0])
        == [c.issue_us for c in s1.collectives]
    )
    assert [c.needed_us for c in s1.collectives] == pytest.approx([225.0, 620.0])
    shared = simulate([s0, s1], link, serial=True)
    assert [o["model_peer_wait_ms"] for o in shared] == pytest.approx([0.0, 0.0])
    assert [o["model_step_time_ms"] for o in shared] == pytest.approx([1.2, 1.2])  # compute + 2 × 100 µs
    # a rank with more compute keeps it: its points at the same fractions of its own
    longer = shared_placement([r0, StepTimeline(2000.0, r1.collectives)])[1]
    assert [c.issue_us for c in longer.collectives] == pytest.approx(
        [2000 * (0.2 + 0.125) / 2, 2000 * (0.6 + 0.32) / 2]
    )
    # ranks that do not issue the same collectives (should not happen) keep their own placement
    other = StepTimeline(1000.0, (PlacedCollective("all_reduce", 8, 2, 300.0, 300.0),) * 2)
    assert shared_placement([r0, other]) == [r0, other] and shared_placement([r0]) == [r0]


def test_no_idle_core_only_where_cpu_ranks_threads_fill_the_cores() -> None:
    assert no_idle_core("cpu", 2, 1, 2)  # quickstart's 2 ranks × 1 thread on 2 cores
    assert no_idle_core("cpu", 4, 1, 2)  # more ranks than cores
    assert not no_idle_core("cpu", 1, 2, 2)  # one rank: nothing to overlap with a peer's collective
    assert not no_idle_core("cpu", 3, 1, 4)  # a core left for gloo's threads
    assert not no_idle_core("cuda", 8, 1, 2)  # GPU ranks compute on the device
    assert not no_idle_core("cpu", 2, 1, None)  # cores unknown: the model as it was


def _ddp_trace(rank: int) -> dict:
    """A 2-rank DDP step on gloo: one bucket all-reduce issued at 400 (asynchronous, its gloo work
    405–505), more backward until 710, the optimizer 710–800."""
    dims = {"Input Dims": [[1000]], "Input type": ["float"]}
    return {
        "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2},
        "traceEvents": [
            trace_event("aten::mm", 0, 400, 1),
            trace_event("c10d::allreduce_", 400, 10, 1, **dims),
            trace_event("gloo:all_reduce", 405, 100, 2, **dims),
            trace_event("aten::mm", 410, 300, 1),
            trace_event("Optimizer.step#AdamW.step", 710, 90, 1, cat="user_annotation"),
            trace_event("aten::add_", 710, 90, 1),
        ],
    }


def test_case_model_columns_serial_says_so_in_model_method(tmp_path: Path, monkeypatch) -> None:
    ddp = get_strategy("ddp").sharding
    paths = {}
    for r in (0, 1):
        paths[r] = tmp_path / f"trace_rank{r}.json"
        paths[r].write_text(json.dumps(_ddp_trace(r)))
    link = Link("l", alpha_us=200.0, busbw_GBps=1e9)  # the bucket: 200 µs (its 4000 B are nothing)
    bare = {0: 0.8, 1: 0.8}  # ms: the profiled compute as it is (scale 1)
    free = case_model_columns(paths, ddp, "cpu", link, bare_compute_ms=bare, method=METHOD_TWIN)
    busy = case_model_columns(paths, ddp, "cpu", link, bare_compute_ms=bare, method=METHOD_TWIN, serial=True)
    # issued at 400 of 800 µs of compute, needed at 710: hidden; serialised: 200 µs more
    assert free[0]["model_step_time_ms"] == pytest.approx(0.8)
    assert busy[0]["model_step_time_ms"] == pytest.approx(1.0)
    assert free[0]["model_method"] == METHOD_TWIN
    assert busy[0]["model_method"] == METHOD_TWIN + METHOD_NO_IDLE_CORE
    assert "no idle core" in busy[1]["model_method"]
    # serialised (CPU ranks filling the cores), the ranks share one placement; overlapping, each its own
    import fsdpbench.predictors.step_model as step_model

    placed: list[int] = []
    monkeypatch.setattr(step_model, "shared_placement", lambda ts: placed.append(len(ts)) or ts)
    case_model_columns(paths, ddp, "cpu", link, bare_compute_ms=bare, method=METHOD_TWIN)
    assert placed == []
    case_model_columns(paths, ddp, "cpu", link, bare_compute_ms=bare, method=METHOD_TWIN, serial=True)
    assert placed == [2]


def test_in_context_probe_time_is_the_slowest_ranks_extra_time_per_collective_averaged() -> None:
    # 4 collectives per sequence; two ranks, three repetitions (seconds). Bursts alone 8 ms; with a
    # collective after each: rank 0 10, 11, 10.4 ms; rank 1 10.4, 10.6, 11.2 ms. The slowest rank's
    # extra time per repetition: 2.4, 3.0, 3.2 ms → per collective 0.6, 0.75, 0.8 ms, mean 716.7 µs
    compute = [[8e-3, 8e-3, 8e-3], [8e-3, 8e-3, 8e-3]]
    sequence = [[10e-3, 11e-3, 10.4e-3], [10.4e-3, 10.6e-3, 11.2e-3]]
    assert in_context_time_us(compute, sequence, 4) == pytest.approx((600 + 750 + 800) / 3)
    assert in_context_reps_us(compute, sequence, 4) == pytest.approx([600, 750, 800])  # the cache keeps them
    # each repetition against its own bursts alone (paired): a slow burst repetition is taken out
    assert in_context_time_us([[8e-3, 9e-3]], [[10e-3, 11e-3]], 4) == pytest.approx(500.0)
    # the mean, not the median: one slow repetition of four moves it (a step sums its collectives)
    slow = [[10e-3, 10e-3, 10e-3, 18e-3]]
    assert in_context_time_us([[8e-3] * 4], slow, 4) == pytest.approx((500 * 3 + 2500) / 4)
    assert in_context_time_us([[8e-3]], [[7e-3]], 4) == 0.0  # faster than the bursts alone: noise, 0
    with pytest.raises(ValueError):
        in_context_time_us([], [], 4)


def test_checkable_only_where_the_model_describes_the_measurement() -> None:
    assert checkable("cpu", 2, emulated=False, cores=2) == ""
    assert "contend for cores" in checkable("cpu", 4, emulated=False, cores=2)
    assert checkable("cpu", 4, emulated=True, cores=64).startswith("emulated")
    assert checkable("cuda", 8, emulated=False, cores=2) == ""  # GPU ranks do not share CPU cores


def test_the_compute_twin_is_the_case_emulated_with_timed_steps_only() -> None:
    from fsdpbench.pipeline.compute_twin import MIN_STEPS, twin_case
    from tests.helpers import tiny_case

    case = tiny_case(strategy="zero3", world_size=2).replace(warmup_steps=1, steps=3)
    twin = twin_case(case)
    assert twin.emulate and twin.emulate_ranks == (0, 1)
    assert (twin.memory_steps, twin.profile_steps, twin.bare_steps, twin.time_blocks) == (0, 0, 0, 0)
    assert twin.steps == MIN_STEPS and twin.warmup_steps == 2
    assert (twin.strategy, twin.world_size, twin.model, twin.batch_size) == (
        case.strategy,
        case.world_size,
        case.model,
        case.batch_size,
    )
    # 1 rank: the case itself, real, on its 1-rank group (its local "collectives" cost gloo calls)
    alone = twin_case(case.replace(world_size=1))
    assert not alone.emulate and alone.profile_steps == 0 and alone.steps == MIN_STEPS


def test_fit_link_recovers_alpha_and_busbw_per_kind_from_exact_points() -> None:
    lines = {"all_reduce": (300.0, 0.5), "all_gather": (200.0, 1.0), "broadcast": (100.0, 2.0)}
    factors = {"all_reduce": 1.5, "all_gather": 0.75, "broadcast": 1.0}  # 4 ranks
    points = [
        {"kind": k, "payload_bytes": s, "time_us": a + s * factors[k] / (b * 1e3)}
        for k, (a, b) in lines.items()
        for s in (4096, 65536, 2 << 20)
    ]
    link = fit_link(points, world_size=4)
    for kind, (alpha, busbw) in lines.items():
        assert link.alpha_busbw(kind) == pytest.approx((alpha, busbw)), kind
    assert link.reduce_scatter_as_all_reduce and link.source.startswith("probed")
    # no reduce-scatter probed (a cache from before they were): timed with gloo's all-reduce line
    s = 1 << 20
    assert collective_time_us(link, "reduce_scatter", s, 4) == pytest.approx(300 + s * 1.5 / 500)
    # probed: its own line, with the reduce-scatter's factor (N-1)/N
    rs = [
        {"kind": "reduce_scatter", "payload_bytes": b, "time_us": 400 + b * 0.75 / 250}
        for b in (4096, 1 << 20)
    ]
    with_rs = fit_link(points + rs, world_size=4)
    assert not with_rs.reduce_scatter_as_all_reduce
    assert with_rs.alpha_busbw("reduce_scatter") == pytest.approx((400.0, 0.25))
    assert collective_time_us(with_rs, "reduce_scatter", s, 4) == pytest.approx(400 + s * 0.75 / 250)
    # a kind whose times do not grow with size (noise) is timed by the line through all the points
    flat = [{**p, "time_us": 500.0} if p["kind"] == "broadcast" else p for p in points]
    no_bcast = fit_link(flat, world_size=4)
    assert "broadcast" not in {k for k, _, _ in no_bcast.per_kind}
    assert no_bcast.alpha_busbw("broadcast") == (no_bcast.alpha_us, no_bcast.busbw_GBps)
    # one kind alone: the fallback line is that kind's
    single = fit_link([p for p in points if p["kind"] == "all_gather"], world_size=4)
    assert (single.alpha_us, single.busbw_GBps) == pytest.approx((200.0, 1.0))


def test_queued_collectives_take_the_queued_line() -> None:
    # in context (after compute) α 100 µs; queued behind the previous one (no compute between) α 10 µs
    link = Link(
        "gloo",
        alpha_us=1000.0,
        busbw_GBps=1e9,
        per_kind=(("broadcast", 100.0, 1e9), ("all_reduce", 200.0, 1e9), ("all_gather", 100.0, 1e9)),
        per_kind_queued=(("broadcast", 10.0, 1e9), ("all_gather", 10.0, 1e9)),
    )
    assert collective_time_us(link, "broadcast", 8, 2, queued=True) == pytest.approx(10.0)
    assert collective_time_us(link, "all_reduce", 8, 2, queued=True) == pytest.approx(200.0)  # no queued line
    assert collective_time_us(link, "reduce_scatter", 8, 2, queued=True) == pytest.approx(1000.0)  # fallback
    # asynchronous, waited for at the end (ZeRO-1's broadcasts): a burst of three at 0, 50 and 55 µs,
    # then two more at 500 and 510 µs. 0: after compute (100, ends 100); 50 < 100: queued (10, ends
    # 110); 55 < 110: queued (10); 500: after compute (100, ends 600); 510 < 600, but no queued
    # all-reduce line: in context (200)
    at = [0.0, 50.0, 55.0, 500.0, 510.0]
    kinds = ["broadcast", "broadcast", "broadcast", "broadcast", "all_reduce"]
    burst = StepTimeline(1000.0, tuple(PlacedCollective(k, 8, 2, t, 1000.0) for k, t in zip(kinds, at)))
    assert collective_durations([burst], link) == pytest.approx([100.0, 10.0, 10.0, 100.0, 200.0])
    (out,) = simulate([burst], link)
    assert out["model_comm_ms"] == pytest.approx(0.42)
    assert out["model_step_time_ms"] == pytest.approx(1.0)  # all over by 800 µs, needed at 1000
    # no idle core: compute pauses while each runs, so the 50 µs between the first two are computed
    # after the first has ended, and the second follows compute; one issued at the very point the
    # previous one was (a burst with no compute between) still queues
    same = StepTimeline(1000.0, tuple(PlacedCollective("broadcast", 8, 2, 500.0, 1000.0) for _ in range(3)))
    assert collective_durations([same], link, serial=True) == pytest.approx([100.0, 10.0, 10.0])
    (out,) = simulate([same], link, serial=True)
    assert out["model_step_time_ms"] == pytest.approx(1.12)
    assert collective_durations([burst], link, serial=True) == pytest.approx(
        [100.0, 100.0, 100.0, 100.0, 200.0]
    )
    # collectives that block their caller (FSDP2's on the CPU: needed at the issue) are never queued,
    # though the second is issued 50 µs after the first on the compute clock, before the first's 100 µs
    # would have ended: the caller waited for the first, so compute came between them
    blocking = StepTimeline(1000.0, tuple(PlacedCollective("all_gather", 8, 2, t, t) for t in (0.0, 50.0)))
    for serial in (False, True):
        assert collective_durations([blocking], link, serial=serial) == pytest.approx([100.0, 100.0])
        (out,) = simulate([blocking], link, serial=serial)
        assert out["model_step_time_ms"] == pytest.approx(1.2)


def test_the_probed_link_with_its_queued_lines_round_trips_through_the_run_cache(tmp_path: Path) -> None:
    from fsdpbench.pipeline.comm_probe import gloo_link

    in_context = [
        {"kind": k, "payload_bytes": s, "time_us": a + s / 1e3}
        for k, a in (("all_reduce", 500.0), ("broadcast", 300.0))
        for s in (4096, 1 << 20)
    ]
    # bursts of 8 and 32 issued at once: a start of 900 µs, then per collective α 250 and 50 µs
    in_a_burst = [
        {**p, "burst_s": {str(n): [(900.0 + n * (p["time_us"] - 250.0)) / 1e6] * 2 for n in (8, 32)}}
        for p in in_context
    ]
    link = fit_link(in_context, world_size=2, queued_points=in_a_burst)
    assert link.alpha_busbw("broadcast") == pytest.approx((300.0, 1.0))
    assert link.alpha_busbw("broadcast", queued=True) == pytest.approx((50.0, 1.0))
    assert link.alpha_busbw("all_reduce", queued=True) == pytest.approx((250.0, 1.0))  # factor 2(N−1)/N = 1
    cache = tmp_path / "comm_probe" / "gloo_n2.json"
    cache.parent.mkdir()
    cache.write_text(
        json.dumps({"link": link.to_dict(), "world_size": 2, "points": in_context, "host_tuning": "none"})
    )
    assert gloo_link(tmp_path, 2) == link  # per_kind and per_kind_queued back as tuples


def test_a_probe_is_cached_per_host_tuning_and_one_without_its_tuning_measured_again(
    tmp_path: Path, monkeypatch
) -> None:
    from fsdpbench.core.case import HOST_TUNINGS
    from fsdpbench.pipeline import comm_probe

    points = [{"kind": "all_reduce", "payload_bytes": s, "time_us": 400.0 + s / 1e3} for s in (4096, 1 << 20)]
    probes: list[tuple[int, str]] = []
    monkeypatch.setattr(
        comm_probe,
        "run_probe",
        lambda n, reps, log_dir, host_tuning, root: probes.append((n, host_tuning)) or {"points": points},
    )
    cache = tmp_path / "comm_probe" / "gloo_n2.json"
    cache.parent.mkdir()
    cache.write_text(json.dumps({"link": {}, "world_size": 2, "points": [], "loop_threads_idle": False}))
    again = comm_probe.probe(tmp_path, 2)  # an older run's cache, its processes pinned then: measured again
    assert probes == [(2, "none")] and again["host_tuning"] == "none" and again["points"] == points
    assert again["link"]["source"].endswith(" points")  # untuned: nothing said
    stored = json.loads(json.dumps(again))  # as read back from its file
    assert comm_probe.probe(tmp_path, 2) == stored and len(probes) == 1  # the cache
    tuned = comm_probe.probe(tmp_path, 2, host_tuning="pin")  # a tuned case's ranks: a probe of its own
    assert probes[-1] == (2, "pin") and (tmp_path / "comm_probe" / "gloo_n2_pin.json").exists()
    assert tuned["link"]["source"].endswith(f"; host tuning pin: {HOST_TUNINGS['pin']}")
    assert comm_probe.probe(tmp_path, 2) == stored and len(probes) == 2  # each tuning keeps its own


def test_a_queued_collective_costs_what_it_adds_to_a_burst_not_a_share_of_its_start() -> None:
    """A burst of n collectives issued at once takes start + n × (α + S·factor/busbw): the start (gloo's
    idle threads woken) is the burst's first collective's, timed in context. Per collective of a burst of
    8 (the probe's earlier line), each of ZeRO-1's 38 queued broadcasts paid an eighth of the start."""
    from fsdpbench.pipeline.comm_probe import _fit_bursts

    start_us, alpha_us, us_per_byte = 1600.0, 60.0, 1 / 4e3  # 4 GB/s
    bursts = [
        {
            "kind": "broadcast",  # factor 1
            "payload_bytes": size,
            "burst_s": {str(n): [(start_us + n * (alpha_us + size * us_per_byte)) / 1e6] for n in (8, 32)},
        }
        for size in (4096, 65536, 1 << 20)
    ]
    big = 8 << 20  # a burst of 8 alone: the long one adds nothing at this size
    bursts.append(
        {
            "kind": "broadcast",
            "payload_bytes": big,
            "burst_s": {"8": [(start_us + 8 * (alpha_us + big * us_per_byte)) / 1e6]},
        }
    )
    assert _fit_bursts(bursts, world_size=2) == pytest.approx((start_us, alpha_us, us_per_byte))
    link = fit_link(
        [{**b, "time_us": 900.0 + b["payload_bytes"] / 1e3} for b in bursts], 2, queued_points=bursts
    )
    assert link.alpha_busbw("broadcast", queued=True) == pytest.approx((alpha_us, 4.0))
    # one length only, or one size only: no line (queued collectives then take the in-context line)
    for one in ({"8"}, None):
        bad = (
            [{**b, "burst_s": {n: t for n, t in b["burst_s"].items() if n in one}} for b in bursts]
            if one
            else bursts[:1]
        )
        with pytest.raises(ValueError):
            _fit_bursts(bad, world_size=2)


def test_link_specs() -> None:
    for name in ("auto", "gloo", *LINK_PRESETS, "alpha_us=5,busbw_GBps=40"):
        assert validate_link_spec(name) == name
    for bad in ("nvlink9", "alpha_us=5", "alpha_us=x,busbw_GBps=1", "alpha_us=1,busbw_GBps=0"):
        with pytest.raises(LinkError):
            validate_link_spec(bad)


def test_bad_link_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from fsdpbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", "scenarios/ci.yaml", "--out", str(tmp_path / "run"), "--link", "nvlink9"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --link 'nvlink9': expected one of auto, gloo, nvlink4") and "\n" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_real_cpu_ranks_beyond_the_cores_get_no_modelled_figure_no_probe_and_no_twin(tmp_path, monkeypatch):
    """Where the model is known not to hold (ranks contending for cores) nothing is modelled: the
    rows say why, and neither the probe nor the twin runs for it."""
    import os

    from fsdpbench.pipeline.runner import run_cases
    from fsdpbench.report.data import build_case_frame
    from fsdpbench.report.tables import case_table, model_error_lines
    from fsdpbench.store.results import RunStore
    from tests.helpers import tiny_case

    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # 2 ranks on "1 core"
    store = RunStore(tmp_path / "run")
    frame = run_cases([tiny_case(strategy="zero3", world_size=2)], [], store, {"env": {}}, link="auto")
    assert set(frame["status"]) == {"ok"}
    reason = "2 CPU ranks on 1 cores: the ranks contend for cores, which the model does not describe"
    assert (~frame[MODEL_CHECKABLE].astype(bool)).all() and (frame[MODEL_UNCHECKED_REASON] == reason).all()
    assert "model_step_time_ms" not in frame and "case_model_step_time_ms" not in frame
    assert not (store.run_dir / "comm_probe").exists()
    assert not any(store.run_dir.glob("cases/*/compute_twin"))
    cases = build_case_frame(frame)
    assert case_table(cases)["step time modelled"].iloc[0] == f"unchecked ({reason})"
    assert model_error_lines(cases) == [
        f"step-time model, adhoc: 1 case(s) not checked, no modelled figure shown as a prediction: {reason}"
    ]


@pytest.mark.slow
def test_run_adds_labelled_model_columns_with_the_probed_gloo_link(tmp_path: Path, monkeypatch) -> None:
    from fsdpbench.core.case import HOST_TUNINGS
    from fsdpbench.hosttuning.threads import host_tuning_unsupported
    from fsdpbench.pipeline.runner import run_cases
    from fsdpbench.report.data import build_case_frame
    from fsdpbench.report.tables import case_table
    from fsdpbench.store.results import RunStore
    from tests.helpers import tiny_case

    # the opt-in (the default is the one-case run's, tests/test_threads.py): ranks and probe both take
    # it; where this torch's gloo cannot be told apart (host_tuning_unsupported), the pin alone
    tuning = "pin" if host_tuning_unsupported("pin-idle-loops") else "pin-idle-loops"
    store = RunStore(tmp_path / "run")
    case = tiny_case(strategy="zero3", world_size=2, host_tuning=tuning)
    frame = run_cases([case], [], store, {"env": {}}, link="auto")
    assert set(frame["status"]) == {"ok"}
    probe = store.run_dir / "comm_probe" / f"gloo_n2_{tuning}.json"
    assert probe.exists()  # cached in the run directory
    assert list(frame["gloo_loops_idle"]) == (
        [1, 1] if tuning == "pin-idle-loops" else [0, 0]
    )  # a group each
    if len(os.sched_getaffinity(0)) >= 2:  # each rank pinned to a core of its own
        assert (frame["cores"] != "").all()
        if tuning == "pin-idle-loops":  # the default group's gloo threads bound to it too
            assert (frame["gloo_threads_bound"] >= 1).all()
    assert json.loads(probe.read_text())["host_tuning"] == tuning
    assert frame["model_link_source"].str.endswith(f"; host tuning {tuning}: {HOST_TUNINGS[tuning]}").all()
    for col in (
        "model_step_time_ms",
        "model_compute_ms",
        "model_comm_ms",
        "model_exposed_comm_ms",
        "model_overlap_ratio",
        "case_model_step_time_ms",
    ):
        assert frame[col].notna().all() and (frame[col] >= 0).all(), col
    assert (frame["model_step_time_ms"] >= frame["model_compute_ms"]).all()
    assert frame["case_model_step_time_ms"].iloc[0] == pytest.approx(frame["model_step_time_ms"].max())
    # 2 ranks × 1 thread on this 2-core machine: no idle core, said in the method
    from fsdpbench.engine.intra_op import rank_threads

    serial = no_idle_core("cpu", 2, rank_threads(2), os.cpu_count())
    assert (frame["model_method"] == METHOD_TWIN_INTERLEAVED + (METHOD_NO_IDLE_CORE if serial else "")).all()
    # the compute twin timed every rank; the profiled step's compute was scaled to it
    assert frame[MODEL_COMPUTE_BARE].notna().all()
    assert frame["model_compute_ms"].to_numpy() == pytest.approx(frame[MODEL_COMPUTE_BARE].to_numpy())
    assert frame[MODEL_CHECKABLE].all() and (frame[MODEL_UNCHECKED_REASON] == "").all()
    assert frame["model_link"].str.startswith("gloo (α=").all()
    assert frame["model_link_source"].str.startswith("probed: gloo, 2 CPU processes").all()
    probed = json.loads(probe.read_text())
    kinds = {"all_reduce", "all_gather", "broadcast", "reduce_scatter"}
    # the link is the fit of the cached points: a line per kind whose times grow with size. Which ones
    # do is the machine's (under the suite's load a kind's points can come out flat, and that kind then
    # takes the line through all the points), so the test refits them rather than naming the kinds
    refit = fit_link(probed["points"], 2, queued_points=probed["points_queued"], host_tuning=tuning)
    assert [list(line) for line in refit.per_kind] == probed["link"]["per_kind"]
    assert {k for k, _, _ in refit.per_kind} <= kinds and refit.per_kind
    # a reduce-scatter with a line of its own is timed as gloo runs it, not as an all-reduce
    assert probed["link"]["reduce_scatter_as_all_reduce"] == (
        "reduce_scatter" not in {k for k, _, _ in refit.per_kind}
    )
    # the fit's points are timed in context (4 kinds × 4 sizes); the queued ones (a burst issued at once)
    # beside them, for the kinds a step can queue: not the reduce-scatter, which blocks its caller
    assert len(probed["points"]) == 16 and {p["kind"] for p in probed["points"]} == kinds
    assert len(probed["points_queued"]) == 12 and "reduce_scatter" not in {
        p["kind"] for p in probed["points_queued"]
    }
    assert all(p["time_us"] >= 0 for p in probed["points"])
    # each (kind, size): per repetition one burst of 8 and, to 1 MB, one of 32; every total a time
    lengths = {p["payload_bytes"]: sorted(p["burst_s"]) for p in probed["points_queued"]}
    assert lengths == {4096: ["32", "8"], 65536: ["32", "8"], 1 << 20: ["32", "8"], 8 << 20: ["8"]}
    assert all(t > 0 for p in probed["points_queued"] for times in p["burst_s"].values() for t in times)
    assert "queued: what one more adds to a burst issued at once, 8 against 32" in probed["link"]["source"]
    # zero3 on decoder-tiny's 2 blocks + root: 3 all-gathers forward, 3 backward, 3 reduce-scatters
    assert (frame["model_collectives"] == 9).all()
    table = case_table(build_case_frame(frame))
    assert "step time modelled" in table.columns and " ms on gloo" in table["step time modelled"].iloc[0]


@pytest.mark.slow
def test_one_rank_run_models_its_twin_compute_and_no_communication(tmp_path: Path) -> None:
    from fsdpbench.pipeline.runner import run_cases
    from fsdpbench.store.results import RunStore
    from tests.helpers import tiny_case

    store = RunStore(tmp_path / "run")
    frame = run_cases([tiny_case(strategy="ddp", world_size=1)], [], store, {"env": {}}, link="auto")
    row = frame.iloc[0]
    assert row["status"] == "ok" and row["model_method"] == METHOD_TWIN_INTERLEAVED
    assert row["model_comm_ms"] == 0.0 and row["model_exposed_comm_ms"] == 0.0
    assert row["model_step_time_ms"] == pytest.approx(row["model_compute_ms"])
    assert row["model_compute_ms"] == pytest.approx(row[MODEL_COMPUTE_BARE])
    assert (store.case_dir(row["case_id"]) / "compute_twin" / "rank0.json").exists()
    # nothing leaves a 1-rank process: no link to probe, and none probed
    assert row["model_link"] == "one rank (no collective leaves the process)"
    assert row["model_link_source"] == "not probed: at 1 rank no collective leaves the process"
    assert not (store.run_dir / "comm_probe").exists()


@pytest.mark.slow
def test_a_twin_that_failed_beside_the_case_is_run_after_it_and_said_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdpbench.pipeline import compute_twin
    from fsdpbench.pipeline.runner import run_cases
    from fsdpbench.store.results import RunStore
    from tests.helpers import tiny_case

    def broken(case: Any) -> Any:  # the twin beside the case cannot build its model
        return case.replace(model="no-such-model")

    monkeypatch.setattr(compute_twin, "interleaved_twin", broken)
    store = RunStore(tmp_path / "run")
    frame = run_cases([tiny_case(strategy="ddp", world_size=1)], [], store, {"env": {}}, link="auto")
    row = frame.iloc[0]
    assert row["status"] == "ok" and row["model_method"] == METHOD_TWIN  # "run after the case"
    assert row["model_compute_ms"] == pytest.approx(row[MODEL_COMPUTE_BARE]) and row[MODEL_COMPUTE_BARE] > 0


@requires_cuda
def test_a_one_gpu_case_is_modelled_from_its_twin_run_after_it(tmp_path: Path) -> None:
    """On a GPU the twin runs after the case (the two would share the device), and the model's compute is
    its timed steps, not the profiled kernels: a step the host cannot launch fast enough is longer than
    its kernels (decoder-base bf16 on an H200: 26-30 ms of kernels in a 50-92 ms step)."""
    from fsdpbench.pipeline.runner import run_cases
    from fsdpbench.store.results import RunStore
    from tests.helpers import tiny_case

    store = RunStore(tmp_path / "run")
    case = tiny_case(strategy="zero3", world_size=1, device="cuda", backend="nccl", profile_steps=1)
    row = run_cases([case], [], store, {"env": {}}, link="auto").iloc[0]
    assert row["status"] == "ok" and row["model_method"] == METHOD_TWIN
    assert row["model_comm_ms"] == 0.0 and row[MODEL_COMPUTE_BARE] > 0
    assert row["model_step_time_ms"] == pytest.approx(row[MODEL_COMPUTE_BARE])
    assert (store.case_dir(row["case_id"]) / "compute_twin" / "rank0.json").exists()
    assert row["model_link"] == "one rank (no collective leaves the process)"  # not nvlink4


@pytest.mark.parametrize("spec", ["auto", "nvlink4", "ib-ndr400", "gloo"])
def test_a_one_rank_case_names_no_link_on_any_backend(spec: str, tmp_path: Path) -> None:
    from fsdpbench.pipeline.comm_probe import resolve_link
    from fsdpbench.predictors.comm_model import LINK_PRESETS, ONE_RANK_LINK

    for backend in ("nccl", "gloo"):
        assert resolve_link(spec, backend, 1, tmp_path) is ONE_RANK_LINK
    if spec != "gloo":  # at 2 ranks the link is the one named (auto: nvlink4 for NCCL)
        assert resolve_link(spec, "nccl", 2, tmp_path) is LINK_PRESETS["nvlink4" if spec == "auto" else spec]
    assert not (tmp_path / "comm_probe").exists()  # nothing probed


def test_report_shows_error_where_checkable_and_the_reason_where_not() -> None:
    import pandas as pd

    from fsdpbench.report.tables import _checked_model, _fmt_modelled, model_error_lines

    contended = checkable("cpu", 4, emulated=False, cores=2)
    cases = pd.DataFrame(
        {
            "label": ["ddp n1", "zero3 n2", "zero1 n2", "zero1 n4"],
            "scenario": ["quickstart"] * 4,
            "status": ["ok"] * 4,
            "model_step_time_ms": [10.0, 22.0, 19.0, 90.0],
            "model_step_err": [0.02, -0.08, 0.05, float("nan")],
            MODEL_CHECKABLE: [True, True, True, False],
            MODEL_UNCHECKED_REASON: ["", "", "", contended],
            "model_link": ["gloo (α=1 µs, busbw=1 GB/s)"] * 4,
        }
    )
    (line,) = model_error_lines(cases)
    assert line.startswith("step-time model, quickstart: modelled vs measured step time over 3 case(s)")
    assert "mean absolute error 5.0%, worst -8.0% (zero3 n2)" in line
    assert f"1 case(s) not checked, no modelled figure shown as a prediction: {contended}" in line
    checked, unchecked = cases.iloc[1], cases.iloc[3]
    assert _checked_model(checked) == 22.0 and _checked_model(unchecked) is None  # glance: no figure
    assert _fmt_modelled(checked, 22.0) == "22.0 ms on gloo (-8.0%)"
    assert _fmt_modelled(unchecked, None) == f"unchecked ({contended})"
    assert _fmt_modelled(unchecked, 90.0) == f"90.0 ms, unchecked ({contended})"  # the full case table


def test_report_says_where_the_measured_steps_spread_wider_than_the_models_band() -> None:
    """A case whose own timed steps spread over 20 % of their median (p10–p90) gets that beside its
    modelled figure, and the scenario's error line counts such cases; a steady case gets nothing."""
    import pandas as pd

    from fsdpbench.report.tables import _fmt_modelled, model_error_lines, steps_spread

    cases = pd.DataFrame(
        {
            "label": ["ddp n2", "zero1 n2"],
            "scenario": ["ci"] * 2,
            "status": ["ok"] * 2,
            "step_time_ms": [10.0, 20.0],
            "step_time_p10_ms": [9.5, 16.0],  # ddp: 10 % of its median; zero1: 60 %
            "step_time_p90_ms": [10.5, 28.0],
            "model_step_time_ms": [10.2, 18.0],
            "model_step_err": [0.02, -0.10],
            MODEL_CHECKABLE: [True, True],
            "model_link": ["gloo (α=1 µs, busbw=1 GB/s)"] * 2,
        }
    )
    steady, unsteady = cases.iloc[0], cases.iloc[1]
    assert steps_spread(steady) == pytest.approx(0.10) and steps_spread(unsteady) == pytest.approx(0.60)
    assert _fmt_modelled(steady, 10.2) == "10.2 ms on gloo (+2.0%)"
    assert _fmt_modelled(unsteady, 18.0) == "18.0 ms on gloo (-10.0%); measured steps spread 60% (p10–p90)"
    (line,) = model_error_lines(cases)
    assert "1 of them with measured steps spread over 20% of their median (p10–p90)" in line
    assert steps_spread(cases.drop(columns=["step_time_p10_ms"]).iloc[1]) is None  # rows from before it


@pytest.mark.slow
def test_one_emulated_rank_gives_a_modelled_n_rank_step_on_a_preset_link(tmp_path: Path) -> None:
    from fsdpbench.pipeline.runner import run_cases
    from fsdpbench.predictors.step_model import METHOD_EMULATED
    from fsdpbench.store.results import RunStore
    from tests.helpers import tiny_case

    case = tiny_case(strategy="zero3", world_size=8, emulate=True, emulate_ranks=(0,))
    store = RunStore(tmp_path / "run")
    frame = run_cases([case], [], store, {"env": {}}, link="ib-ndr400")
    row = frame.iloc[0]
    assert row["status"] == "ok" and row["model_method"] == METHOD_EMULATED
    # its own timed steps are its compute; the collectives it issued (the real sizes) cost α–β time
    assert row["model_compute_ms"] == pytest.approx(row[MODEL_COMPUTE_BARE])
    assert row[MODEL_COMPUTE_BARE] == pytest.approx(row["step_time_ms"])
    assert row["model_collectives"] == 9 and row["model_comm_ms"] > 9 * 20e-3  # 9 × at least α = 20 µs
    assert row["model_step_time_ms"] >= row["model_compute_ms"]
    assert not row[MODEL_CHECKABLE] and row[MODEL_UNCHECKED_REASON].startswith("emulated")
    assert not (store.run_dir / "comm_probe").exists()  # a preset link: nothing probed


@pytest.mark.slow
def test_predict_emulated_with_a_link_models_the_n_rank_step() -> None:
    from fsdpbench.pipeline.emulated_rank import emulate_rank
    from fsdpbench.predictors.step_model import METHOD_EMULATED
    from tests.helpers import tiny_case

    emu = emulate_rank(tiny_case(strategy="zero3", world_size=4), link=LINK_PRESETS["ib-ndr400"])
    m = emu.modelled_step
    assert m["model_method"] == METHOD_EMULATED and m["model_link"].startswith("ib-ndr400")
    assert m["model_compute_ms"] == pytest.approx(emu.step_time_ms)  # its timed steps are its compute
    assert m["model_comm_ms"] >= 9 * 20e-3  # 9 collectives, each at least α = 20 µs
    assert m["model_step_time_ms"] >= m["model_compute_ms"]
    assert emulate_rank(tiny_case(strategy="zero3", world_size=4)).modelled_step is None  # no link, no model
