"""Property tests: every flexible configuration is complete, ordered and deadlock-free."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from l3plugin.schedule.plan import build_schedule, flexible_plan, validate


@st.composite
def configs(draw):
    pp = draw(st.integers(1, 8))
    vpp = draw(st.integers(1, 4))
    m = draw(st.integers(1, 32))
    k = draw(st.integers(1, m))
    return pp, vpp, m, k


@settings(deadline=None, max_examples=300)
@given(configs())
def test_every_config_is_complete_ordered_and_deadlock_free(config):
    pp, vpp, m, k = config
    schedule = flexible_plan(pp, vpp, m, k)  # what build_schedule returns once validate() passed (no second replay)
    validate(schedule)  # raises on deadlock
    expected = Counter((op, mb, c) for op in "FB" for mb in range(m) for c in range(vpp))
    for plan in schedule.ranks:
        assert Counter((a.op, a.microbatch, a.chunk) for a in plan.actions) == expected
        position = {(a.op, a.microbatch, a.chunk): i for i, a in enumerate(plan.actions)}
        assert all(position[("B", mb, c)] > position[("F", mb, c)] for _, mb, c in expected)
        assert 0 <= plan.warmup <= m * vpp
        if k < pp:
            assert plan.warmup == m * vpp  # all-forward-all-backward


@settings(deadline=None, max_examples=60)
@given(configs())
def test_warmup_never_exceeds_megatron_formula(config):
    # The deadlock fix for small final groups only ever lowers a warm-up.
    pp, vpp, m, k = config
    schedule = build_schedule(pp, vpp, m, k)
    for rank, plan in enumerate(schedule.ranks):
        if k < pp:
            continue
        stock = pp - rank - 1 if vpp == 1 else 2 * (pp - rank - 1) + (vpp - 1) * k
        assert plan.warmup <= min(stock, m * vpp)
        if not 0 < m % k < pp:
            assert plan.warmup == min(stock, m * vpp)


def test_exhaustive_small_grid_including_small_final_groups():
    built = 0
    for pp in range(1, 6):
        for vpp in range(1, 4):
            for m in range(1, 13):
                for k in range(1, m + 1):
                    build_schedule(pp, vpp, m, k)  # validates; raises on any deadlock
                    built += 1
    assert built == 5 * 3 * (12 * 13 // 2)
