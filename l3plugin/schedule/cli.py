"""``l3plugin schedule`` and ``l3plugin simulate`` subcommands.

The top-level CLI registers them with :func:`add_schedule_parser` / :func:`add_simulate_parser`
and dispatches with ``args.func(args)``; handlers return the process exit code.
"""

from __future__ import annotations

import argparse
import json
import sys

from .plan import build_schedule
from .simulate import simulate
from .timeline import MissingExtraError, render_png, render_text, unit_simulation
from .zero_bubble import build_zero_bubble_schedule

FLEXIBLE, ZERO_BUBBLE = "flexible", "flexible-zb"

EXIT_BAD_INPUT = 2
EXIT_MISSING_EXTRA = 1


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size p")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank v (default 1)")
    parser.add_argument(
        "--microbatches", type=int, required=True, help="microbatches per step m (any m >= 1)"
    )
    parser.add_argument(
        "--group-size", type=int, default=None,
        help="consecutive microbatches per virtual stage per round k, 1..m "
        "(default min(p, m); k < p runs all-forward-all-backward)",
    )
    parser.add_argument(
        "--schedule", choices=(FLEXIBLE, ZERO_BUBBLE), default=FLEXIBLE,
        help="flexible (default) or flexible-zb: each backward split into B (input gradient) and W (weight "
        "gradient), W placed into idle slots",
    )
    parser.add_argument(
        "--inflight-limit", type=int, default=None,
        help="flexible-zb: most microbatch-chunks of activations a rank holds (default and minimum: the "
        "flexible schedule's peak)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a timeline")
    parser.add_argument("--png", metavar="FILE", help="also draw the timeline to FILE (needs matplotlib)")


def add_schedule_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "schedule",
        help="print the flexible interleaved 1F1B pipeline schedule",
        description="Print each pipeline rank's order of forward/backward steps for the flexible "
        "interleaved 1F1B schedule (Llama 3 paper, 3.1.1). The text timeline gives every step "
        "one slot; --json prints the plan as data.",
    )
    _add_plan_arguments(parser)
    parser.set_defaults(func=run_schedule)
    return parser


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate the pipeline schedule: makespan, bubble ratio, peak memory",
        description="Simulate the flexible interleaved 1F1B schedule (or its zero-bubble variant) with "
        "uniform per-chunk costs and report makespan, bubble ratio (idle / compute time, worst rank) and "
        "peak in-flight microbatches per rank (activation memory in chunks; to the weight gradient where it "
        "is split off).",
    )
    _add_plan_arguments(parser)
    parser.add_argument("--forward-time", type=float, default=1.0, help="forward time per chunk (default 1.0)")
    parser.add_argument(
        "--backward-time", type=float, default=None,
        help="backward time per chunk (default 2 x forward time); with --weight-time the input gradient alone "
        "(default the forward time)",
    )
    parser.add_argument(
        "--weight-time", type=float, default=None,
        help="weight-gradient time per chunk (default: half the backward on flexible-zb); both schedules are "
        "timed with the same costs",
    )
    parser.add_argument("--p2p-latency", type=float, default=0.0, help="point-to-point latency (default 0)")
    parser.set_defaults(func=run_simulate)
    return parser


def _report_errors(handler):
    """Turn bad input and a missing optional dependency into `error: ...` and an exit code."""

    def wrapped(args) -> int:
        try:
            return handler(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except MissingExtraError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_MISSING_EXTRA

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


def _write_png(sim, path: str, quiet: bool) -> None:
    render_png(sim, path)
    if not quiet:  # with --json, stdout must stay pure JSON
        print(f"wrote {path}")


def _build(args):
    if args.schedule == ZERO_BUBBLE:
        return build_zero_bubble_schedule(args.pp, args.vpp, args.microbatches, args.group_size,
                                          inflight_limit=args.inflight_limit)
    if args.inflight_limit is not None:
        raise ValueError("--inflight-limit applies to --schedule flexible-zb only")
    return build_schedule(args.pp, args.vpp, args.microbatches, args.group_size)


@_report_errors
def run_schedule(args) -> int:
    schedule = _build(args)
    unit_sim = None
    if args.json:
        print(json.dumps(schedule.to_dict()))
    else:
        unit_sim = unit_simulation(schedule)
        print(render_text(schedule, unit_sim))
    if args.png:
        unit_sim = unit_sim or unit_simulation(schedule)
        _write_png(unit_sim, args.png, quiet=args.json)
    return 0


@_report_errors
def run_simulate(args) -> int:
    schedule = _build(args)
    sim = simulate(schedule, args.forward_time, args.backward_time, args.p2p_latency, weight_time=args.weight_time)
    if args.json:
        print(json.dumps(sim.to_dict()))
    else:
        print(render_text(schedule, sim))
        print(f"makespan: {sim.makespan:g}")
        print(f"bubble ratio (idle / compute, worst rank): {sim.bubble_ratio:.4f}")
        print(f"peak in-flight microbatches per rank: {list(sim.peak_inflight)}")
    if args.png:
        _write_png(sim, args.png, quiet=args.json)
    return 0
