"""``fsdpbench env``: what this machine offers fsdpbench, and why a GPU path is not usable."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from fsdpbench.core.markup import escape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    from fsdpbench.store.env import collect_env

    env = collect_env()
    if args.json:
        print(json.dumps(env, indent=2))
        return 0
    table = Table(title="fsdpbench environment", show_header=False)
    for key, value in env.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(value) or "none"
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        table.add_row(escape(key), escape(value))
    Console().print(table)
    return 0
