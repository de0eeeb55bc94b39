"""`l3plugin` command line: one entry point, one subcommand per tool.

Subcommands that need no processes (mesh, schedule, simulate) import no framework.
"""

from __future__ import annotations

import argparse
import json
import sys


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid: must be an integer >= 1")
    return value


def add_mesh_sizes(parser: argparse.ArgumentParser, *, tp=1, cp=1, pp=1, dp=1):
    for dim, default in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp)):
        parser.add_argument(f"--{dim}", type=_positive_int, default=default,
                            help=f"{dim.upper()} size (default {default})")


def _cmd_mesh(args) -> int:
    from l3plugin.mesh import MeshShape, format_table

    shape = MeshShape(tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp)
    if args.json:
        print(json.dumps({"tp": shape.tp, "cp": shape.cp, "pp": shape.pp, "dp": shape.dp,
                          "ranks": shape.table(),
                          "groups": {d: shape.group_ranks(d) for d in ("tp", "cp", "pp", "dp", "cp-dp")}}))
    else:
        print(format_table(shape))
    return 0


def _cmd_demo(args) -> int:
    from l3plugin.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="l3plugin",
        description="Llama 3 parallelism for Megatron-Core and DeepSpeed: tools and the CPU demo.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mesh = sub.add_parser("mesh", help="print the 4D rank table in the order TP, CP, PP, DP (no processes)",
                          description="Rank -> (tp, cp, pp, dp) coordinates and the ranks sharing each "
                                      "group, innermost to outermost: TP, CP, PP, DP.")
    add_mesh_sizes(mesh)
    mesh.add_argument("--json", action="store_true", help="print JSON instead of a table")
    mesh.set_defaults(func=_cmd_mesh)

    demo = sub.add_parser("demo", help="the main job: a multi-process CPU run over gloo",
                          description="Starts tp*cp*pp*dp CPU processes over gloo, builds the 4D mesh "
                                      "through Megatron-Core's parallel_state and checks every group.")
    add_mesh_sizes(demo, tp=2, cp=2, pp=2, dp=1)
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung run is stopped")
    demo.set_defaults(func=_cmd_demo)

    for register in _optional_subcommands():
        register(sub)
    return parser


def _optional_subcommands():
    """Subcommands owned by feature packages (each module adds its own parser)."""
    registrars = []
    try:
        from l3plugin.schedule.cli import add_schedule_parser, add_simulate_parser
        registrars += [add_schedule_parser, add_simulate_parser]
    except ImportError:
        pass
    return registrars


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
