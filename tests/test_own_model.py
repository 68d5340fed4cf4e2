"""Your own model (``model: package.module:factory`` returning an ``OwnModel``): refused unless plugins are
allowed, then run on real ranks, emulated and traced as a registered model; ``predict`` says it has no
analytic activation model and answers with the traced peak. The worked example: examples/my_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdpbench.cli import main
from fsdpbench.core.case import Case
from fsdpbench.models import check_model_args, count_params, resolve_model
from fsdpbench.pipeline.scenario import ScenarioError, load_scenario
from fsdpbench.predictors.traced import estimate
from tests.helpers import REPO, global_losses, run

EXAMPLE = REPO / "examples/my_model.yaml"
FACTORY = "examples.my_model:build"
SHAPE = dict(world_size=2, batch_size=2, seq_len=16, warmup_steps=1, steps=2, timeout_s=180)


def test_the_example_scenario_needs_allow_plugins():
    with pytest.raises(ScenarioError, match=r"model: 'examples.my_model:build' is a plugin.*--allow-plugins"):
        load_scenario(EXAMPLE, allow_plugins=False)
    scenario = load_scenario(EXAMPLE, allow_plugins=True)
    assert [c.strategy for c in scenario.cases] == ["ddp", "zero2", "zero3"]
    assert scenario.cases[0].case_id.startswith("ddp_n2_examples.my_model.build-depth2-width64_")


def test_the_factorys_keyword_arguments_are_its_model_args():
    mdef, args = resolve_model(FACTORY, {"width": 32})
    assert args == {"width": 32, "depth": 2, "vocab": 256, "classes": 16}
    assert mdef.block_class_names == ("ResidualBlock",) and mdef.is_sequence
    # 256·32 embedding + 2 blocks (LayerNorm 64, 32→128→32 with biases) + LayerNorm 64 + 32→16 head
    assert (
        count_params(FACTORY, {"width": 32})
        == 256 * 32 + 2 * (64 + 32 * 128 + 128 + 128 * 32 + 32) + 64 + 528
    )
    assert "width: should be an integer" in check_model_args(FACTORY, {"width": "wide"})
    assert "no argument(s) ['heads']" in check_model_args(FACTORY, {"heads": 4})
    # a factory whose arguments have no defaults, and one that does not return an OwnModel
    assert "needs a default" in check_model_args("examples.my_model:token_loss", {})
    assert "returned Fraction, not fsdpbench.models.OwnModel" in check_model_args("fractions:Fraction", {})


def test_it_runs_on_real_ranks_and_the_trace_is_the_measurement(tmp_path: Path):
    """ddp and zero3 on 2 CPU ranks: the same losses (the same global batch), each rank's tracker peak
    equal to the traced one, to the byte."""
    losses = {}
    for strategy, wrap in (("ddp", "none"), ("zero3", "block")):
        case = Case(model=FACTORY, strategy=strategy, wrap=wrap, **SHAPE)
        outcome = run(case, tmp_path)
        assert outcome.status == "ok", outcome.error
        losses[strategy] = global_losses(outcome)
        for rank in outcome.ranks:
            assert rank.memory.peak["total"] == estimate(case, rank=rank.rank).peak_bytes
    assert losses["zero3"] == pytest.approx(losses["ddp"], rel=1e-5)
    assert losses["ddp"][-1] != losses["ddp"][0]  # it trained


def test_it_is_emulated_as_the_real_rank_measures(tmp_path: Path):
    real = Case(model=FACTORY, strategy="zero3", **SHAPE)
    emulated = real.replace(emulate=True, emulate_ranks=(1,))
    real_out, emu_out = run(real, tmp_path), run(emulated, tmp_path)
    assert real_out.status == emu_out.status == "ok", (real_out.error, emu_out.error)
    assert emu_out.ranks[0].memory.peak == real_out.ranks[1].memory.peak


def test_predict_falls_back_to_the_trace(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--model", FACTORY, "--world-size", "4", "--strategy", "zero3", "--device", "cpu",
              "--batch-size", "2", "--seq-len", "16", "--json"])  # fmt: skip
    assert (exc.value.code or 0) == 0
    analytic, traced = json.loads(capsys.readouterr().out)
    assert analytic["peak_bytes"] is None and analytic["model_states_bytes"] > 0
    assert traced["fallback"] == f"analytic activation model not available for {FACTORY}: traced instead"
    case = Case(model=FACTORY, strategy="zero3", world_size=4, batch_size=2, seq_len=16)
    assert traced["peak_bytes"] == estimate(case).peak_bytes
