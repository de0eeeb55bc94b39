"""Argument helpers shared by the `l3plugin` subcommands (cli.py, planner/cli.py, debug/slow_rank.py, demo/).

Their own module so that subcommand modules never import cli.py, which imports them all.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:  # argparse names the flag before this text: the wording of checks.check_int
        raise argparse.ArgumentTypeError(f"{value} is out of range: must be an integer >= 1")
    return value


def add_mesh_sizes(parser: argparse.ArgumentParser, *, tp=1, cp=1, pp=1, dp=1):
    for dim, default in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp)):
        parser.add_argument(f"--{dim}", type=positive_int, default=default,
                            help=f"{dim.upper()} size (default {default})")
