"""``fsdpbench predict``: the table, --json, fitting, and errors that name what is allowed."""

from __future__ import annotations

import json

import pytest

from fsdpbench.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(["predict", *argv])
    out = capsys.readouterr()
    return exc.value.code or 0, out.out, out.err


ZERO_PAPER = (
    "--params",
    "7.5e9",
    "--world-size",
    "64",
    "--strategy",
    "zero1,zero2,zero3",
    "--precision",
    "mixed",
    "--optimizer",
    "adam",
)


def test_zero_paper_figure_json(capsys):
    code, out, _ = run_cli(capsys, *ZERO_PAPER, "--json")
    assert code == 0
    records = json.loads(out)
    assert [(r["strategy"], r["method"], r["model_states_bytes"]) for r in records] == [
        ("zero1", "analytic", 31_406_250_000),
        ("zero2", "analytic", 16_640_625_000),
        ("zero3", "analytic", 1_875_000_000),
    ]
    for r in records:
        assert {
            "strategy",
            "world_size",
            "params",
            "method",
            "model_states_bytes",
            "peak_bytes",
            "bytes",
        } <= set(r)
        assert r["world_size"] == 64 and r["params"] == 7_500_000_000
        assert r["peak_bytes"] is None and r["bytes"]["activations"] is None  # not estimated without a model


def test_zero_paper_figure_table(capsys):
    code, out, _ = run_cli(capsys, *ZERO_PAPER)
    assert code == 0
    lines = [ln for ln in out.splitlines() if "model states (ZeRO accounting)" in ln]
    assert [ln.split("│")[-2].strip() for ln in lines] == ["31.4", "16.6", "1.9"]
    assert "needs --model" in out


def test_model_prediction_with_device_memory(capsys):
    code, out, _ = run_cli(
        capsys,
        "--model",
        "decoder-small",
        "--world-size",
        "4",
        "--strategy",
        "zero3",
        "--seq-len",
        "128",
        "--batch-size",
        "4",
        "--device-memory",
        "80GiB",
        "--json",
    )
    assert code == 0
    [rec] = json.loads(out)
    assert rec["fits"] is True and rec["fit_complete"] is True
    assert rec["smallest_world_size"] == 1 and rec["largest_batch"] > 4
    assert rec["peak_bytes"] > rec["model_states_bytes"]
    assert rec["device_peak_bytes"] == rec["peak_bytes"] + rec["terms"]["untracked"] + 2**30  # cuda context


def test_does_not_fit(capsys):
    code, out, _ = run_cli(
        capsys, "--model", "llama-7b", "--world-size", "8", "--strategy", "ddp", "--device-memory", "80GiB"
    )
    assert code == 0
    assert "does NOT fit in 85.9 GB" in out
    assert "largest per-rank batch that fits: none" in out


def test_traced_and_analytic_side_by_side(capsys):
    code, out, _ = run_cli(
        capsys,
        "--model",
        "decoder-tiny",
        "--world-size",
        "2",
        "--strategy",
        "zero3",
        "--device",
        "cpu",
        "--batch-size",
        "4",
        "--seq-len",
        "64",
        "--method",
        "both",
        "--json",
    )
    assert code == 0
    analytic, traced = json.loads(out)
    assert (analytic["method"], traced["method"]) == ("analytic", "traced")
    assert analytic["peak_bytes"] == traced["peak_bytes"] == 5856220  # the measured zero3 n2 peak


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--model", "nope", "--world-size", "2"), "allowed: "),
        (("--model", "decoder-tiny", "--world-size", "2", "--strategy", "foo"), "known: ddp"),
        (("--model", "decoder-tiny", "--world-size", "3", "--strategy", "hsdp"), "does not divide"),
        (("--model", "decoder-tiny", "--world-size", "2", "--device-memory", "80Gb2"), "GiB"),
        (("--params", "1e9", "--world-size", "2", "--method", "traced"), "needs --model"),
        (("--model", "decoder-tiny", "--world-size", "2", "--rank", "5"), "--rank 5"),
    ],
)
def test_errors_name_what_is_allowed(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in " ".join(err.split())
