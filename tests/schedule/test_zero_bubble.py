"""The zero-bubble flexible plan (l3plugin.schedule.zero_bubble): complete, deadlock-free, the flexible plan's
F/B order and weight-gradient order, within the memory bound, no W on frozen stages; and what it buys in
simulation (a third of the flexible schedule's idle time at uniform costs, the least any plan can have)."""

import json
import random
import re

import pytest

from l3plugin.schedule.plan import (BACKWARD, FORWARD, WEIGHT, ScheduleError, build_schedule, first_grad_stage,
                                    validate, with_trainable_stages)
from l3plugin.schedule.receives import receive_budget
from l3plugin.schedule.simulate import simulate, simulate_posted
from l3plugin.schedule.zero_bubble import build_zero_bubble_schedule, weight_order
from test_comm_order import check_posting_discipline
from test_receive_posts import check_posts


def check_plan(p, v, m, k, trainable=None, inflight_limit=None):
    """Build the split plan and check it against the flexible plan of the same (p, v, m, k)."""
    schedule = build_zero_bubble_schedule(p, v, m, k, trainable=trainable, inflight_limit=inflight_limit)
    validate(schedule)  # complete, messages one-to-one, deadlock-free
    trainable = [True] * (p * v) if trainable is None else list(trainable)
    flexible = with_trainable_stages(build_schedule(p, v, m, k), trainable)
    assert schedule.weight_stages == tuple(trainable)
    assert schedule.first_grad_stage == first_grad_stage(trainable)
    limit = inflight_limit or max(plan.peak_inflight() for plan in flexible.ranks)
    for rank, (plan, flat) in enumerate(zip(schedule.ranks, flexible.ranks)):
        # The flexible plan's forwards and backwards, in its order; W only for trainable stages, after its B.
        assert tuple(a for a in plan.actions if a.op != WEIGHT) == flat.actions
        position = {(a.op, a.microbatch, a.chunk): i for i, a in enumerate(plan.actions)}
        weights = [a for a in plan.actions if a.op == WEIGHT]
        assert {(a.microbatch, a.chunk) for a in weights} == {
            (mb, c) for mb in range(m) for c in range(v) if trainable[schedule.stage_of(rank, c)]}
        assert all(position[(WEIGHT, a.microbatch, a.chunk)] > position[(BACKWARD, a.microbatch, a.chunk)]
                   for a in weights)
        # Each parameter's gradient accumulates over the microbatches in the flexible plan's order.
        assert weight_order(schedule, rank) == weight_order(flexible, rank)
        assert plan.peak_inflight() <= limit
        # Grad sync after each chunk's last gradient step: its last W, or its last B without W steps.
        last = {}
        for index, action in enumerate(plan.actions):
            if action.op == (WEIGHT if trainable[schedule.stage_of(rank, action.chunk)] else BACKWARD):
                last[action.chunk] = index
        assert plan.grad_sync_points() == frozenset(last.values())
        ends = {}
        for index, action in enumerate(plan.actions):
            if action.op != FORWARD:
                ends[(action.chunk, schedule.round_of(action.microbatch))] = index
        assert schedule.round_end_points(rank) == frozenset(ends.values())
        assert all(schedule.action_messages(rank, a) == (None, None) for a in weights)
    return schedule


def test_exhaustive_small_grid():
    # Every k for p <= 3, v <= 3, m <= 7 (last groups of every size, k < p, m < p).
    for p in range(1, 4):
        for v in range(1, 4):
            for m in range(1, 8):
                for k in range(1, m + 1):
                    check_plan(p, v, m, k)


def sampled_configs(count, seed):
    rng = random.Random(seed)
    for _ in range(count):
        p, v, m = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 32)
        yield p, v, m, rng.randint(1, m)


@pytest.mark.parametrize("p,v,m,k", list(sampled_configs(40, seed=44)))
def test_sampled_configs_up_to_p8_v4_m32(p, v, m, k):
    schedule = check_plan(p, v, m, k)
    check_posting_discipline(schedule)  # both ranks of every pair derive one posting order
    check_posts(schedule, p - 1, receive_budget(schedule))


@pytest.mark.parametrize("p,v,m,k", list(sampled_configs(25, seed=4401)))
def test_frozen_stages_have_no_weight_steps(p, v, m, k):
    rng = random.Random(p * 1000 + v * 100 + m * 10 + k)
    prefix = rng.randint(0, p * v)
    trainable = [s >= prefix and rng.random() < 0.7 for s in range(p * v)]  # a frozen prefix, frozen middles
    schedule = check_plan(p, v, m, k, trainable=trainable)
    check_posting_discipline(schedule)
    for rank, plan in enumerate(schedule.ranks):
        for action in plan.actions:
            stage = schedule.stage_of(rank, action.chunk)
            if action.op == BACKWARD and stage <= schedule.first_grad_stage:
                assert schedule.action_messages(rank, action)[1] is None  # nothing upstream needs a gradient


def test_a_larger_memory_bound_is_kept_and_w_may_wait_longer():
    base = check_plan(4, 2, 8, 4)
    roomy = check_plan(4, 2, 8, 4, inflight_limit=16)
    assert max(plan.peak_inflight() for plan in roomy.ranks) <= 16
    assert max(plan.peak_inflight() for plan in base.ranks) == 11  # the flexible plan's rank 0


def test_the_default_bound_is_the_flexible_plans_peak():
    for p, v, m, k in [(4, 1, 8, 4), (4, 2, 8, 4), (4, 3, 12, 6), (3, 2, 5, 2)]:
        flexible = build_schedule(p, v, m, k)
        split = build_zero_bubble_schedule(p, v, m, k)
        assert max(plan.peak_inflight() for plan in split.ranks) == max(plan.peak_inflight() for plan in flexible.ranks)


@pytest.mark.parametrize("p,v", [(4, 1), (4, 2), (8, 2), (6, 3)])
def test_a_third_of_the_flexible_idle_time_at_uniform_costs(p, v):
    """F = B = W, m >= p: worst rank idle / busy (p-1)/(3vm), a third of the flexible schedule's (p-1)/(vm) and
    the least any plan has (the last rank waits p-1 chunk forwards for its first input), at the same memory.
    At v = 1 it is ZB-H1's bubble, (p-1)(T_F + T_B - T_W) over m(T_F + T_B + T_W) (arXiv 2401.10241)."""
    for m in (p, 2 * p, 3 * p):
        flexible = simulate(build_schedule(p, v, m), forward_time=1.0, backward_time=1.0, weight_time=1.0)
        split = simulate(build_zero_bubble_schedule(p, v, m), forward_time=1.0, backward_time=1.0, weight_time=1.0)
        assert flexible.bubble_ratio == pytest.approx((p - 1) / (v * m))
        assert split.bubble_ratio == pytest.approx((p - 1) / (3 * v * m))
        assert max(split.peak_inflight) == max(flexible.peak_inflight)


def test_target_p16_v4():
    # Issue 44's target: at most a third of the flexible schedule's idle fraction, equal in-flight memory.
    for m in (16, 32):  # the table in docs/pipeline.md has m = 8..64
        flexible = simulate(build_schedule(16, 4, m), forward_time=1.0, backward_time=1.0, weight_time=1.0)
        split = simulate(build_zero_bubble_schedule(16, 4, m), forward_time=1.0, backward_time=1.0, weight_time=1.0)
        assert split.bubble_ratio <= flexible.bubble_ratio / 3 + 1e-12
        assert max(split.peak_inflight) == max(flexible.peak_inflight)


def test_costs_place_the_weight_steps_and_the_simulator_charges_them():
    # Pairs (forward, backward) split the backward in half on a stage with W; the first trainable stage's B
    # computes nothing (its input needs no gradient), its W is the whole backward.
    schedule = build_zero_bubble_schedule(2, 1, 4, 2)
    sim = simulate(schedule, stage_times=[(1.0, 2.0), (1.0, 4.0)])
    steps = {(a.rank, a.op): a.end - a.start for a in sim.actions}
    assert steps == {(0, "F"): 1.0, (0, "B"): 0.0, (0, "W"): 2.0, (1, "F"): 1.0, (1, "B"): 2.0, (1, "W"): 2.0}
    assert sim.busy == (12.0, 20.0) and sim.weight_time == 2.0
    fused = simulate(build_schedule(2, 1, 4, 2), stage_times=[(1.0, 1.5, 0.5), (1.0, 3.0, 1.0)])
    assert {(a.rank, a.op): a.end - a.start for a in fused.actions} == {
        (0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.0, (1, "B"): 4.0}
    costed = build_zero_bubble_schedule(2, 2, 6, 2, stage_times=[(1.0, 1.0, 3.0)] * 4, p2p_latency=0.5)
    validate(costed)
    assert simulate(costed, stage_times=[(1.0, 1.0, 3.0)] * 4, p2p_latency=0.5).makespan <= simulate(
        build_zero_bubble_schedule(2, 2, 6, 2), stage_times=[(1.0, 1.0, 3.0)] * 4, p2p_latency=0.5).makespan


def test_json_names_the_weight_stages():
    data = build_zero_bubble_schedule(2, 1, 2, trainable=[False, True]).to_dict()
    assert data["weight_stages"] == [False, True] and data["first_grad_stage"] == 1
    assert {a["op"] for a in data["ranks"][1]["actions"]} == {"F", "B", "W"}
    assert "weight_stages" not in build_schedule(2, 1, 2).to_dict()


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match=r"inflight_limit=10 is out of range: must be an integer >= 11"):
        build_zero_bubble_schedule(4, 2, 8, 4, inflight_limit=10)
    with pytest.raises(ValueError, match=r"trainable has 3 entries; it needs one per virtual stage \(pp x vpp = 4\)"):
        build_zero_bubble_schedule(2, 2, 4, trainable=[True] * 3)
    with pytest.raises(ValueError, match=r"stage_times\[1\]=\(1.0,\) is invalid: must be \(forward, backward\)"):
        build_zero_bubble_schedule(2, 1, 4, stage_times=[(1.0, 1.0), (1.0,)])
    with pytest.raises(ValueError, match=r"p2p_latency=-1 is invalid"):
        build_zero_bubble_schedule(2, 1, 4, p2p_latency=-1)
    with pytest.raises(ValueError, match=r"group_size=5 is out of range: must be an integer in 1..num_microbatches"):
        build_zero_bubble_schedule(2, 1, 4, 5)
    split = build_zero_bubble_schedule(2, 1, 4)
    with pytest.raises(ValueError, match="with_trainable_stages cannot change a split-backward plan"):
        with_trainable_stages(split, [True, True])
    with pytest.raises(ValueError, match="simulate_posted times plans whose backward is one step"):
        simulate_posted(split, [])


def test_validate_catches_a_weight_step_before_its_backward_or_one_too_many():
    import dataclasses

    split = build_zero_bubble_schedule(2, 1, 2)
    plan = split.ranks[1]
    actions = list(plan.actions)
    w = next(i for i, a in enumerate(actions) if a.op == WEIGHT)
    b = next(i for i, a in enumerate(actions) if a.op == BACKWARD and (a.microbatch, a.chunk) == (
        actions[w].microbatch, actions[w].chunk))
    actions.insert(b, actions.pop(w))  # W right before its own B
    moved = dataclasses.replace(split, ranks=(split.ranks[0], dataclasses.replace(plan, actions=tuple(actions))))
    with pytest.raises(ScheduleError, match=r"rank 1 stuck .* its own backward \(B\) has not run"):
        validate(moved)
    frozen = dataclasses.replace(split, weight_stages=(True, False))
    with pytest.raises(ScheduleError, match=r"rank 1 does not run every F, B and W exactly once .* unexpected"):
        validate(frozen)


def test_cli_prints_and_draws_the_split_plan(capsys, tmp_path):
    from test_schedule_cli_timeline import run_cli

    code, out, _ = run_cli(["schedule", "--pp", "2", "--vpp", "2", "--microbatches", "4", "--schedule",
                            "flexible-zb", "--json"], capsys)
    assert code == 0 and json.loads(out) == build_zero_bubble_schedule(2, 2, 4).to_dict()
    png = tmp_path / "zb.png"
    code, out, _ = run_cli(["schedule", "--pp", "2", "--microbatches", "3", "--schedule", "flexible-zb",
                            "--png", str(png)], capsys)
    header, legend, *rows = out.splitlines()[:4]
    assert code == 0 and "W<mb> = weight gradient" in legend and png.exists()
    assert re.findall(r"[FBW]\d+", rows[1]) == [f"{a.op}{a.microbatch}" for a in
                                                build_zero_bubble_schedule(2, 1, 3).ranks[1].actions]
    argv = ["simulate", "--pp", "4", "--vpp", "2", "--microbatches", "8", "--backward-time", "1", "--weight-time", "1"]
    code, flexible, _ = run_cli(argv, capsys)
    code_zb, split, _ = run_cli(argv + ["--schedule", "flexible-zb", "--inflight-limit", "12"], capsys)
    assert code == code_zb == 0
    assert "bubble ratio (idle / compute, worst rank): 0.0625" in split  # (p-1)/(3vm)
    assert "bubble ratio (idle / compute, worst rank): 0.1875" in flexible
    code, _, err = run_cli(["simulate", "--pp", "4", "--microbatches", "3", "--inflight-limit", "3"], capsys)
    assert code == 2 and "--inflight-limit applies to --schedule flexible-zb only" in err
    code, _, err = run_cli(["schedule", "--pp", "4", "--microbatches", "3", "--schedule", "flexible-zb",
                            "--inflight-limit", "2"], capsys)
    assert code == 2 and "inflight_limit=2 is out of range: must be an integer >= 3" in err
