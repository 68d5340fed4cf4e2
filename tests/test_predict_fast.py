"""``fsdpbench predict`` (analytic) answers without importing torch, and prints what it printed before
it stopped importing torch (and at the commit that last rewrote the grid), byte for byte
(tests/predict_grid.py: the grid and how its bytes were written)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from tests import predict_grid
from tests.helpers import REPO as ROOT
from tests.helpers import repo_pythonpath

GRID = predict_grid.load(str(ROOT / "tests/data/predict_grid.json.gz"))
GRID_COMMIT = "138d3c6"  # the commit whose predict wrote the stored bytes (tests/predict_grid.py)
# what predict prints differently from GRID_COMMIT on purpose: (old text, new text), applied to the stored
# bytes before they are compared (none since the grid was last written)
INTENDED_CHANGES: list[tuple[str, str]] = []

ANALYTIC = [
    ("--model", "llama-7b", "--world-size", "64", "--strategy", "zero3"),
    ("--model", "llama-70b", "--world-size", "1024", "--strategy", "hsdp,zero2", "--precision", "bf16",
     "--activation-checkpointing"),
    ("--params", "7.5e9", "--world-size", "64", "--strategy", "ddp,zero1,zero2,zero3", "--precision",
     "mixed"),
    pytest.param(
        ("--model", "decoder-small", "--world-size", "4", "--strategy", "fsdp1_full,ds_zero3", "--device",
         "cpu", "--json"),
        marks=pytest.mark.skipif(
            importlib.util.find_spec("deepspeed") is None,
            reason="ds_zero3 needs DeepSpeed installed (the deepspeed extra); predict refuses it without",
        ),
    ),
    ("--model", "mlp-1m", "--world-size", "8", "--strategy", "zero1", "--optimizer", "sgd-momentum"),
]  # fmt: skip


def imported_modules(*argv: str) -> tuple[set[str], subprocess.CompletedProcess]:
    """The modules ``python -m fsdpbench ARGV`` imports (``-X importtime``), and the finished process."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fsdpbench", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": repo_pythonpath(ROOT), "COLUMNS": "80"},
        timeout=120,
    )
    found = re.findall(r"^import time:\s+\d+ \|\s+\d+ \| +(\S+)$", proc.stderr, flags=re.MULTILINE)
    return set(found), proc


@pytest.mark.parametrize("argv", ANALYTIC, ids=lambda a: " ".join(a[:6]))
def test_analytic_predict_never_imports_torch(argv):
    modules, proc = imported_modules("predict", *argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fsdpbench.predictors.memory_model" in modules  # the detector sees this process's imports
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    assert not {"pandas", "pydantic", "fsdpbench.pipeline.scenario"} & modules  # nor what `run` needs


def test_the_import_check_sees_torch_where_it_is_imported():
    """The same check on a model that has no declared shapes (built on the meta device) finds torch."""
    modules, proc = imported_modules(
        "predict", "--model", "mnist-cnn", "--world-size", "2", "--strategy", "ddp"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch" in modules


def _expected(entry: dict) -> dict:
    out = dict(entry)
    for old, new in INTENDED_CHANGES:
        out["stdout"] = out["stdout"].replace(old, new)
    return out


@pytest.mark.skipif(not INTENDED_CHANGES, reason="no intended change since the grid was written")
def test_each_intended_change_is_in_the_grid():
    """A stated change that matches nothing would let the grid pass while it checks less."""
    for old, _ in INTENDED_CHANGES:
        assert sum(old in e["stdout"] for e in GRID["entries"]) > 50


def test_the_grid_covers_models_strategies_and_precisions():
    argvs = [" ".join(e["argv"]) for e in GRID["entries"]]
    assert GRID["generated_at_commit"] == GRID_COMMIT
    assert argvs == [" ".join(a) for a in predict_grid.grid()]
    assert len(argvs) == len(predict_grid.MODELS) * len(predict_grid.STRATEGIES) * len(
        predict_grid.PRECISIONS
    ) + len(predict_grid.EXTRA)
    assert sum(e["rc"] == 0 for e in GRID["entries"]) > 300  # answers, not mostly errors


def test_predict_prints_the_same_bytes_as_before(monkeypatch):
    """Every command line of the grid: the same exit code, stdout and stderr as main at GRID_COMMIT."""
    for name, value in predict_grid.quiet_environment().items():
        monkeypatch.setenv(name, value)
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS"):
        monkeypatch.delenv(name, raising=False)
    have_deepspeed = importlib.util.find_spec("deepspeed") is not None
    compared, differ = 0, []
    for entry in GRID["entries"]:
        if entry.get("requires") == "deepspeed" and not have_deepspeed:
            continue
        got, want = predict_grid.run_predict(tuple(entry["argv"])), _expected(entry)
        compared += 1
        if (got["rc"], got["stdout"], got["stderr"]) != (want["rc"], want["stdout"], want["stderr"]):
            differ.append(" ".join(entry["argv"]))
    assert not differ, f"{len(differ)} of {compared} differ, first: predict {differ[0]}"
    assert compared == len(GRID["entries"]) if have_deepspeed else compared >= 300


@pytest.mark.parametrize("family", ["decoder", "mlp", "mnist-cnn"])
def test_declared_blocks_and_shapes_are_the_torch_sides(family):
    """What a family declares as data (block class names, parameter shapes) is what its torch side builds."""
    from fsdpbench.models import build_model, resolve_model

    mdef, args = resolve_model(family)
    assert tuple(c.__name__ for c in mdef.block_classes(args)) == mdef.block_class_names
    if mdef.param_shapes is None:
        return
    shapes, n_blocks = mdef.param_shapes(args)
    model = build_model(family, device="meta")
    assert [(p.name, p.shape) for p in shapes] == [(n, tuple(t.shape)) for n, t in model.named_parameters()]
    blocks = [m for m in model.modules() if type(m).__name__ in mdef.block_class_names]
    assert n_blocks == len(blocks) and {p.block for p in shapes} == {-1, *range(n_blocks)}
