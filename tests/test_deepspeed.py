"""DeepSpeed's ZeRO engines as strategies (ds_zero1/2/3): config from the case, skipping without the
extra, the same maths as one rank, and model-state bytes filed by category.

Tests that run DeepSpeed skip with the reason where the optional extra is not installed
(``DS_BUILD_OPS=0 pip install -e ".[deepspeed]"``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import importlib.util

import pytest

from fsdpbench.strategies import deepspeed_zero as dsz
from fsdpbench.strategies import get_strategy
from tests.helpers import global_losses, made_once, run, tiny_case

NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None
needs_deepspeed = pytest.mark.skipif(
    NO_DEEPSPEED,
    reason='DeepSpeed not installed (optional extra: DS_BUILD_OPS=0 pip install -e ".[deepspeed]")',
)
RTOL = 1e-5
DECODER_TINY_PARAMS = 172_352  # Ψ of decoder-tiny, asserted below from the model itself


def test_config_carries_the_case_and_deepspeeds_defaults() -> None:
    case = tiny_case(
        strategy="ds_zero3", world_size=2, batch_size=3, strategy_args={"reduce_bucket_size": 1000}
    )
    cfg = dsz.build_ds_config(case, 3)
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["gradient_accumulation_steps"] == 1
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 1000
    assert (
        zero["stage3_param_persistence_threshold"] == 100_000 and zero["stage3_max_live_parameters"] == 10**9
    )
    assert "overlap_comm" not in zero  # None: DeepSpeed picks (true on stage 3)
    assert "allgather_bucket_size" not in zero  # a stage-1/2 knob
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    assert not cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]


def test_cpu_offload_offloads_the_optimizer_and_on_stage3_the_params() -> None:
    zero2 = dsz.build_ds_config(tiny_case(strategy="ds_zero2", cpu_offload=True), 2)["zero_optimization"]
    assert (
        zero2["offload_optimizer"] == {"device": "cpu", "pin_memory": False} and "offload_param" not in zero2
    )
    zero3 = dsz.build_ds_config(tiny_case(strategy="ds_zero3", cpu_offload=True), 3)["zero_optimization"]
    assert zero3["offload_param"]["device"] == "cpu"
    only_optim = tiny_case(strategy="ds_zero3", cpu_offload=True, strategy_args={"offload_param": False})
    assert "offload_param" not in dsz.build_ds_config(only_optim, 3)["zero_optimization"]
    bf16 = dsz.build_ds_config(tiny_case(strategy="ds_zero2", precision="bf16"), 2)
    assert bf16["bf16"]["enabled"] and not bf16["fp16"]["enabled"]


@needs_deepspeed
def test_check_names_unknown_and_mistyped_knobs() -> None:
    zero2 = get_strategy("ds_zero2")
    reason = zero2.check(tiny_case(strategy="ds_zero2", strategy_args={"stage3_max_live_parameters": 5}))
    assert "unknown to ds_zero2" in reason and "reduce_bucket_size" in reason
    assert "must be int" in zero2.check(
        tiny_case(strategy="ds_zero2", strategy_args={"reduce_bucket_size": "5e8"})
    )
    assert "must be bool" in zero2.check(tiny_case(strategy="ds_zero2", strategy_args={"overlap_comm": 1}))
    assert zero2.check(tiny_case(strategy="ds_zero2", strategy_args={"overlap_comm": True})) is None


def test_without_deepspeed_a_case_is_skipped_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a)
    )
    reason = get_strategy("ds_zero1").check(tiny_case(strategy="ds_zero1", world_size=2))
    assert (
        reason.startswith("DeepSpeed is not installed")
        and 'DS_BUILD_OPS=0 pip install -e ".[deepspeed]"' in reason
    )


@needs_deepspeed
def test_deepspeeds_estimator_is_the_third_prediction() -> None:
    from fsdpbench.models.facts import get_model_facts

    psi = get_model_facts("decoder-tiny").n_params
    assert psi == DECODER_TINY_PARAMS
    # DeepSpeed's formulas: stage 2: 2Ψ + 18Ψ/N; stage 3: 4·largest layer + 18Ψ/N; no stage-1 estimator
    assert get_strategy("ds_zero2").vendor_model_states_bytes(
        tiny_case(strategy="ds_zero2", world_size=2)
    ) == (2 * psi + 18 * psi // 2)
    largest = dsz.largest_layer_params(tiny_case())
    assert get_strategy("ds_zero3").vendor_model_states_bytes(
        tiny_case(strategy="ds_zero3", world_size=2)
    ) == (4 * largest + 18 * psi // 2)
    assert (
        get_strategy("ds_zero1").vendor_model_states_bytes(tiny_case(strategy="ds_zero1", world_size=2))
        is None
    )


@pytest.fixture(scope="module")
@made_once
def ds_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("ds")
    return {s: run(tiny_case(strategy=s, world_size=2), out) for s in ("ds_zero1", "ds_zero2", "ds_zero3")}


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("strategy", ["ds_zero1", "ds_zero2", "ds_zero3"])
def test_two_ranks_match_one_rank_over_the_global_batch(strategy: str, ds_runs, reference_2) -> None:
    outcome = ds_runs[strategy]
    assert outcome.status == "ok", outcome.error
    losses = global_losses(outcome)
    assert len(losses) == len(reference_2) == 5
    assert losses[-1] != losses[0]
    assert losses == pytest.approx(reference_2, rel=RTOL)


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("strategy", ["ds_zero1", "ds_zero2"])
def test_stage12_states_are_filed_whole_params_and_a_master_partition(strategy: str, ds_runs) -> None:
    psi, n = DECODER_TINY_PARAMS, 2
    for rank in ds_runs[strategy].ranks:
        local = rank.memory.states_local
        # the whole model in one flat fp32 buffer; fp32 master partition + Adam's two moments (+ step)
        assert local["params"] == 4 * psi
        assert local["optim"] == 4 * psi // n + 8 * psi // n + 4
        tracked = rank.memory.states_tracker
        assert tracked["params"] == 4 * psi and tracked["optim"] == local["optim"]
        # the reduce bucket: reduce_bucket_size (5e8) fp32 elements, filed as reduce_scatter at the peak
        assert rank.memory.peak["reduce_scatter"] == 4 * 500_000_000


@pytest.mark.slow
@needs_deepspeed
def test_stage3_keeps_parameters_below_the_persistence_threshold_whole(ds_runs) -> None:
    psi, n = DECODER_TINY_PARAMS, 2  # every decoder-tiny parameter is below the default threshold (1e5)
    for rank in ds_runs["ds_zero3"].ranks:
        local = rank.memory.states_local
        assert local["params"] == 4 * psi + 4 * psi // n  # whole persistent params + the partition
        assert local["grads"] == 4 * psi // n  # grad_partitions_flat_buffer: allocated once, kept
        assert local["optim"] == 12 * psi // n + 4
        tracked = rank.memory.states_tracker
        assert {k: tracked[k] for k in ("params", "grads", "optim")} == local


@pytest.mark.slow
@needs_deepspeed
def test_stage3s_compute_twin_runs_every_rank_alone(tmp_path) -> None:
    # the twin runs every rank emulated (the fake process group moves nothing): ZeRO-3's per-step check
    # that a rank's module order is rank 0's broadcast nothing to rank 1, which raised in its first step
    from fsdpbench.pipeline.compute_twin import twin_case

    twin = twin_case(tiny_case(strategy="ds_zero3", world_size=2))
    assert twin.emulate and twin.emulate_ranks == (0, 1)
    outcome = run(twin, tmp_path)
    assert outcome.status == "ok", outcome.error
    assert sorted(r.rank for r in outcome.ranks) == [0, 1]
    assert all(r.status == "ok" and len(r.timed.times_ms) == twin.steps for r in outcome.ranks)
