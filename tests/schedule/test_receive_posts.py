"""The receive-posting plan (l3plugin.schedule.receives): every receive posted before it is needed, from each
peer in that peer's send order, never more than the budget ahead of just-in-time posting."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from l3plugin.schedule.plan import build_schedule
from l3plugin.schedule.receives import agreed_order_posts, incoming, receive_budget, receive_posts
from l3plugin.schedule.simulate import simulate, simulate_posted


def check_posts(schedule, rank, budget):
    posts = receive_posts(schedule, rank, budget)
    by_peer, needed_at = incoming(schedule, rank)
    # Every remote receive exactly once, posted no later than the action that consumes it.
    assert sorted(map(repr, (r.message for r in posts.receives))) == sorted(map(repr, needed_at))
    for r in posts.receives:
        assert 0 <= r.post_at <= r.needed_at == needed_at[r.message]
    # Matching: from each peer in the order that peer sends (first-in-first-out gives each buffer its message).
    for peer, messages in by_peer.items():
        assert [r.message for r in posts.receives if r.peer == peer] == messages
    assert [r.post_at for r in posts.receives] == sorted(r.post_at for r in posts.receives)
    # Budget: at every point, the receives posted beyond what just-in-time posting needs by then <= budget.
    lazy = {r.message: r.post_at for r in receive_posts(schedule, rank, 0).receives}
    for point in range(posts.num_actions + 1):
        ahead = sum(1 for r in posts.receives if r.post_at <= point < lazy[r.message])
        assert ahead <= budget, (rank, point, ahead)
    inflight = posts.inflight()
    assert posts.peak_inflight() == max(inflight, default=0)
    return posts


@settings(max_examples=120, deadline=None)
@given(p=st.integers(1, 6), v=st.integers(1, 4), m=st.integers(1, 16), data=st.data())
def test_any_config_any_budget(p, v, m, data):
    k = data.draw(st.integers(1, m))
    budget = data.draw(st.integers(0, 6))
    schedule = build_schedule(p, v, m, k)
    for rank in range(p):
        check_posts(schedule, rank, budget)


def test_just_in_time_posts_each_receive_at_its_need_or_with_an_earlier_sent_one():
    schedule = build_schedule(2, 2, 8, 2)
    for rank in range(2):
        posts = receive_posts(schedule, rank, 0)
        assert all(r.forced for r in posts.receives)
        assert sum(r.post_at == r.needed_at for r in posts.receives) >= len(posts.receives) // 2


@pytest.mark.parametrize("p, v, m, k", [(2, 2, 8, 2), (2, 2, 8, 3), (2, 4, 8, 3), (4, 2, 12, 6)])
def test_default_budget_posts_every_receive_but_the_first_ahead_of_need(p, v, m, k):
    """The budget k > p buys: 1 + (v - 1)(k - p); with it every receive except rank > 0's very first
    (the pipeline fill: nothing runs before it) is posted at least one action ahead, and k > p leads more."""
    schedule = build_schedule(p, v, m, k)
    assert receive_budget(schedule) == 1 + (v - 1) * max(0, k - p)
    for rank in range(p):
        posts = check_posts(schedule, rank, receive_budget(schedule))
        leads = posts.lead()
        assert min(leads[1:]) >= 1 and (rank == 0 or leads[0] == 0)
        assert posts.peak_inflight() <= receive_posts(schedule, rank, 0).peak_inflight() + posts.budget


def test_k_above_p_posts_further_ahead_than_k_equal_p():
    leads = {k: receive_posts(build_schedule(2, 2, 8, k), 1).lead() for k in (2, 3)}
    assert sum(leads[3]) / len(leads[3]) > sum(leads[2]) / len(leads[2])


def test_bad_input_names_the_parameter():
    schedule = build_schedule(2, 2, 4, 2)
    with pytest.raises(ValueError, match=r"budget=-1 is out of range"):
        receive_posts(schedule, 0, -1)
    with pytest.raises(ValueError, match=r"rank=2 is out of range: must be an integer in 0..pp - 1 \(=1\)"):
        receive_posts(schedule, 2)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 5), v=st.integers(1, 3), m=st.integers(1, 12), data=st.data())
def test_agreed_order_posts_each_receive_in_time_in_send_order(p, v, m, data):
    schedule = build_schedule(p, v, m, data.draw(st.integers(1, m)))
    for rank in range(p):
        posts = agreed_order_posts(schedule, rank)
        by_peer, needed_at = incoming(schedule, rank)
        assert sorted(map(repr, (r.message for r in posts.receives))) == sorted(map(repr, needed_at))
        assert all(r.post_at <= r.needed_at and (r.post_at < r.needed_at or not r.after_receive)
                   for r in posts.receives)
        for peer, messages in by_peer.items():
            assert [r.message for r in posts.receives if r.peer == peer] == messages


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 5), v=st.integers(1, 3), m=st.integers(1, 12), data=st.data())
def test_posted_simulation_without_wire_time_is_the_plain_simulation(p, v, m, data):
    schedule = build_schedule(p, v, m, data.draw(st.integers(1, m)))
    for plan_posts in (lambda r: receive_posts(schedule, r, 0), lambda r: agreed_order_posts(schedule, r)):
        posts = [plan_posts(r) for r in range(p)]
        makespan, waited = simulate_posted(schedule, posts, 1.0, 2.0, 0.0)
        assert makespan == simulate(schedule, 1.0, 2.0).makespan
    # With time on the wire never faster; posting ahead (the budget) never slower than just in time.
    late = simulate_posted(schedule, [receive_posts(schedule, r, 0) for r in range(p)], 1.0, 2.0, 0.3)[0]
    early = simulate_posted(schedule, [receive_posts(schedule, r) for r in range(p)], 1.0, 2.0, 0.3)[0]
    assert simulate(schedule, 1.0, 2.0).makespan <= early <= late


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("share", [0.1, 0.2, 0.3])
def test_simulated_pp2_k_above_p_hides_more_when_receives_post_early(v, share):
    """pp 2, m 8, a message taking ``share`` of a forward: posted early, k = 1.5p is within 1.05x of no wire and
    ahead of k = p; posted in the agreed pair order, k = 1.5p gains (almost) nothing over k = p."""
    def makespan(k, posts_of):
        schedule = build_schedule(2, v, 8, k)
        return simulate_posted(schedule, [posts_of(schedule, r) for r in range(2)], 1.0, 2.0, share)[0]

    no_wire = simulate(build_schedule(2, v, 8, 2), 1.0, 2.0).makespan
    assert makespan(3, receive_posts) <= 1.05 * no_wire
    assert makespan(3, receive_posts) < makespan(2, receive_posts) < makespan(2, agreed_order_posts)
    assert makespan(3, agreed_order_posts) > 0.99 * makespan(2, agreed_order_posts)
