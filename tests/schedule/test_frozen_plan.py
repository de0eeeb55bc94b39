"""Frozen layers in the plan: stages before the first trainable one keep their steps but exchange no gradient,
activations carry a gradient only after it, and both ranks of every pair still agree on one posting order."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from l3plugin.schedule.plan import (BACKWARD, Message, build_schedule, execution_order, first_grad_stage,
                                    validate, with_trainable_stages)
from test_comm_order import check_posting_discipline


def planned_messages(schedule):
    """Every message some action sends, from the plan."""
    return {send for rank, plan in enumerate(schedule.ranks) for action in plan.actions
            if (send := schedule.action_messages(rank, action)[1]) is not None}


def expected_messages(num_stages, m, first_trainable):
    """Written out independently: activations between all neighbours; a gradient from stage s + 1 into stage s
    only if stage s has a trainable parameter in or before it."""
    activations = {Message("activation", mb, s, s + 1) for mb in range(m) for s in range(num_stages - 1)}
    grads = {Message("grad", mb, s + 1, s) for mb in range(m) for s in range(first_trainable, num_stages - 1)}
    return activations | grads


@pytest.mark.parametrize("p,v,m,k", [(2, 1, 4, 2), (2, 2, 5, 3), (2, 2, 3, 1), (4, 2, 9, 4), (3, 3, 7, 5)])
def test_gradient_messages_into_a_frozen_prefix_are_dropped(p, v, m, k):
    base = build_schedule(p, v, m, k)
    for first in range(p * v + 1):
        # Only stage ``first`` trains: the frozen stages after it still need their gradients.
        schedule = with_trainable_stages(base, [s == first for s in range(p * v)])
        assert schedule.first_grad_stage == first
        assert schedule.ranks == base.ranks  # same steps in the same order: only the messages change
        assert planned_messages(schedule) == expected_messages(p * v, m, first)
        for stage in range(p * v):
            assert schedule.has_grad_path(stage) == (stage >= first)
            assert schedule.input_needs_grad(stage) == (stage > first)
        for rank, plan in enumerate(schedule.ranks):
            for action in plan.actions:  # a backward without a gradient path neither waits nor sends
                if action.op == BACKWARD and schedule.stage_of(rank, action.chunk) < first:
                    assert schedule.action_messages(rank, action) == (None, None)
            assert plan.grad_sync_points() == base.ranks[rank].grad_sync_points()


def test_the_first_trainable_stage_decides_frozen_stages_after_it_keep_their_gradients():
    # A frozen stage in the middle still passes gradients on to the trainable stages before it.
    base = build_schedule(2, 2, 4, 2)
    middle = with_trainable_stages(base, [True, False, False, True])
    assert middle.first_grad_stage == 0 and planned_messages(middle) == planned_messages(base)
    assert first_grad_stage([False, False, True, False]) == 2 and first_grad_stage([False] * 3) == 3


def test_fewer_messages_and_to_dict_says_where_gradients_start():
    base = build_schedule(4, 2, 8, 4)
    frozen = with_trainable_stages(base, [False] * 4 + [True] * 4)
    grads = [msg for msg in planned_messages(frozen) if msg.kind == "grad"]
    assert len(grads) == 8 * 3  # stages 4..7 send 3 gradients per microbatch (into 4, 5, 6); base sends 7
    assert len([msg for msg in planned_messages(base) if msg.kind == "grad"]) == 8 * 7
    assert frozen.to_dict()["first_grad_stage"] == 4 and "first_grad_stage" not in base.to_dict()


def test_trainable_flags_need_one_entry_per_virtual_stage():
    with pytest.raises(ValueError, match=r"trainable has 3 entries; it needs one per virtual stage \(pp x vpp = 4\)"):
        with_trainable_stages(build_schedule(2, 2, 4, 2), [True] * 3)


@settings(max_examples=120, deadline=None)
@given(p=st.integers(1, 6), v=st.integers(1, 3), m=st.integers(1, 16), data=st.data())
def test_posting_orders_still_mirror_with_frozen_stages(p, v, m, data):
    k = data.draw(st.integers(1, m))
    trainable = data.draw(st.lists(st.booleans(), min_size=p * v, max_size=p * v))
    schedule = with_trainable_stages(build_schedule(p, v, m, k), trainable)
    validate(schedule)
    check_posting_discipline(schedule)
    # Every planned message is sent before it is received in the global replay (what the executor relies on).
    sent = set()
    for rank, index in execution_order(schedule):
        recv, send = schedule.action_messages(rank, schedule.ranks[rank].actions[index])
        assert recv is None or recv in sent
        if send is not None:
            sent.add(send)


def test_the_balancer_times_the_plan_the_executor_runs_for_a_frozen_prefix():
    # Stages 0-3 frozen (no backward cost), 4-5 trainable, p 2 x v 3: each rank holds frozen and trainable
    # stages. Timed on the plan without gradient messages into the frozen prefix, the frozen stages' no-op
    # backwards wait for nothing and the step is shorter (42 vs 45).
    from l3plugin.schedule.balance import LayerCost, StageSplitter
    from l3plugin.schedule.simulate import simulate

    schedule = build_schedule(2, 3, 4, 1)
    times = [(1.0, 0.0), (2.0, 0.0), (1.0, 0.0), (1.0, 0.0), (1.0, 1.0), (1.0, 4.0)]
    split = StageSplitter([LayerCost(f, b) for f, b in times], schedule).evaluate("frozen prefix", (1,) * 6)
    frozen = simulate(with_trainable_stages(schedule, [False] * 4 + [True] * 2), stage_times=times)
    assert split.makespan == frozen.makespan == 42.0 and simulate(schedule, stage_times=times).makespan == 45.0
