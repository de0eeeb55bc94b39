"""`l3plugin` command line: one entry point, one subcommand per tool (``doctor``: the upstream patches).

Subcommands that need no processes (mesh, schedule, simulate, plan, analyze-trace) import no framework.
"""

from __future__ import annotations

import argparse
import json
import sys

from l3plugin.arguments.flags import add_mesh_sizes


def _cmd_mesh(args) -> int:
    from l3plugin.mesh.shape import MeshShape, format_table

    shape = MeshShape(tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp)
    if args.json:
        print(json.dumps({"tp": shape.tp, "cp": shape.cp, "pp": shape.pp, "dp": shape.dp,
                          "ranks": shape.table(),
                          "groups": {d: shape.group_ranks(d) for d in ("tp", "cp", "pp", "dp", "cp-dp")}}))
    else:
        print(format_table(shape))
    return 0


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

    for register in _subcommands():
        register(sub)
    return parser


def _subcommands():
    """Subcommands owned by feature packages; each module adds its own parser (imports stay light)."""
    from l3plugin.debug.slow_rank import add_analyze_parser
    from l3plugin.demo import add_demo_parser
    from l3plugin.upstream.doctor import add_doctor_parser
    from l3plugin.planner import add_plan_parser
    from l3plugin.planner.balance_cli import add_balance_parser
    from l3plugin.schedule.cli import add_schedule_parser, add_simulate_parser

    return [add_schedule_parser, add_simulate_parser, add_plan_parser, add_balance_parser, add_analyze_parser, add_demo_parser,
            add_doctor_parser]


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
