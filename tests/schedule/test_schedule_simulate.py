"""Simulator against closed forms, memory counts and its JSON."""

import json

import pytest

from l3plugin.schedule.plan import build_schedule
from l3plugin.schedule.simulate import simulate


@pytest.mark.parametrize("backward_time", [1.0, 2.0, 3.0])
@pytest.mark.parametrize(
    "pp,vpp,m,k",
    [(p, 1, m, p) for p in (1, 2, 4, 5) for m in (p, 2 * p + 1, 12)]  # v=1: any m >= p
    + [(2, 2, 4, 2), (4, 2, 8, 4), (4, 3, 12, 4), (3, 2, 9, 3), (4, 2, 8, 8), (3, 4, 12, 6)],
)
def test_bubble_ratio_matches_closed_form(pp, vpp, m, k, backward_time):
    """(p-1)/(m*v) for 1F1B and interleaved 1F1B with full groups (m a multiple of k >= p)."""
    sim = simulate(build_schedule(pp, vpp, m, k), forward_time=1.0, backward_time=backward_time)
    assert sim.bubble_ratio == pytest.approx((pp - 1) / (m * vpp))
    busy = m * vpp * (1.0 + backward_time)
    assert sim.makespan == pytest.approx(busy * (1 + (pp - 1) / (m * vpp)))
    assert sim.bubble_ratio_per_rank == pytest.approx([sim.bubble_ratio] * pp)


def test_backward_defaults_to_twice_forward_and_latency_only_adds():
    schedule = build_schedule(4, 2, 8, 4)
    base = simulate(schedule, forward_time=1.5)
    assert base.backward_time == 3.0
    slow = simulate(schedule, forward_time=1.5, p2p_latency=0.25)
    assert slow.makespan > base.makespan
    assert slow.bubble_ratio > base.bubble_ratio


def test_partial_groups_cost_more_bubble_than_full_ones():
    full = simulate(build_schedule(4, 2, 8, 4)).bubble_ratio
    partial = simulate(build_schedule(4, 2, 6, 4)).bubble_ratio
    assert partial > full


def test_peak_inflight_v1_and_afab():
    assert simulate(build_schedule(4, 1, 8)).peak_inflight == (4, 3, 2, 1)
    assert simulate(build_schedule(4, 1, 2)).peak_inflight == (2, 2, 2, 2)  # AFAB, k=m<p
    assert simulate(build_schedule(4, 3, 5, 2)).peak_inflight == (15,) * 4


def test_peak_inflight_interleaved_is_warmup_plus_one():
    sim = simulate(build_schedule(4, 2, 8, 4))
    assert sim.peak_inflight == (11, 9, 7, 5)  # 2*(p-r-1) + (v-1)*k + 1


def test_actions_are_consistent_with_plan_and_costs():
    schedule = build_schedule(3, 2, 7, 4)
    sim = simulate(schedule, forward_time=1.0, backward_time=2.0, p2p_latency=0.5)
    for rank in range(3):
        timed = [a for a in sim.actions if a.rank == rank]
        plan = schedule.ranks[rank].actions
        assert [(a.op, a.microbatch, a.chunk) for a in timed] == [
            (a.op, a.microbatch, a.chunk) for a in plan
        ]
        assert all(b.start >= a.end for a, b in zip(timed, timed[1:]))
        assert all(a.end - a.start == (1.0 if a.op == "F" else 2.0) for a in timed)
    assert max(a.end for a in sim.actions) == sim.makespan


def test_to_dict_is_json_with_required_keys():
    sim = simulate(build_schedule(2, 2, 4, 2))
    data = json.loads(json.dumps(sim.to_dict()))
    assert {"makespan", "bubble_ratio", "peak_inflight"} <= set(data)
    assert data["makespan"] == sim.makespan
    assert data["peak_inflight"] == [5, 3]
    assert data["actions"][0] == {
        "rank": 0, "op": "F", "microbatch": 0, "chunk": 0, "start": 0.0, "end": 1.0
    }


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"forward_time": 0}, "forward_time=0 is invalid: must be a finite number > 0"),
        ({"backward_time": -1.0}, "backward_time=-1.0 is invalid: must be a finite number > 0"),
        ({"p2p_latency": -0.1}, "p2p_latency=-0.1 is invalid: must be a finite number >= 0"),
        ({"forward_time": "1"}, "forward_time='1' is invalid: must be a finite number > 0"),
        ({"p2p_latency": float("nan")}, "p2p_latency=nan is invalid: must be a finite number >= 0"),
        ({"forward_time": True}, "forward_time=True is invalid: must be a finite number > 0"),
    ],
)
def test_bad_costs_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate(build_schedule(2, 1, 2), **kwargs)
