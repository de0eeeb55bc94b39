"""The zero-bubble flexible schedule: the flexible plan with each backward split into B and W.

B computes a virtual stage's input gradient (the message upstream waits for it); W its weight gradients
(nothing waits for them). Splitting them and moving W into the slots where a rank would idle removes most
of the pipeline bubble (Zero Bubble Pipeline Parallelism, Qi et al., arXiv 2401.10241). Here, for every
configuration the flexible plan accepts (any m >= 1, any k in 1..m, interleaved or not, frozen stages):

- The forwards and B steps run in the flexible plan's order on every rank (the same plan, the same warm-up),
  so the messages, their order per pair and the receive posting are the flexible plan's; W steps are
  inserted between them. A W has no message and only needs its own B, so the plan is deadlock-free exactly
  when the flexible one is (the replay in plan.validate checks it anyway).
- Each chunk's W steps run in its B order (micro-batches increasing), the order the flexible plan's
  backwards accumulate each parameter's gradient: gradients come out bit-identical.
- Where W goes: a rank simulates the plan with nominal costs (F = B = W = 1 per stage, or ``stage_times``)
  and, whenever its next F or B cannot start yet (its message has not arrived), runs its oldest pending W;
  if the message is known to arrive sooner than that W would take, it waits instead. A forward may not
  start while ``inflight_limit`` microbatch-chunks are held (from F until W, or until B where the stage
  has no W): then the oldest W runs first. The default limit is the flexible plan's peak over its ranks
  (ZB-H1's rule: no rank holds more activations than the flexible schedule's most loaded rank, rank 0);
  a larger limit lets W steps wait longer. Remaining W steps run at the end.
- Frozen stages: a stage without a trainable parameter has no W (its B, the input gradient, is all there
  is; before the first trainable stage not even that). The first trainable stage's B computes nothing (its
  input needs no gradient) and its W all of its gradients.
- Grad-sync and round hooks move to the chunk's (round's) last W: ``RankPlan.grad_sync_points`` and
  ``Schedule.round_end_points`` count B and W steps.

Under uniform costs, F = B = W, and m >= p this meets the lower bound of any schedule on the worst rank's
idle / busy: the last rank idles for the p - 1 chunk forwards before its first input, (p - 1) / (3 v m),
a third of the flexible schedule's (p - 1) / (v m) (tests/schedule/test_zero_bubble.py).

Pure Python: no torch, no processes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

from l3plugin.arguments.checks import check_int, check_number

from .plan import (BACKWARD, FORWARD, WEIGHT, Action, RankPlan, Schedule, ScheduleError, flexible_plan,
                   trainable_stages_plan, validate)
from .simulate import check_stage_times, step_costs


def build_zero_bubble_schedule(pp_size: int, vpp_size: int, num_microbatches: int, group_size=None, *,
                               trainable=None, inflight_limit: int | None = None, stage_times=None,
                               p2p_latency: float = 0.0) -> Schedule:
    """Build and validate the zero-bubble flexible schedule (module docstring).

    ``trainable``: one flag per virtual stage (stage s = chunk s // pp on rank s % pp), True where it holds
    a trainable parameter (default: every stage). ``inflight_limit``: the most microbatch-chunks of
    activations any rank holds (default and minimum: the flexible plan's peak). ``stage_times``: the costs
    to place the W steps by, as ``simulate`` takes them: (forward, backward) or (forward, input gradient,
    weight gradient) per virtual stage (default 1, 1, 1; the plan depends on them only through where W
    goes). ``p2p_latency``: the same, for messages.
    """
    # The flexible plan is not validated on its own: the split plan, validated below, deadlocks if it does.
    flexible = flexible_plan(pp_size, vpp_size, num_microbatches, group_size)
    num_stages = flexible.num_stages
    trainable = [True] * num_stages if trainable is None else [bool(flag) for flag in trainable]
    flexible = trainable_stages_plan(flexible, trainable)  # checks the length; the messages of a frozen prefix
    least = max(plan.peak_inflight() for plan in flexible.ranks)
    limit = least if inflight_limit is None else check_int("inflight_limit", inflight_limit, least)
    times = _nominal_times(flexible, trainable, stage_times)
    p2p_latency = check_number("p2p_latency", p2p_latency, 0)
    ranks = _place_weight_steps(flexible, trainable, limit, times, p2p_latency)
    schedule = replace(flexible, ranks=ranks, weight_stages=tuple(trainable))
    validate(schedule)
    return schedule


def _nominal_times(schedule: Schedule, trainable, stage_times) -> list[tuple[float, float, float]]:
    """(F, B, W) step costs per stage for placing W, as the simulator charges them (simulate.step_costs)."""
    if stage_times is None:
        stage_times = [(1.0, 1.0, 1.0)] * schedule.num_stages
    split = replace(schedule, weight_stages=tuple(trainable))
    return step_costs(split, check_stage_times(stage_times, schedule.num_stages))


def _place_weight_steps(flexible: Schedule, trainable, limit: int, times, latency: float) -> tuple[RankPlan, ...]:
    """Every rank's flexible F/B order with W steps inserted, by simulating all ranks with ``times``."""
    pp = flexible.pp
    orders = [plan.actions for plan in flexible.ranks]
    cursor = [0] * pp
    free_at = [0.0] * pp
    held = [0] * pp  # microbatch-chunks whose activations this rank holds
    pending: list[deque] = [deque() for _ in range(pp)]  # W steps not yet run, in B order
    arrival: dict = {}  # message -> when it reaches its receiver
    placed: list[list[Action]] = [[] for _ in range(pp)]

    def next_step(rank):
        """(start, action) this rank would run next given what has arrived; start inf: blocked."""
        now, index = free_at[rank], cursor[rank]
        weight = (now, Action(WEIGHT, *pending[rank][0])) if pending[rank] else (math.inf, None)
        if index == len(orders[rank]):
            return weight
        action = orders[rank][index]
        if action.op == FORWARD and held[rank] >= limit:
            return weight  # memory: the oldest W frees a chunk first (one is pending: F - B < limit)
        recv = flexible.messages[rank][index][0]
        ready = now if recv is None else max(now, arrival.get(recv, math.inf))
        if ready > now and pending[rank]:
            return weight  # an idle slot (or a message not sent yet): a W fills it
        return ready, action

    remaining = sum(len(order) for order in orders) + sum(
        flexible.microbatches for s in range(flexible.num_stages) if trainable[s])
    # A rank's next step depends on its own state and its messages' arrivals only: after a step, only its
    # rank and the receiver of its message need a new look.
    candidates = [next_step(rank) for rank in range(pp)]
    while remaining:
        start, rank, action = math.inf, -1, None
        for candidate, (when, step) in enumerate(candidates):  # the step that can start first (ties: lowest rank)
            if step is not None and when < start:
                start, rank, action = when, candidate, step
        if action is None:
            raise ScheduleError(f"placing W steps got stuck (pp={flexible.pp} vpp={flexible.vpp} "
                                f"microbatches={flexible.microbatches} group_size={flexible.group_size}, "
                                f"inflight_limit={limit})")
        stage = flexible.stage_of(rank, action.chunk)
        key = (action.microbatch, action.chunk)
        if action.op == WEIGHT:
            pending[rank].popleft()
            held[rank] -= 1
            cost = times[stage][2]
        else:
            send = flexible.messages[rank][cursor[rank]][1]
            cursor[rank] += 1
            if action.op == FORWARD:
                held[rank] += 1
                cost = times[stage][0]
            else:
                cost = times[stage][1]
                if trainable[stage]:
                    pending[rank].append(key)
                else:
                    held[rank] -= 1  # no W: the activations go with the B
            if send is not None:
                receiver = flexible.owner_of(send.dst_stage)[0]
                arrival[send] = start + cost + (latency if receiver != rank else 0.0)
        free_at[rank] = start + cost
        placed[rank].append(action)
        remaining -= 1
        candidates[rank] = next_step(rank)
        if action.op != WEIGHT and send is not None:
            candidates[receiver] = next_step(receiver)
    return tuple(RankPlan(plan.rank, plan.warmup, tuple(actions)) for plan, actions in zip(flexible.ranks, placed))


def weight_order(schedule: Schedule, rank: int) -> dict[int, list[int]]:
    """{chunk: microbatches in the order their weight gradients accumulate on ``rank``}: its W steps, or its
    B steps where the chunk has none (a fused plan). Equal for a split plan and its flexible plan."""
    split = {a.chunk for a in schedule.ranks[rank].actions if a.op == WEIGHT}
    order: dict[int, list[int]] = {}
    for action in schedule.ranks[rank].actions:
        if action.op == (WEIGHT if action.chunk in split else BACKWARD):
            order.setdefault(action.chunk, []).append(action.microbatch)
    return order
