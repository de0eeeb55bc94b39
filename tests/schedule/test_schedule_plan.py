"""The plan: identity with stock Megatron-Core where it accepts the config, the flexible cases
it rejects, validation, executor helpers and the JSON layout."""

import json

import pytest

from l3plugin.schedule.p2p import SEND, pair_orders
from l3plugin.schedule.plan import (
    Action,
    RankPlan,
    Schedule,
    ScheduleError,
    build_schedule,
    schedule_from_warmups,
    validate,
)

from megatron.core.pipeline_parallel import schedules as megatron_schedules  # noqa: E402


class _FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class _FakeP2PCommunicator:
    """Just what get_pp_rank_microbatches reads, so no process group is needed."""

    def __init__(self, pp, rank, vpp):
        self.pp_group = _FakeGroup(pp, rank)
        self.virtual_pipeline_model_parallel_size = vpp


def megatron_order(pp, vpp, m, k, rank):
    """The (op, microbatch, chunk) order Megatron's pipelined loops run on ``rank``: warm-up
    forwards, then one forward + one backward per steady-state step, then the cool-down."""
    comm = _FakeP2PCommunicator(pp, rank, vpp if vpp > 1 else None)  # None: non-interleaved
    total, _, warmup, remaining = megatron_schedules.get_pp_rank_microbatches(
        m, vpp, k, p2p_communicator=comm
    )
    table = megatron_schedules.get_schedule_table(m, vpp, k)

    def forward(i):
        return Action("F", table[i][0], table[i][1])

    def backward(i):
        return Action("B", table[i][0], vpp - 1 - table[i][1])

    order = [forward(i) for i in range(warmup)]
    for i in range(remaining):
        order += [forward(warmup + i), backward(i)]
    order += [backward(i) for i in range(remaining, total)]
    return warmup, order


def megatron_accepts(pp, vpp, m, k):
    if vpp == 1:
        return True  # non-interleaved 1F1B ignores k
    final_group = m % k
    return pp > 1 and pp <= k <= m and not 0 < final_group < pp


STOCK_CONFIGS = [
    (pp, vpp, m, k)
    for pp in range(1, 5)
    for vpp in range(1, 4)
    for m in range(1, 13)
    for k in range(pp, m + 1)  # k >= p: for v=1 the paper's k < p means AFAB, not Megatron
    if megatron_accepts(pp, vpp, m, k)
]


def test_stock_grid_is_not_trivial():
    assert len(STOCK_CONFIGS) > 150
    assert any(vpp > 1 and m % k for pp, vpp, m, k in STOCK_CONFIGS)  # partial groups >= p


@pytest.mark.parametrize("pp,vpp,m,k", STOCK_CONFIGS)
def test_identical_to_megatron_where_megatron_accepts(pp, vpp, m, k):
    schedule = build_schedule(pp, vpp, m, k)
    for rank in range(pp):
        warmup, order = megatron_order(pp, vpp, m, k, rank)
        assert schedule.ranks[rank].warmup == warmup
        assert list(schedule.ranks[rank].actions) == order


@pytest.mark.parametrize("pp,m", [(2, 5), (4, 4), (4, 9), (3, 7)])
def test_v1_is_megatron_non_interleaved(pp, m):
    schedule = build_schedule(pp, 1, m, pp)
    assert [r.warmup for r in schedule.ranks] == [min(pp - r - 1, m) for r in range(pp)]


def _is_afab(plan: RankPlan, total: int) -> bool:
    ops = [a.op for a in plan.actions]
    return ops == ["F"] * total + ["B"] * total and plan.warmup == total


@pytest.mark.parametrize("pp,vpp,m,k", [(4, 1, 8, 2), (4, 2, 8, 3), (4, 3, 7, 1), (8, 2, 5, 4)])
def test_group_smaller_than_pp_degrades_to_all_forward_all_backward(pp, vpp, m, k):
    schedule = build_schedule(pp, vpp, m, k)
    assert all(_is_afab(plan, m * vpp) for plan in schedule.ranks)


@pytest.mark.parametrize("vpp", [1, 2, 3, 4])
@pytest.mark.parametrize("pp,m", [(4, 1), (4, 3), (8, 5), (2, 1)])
def test_fewer_microbatches_than_pp_works_for_every_vpp(pp, vpp, m):
    schedule = build_schedule(pp, vpp, m)  # default k = min(p, m) = m < p
    assert schedule.group_size == m
    assert all(_is_afab(plan, m * vpp) for plan in schedule.ranks)


@pytest.mark.parametrize("pp,vpp,m,k", [(4, 2, 5, 4), (4, 3, 9, 4), (4, 2, 6, 4), (8, 4, 17, 8)])
def test_final_group_smaller_than_pp_builds(pp, vpp, m, k):
    assert 0 < m % k < pp  # stock Megatron rejects these
    schedule = build_schedule(pp, vpp, m, k)
    validate(schedule)


def test_uncapped_megatron_warmup_deadlocks_on_small_final_group_and_the_cap_fixes_it():
    pp, vpp, m, k = 4, 3, 5, 4  # final group of 1 microbatch
    stock = [2 * (pp - r - 1) + (vpp - 1) * k for r in range(pp)]
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(schedule_from_warmups(pp, vpp, m, k, stock))
    assert "rank 0 stuck" in str(info.value)
    # extra term 2*(p-r-1) capped at final group + k = 5: only rank 0 changes (14 -> 13)
    fixed = build_schedule(pp, vpp, m, k)
    assert [r.warmup for r in fixed.ranks] == [13, 12, 10, 8]


def test_extra_warmup_for_k_above_p_is_paper_count():
    pp, vpp, m = 4, 3, 24
    at_p = build_schedule(pp, vpp, m, pp)
    for k in (6, 8, 12):
        bigger = build_schedule(pp, vpp, m, k)
        for a, b in zip(at_p.ranks, bigger.ranks):
            assert b.warmup - a.warmup == (k - pp) * (vpp - 1)
            assert b.peak_inflight() - a.peak_inflight() == (k - pp) * (vpp - 1)


def test_grad_sync_and_round_end_points():
    pp, vpp, m, k = 2, 3, 7, 3  # groups {0,1,2} {3,4,5} {6}
    schedule = build_schedule(pp, vpp, m, k)
    for rank, plan in enumerate(schedule.ranks):
        sync = plan.grad_sync_points()
        assert sorted(plan.actions[i].chunk for i in sync) == list(range(vpp))
        assert all(plan.actions[i].op == "B" and plan.actions[i].microbatch == m - 1 for i in sync)
        ends = schedule.round_end_points(rank)
        assert len(ends) == vpp * 3
        assert {plan.actions[i].microbatch for i in ends} == {2, 5, 6}
        assert sync <= ends
        for i in ends:  # no later backward of the same chunk and round
            a = plan.actions[i]
            assert not any(
                b.op == "B" and b.chunk == a.chunk and b.microbatch // k == a.microbatch // k
                for b in plan.actions[i + 1:]
            )


def test_messages_and_channels_in_sender_order():
    schedule = build_schedule(2, 2, 4, 2)  # pp=2: each peer gets activations and grads
    fwd = schedule.action_messages(0, Action("F", 1, 0))
    assert (fwd[0], fwd[1].src_stage, fwd[1].dst_stage) == (None, 0, 1)
    last = schedule.action_messages(1, Action("B", 1, 1))  # stage 3 is the last stage
    assert last[0] is None and (last[1].kind, last[1].dst_stage) == ("grad", 2)
    orders = {r: pair_orders(schedule, r) for r in range(2)}
    assert set(orders[0]) == {1} and set(orders[1]) == {0}
    assert {msg.kind for kind, msg in orders[0][1] if kind == SEND} == {"activation", "grad"}
    sent_in_order = [
        send for a in schedule.ranks[0].actions
        if (send := schedule.action_messages(0, a)[1]) is not None
    ]
    assert [msg for kind, msg in orders[0][1] if kind == SEND] == sent_in_order
    stages = schedule.num_stages
    assert sum(kind == SEND for r in range(2) for kind, _ in orders[r][1 - r]) == 2 * 4 * (stages - 1)


def test_pp1_with_chunks_sends_to_itself():
    schedule = build_schedule(1, 3, 4, 2)
    assert pair_orders(schedule, 0) == {}  # every tensor is handed over on the rank itself
    assert schedule.ranks[0].warmup == 4  # (v-1)*k: chunk 2's forward precedes its backward


def test_validate_rejects_missing_action_and_backward_before_forward():
    good = build_schedule(2, 1, 2, 2)
    missing = Schedule(2, 1, 2, 2, (good.ranks[0], RankPlan(1, 0, good.ranks[1].actions[:-1])))
    with pytest.raises(ScheduleError, match="rank 1 does not run every F and B exactly once"):
        validate(missing)
    acts = list(good.ranks[1].actions)  # F0 B0 F1 B1 -> B0 F0 ...
    acts[0], acts[1] = acts[1], acts[0]
    swapped = Schedule(2, 1, 2, 2, (good.ranks[0], RankPlan(1, 0, tuple(acts))))
    with pytest.raises(ScheduleError, match="rank 1 stuck at action #0"):
        validate(swapped)


def test_to_dict_layout_is_exact():
    schedule = build_schedule(2, 2, 2, 2)
    data = json.loads(json.dumps(schedule.to_dict()))
    assert list(data) == ["pp", "vpp", "microbatches", "group_size", "ranks"]
    assert (data["pp"], data["vpp"], data["microbatches"], data["group_size"]) == (2, 2, 2, 2)
    assert [list(r) for r in data["ranks"]] == [["rank", "warmup", "actions"]] * 2
    assert data["ranks"][0]["actions"][0] == {"op": "F", "microbatch": 0, "chunk": 0}
    assert data["ranks"][1]["warmup"] == 2
    assert len(data["ranks"][1]["actions"]) == 2 * 2 * 2


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 1, 8), "pp_size=0 is out of range: must be an integer >= 1"),
        ((2, 0, 8), "vpp_size=0 is out of range: must be an integer >= 1"),
        ((2, 1, 0), "num_microbatches=0 is out of range: must be an integer >= 1"),
        ((2, 1, 8, 0), r"group_size=0 is out of range: must be an integer in 1\.\.num_microbatches \(=8\)"),
        ((2, 1, 8, 9), r"group_size=9 is out of range: must be an integer in 1\.\.num_microbatches \(=8\)"),
        ((2.0, 1, 8), "pp_size=2.0 is out of range: must be an integer >= 1"),
        ((2, True, 8), "vpp_size=True is out of range: must be an integer >= 1"),
    ],
)
def test_bad_input_names_parameter_value_and_range(args, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)


@pytest.mark.parametrize("pp, vpp, m, k", [(4, 3, 5, 4), (8, 2, 18, 8), (16, 4, 36, 16), (5, 2, 13, 6)])
def test_a_small_final_group_is_list_scheduled_faster_in_the_same_orders_and_memory(pp, vpp, m, k):
    from l3plugin.schedule.plan import warmup_count
    from l3plugin.schedule.simulate import simulate

    assert 0 < m % k < pp
    listed = build_schedule(pp, vpp, m, k)
    laid_out = schedule_from_warmups(pp, vpp, m, k, [warmup_count(pp, vpp, m, k, r) for r in range(pp)])
    validate(laid_out)  # deadlock-free too, only slower
    for a, b in zip(listed.ranks, laid_out.ranks):
        for op in "FB":  # each kind in the same order: every parameter accumulates its gradients in the same order
            assert [x for x in a.actions if x.op == op] == [x for x in b.actions if x.op == op]
        assert a.peak_inflight() <= b.peak_inflight() and a.warmup == b.warmup
    assert simulate(listed).makespan < simulate(laid_out).makespan
    if (pp, vpp, m) == (16, 4, 36):
        assert simulate(listed).bubble_ratio < 0.3 < 2.5 < simulate(laid_out).bubble_ratio
