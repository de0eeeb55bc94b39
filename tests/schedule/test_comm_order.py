"""The P2P posting order of l3plugin.schedule.p2p: both ranks of a pair agree on it, and every rank can
post in it while running its actions in plan order (no send has to overtake another)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from l3plugin.schedule.p2p import RECV, SEND, pair_orders
from l3plugin.schedule.plan import build_schedule


def check_posting_discipline(schedule):
    orders = {r: pair_orders(schedule, r) for r in range(schedule.pp)}
    # 1. Mirrored: what a sends to b, b receives from a, in the same position of the pair's sequence.
    for a in range(schedule.pp):
        for b, ops in orders[a].items():
            mirrored = [(RECV if k == SEND else SEND, m) for k, m in orders[b][a]]
            assert list(ops) == mirrored, (a, b)
    # 2. Executable: run each rank's actions in order; a receive posts the pair's ops up to it, a send
    #    must find only receives (or itself) ahead of it in the pair's sequence.
    for r in range(schedule.pp):
        queues = {peer: list(ops) for peer, ops in orders[r].items()}
        for action in schedule.ranks[r].actions:
            recv, send = schedule.action_messages(r, action)
            for msg, kind in ((recv, RECV), (send, SEND)):
                if msg is None:
                    continue
                peer = schedule.owner_of(msg.src_stage if kind == RECV else msg.dst_stage)[0]
                if peer == r:
                    continue
                q = queues[peer]
                if (kind, msg) not in q:
                    assert kind == RECV  # already posted by an earlier receive's advance
                    continue
                pos = q.index((kind, msg))
                assert all(k == RECV for k, _ in q[:pos]), f"rank {r}: {msg} would overtake a send"
                del q[: pos + 1]
        assert all(not q for q in queues.values())


def test_paper_and_hazard_configs():
    for p, v, m, k in [(2, 2, 4, 2), (2, 2, 7, 3), (2, 3, 1, 1), (4, 2, 9, 4), (4, 3, 5, 4), (8, 2, 12, 16 // 2)]:
        check_posting_discipline(build_schedule(p, v, m, min(k, m)))


@settings(max_examples=150, deadline=None)
@given(p=st.integers(1, 8), v=st.integers(1, 4), m=st.integers(1, 24), data=st.data())
def test_any_config(p, v, m, data):
    k = data.draw(st.integers(1, m))
    check_posting_discipline(build_schedule(p, v, m, k))
