"""Every scenario in scenarios/ expands without error, and a CPU-sized variant of each runs: its first
case (compile off), with one step per phase. The full studies run with ``fsdpbench run``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fsdpbench.pipeline.launch import launch_case
from fsdpbench.pipeline.scenario import load_scenario
from tests.helpers import CPU

SCENARIOS = sorted((Path(__file__).parents[1] / "scenarios").glob("*.yaml"))
ONE_STEP = {"warmup_steps": 1, "steps": 1, "memory_steps": 1, "profile_steps": 0, "bare_steps": 1}
# a GPU-sized scenario (its defaults name device: cuda) made CPU-sized: decoder-base's one step at batch 8,
# seq 1024 takes minutes on 2 cores
CPU_SIZED = {"model": "decoder-mini", "batch_size": 2, "seq_len": 32}


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_expands_with_reasons_for_every_skip(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.description.strip(), f"{path.name}: say in a sentence what the study answers"
    assert scenario.cases or scenario.skipped
    assert len({c.case_id for c in scenario.cases}) == len(scenario.cases)
    for skipped in scenario.skipped:
        assert skipped.reason.strip()


def test_knob_studies_exist_and_sweep_their_knob() -> None:
    names = {p.stem for p in SCENARIOS}
    assert {
        "strategies",
        "wrap_granularity",
        "prefetch",
        "precision",
        "offload",
        "fsdp1_vs_fsdp2",
        "tutorial_mnist",
    } <= names
    prefetch = load_scenario(Path(SCENARIOS[0].parent, "prefetch.yaml"), overrides=CPU)
    assert {c.backward_prefetch for c in prefetch.cases if c.strategy == "fsdp1_full"} == {
        "pre",
        "post",
        "none",
    }
    offload = load_scenario(Path(SCENARIOS[0].parent, "offload.yaml"), overrides=CPU)
    assert {c.strategy for c in offload.cases if c.cpu_offload} == {"zero2", "zero3"}
    assert [s.case.strategy for s in offload.skipped] == ["fsdp1_full"]  # pinned host memory needs a GPU
    tutorial = load_scenario(Path(SCENARIOS[0].parent, "tutorial_mnist.yaml"), overrides=CPU)
    assert {
        (c.wrap, c.wrap_min_params if c.wrap == "size" else None)
        for c in tutorial.cases
        if c.strategy != "ddp"
    } == {("whole", None), ("size", 100), ("size", 20_000)}
    assert {(c.optimizer, c.lr, c.batch_size) for c in tutorial.cases} == {("adadelta", 1.0, 64)}


@pytest.mark.slow
@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_a_cpu_sized_variant_runs(path: Path, tmp_path: Path) -> None:
    gpu_sized = (yaml.safe_load(path.read_text()).get("defaults") or {}).get("device") == "cuda"
    scenario = load_scenario(path, overrides={**ONE_STEP, **CPU, **(CPU_SIZED if gpu_sized else {})})
    runnable = [c for c in scenario.cases if not c.compile]
    if not runnable:
        pytest.skip(f"{path.name}: every case skipped here: {scenario.skipped[0].reason}")
    case = runnable[0]
    outcome = launch_case(case, tmp_path / case.case_id)
    assert outcome.status == "ok", f"{path.name} {case.case_id}: {outcome.error}"
    assert outcome.ranks[0].memory.peak["total"] > 0
