"""Built and simulated pipeline schedules for the planner, cached by (p, v, m, k).

Uses l3plugin.schedule's public build_schedule / simulate. Long schedules (more than 8 rounds of k
microbatches, 1F1B) are simulated at 4, 5 and 6 rounds with the same final group: warm-up, peak and
cool-down are the same, and when the idle time grows by the same amount per round it is extrapolated
linearly (else the full schedule is simulated). Tests compare both shortcuts with full runs.
"""

from __future__ import annotations

import math

from l3plugin.schedule.plan import FORWARD, build_schedule, with_trainable_stages
from l3plugin.schedule.simulate import Replay, simulate

from .costs import chunk_class

SHORTEN_AFTER = 8  # rounds of k microbatches simulated in full


def _two_sig(x: float) -> float:
    return float(f"{x:.2g}")


class ScheduleCache:
    """Built schedules' in-flight frontiers and simulated idle times, keyed by (p, v, m, k)."""

    def __init__(self, keep_built: int = 8):
        self._frontiers, self._idle, self._built, self._keep = {}, {}, {}, keep_built
        self._replays = {}

    def _schedule(self, p: int, v: int, m: int, k: int):
        """Built schedules are large: keep the last few, enough for one layout's memory and bubble."""
        key = (p, v, m, k)
        schedule = self._built.pop(key, None) or build_schedule(p, v, m, k)
        self._built[key] = schedule  # most recent last
        while len(self._built) > self._keep:
            self._built.pop(next(iter(self._built)))
        return schedule

    @staticmethod
    def _canonical(p: int, v: int, m: int, k: int) -> tuple[int, int, int, int]:
        # With one chunk per rank every k >= p gives the same plan (warm-up p-r-1).
        return (p, v, m, min(p, m)) if v == 1 and k >= p else (p, v, m, k)

    @staticmethod
    def simulated_lengths(p: int, m: int, k: int) -> list[int]:
        """Lengths to simulate for m microbatches: m itself, or for more than SHORTEN_AFTER rounds of
        1F1B (k >= p; its warm-up spans at most two rounds) the same final group after 4, 5 and 6 rounds
        (bubble() checks that the idle time grows linearly)."""
        rounds = math.ceil(m / k)
        if rounds <= SHORTEN_AFTER or k < p:
            return [m]
        final = m - (rounds - 1) * k
        return [final + 3 * k, final + 4 * k, final + 5 * k]

    def _idle_time(self, p, v, m, k, b, lat) -> float:
        result = simulate(self._schedule(p, v, m, k), 1.0, b, lat)
        return result.bubble_ratio * m * v * (1.0 + b)

    def frontier(self, p, v, m, k):
        """Per rank, the Pareto-maximal in-flight counts (class 0, 1, 2) after each forward."""
        key = self._canonical(p, v, m, k)
        if key not in self._frontiers:
            schedule = self._schedule(p, v, self.simulated_lengths(p, m, key[3])[-1], key[3])
            self._frontiers[key] = tuple(_pareto(plan.actions, v) for plan in schedule.ranks)
        return self._frontiers[key]

    def bubble(self, p, v, m, k, backward_over_forward: float, latency_over_forward: float) -> float:
        """Simulated bubble ratio with uniform stages (forward time 1). The time ratios are rounded to
        two significant digits so that layouts with nearly the same ratios share one simulation."""
        if p == 1:
            return 0.0
        key = self._canonical(p, v, m, k) + (_two_sig(backward_over_forward), _two_sig(latency_over_forward))
        if key not in self._idle:
            b, lat, k_sched = key[4], key[5], key[3]
            lengths = self.simulated_lengths(p, m, k_sched)
            idle = [self._idle_time(p, v, n, k_sched, b, lat) for n in lengths]
            if len(idle) == 3:
                step = idle[2] - idle[1]
                if abs(step - (idle[1] - idle[0])) <= 1e-9 * max(1.0, abs(idle[2])):
                    idle = [idle[2] + step * (math.ceil(m / k_sched) - 6)]  # linear per extra round
                else:  # still in a transient: no shortcut
                    idle = [self._idle_time(p, v, m, k_sched, b, lat)]
            self._idle[key] = idle[0] / (m * v * (1.0 + b))
        return self._idle[key]


    # ---- stages of different cost (layers that differ: a LayerProfile) ----------------------------
    def _replay(self, p, v, m, k, first_grad_stage: int) -> Replay:
        key = (p, v, m, k, first_grad_stage)
        replay = self._replays.pop(key, None)
        if replay is None:
            schedule = self._schedule(p, v, m, k)
            if first_grad_stage:  # a frozen prefix exchanges no gradients
                schedule = with_trainable_stages(schedule, [s >= first_grad_stage for s in range(p * v)])
            replay = Replay(schedule)
        self._replays[key] = replay  # most recent last
        while len(self._replays) > 4 * self._keep:
            self._replays.pop(next(iter(self._replays)))
        return replay

    def staged_makespan(self, p, v, m, k, stage_times, latency: float, first_grad_stage: int = 0) -> float:
        """Simulated step with ``stage_times`` [(forward, backward)] per virtual stage. More than
        SHORTEN_AFTER rounds of 1F1B: timed after 4, 5 and 6 rounds and extrapolated when the step grows by
        the same time per round (steady state), else timed in full."""
        p, v, m, k = self._canonical(p, v, m, k)
        if p == 1:
            return m * sum(f + b for f, b in stage_times)
        lengths = self.simulated_lengths(p, m, k)
        spans = [self._replay(p, v, n, k, first_grad_stage).makespan(stage_times, latency) for n in lengths]
        if len(spans) == 1:
            return spans[0]
        step = spans[2] - spans[1]
        if abs(step - (spans[1] - spans[0])) <= 1e-9 * max(1.0, abs(spans[2])):
            return spans[2] + step * (math.ceil(m / k) - 6)
        return self._replay(p, v, m, k, first_grad_stage).makespan(stage_times, latency)

    def stage_peaks(self, p, v, m, k, stage_act) -> tuple[list[float], int]:
        """Per rank, the most activation bytes in flight (a forward holds its stage's ``stage_act`` until
        its backward), and the most chunk-microbatches in flight on any rank (the same schedule length
        as frontier())."""
        p, v, m, k = self._canonical(p, v, m, k)
        schedule = self._schedule(p, v, self.simulated_lengths(p, m, k)[-1], k)
        peaks, most = [], 0
        for plan in schedule.ranks:
            held = peak = 0.0
            for action in plan.actions:
                size = stage_act[schedule.stage_of(plan.rank, action.chunk)]
                held += size if action.op == FORWARD else -size
                peak = max(peak, held)
            peaks.append(peak)
            most = max(most, plan.peak_inflight())
        return peaks, most


def _pareto(actions, vpp: int) -> tuple[tuple[int, int, int], ...]:
    """In-flight counts per chunk class after every forward, keeping only those no other one dominates:
    with non-negative activation sizes the worst moment is always among them."""
    counts, points = [0, 0, 0], set()
    for action in actions:
        cls = chunk_class(action.chunk, vpp)
        counts[cls] += 1 if action.op == FORWARD else -1
        if action.op == FORWARD:
            points.add(tuple(counts))
    kept = []
    for point in sorted(points, key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(other, point)) for other in kept):
            kept.append(point)
    return tuple(kept)


def warmup_inflight(p: int, v: int, m: int, k: int, rank: int) -> tuple[int, int, int]:
    """In-flight (class 0, 1, 2) counts on ``rank`` just before its first backward, from the paper's
    warm-up rule: k < p runs all m v forwards first; otherwise (v-1) k + 2 (p-rank-1) forwards (p-rank-1
    with one chunk; the extra term capped at final group + k, see schedule.plan) plus the first
    steady-state forward. Those forwards are the first entries of the forward order: groups of k
    microbatches, each visiting chunks 0..v-1. A lower bound of the schedule's peak (equal to it where the plan
    is laid out as warm-up and pairs). A final group of s < p is list-scheduled (schedule.plan), whose peak can
    be lower: there only the forwards that come before (microbatch 0, last chunk) in that order are counted."""
    total = m * v
    if k < p:
        count = total
    elif v == 1:
        count = min(p - rank, total)
    elif 0 < m % k < p:
        count = min((v - 1) * k + 1, total)
    else:
        count = min((v - 1) * k + 2 * (p - rank - 1) + 1, total)
    counts = [0, 0, 0]
    for start in range(0, m, k):
        size = min(k, m - start)
        for chunk in range(v):
            take = min(size, count)
            counts[chunk_class(chunk, v)] += take
            count -= take
            if not count:
                return tuple(counts)
    return tuple(counts)
