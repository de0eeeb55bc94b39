"""A measured timeline of the flexible executor: when each rank's forward and backward steps really ran.

Within ``record_steps()`` every call of Megatron-Core's ``forward_step`` / ``backward_step`` that the flexible
executor makes (it looks them up at call time) is timed on this rank. ``timeline(...)`` labels the calls with the
rank's plan (the executor runs its actions in plan order; a frozen prefix's backwards make no call) and returns
them as l3plugin's ``SimulationResult``, so ``l3plugin.schedule.timeline.render_png`` draws the measured run as
it draws a simulated one. Clocks: ``time.perf_counter`` is the machine's monotonic clock, the same in every
process on one machine; times are relative to the earliest start over the ranks.
"""

from __future__ import annotations

import contextlib
import functools
import time


@contextlib.contextmanager
def record_steps(calls: list):
    """Append (op, start, end) for each forward / backward step call made within the block."""
    from megatron.core.pipeline_parallel import schedules

    originals = {"F": schedules.forward_step, "B": schedules.backward_step}

    def timed(op):
        @functools.wraps(originals[op])  # the executor reads backward_step's signature
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return originals[op](*args, **kwargs)
            finally:
                calls.append((op, start, time.perf_counter()))
        return wrapper

    schedules.forward_step, schedules.backward_step = timed("F"), timed("B")
    try:
        yield calls
    finally:
        schedules.forward_step, schedules.backward_step = originals["F"], originals["B"]


def executed_actions(schedule, rank: int) -> list:
    """The plan's actions of ``rank`` that make a forward_step / backward_step call, in order."""
    from l3plugin.schedule.plan import FORWARD

    return [a for a in schedule.ranks[rank].actions
            if a.op == FORWARD or schedule.has_grad_path(schedule.stage_of(rank, a.chunk))]


def label(schedule, rank: int, calls: list) -> list[dict]:
    """The rank's calls as dicts with op, microbatch, chunk, start, end (plan order = call order)."""
    actions = executed_actions(schedule, rank)
    if len(actions) != len(calls) or any(a.op[0].upper() != op for a, (op, _, _) in zip(actions, calls)):
        raise RuntimeError(f"rank {rank}: {len(calls)} recorded calls do not follow its {len(actions)} planned "
                           f"actions")
    return [{"rank": rank, "op": a.op, "microbatch": a.microbatch, "chunk": a.chunk, "start": s, "end": e}
            for a, (_, s, e) in zip(actions, calls)]


def timeline(schedule, per_rank: list[list[dict]]):
    """A SimulationResult of the measured actions of every rank (seconds from the earliest start)."""
    import statistics

    from l3plugin.schedule.plan import FORWARD
    from l3plugin.schedule.simulate import SimulationResult, TimedAction

    t0 = min(a["start"] for actions in per_rank for a in actions)
    actions = tuple(TimedAction(a["rank"], a["op"], a["microbatch"], a["chunk"], a["start"] - t0, a["end"] - t0)
                    for rank_actions in per_rank for a in rank_actions)
    makespan = max(a.end for a in actions)
    busy = tuple(sum(a.end - a.start for a in actions if a.rank == r) for r in range(schedule.pp))
    idle = tuple((makespan - b) / b for b in busy)
    forward = statistics.median(a.end - a.start for a in actions if a.op == FORWARD)
    backwards = [a.end - a.start for a in actions if a.op != FORWARD]
    return SimulationResult(
        pp=schedule.pp, vpp=schedule.vpp, microbatches=schedule.microbatches, group_size=schedule.group_size,
        forward_time=forward, backward_time=statistics.median(backwards) if backwards else forward, p2p_latency=0.0,
        makespan=makespan, bubble_ratio=max(idle), bubble_ratio_per_rank=idle,
        peak_inflight=tuple(0 for _ in range(schedule.pp)), actions=tuple(sorted(actions, key=lambda a: (a.rank, a.start))),
        busy=busy)
