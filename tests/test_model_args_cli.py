"""``--model-args`` on ``predict`` and ``compare``: any shape of a family from the command line, checked as a
scenario's ``model_args`` are; a bad name or value is one line naming the flag and the argument, exit 2."""

from __future__ import annotations

import json

import pytest

from fsdpbench.cli import main
from fsdpbench.pipeline.scenario import ScenarioError, parse_scenario


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out = capsys.readouterr()
    return exc.value.code or 0, out.out, out.err


PREDICT = ("predict", "--model", "decoder", "--world-size", "8", "--strategy", "zero3", "--json")


def test_model_args_give_the_presets_answer(capsys):
    """The llama3-8b shape spelled out as decoder arguments predicts what the preset predicts."""
    shape = "d_model=4096,n_layers=32,n_heads=32,n_kv_heads=8,vocab=128256,multiple_of=1024,"
    shape += "ffn_dim_multiplier=1.3,rope_theta=500000.0,rope_scaling=llama3"
    code, out, _ = run_cli(capsys, *PREDICT, "--model-args", shape)
    assert code == 0
    by_args = json.loads(out)[0]
    code, out, _ = run_cli(capsys, *[a if a != "decoder" else "llama3-8b" for a in PREDICT])
    preset = json.loads(out)[0]
    assert by_args["params"] == preset["params"] == 8_030_261_248
    assert by_args["peak_bytes"] == preset["peak_bytes"]


@pytest.mark.parametrize(
    "value,message",
    [
        ("d_modl=64", "--model-args: model 'decoder' has no argument(s) ['d_modl']"),
        ("d_model=wide", "--model-args: d_model: should be an integer (got 'wide')"),
        ("n_layers=0", "--model-args: n_layers: should be at least 1 (got 0)"),
        ("n_kv_heads=3", "--model-args: n_kv_heads: n_heads=4 is not divisible by n_kv_heads=3"),
        ("rope_theta=true", "--model-args: rope_theta: should be float (got True)"),
        ("d_model", "--model-args 'd_model': expected NAME=VALUE"),
        ("d_model=[1, 2]", "--model-args d_model"),
    ],
)
@pytest.mark.parametrize("verb", ["predict", "compare"])
def test_a_bad_argument_is_one_line_naming_the_flag_and_the_argument(capsys, verb, value, message):
    argv = PREDICT if verb == "predict" else ("compare", "--model", "decoder", "--world-size", "2")
    code, out, err = run_cli(capsys, *argv, "--model-args", value)
    assert code == 2
    assert err.strip().startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not out


def test_the_flag_and_the_scenario_refuse_the_same_arguments(capsys):
    """The same check as a scenario's model_args: the scenario's message between its own prefix and the
    field's section (a flag has none)."""
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(
            "name: x\ndefaults: {model: decoder, model_args: {n_kv_heads: 3}}\nsweep: {strategy: [ddp]}\n"
        )
    code, _, err = run_cli(capsys, *PREDICT, "--model-args", "n_kv_heads=3")
    assert code == 2
    message = str(exc.value).partition("model_args: ")[2]
    assert message.endswith(" [model section]")
    assert message.removesuffix(" [model section]") in err


def test_compare_keeps_the_arguments_in_its_scenario():
    from argparse import Namespace

    from fsdpbench.commands.compare import build_scenario_text

    args = Namespace(
        model="llama3-tiny",
        model_args="n_layers=1,vocab=256",
        world_size=2,
        strategies="zero2,zero3",
        **dict.fromkeys(("precision", "optimizer", "wrap", "batch_size", "seq_len", "steps", "warmup_steps")),
    )
    scenario = parse_scenario(build_scenario_text(args))
    assert [c.model_args for c in scenario.cases] == [{"n_layers": 1, "vocab": 256}] * 2


def test_model_args_need_a_model(capsys):
    code, _, err = run_cli(
        capsys, "predict", "--params", "1e9", "--world-size", "2", "--model-args", "d_model=64"
    )
    assert code == 2 and "--model-args: needs --model" in err
