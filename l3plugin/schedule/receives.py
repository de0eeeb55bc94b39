"""When a pipeline rank posts each of its receives: as early as the schedule allows, within a budget.

Why it matters: gloo (as NCCL) moves a send's bytes only once the matching receive is posted, so a
transfer can overlap the receiver's compute only if the receiver posted the receive before it needs it.

The rules (pure planning; l3plugin.schedule.p2p executes them):
- Matching: receives from a peer are posted in the order that peer sends to this rank (its action
  order), so that first-in-first-out matching per peer gives every buffer its own message (an
  activation is never matched with a gradient).
- Never late: a receive is posted at the latest just before the action that needs it, together with
  every receive from the same peer ordered before it ("forced").
- Early, within a budget: before each action, further receives are posted in the order they are needed
  while fewer than ``budget`` posted receives are ahead of what forced posting would have posted by then.
  The budget is one buffer, plus the extra warm-up micro-batches k > p buys, (v - 1) * (k - p): the
  activations those add are the memory the schedule already spends on hiding P2P.
- A posting point ``i`` is "before action i runs, after action i - 1 (and its send)"; ``i`` equals the
  number of actions this rank has run.

Posting never blocks, sends never wait for receives, and a rank only blocks on a receive its next action
needs, so the execution is the replay that :func:`~l3plugin.schedule.plan.validate` checks (deadlock
free). This relies on a transport where a pending receive does not hold back this rank's own sends
(gloo); a transport that runs a pair's sends and receives in posting order on one stream (NCCL) needs
one order both ranks of a pair agree on instead (:func:`pair_orders`; :func:`agreed_order_posts` says when
that executor posts, for comparison).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from l3plugin.arguments.checks import check_int
from l3plugin.schedule.plan import Message, Schedule, execution_order

SEND, RECV = "send", "recv"


def pair_orders(schedule: Schedule, pp_rank: int) -> dict[int, deque]:
    """For each peer: this rank's sends to it and receives from it, as (SEND|RECV, message), in the
    order of the global replay. Both ranks of a pair derive the same sequence (mirrored)."""
    ops: dict[int, deque] = {}
    for rank, index in execution_order(schedule):
        _, send = schedule.messages[rank][index]
        if send is None:
            continue
        dst = schedule.owner_of(send.dst_stage)[0]
        if rank == dst:
            continue  # pp=1 with chunks: handed over locally
        if rank == pp_rank:
            ops.setdefault(dst, deque()).append((SEND, send))
        elif dst == pp_rank:
            ops.setdefault(rank, deque()).append((RECV, send))
    return ops


@dataclass(frozen=True)
class PostedReceive:
    message: Message
    peer: int  # the pipeline rank that sends it
    post_at: int  # posting point: before this rank's action ``post_at`` runs
    needed_at: int  # index of the action that consumes it
    forced: bool  # posted because it (or a later receive from the same peer) was needed, not ahead
    after_receive: bool = False  # posted once action ``post_at``'s own receive has arrived (agreed order)


@dataclass(frozen=True)
class ReceivePosts:
    """One rank's receives in posting order, with the budget they were planned under."""

    rank: int
    budget: int
    num_actions: int
    receives: tuple[PostedReceive, ...]

    def inflight(self) -> list[int]:
        """Per posting point: receives posted and not yet consumed (their buffers exist, data or not)."""
        counts = [0] * (self.num_actions + 1)
        for r in self.receives:  # one posted after its action's own receive arrived counts from the next point
            for point in range(r.post_at + r.after_receive, r.needed_at + 1):
                counts[point] += 1
        return counts

    def peak_inflight(self) -> int:
        return max(self.inflight(), default=0)

    def lead(self) -> list[int]:
        """Per receive (posting order): actions between its posting and its need (0: posted just in time)."""
        return [r.needed_at - r.post_at for r in self.receives]


def receive_budget(schedule: Schedule) -> int:
    """Receive buffers a rank may post ahead of need: 1 + (v - 1) * max(0, k - p) (module docstring)."""
    return 1 + (schedule.vpp - 1) * max(0, schedule.group_size - schedule.pp)


def incoming(schedule: Schedule, rank: int) -> tuple[dict[int, list[Message]], dict[Message, int]]:
    """({peer: messages it sends to ``rank``, in its send order}, {message: index of the action of ``rank``
    that consumes it}); messages a rank hands to itself (pp = 1 with chunks) are not included."""
    by_peer: dict[int, list[Message]] = {}
    for peer, plan in enumerate(schedule.ranks):
        if peer == rank:
            continue
        for action in plan.actions:
            _, send = schedule.action_messages(peer, action)
            if send is not None and schedule.owner_of(send.dst_stage)[0] == rank:
                by_peer.setdefault(peer, []).append(send)
    needed_at = {}
    for index, action in enumerate(schedule.ranks[rank].actions):
        recv, _ = schedule.action_messages(rank, action)
        if recv is not None and schedule.owner_of(recv.src_stage)[0] != rank:
            needed_at[recv] = index
    return by_peer, needed_at


def receive_posts(schedule: Schedule, rank: int, budget: int | None = None) -> ReceivePosts:
    """Plan when ``rank`` posts each receive (module docstring); ``budget`` defaults to
    :func:`receive_budget`, 0 posts every receive just in time."""
    check_int("rank", rank, 0, schedule.pp - 1, "pp - 1")
    budget = receive_budget(schedule) if budget is None else budget
    check_int("budget", budget, 0)
    by_peer, needed_at = incoming(schedule, rank)
    queues = {peer: list(messages) for peer, messages in by_peer.items()}
    positions = {msg: (peer, pos) for peer, messages in by_peer.items() for pos, msg in enumerate(messages)}
    posted_count = dict.fromkeys(queues, 0)  # per peer: how many of its messages are posted
    forced_count = dict.fromkeys(queues, 0)  # per peer: how many forced posting would have posted
    receives: list[PostedReceive] = []

    def post(peer, point, forced):
        msg = queues[peer][posted_count[peer]]
        posted_count[peer] += 1
        receives.append(PostedReceive(msg, peer, point, needed_at[msg], forced))

    actions = schedule.ranks[rank].actions
    for point, action in enumerate(actions):
        recv, _ = schedule.action_messages(rank, action)
        if recv in positions:
            peer, pos = positions[recv]
            forced_count[peer] = max(forced_count[peer], pos + 1)
            while posted_count[peer] < forced_count[peer]:
                post(peer, point, True)
        while sum(posted_count[q] - forced_count[q] for q in queues) < budget:
            heads = [(needed_at[queues[q][posted_count[q]]], q) for q in queues if posted_count[q] < len(queues[q])]
            if not heads:
                break
            post(min(heads)[1], point, False)
    return ReceivePosts(rank, budget, len(actions), tuple(receives))


def agreed_order_posts(schedule: Schedule, rank: int) -> ReceivePosts:
    """When ``rank`` posts its receives under the agreed pair order (p2p.py without ``posts``, the executor for
    stream-ordered transports): a receive is posted when needed, or when one of this rank's sends needs the
    pair's earlier receives posted, or right after the previous receive from that peer arrived if it is next
    in the pair's order (one ahead). For comparing the two executors, e.g. in the simulator."""
    check_int("rank", rank, 0, schedule.pp - 1, "pp - 1")
    _, needed_at = incoming(schedule, rank)
    queues = {peer: deque(ops) for peer, ops in pair_orders(schedule, rank).items()}
    receives: list[PostedReceive] = []

    posted = set()

    def post(msg, peer, point, forced, after_receive=False):
        posted.add(msg)
        receives.append(PostedReceive(msg, peer, point, needed_at[msg], forced, after_receive))

    def advance(peer, until, point):  # the pair's operations up to ``until``, in the agreed order
        while queues[peer]:
            kind, msg = queues[peer].popleft()
            if kind == RECV:
                post(msg, peer, point, True)
            if msg == until:
                return

    for index, action in enumerate(schedule.ranks[rank].actions):
        recv, send = schedule.action_messages(rank, action)
        if recv in needed_at:
            peer = schedule.owner_of(recv.src_stage)[0]
            if recv not in posted:
                advance(peer, recv, index)
            if queues[peer] and queues[peer][0][0] == RECV:  # one ahead, once this receive has arrived
                post(queues[peer].popleft()[1], peer, index, False, after_receive=True)
        if send is not None and schedule.owner_of(send.dst_stage)[0] != rank:
            advance(schedule.owner_of(send.dst_stage)[0], send, index + 1)
    return ReceivePosts(rank, 1, len(schedule.ranks[rank].actions), tuple(receives))
