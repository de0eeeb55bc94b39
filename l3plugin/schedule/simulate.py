"""Event simulation of a pipeline :class:`~l3plugin.schedule.plan.Schedule`.

Every rank runs its actions in plan order; an action starts as soon as the rank is free and
its input message has arrived (sender's end time + p2p latency).  Sends never block, matching
the protocol :func:`~l3plugin.schedule.plan.validate` checks.

Bubble ratio follows the paper (section 3.1.1): idle time / (forward + backward compute time).
A rank's idle time is ``makespan - busy`` (every rank waits for the whole step to finish), so
for zero latency and uniform stages 1F1B gives ``(p-1) / (m*v)``.  ``bubble_ratio`` is the
maximum over ranks (the worst rank; with uniform stages every rank has the same busy time, so
it equals the mean); ``bubble_ratio_per_rank`` keeps the per-rank values.

Stages of different cost (layers of different kinds, frozen layers, the output head) are given as
``stage_times``: one (forward, backward) pair per virtual stage; a backward may cost nothing (a
frozen stage with nothing trainable before it).

Split backward (the zero-bubble plan, zero_bubble.py): a backward's cost is its input gradient B plus its
weight gradient W. Give them apart as ``weight_time`` (then ``backward_time`` is B alone) or as (forward,
B, W) triples in ``stage_times``; a plan that does not split runs B + W as one step, so one set of costs
times both plans. A whole-backward cost alone is split in half (B = W: one matmul each for a linear layer)
on a stage with W steps. ``peak_inflight`` counts a microbatch-chunk from its forward until its W (until its
backward where it has none).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from l3plugin.arguments.checks import check_number

from .plan import BACKWARD, FORWARD, WEIGHT, Schedule, execution_order

COST_INDEX = {FORWARD: 0, BACKWARD: 1, WEIGHT: 2}  # an action's cost in a stage's (forward, B, W) times


@dataclass(frozen=True)
class TimedAction:
    """One action with its simulated start/end time (for drawing timelines)."""

    rank: int
    op: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    pp: int
    vpp: int
    microbatches: int
    group_size: int
    forward_time: float
    backward_time: float
    p2p_latency: float
    makespan: float
    bubble_ratio: float  # max over ranks of idle / busy
    bubble_ratio_per_rank: tuple[float, ...]
    peak_inflight: tuple[int, ...]  # per rank, in units of one chunk's activations
    actions: tuple[TimedAction, ...]  # sorted by (rank, start)
    busy: tuple[float, ...] = ()  # per rank: its compute time
    weight_time: float = 0.0  # the shortest W step (0: the plan does not split its backward)

    def to_dict(self) -> dict:
        return {
            "pp": self.pp,
            "vpp": self.vpp,
            "microbatches": self.microbatches,
            "group_size": self.group_size,
            "forward_time": self.forward_time,
            "backward_time": self.backward_time,
            "weight_time": self.weight_time,
            "p2p_latency": self.p2p_latency,
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "bubble_ratio_per_rank": list(self.bubble_ratio_per_rank),
            "peak_inflight": list(self.peak_inflight),
            "busy": list(self.busy),
            "actions": [asdict(a) for a in self.actions],
        }


def _check_time(name: str, value, allow_zero: bool) -> float:
    return check_number(name, value, 0, low_open=not allow_zero)


def simulate(
    schedule: Schedule,
    forward_time: float = 1.0,
    backward_time: float | None = None,
    p2p_latency: float = 0.0,
    stage_times=None,
    weight_time: float | None = None,
) -> SimulationResult:
    """Simulate ``schedule`` with uniform per-chunk costs; ``backward_time`` defaults to
    ``2 * forward_time`` (backward computes both input and weight gradients). With ``weight_time``
    (the weight gradient W) ``backward_time`` is the input gradient B alone and defaults to
    ``forward_time`` (module docstring). With ``stage_times`` ([(forward, backward)] or [(forward, B, W)]
    per virtual stage s = chunk * pp + rank) each stage costs its own times and the uniform ones are
    ignored."""
    p2p_latency = _check_time("p2p_latency", p2p_latency, allow_zero=True)
    if stage_times is None:
        forward_time = _check_time("forward_time", forward_time, allow_zero=False)
        if weight_time is not None:
            weight_time = _check_time("weight_time", weight_time, allow_zero=True)
        if backward_time is None:
            backward_time = 2.0 * forward_time if weight_time is None else forward_time
        backward_time = _check_time("backward_time", backward_time, allow_zero=False)
        stage_times = [(forward_time, backward_time) if weight_time is None
                       else (forward_time, backward_time, weight_time)] * schedule.num_stages
    stage_times = step_costs(schedule, check_stage_times(stage_times, schedule.num_stages))
    # The drawing unit: the shortest non-zero forward, B and W.
    forward_time = min(t[0] for t in stage_times)
    backward_time = min((t[1] for t in stage_times if t[1] > 0), default=forward_time)
    weight_time = min((t[2] for t in stage_times if t[2] > 0), default=0.0) if schedule.split_backward else 0.0

    replay = Replay(schedule)
    times, busy = replay.run(stage_times, p2p_latency)
    timed = [TimedAction(rank, action.op, action.microbatch, action.chunk, start, end)
             for (rank, action, *_), (start, end) in zip(replay.steps, times)]
    makespan = max(end for _, end in times)
    ratios = tuple((makespan - b) / b for b in busy)
    return SimulationResult(
        pp=schedule.pp,
        vpp=schedule.vpp,
        microbatches=schedule.microbatches,
        group_size=schedule.group_size,
        forward_time=forward_time,
        backward_time=backward_time,
        p2p_latency=p2p_latency,
        makespan=makespan,
        bubble_ratio=max(ratios),
        bubble_ratio_per_rank=ratios,
        peak_inflight=tuple(plan.peak_inflight() for plan in schedule.ranks),
        actions=tuple(sorted(timed, key=lambda a: (a.rank, a.start))),
        busy=tuple(busy),
        weight_time=weight_time,
    )


def step_costs(schedule: Schedule, stage_times) -> list[tuple[float, float, float]]:
    """(forward, B step, W step) per stage for ``schedule`` from checked pairs or triples: a plan without W
    steps (or a stage without them) runs B + W as its backward; a whole backward (a pair) on a stage with W
    steps is split in half; where the stage's input needs no gradient (the first trainable stage) its B has
    nothing to compute and its W is the whole backward (what the generic executor does)."""
    costs = []
    for stage, times in enumerate(stage_times):
        whole = times[1] if len(times) == 2 else times[1] + times[2]
        if not schedule.has_weight_step(stage):
            costs.append((times[0], whole, 0.0))
        elif not schedule.input_needs_grad(stage):
            costs.append((times[0], 0.0, whole))
        else:
            costs.append((times[0], whole / 2, whole / 2) if len(times) == 2 else times)
    return costs


class Replay:
    """A schedule's actions in a dependency-respecting order, each with its stage and messages,
    worked out once so that one schedule can be timed under many stage costs (the balancer times
    hundreds of candidate splits on one schedule)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        slots: dict = {}  # message -> its index in the arrival list
        self.steps = []  # (rank, action, stage, cost index, received slot or -1, sent slot or -1, pays latency)
        # execution_order is a dependency-respecting order, so every producer is timed before
        # its consumer; it also raises if the plan deadlocks.
        for rank, index in execution_order(schedule):
            action = schedule.ranks[rank].actions[index]
            recv, send = schedule.messages[rank][index]
            # A rank handing a tensor to itself (pp=1) pays no network latency.
            remote = send is not None and schedule.owner_of(send.dst_stage)[0] != rank
            self.steps.append((rank, action, schedule.stage_of(rank, action.chunk), COST_INDEX[action.op],
                               -1 if recv is None else slots.setdefault(recv, len(slots)),
                               -1 if send is None else slots.setdefault(send, len(slots)), remote))
        self.num_messages = len(slots)

    def run(self, stage_times, p2p_latency: float = 0.0):
        """([(start, end)] per step, busy time per rank) with ``stage_times`` [(forward, backward)]
        per virtual stage (a split plan: [(forward, B, W)]); an action starts when its rank is free and its
        input has arrived."""
        free_at = [0.0] * self.schedule.pp
        busy = [0.0] * self.schedule.pp
        arrival = [0.0] * self.num_messages
        times = []
        for rank, _, stage, cost_index, received, sent, remote in self.steps:
            start = free_at[rank] if received < 0 else max(free_at[rank], arrival[received])
            cost = stage_times[stage][cost_index]
            free_at[rank] = end = start + cost
            busy[rank] += cost
            if sent >= 0:
                arrival[sent] = end + (p2p_latency if remote else 0.0)
            times.append((start, end))
        return times, busy

    def makespan(self, stage_times, p2p_latency: float = 0.0) -> float:
        return max(end for _, end in self.run(stage_times, p2p_latency)[0])


def check_stage_times(stage_times, num_stages: int) -> list[tuple[float, ...]]:
    """[(forward, backward)] or [(forward, B, W)] per virtual stage, checked: forwards > 0, the rest >= 0."""
    stage_times = list(stage_times)
    if len(stage_times) != num_stages:
        raise ValueError(f"stage_times has {len(stage_times)} entries; it needs one (forward, backward) pair "
                         f"per virtual stage (pp x vpp = {num_stages})")
    names = {2: ("forward", "backward"), 3: ("forward", "input gradient", "weight gradient")}
    checked = []
    for s, times in enumerate(stage_times):
        times = tuple(times)
        if len(times) not in names:
            raise ValueError(f"stage_times[{s}]={times!r} is invalid: must be (forward, backward) or "
                             f"(forward, input gradient, weight gradient)")
        checked.append(tuple(_check_time(f"stage_times[{s}] {name}", t, allow_zero=i > 0)
                             for i, (name, t) in enumerate(zip(names[len(times)], times))))
    return checked


def simulate_posted(schedule: Schedule, posts, forward_time: float = 1.0, backward_time: float | None = None,
                    message_time: float = 0.0) -> tuple[float, list[float]]:
    """(makespan, per rank: time spent waiting for receives) when a message moves only once its receive is
    posted (gloo, NCCL). ``posts``: one ``ReceivePosts`` per rank (l3plugin.schedule.receives). A message
    takes ``message_time`` on the wire, starting when it is sent and its receive is posted, after the
    previous message in the same direction (first in, first out; each direction its own link, full duplex).
    A receive posted at point i is posted when action i - 1 ends; ``after_receive``: when action i starts."""
    if schedule.split_backward:
        raise ValueError("simulate_posted times plans whose backward is one step; this one splits it into B and W")
    message_time = _check_time("message_time", message_time, allow_zero=True)
    forward_time = _check_time("forward_time", forward_time, allow_zero=False)
    backward_time = _check_time("backward_time", 2.0 * forward_time if backward_time is None else backward_time,
                                allow_zero=False)
    planned = {r.message: (rank, r) for rank, plan in enumerate(posts) for r in plan.receives}
    previous = {}  # message -> the message before it in its direction
    last = {}
    for rank, plan in enumerate(posts):
        for r in plan.receives:
            previous[r.message], last[(r.peer, rank)] = last.get((r.peer, rank)), r.message
    starts = [[0.0] * len(plan.actions) for plan in schedule.ranks]
    ends = [[0.0] * len(plan.actions) for plan in schedule.ranks]
    sent_at, arrival = {}, {}

    def arrive(msg):
        if msg not in arrival:
            rank, r = planned[msg]
            posted = (starts[rank][r.post_at] if r.after_receive
                      else ends[rank][r.post_at - 1] if r.post_at else 0.0)
            before = previous[msg]
            arrival[msg] = max(sent_at[msg], posted, arrive(before) if before else 0.0) + message_time
        return arrival[msg]

    free_at, waited = [0.0] * schedule.pp, [0.0] * schedule.pp
    for rank, index in execution_order(schedule):
        action = schedule.ranks[rank].actions[index]
        recv, send = schedule.messages[rank][index]
        ready = free_at[rank]
        if recv is not None:
            ready = max(ready, arrive(recv) if recv in planned else sent_at[recv])
        waited[rank] += ready - free_at[rank]
        starts[rank][index] = ready
        free_at[rank] = ends[rank][index] = ready + (forward_time if action.op == FORWARD else backward_time)
        if send is not None:
            sent_at[send] = free_at[rank]
    return max(free_at), waited
