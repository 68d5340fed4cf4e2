"""DeepSpeed's own checkpoint (``checkpoint: native``: ``engine.save_checkpoint``/``load_checkpoint``) in
the checkpoint phase, and its bytes on disk predicted per rank (predictors/deepspeed_checkpoint.py).

Tests that need DeepSpeed skip with the reason where the optional extra is not installed
(``DS_BUILD_OPS=0 pip install -e ".[deepspeed]"``); the prediction reads DeepSpeed's version and its
recovery scripts' sizes from the installed package, so it needs it too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fsdpbench.core import schema
from fsdpbench.core.case import Case
from fsdpbench.pipeline.scenario import parse_scenario
from fsdpbench.predictors import deepspeed_checkpoint as dsc
from fsdpbench.predictors.checkpoint import NATIVE_TAG, predict_checkpoint
from fsdpbench.strategies import get_strategy
from tests.helpers import run_with_predictions
from tests.test_checkpoint import CKPT_TINY, NO_DEEPSPEED

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason=NO_DEEPSPEED,
)

# mlp width 64, depth 2: blocks.{0,1}.fc (64x64 + 64) and head (10x64 + 10): 8970 parameters; a longer
# limit for DeepSpeed's import and engine set-up
TINY = {**CKPT_TINY, "timeout_s": 300}
PSI = 2 * (64 * 64 + 64) + 10 * 64 + 10


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("strategy, offload", [("ds_zero2", False), ("ds_zero3", False), ("ds_zero3", True)])
def test_native_round_trip_and_every_ranks_files_to_the_byte(
    strategy: str, offload: bool, tmp_path: Path
) -> None:
    # with cpu_offload the files carry the offload config: the same layout, a few bytes more
    case = Case(
        **TINY,
        strategy=strategy,
        world_size=2,
        checkpoint="native",
        keep_checkpoints=True,
        cpu_offload=offload,
    )
    rows = run_with_predictions(case, tmp_path).sort_values("rank")
    assert rows[schema.CHECKPOINT_COLUMNS["state_equal"]].tolist() == [True, True]
    assert rows[schema.CHECKPOINT_COLUMNS["loss_equal"]].tolist() == [True, True]
    stage = int(strategy[-1])
    directory = tmp_path / case.case_id / "checkpoint"
    preds = predict_checkpoint(case, get_strategy(strategy))
    for rank in range(2):
        files = dsc.native_files(case, _shapes(case), stage, rank, NATIVE_TAG)
        model_file = dsc.model_state_file(stage, rank)
        real_model = (directory / NATIVE_TAG / model_file).stat().st_size if model_file else 0
        assert files.model_states == real_model
        assert files.optim_states == (directory / NATIVE_TAG / dsc.optim_state_file(rank)).stat().st_size
        assert preds[rank].bytes == files.total
    # rank 0 also writes `latest` and the recovery scripts; with ZeRO-3 every rank its model states
    assert rows[schema.CKPT_BYTES].tolist() == [p.bytes for p in preds]
    assert rows[schema.PRED_CKPT_BYTES_ERR].tolist() == [0.0, 0.0]
    assert rows[schema.CHECKPOINT_COLUMNS["files"]].tolist() == [5, 2 if stage == 3 else 1]
    assert (directory / "latest").read_text() == NATIVE_TAG


def _shapes(case: Case) -> list[tuple[str, tuple[int, ...]]]:
    from fsdpbench.predictors.checkpoint import _params

    return [(p.name, p.shape) for p in _params(case)[0]]


@needs_deepspeed
def test_zero2_partitions_the_padded_flat_buffer_and_zero3_every_parameter() -> None:
    case = Case(**TINY, strategy="ds_zero2", world_size=2, checkpoint="native")
    # stage 1/2: 8970 elements padded to a multiple of 2N = 4: 8972, two partitions of 4486, the last
    # rank's holding the 2 of padding; each rank saves its fp32 partition, exp_avg, exp_avg_sq (the
    # padded partition) and a 4-byte step; rank 0 the model states: the flat buffer's storage, once
    flat = 8972
    z2 = [dsc.native_files(case, _shapes(case), 2, rank, NATIVE_TAG) for rank in range(2)]
    assert [f.payload for f in z2] == [4 * flat + 3 * 4 * (flat // 2) + 4, 3 * 4 * (flat // 2) + 4]
    assert z2[1].model_states == 0 and z2[1].recovery_scripts == 0 and z2[0].latest == len(NATIVE_TAG)
    # stage 3: every parameter partitioned alone, ceil(numel / 2) each: 4485 per rank; the model
    # states (every rank) hold empty tensors
    z3 = [dsc.native_files(case, _shapes(case), 3, rank, NATIVE_TAG) for rank in range(2)]
    part = 2 * (32 * 64 + 32) + 5 * 64 + 5
    assert part == -(-PSI // 2) == 4485
    assert [f.payload for f in z3] == [3 * 4 * part + 4] * 2
    assert z3[0].model_states == z3[1].model_states > 0
    # the format's own bytes: 10 zip records (~240 bytes each: header, 64-byte alignment, descriptor,
    # central entry, a 48-character name twice) and a 1.9 KB pickle (the config, the fragments)
    assert 4096 < z2[1].optim_states - z2[1].payload < 8192


@needs_deepspeed
def test_the_host_memory_of_a_native_save_is_nothing_new_on_a_cpu_rank() -> None:
    case = Case(model="mlp", world_size=4, strategy="ds_zero3", checkpoint="native")
    preds = predict_checkpoint(case, get_strategy("ds_zero3"))
    assert [p.save_host_peak_bytes for p in preds] == [0] * 4
    on_gpu = predict_checkpoint(case.replace(device="cuda", backend="nccl"), get_strategy("ds_zero3"))
    assert [p.save_host_peak_bytes for p in on_gpu] == [p.payload_bytes for p in on_gpu]


def test_deepspeed_runs_native_only_and_the_others_do_not() -> None:
    scenario = parse_scenario(
        """
name: ck
defaults: {model: mlp, world_size: 2, device: cpu}
sweep:
  strategy: [ds_zero2, zero3]
  checkpoint: [native, dcp]
"""
    )
    reasons = {(s.case.strategy, s.case.checkpoint): s.reason for s in scenario.skipped}
    assert (
        reasons[("zero3", "native")]
        == "checkpoint=native: zero3 checkpoints with full, sharded, dcp, dcp_async"
    )
    if importlib.util.find_spec("deepspeed") is None:  # every ds case is skipped for the extra
        assert "DeepSpeed is not installed" in reasons[("ds_zero2", "native")]
    else:
        assert {(c.strategy, c.checkpoint) for c in scenario.cases} == {
            ("ds_zero2", "native"),
            ("zero3", "dcp"),
        }
        assert reasons[("ds_zero2", "dcp")] == "checkpoint=dcp: ds_zero2 checkpoints with native"


@needs_deepspeed
@pytest.mark.parametrize("precision, modelled", [("fp32", True), ("bf16", False)])
def test_predict_gives_deepspeeds_files_in_fp32_and_says_why_not_in_bf16(
    precision: str, modelled: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from fsdpbench.cli import main

    argv = ["predict", "--model", "mlp", "--world-size", "2", "--strategy", "ds_zero2", "--device", "cpu"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--precision", precision, "--checkpoint", "native", "--json"])
    assert exit_.value.code == 0
    record = [r for r in json.loads(capsys.readouterr().out) if r.get("checkpoint") == "native"][0]
    if modelled:
        case = Case(model="mlp", world_size=2, strategy="ds_zero2", checkpoint="native")
        expected = [p.bytes for p in predict_checkpoint(case, get_strategy("ds_zero2"))]
        assert [r["bytes"] for r in record["ranks"]] == expected
        assert record["bytes_on_disk_total"] == sum(expected)
    else:
        assert record["not_applicable"] == "DeepSpeed's bf16 checkpoint files are not modelled (fp32 only)"
