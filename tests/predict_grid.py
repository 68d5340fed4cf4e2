"""The analytic ``fsdpbench predict`` over a grid of models × strategies × precisions (world sizes,
activation checkpointing, devices, batches, wraps and ``--json`` rotated through), run in-process,
and its exact bytes (stdout, stderr, exit code) per command line.

``tests/data/predict_grid.json.gz`` holds those bytes; ``tests/test_predict_fast.py`` asserts today's code
prints the same. History: first written at commit 3cb4e70, before predict stopped importing torch, and
the torch-free predict was checked byte-identical against it on its branch; rewritten at 33e756d, where
DeepSpeed's own layout (a ``step_temp`` term) and the traced fallback for models without an
activation model changed answers on purpose (mnist-cnn left the grid then); rewritten at 4b6e469, where each
rank came to hold only its own batch (the batch term, and the peaks it is part of) and the loss scalar and
autograd's seed gradient came to be counted through backward; rewritten at 023b06c, the merge of the recipe
(every answer's note names the optimizer update, the clipping and the checkpointing it assumes, and the JSON
its ``optimizer_impl``; the MLP's loss and seed gradient, counted through backward as the decoder's were,
add two scalars to its activations in backward); rewritten at 138d3c6, where predict came to print sizes
below one unit in a smaller one (256 KiB, 4 B), notes once and lines within 80 columns. Written by

    PYTHONPATH=$PWD python tests/predict_grid.py --write tests/data/predict_grid.json.gz --commit <commit>

Entries whose strategy needs DeepSpeed carry ``requires``: the test skips them where it is not
installed (the answer is then an error). No Hugging Face model is in the grid: its answer depends on
whether ``transformers`` is installed, and the machine that wrote the file had none.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import json
import os
import sys
from typing import Any

# the models with an analytic activation model: predict answers the others (mnist-cnn, the Hugging Face
# models) by tracing them (tests/test_predict_cli.py), which is not the instant path this grid pins
MODELS = ("decoder-tiny", "decoder-small", "llama-7b", "llama-70b", "mlp-1m")
STRATEGIES = (
    "ddp",
    "zero1",
    "zero2",
    "zero3",
    "hsdp",
    "fsdp1_full",
    "fsdp1_grad_op",
    "fsdp1_no_shard",
    "fsdp1_hybrid",
    "ds_zero1",
    "ds_zero2",
    "ds_zero3",
)
PRECISIONS = ("fp32", "bf16", "fp16", "mixed", "bf16-lowreduce", "fp16-lowreduce")
# rotated through the grid by index: each value meets many models, strategies and precisions
WORLD_SIZES = ("1", "2", "8", "64", "1024")
VARIANTS = (
    (),
    ("--activation-checkpointing",),
    ("--device", "cpu"),
    ("--batch-size", "4", "--seq-len", "512"),
    ("--wrap", "none"),
    ("--prefetch", "1"),
    ("--optimizer", "sgd-momentum", "--rank", "1"),
    ("--cpu-offload",),
    ("--json",),
    ("--units", "GiB", "--activation-checkpointing", "--device", "cpu"),
    ("--shard-size", "4", "--optimizer", "adam"),
)
# a parameter count alone, every strategy and precision, and a few multi-strategy lines
EXTRA = (
    *(
        ("--params", "7.5e9", "--world-size", "64", "--strategy", s, "--precision", p)
        for s, p in itertools.product(("ddp", "zero1", "zero2", "zero3", "hsdp"), PRECISIONS)
    ),
    ("--params", "1e12", "--world-size", "4096", "--strategy", "zero3", "--precision", "mixed", "--json"),
    ("--model", "llama-7b", "--world-size", "64", "--strategy", "zero3"),
    (
        "--model",
        "llama-7b",
        "--world-size",
        "64",
        "--strategy",
        "ddp,zero1,zero2,zero3",
        "--precision",
        "bf16",
    ),
    ("--model", "decoder-small", "--world-size", "4", "--strategy", "ddp,zero3", "--device", "cpu", "--json"),
    ("--model", "no-such-model", "--world-size", "8", "--strategy", "zero3"),
    ("--model", "llama-7b", "--world-size", "0", "--strategy", "zero3"),
)
COLUMNS = "1000"  # wide enough that no note wraps: a changed sentence is one changed line


def requires(argv: tuple[str, ...]) -> str | None:
    """The optional package a command line's answer depends on, or None."""
    joined = " ".join(argv)
    return "deepspeed" if "ds_zero" in joined else None


def grid() -> list[tuple[str, ...]]:
    """Every command line of the grid (after ``predict``), in a fixed order."""
    lines = []
    for i, (model, strategy, precision) in enumerate(itertools.product(MODELS, STRATEGIES, PRECISIONS)):
        argv = ("--model", model, "--world-size", WORLD_SIZES[i % len(WORLD_SIZES)])
        argv += ("--strategy", strategy, "--precision", precision, *VARIANTS[i % len(VARIANTS)])
        lines.append(argv)
    return [*lines, *EXTRA]


def run_predict(argv: tuple[str, ...]) -> dict[str, Any]:
    """``fsdpbench predict ARGV`` in this process: its stdout, stderr and exit code."""
    from fsdpbench.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["predict", *argv])
        except SystemExit as exc:
            code = exc.code
    return {"argv": list(argv), "rc": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def quiet_environment() -> dict[str, str]:
    """The environment rich must see for the bytes to be comparable: a wide, colourless console."""
    return {"COLUMNS": COLUMNS, "LINES": "25", "NO_COLOR": "1", "TERM": "dumb"}


def main() -> None:
    path = sys.argv[sys.argv.index("--write") + 1]
    os.environ.update(quiet_environment())
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS"):
        os.environ.pop(name, None)
    entries = []
    for argv in grid():
        entry = run_predict(argv)
        need = requires(argv)
        if need:
            entry["requires"] = need
        entries.append(entry)
    record = {"generated_at_commit": sys.argv[sys.argv.index("--commit") + 1], "entries": entries}
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as z:
        z.write(json.dumps(record).encode() + b"\n")


def load(path: str) -> dict[str, Any]:
    """The stored grid: ``generated_at_commit`` and ``entries`` (argv, rc, stdout, stderr, requires)."""
    with gzip.open(path, "rt") as f:
        return json.load(f)


if __name__ == "__main__":
    main()
