"""FSDP2's int ``reshard_after_forward`` (``strategy_args: {reshard_after_forward: n}``): after its forward
each unit keeps its parameters sharded over groups of n ranks and gathers them back over that group in
backward. It runs on real ranks and emulated, the traced predictor (which runs FSDP2 itself) equals the
measured tracker peak to the byte, the communication is the mechanism's, and the analytic models, which
have no term for it, say so and give no figure: ``predict`` traces instead."""

from __future__ import annotations

import json
import math

import pytest

from fsdpbench.cli import main
from fsdpbench.models import build_model
from fsdpbench.predictors.memory_model import NO_PEAK_TERM, predict_memory
from fsdpbench.predictors.traced import estimate
from fsdpbench.strategies import get_strategy
from tests.helpers import run, tiny_case

WORLD, GROUP = 4, 2


def int_case(**fields):
    return tiny_case(
        strategy="zero3", world_size=WORLD, strategy_args={"reshard_after_forward": GROUP}, **fields
    )


def padded_bytes(case, *, blocks: bool) -> int:
    """fp32 bytes of the block units' (or the root's) parameters, each padded to a multiple of the world
    size as FSDP2 shards it: what an all-gather of them outputs."""
    model = build_model(case.model, case.model_args)
    return sum(
        4 * math.ceil(p.numel() / WORLD) * WORLD
        for name, p in model.named_parameters()
        if name.startswith("layers.") == blocks
    )


def test_real_ranks_measure_the_traced_peak_and_the_mechanisms_all_gathers(tmp_path):
    case = int_case()
    outcome = run(case, tmp_path)
    assert outcome.status == "ok", outcome.error
    for rank in outcome.ranks:
        assert rank.memory.peak["total"] == estimate(case, rank=rank.rank).peak_bytes
    # forward: every unit gathered over the 4 ranks; backward: the blocks over groups of 2, the root
    # (resharded as with true) over the 4 again; a gather sends (g - 1)/g of its output
    blocks, root = padded_bytes(case, blocks=True), padded_bytes(case, blocks=False)
    expected = (blocks + root) * 3 / 4 + blocks * 1 / 2 + root * 3 / 4
    for rank in outcome.ranks:
        assert rank.profiled["comm_all_gather_bytes"] == expected
        assert "comm_pred_all_gather_bytes" not in rank.profiled
        assert "reshard_after_forward=2" in rank.profiled["comm_pred_note"]
    # each unit's kept slice: the same case resharding fully holds less at its peak
    full = run(case.replace(strategy_args={}), tmp_path)
    assert full.status == "ok", full.error
    assert full.ranks[0].memory.peak["total"] < outcome.ranks[0].memory.peak["total"]


def test_an_emulated_rank_measures_as_the_real_one(tmp_path):
    real = int_case(profile_steps=0)
    emulated = real.replace(emulate=True, emulate_ranks=(1,))
    real_out, emu_out = run(real, tmp_path), run(emulated, tmp_path)
    assert real_out.status == emu_out.status == "ok", (real_out.error, emu_out.error)
    assert emu_out.ranks[0].memory.peak == real_out.ranks[1].memory.peak


def test_the_analytic_model_says_it_has_no_term_and_predict_traces_instead(capsys):
    case = int_case()
    gap = get_strategy("zero3").analytic_gap(case)
    assert gap is not None and gap.startswith("reshard_after_forward=2")
    pred = predict_memory(case)
    assert pred.peak_bytes is None and NO_PEAK_TERM.format(gap=gap) in pred.notes
    assert pred.model_states_bytes > 0  # the states it does model
    assert get_strategy("zero3").analytic_gap(case.replace(strategy_args={})) is None
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--model", "decoder-tiny", "--world-size", "4", "--strategy", "zero3", "--device",
              "cpu", "--batch-size", "2", "--seq-len", "16", "--strategy-args", "reshard_after_forward=2",
              "--json"])  # fmt: skip
    assert (exc.value.code or 0) == 0
    analytic, traced = json.loads(capsys.readouterr().out)
    assert analytic["peak_bytes"] is None
    assert traced["fallback"] == f"analytic model has no term for {gap}: traced instead"
    assert traced["peak_bytes"] == estimate(case.replace(warmup_steps=0)).peak_bytes


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("3", "3 is not a group size to reshard to: FSDP2's int form needs a factor of the 4 ranks"),
        ("4", "below it (that is true)"),
        ("1", "above 1 (1 is false: zero2)"),
        ("sometimes", "'sometimes' is not true, except_last or an int"),
    ],
)
def test_a_group_size_fsdp2_refuses_is_one_line_and_exit_2(value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--model", "decoder-tiny", "--world-size", "4", "--strategy", "zero3", "--device",
              "cpu", "--strategy-args", f"reshard_after_forward={value}"])  # fmt: skip
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
