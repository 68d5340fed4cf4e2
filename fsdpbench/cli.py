"""The ``fsdpbench`` command: one sub-command per verb, each in ``fsdpbench/commands/<verb>.py``.

fsdpbench run scenarios/quickstart.yaml      # run a scenario, store results, write the report
fsdpbench env                                # versions, backends, devices; why CUDA/NVML are unusable
"""

from __future__ import annotations

import argparse
import importlib
import sys

# verb -> module in fsdpbench.commands; each module has add_arguments(parser) and main(args) -> int
COMMANDS = {
    # not a column: the command
    "run": "Run a scenario: every case in fresh rank processes; results, then the report.",
    "env": "Show versions, distributed backends and devices, and why CUDA or NVML is not usable.",
    "predict": "Predict per-rank memory (analytic and traced) for any model size and world size.",
    "compare": "Run strategies side by side for one model and world size, without a YAML file.",
    "report": "Write the HTML report of one or more run directories.",
    "regress": "Compare a run against a baseline; exit non-zero on a regression (for CI).",
    "check": "Measure and predict a fixed grid on this GPU: how far to trust the predictions here.",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given a command line, only its verb's module is imported (``predict`` answers
    without importing what ``run`` needs); without one, or for ``--help``, every verb's."""
    from fsdpbench import __version__

    parser = argparse.ArgumentParser(
        prog="fsdpbench",
        epilog="Start with: fsdpbench run scenarios/quickstart.yaml (see README.md)",
        description="Benchmark and model the memory of data-parallel sharding in PyTorch: DDP, ZeRO-1/2/3 "
        "(FSDP2), FSDP1 and HSDP, measured on real ranks and predicted for any size.",
    )
    parser.add_argument("--version", action="version", version=f"fsdpbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _verb(argv)
    for verb, help_text in COMMANDS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        if chosen in (None, verb):
            module = importlib.import_module(f"fsdpbench.commands.{verb}")
            module.add_arguments(p)
            p.set_defaults(_main=module.main, _exit_at_once=getattr(module, "EXIT_AT_ONCE", False))
    return parser


def _verb(argv: list[str] | None) -> str | None:
    """The verb of a command line: its first word that is not an option (None: no verb, or not one)."""
    first = next((w for w in argv or () if not w.startswith("-")), None)
    return first if first in COMMANDS else None


def main(argv: list[str] | None = None) -> None:
    # the current directory is not put on sys.path: a scenario's plugin (module:Class) is imported only
    # with `run --allow-plugins`, which then searches the current directory last (README: "What a
    # scenario file can make happen")
    command_line = argv is None  # not a call from Python, which keeps its own fork server and process
    if argv is None:
        argv = sys.argv[1:]
        _start_forkserver_if_ranks_will_run(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        code = args._main(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    # a profiler (python -m cProfile -m fsdpbench) writes its figures once the command has returned
    if command_line and args._exit_at_once and sys.getprofile() is None:
        _exit_at_once(code or 0)
    sys.exit(code or 0)


def _exit_at_once(code: int) -> None:
    """End the process without the interpreter's teardown of every module, after the exit handlers and
    with the output flushed, as ``sys.exit`` would: for a command (``EXIT_AT_ONCE`` in its module) that
    leaves nothing to a teardown, once torch and its distributed modules are imported the teardown alone
    took ~0.75 s (2-core CPU)."""
    import atexit
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (| head), or a closed stream
            pass
    os._exit(code)


# options after which `run`/`compare` start no rank (argparse also takes a prefix of an option: "--dry")
_NO_RANKS = ("--dry-run", "--export-cases", "--collect", "--help")


def _start_forkserver_if_ranks_will_run(argv: list[str]) -> None:
    """``run`` and ``compare`` start their fork server before importing anything else (launch.py's
    ``start_forkserver``): ~2 s sooner to the first case. Not where no rank will run."""
    # not a column: the commands
    if not argv or argv[0] not in ("run", "compare"):
        return
    options = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("-")]
    abbreviates = [o for o in options if o.startswith("--") and len(o) > 3]
    if "-h" in options or any(n.startswith(o) for o in abbreviates for n in _NO_RANKS):
        return
    from fsdpbench.pipeline.launch import start_forkserver

    start_forkserver()
