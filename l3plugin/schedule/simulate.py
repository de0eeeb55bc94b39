"""Event simulation of a pipeline :class:`~l3plugin.schedule.plan.Schedule`.

Every rank runs its actions in plan order; an action starts as soon as the rank is free and
its input message has arrived (sender's end time + p2p latency).  Sends never block, matching
the protocol :func:`~l3plugin.schedule.plan.validate` checks.

Bubble ratio follows the paper (section 3.1.1): idle time / (forward + backward compute time).
A rank's idle time is ``makespan - busy`` (every rank waits for the whole step to finish), so
for zero latency and uniform stages 1F1B gives ``(p-1) / (m*v)``.  ``bubble_ratio`` is the
maximum over ranks (the worst rank; with uniform stages every rank has the same busy time, so
it equals the mean); ``bubble_ratio_per_rank`` keeps the per-rank values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .plan import FORWARD, Schedule, execution_order


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

    def to_dict(self) -> dict:
        return {
            "pp": self.pp,
            "vpp": self.vpp,
            "microbatches": self.microbatches,
            "group_size": self.group_size,
            "forward_time": self.forward_time,
            "backward_time": self.backward_time,
            "p2p_latency": self.p2p_latency,
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "bubble_ratio_per_rank": list(self.bubble_ratio_per_rank),
            "peak_inflight": list(self.peak_inflight),
            "actions": [asdict(a) for a in self.actions],
        }


def _check_time(name: str, value, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} is not a number")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name}={value} is out of range: must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value} is out of range: must be {bound}")
    return float(value)


def simulate(
    schedule: Schedule,
    forward_time: float = 1.0,
    backward_time: float | None = None,
    p2p_latency: float = 0.0,
) -> SimulationResult:
    """Simulate ``schedule`` with uniform per-chunk costs; ``backward_time`` defaults to
    ``2 * forward_time`` (backward computes both input and weight gradients)."""
    forward_time = _check_time("forward_time", forward_time, allow_zero=False)
    if backward_time is None:
        backward_time = 2.0 * forward_time
    backward_time = _check_time("backward_time", backward_time, allow_zero=False)
    p2p_latency = _check_time("p2p_latency", p2p_latency, allow_zero=True)

    free_at = [0.0] * schedule.pp  # when each rank finishes its previous action
    arrival = {}  # message -> time it is available at the receiver
    timed: list[TimedAction] = []
    # execution_order is a dependency-respecting order, so every producer is timed before
    # its consumer; it also raises if the plan deadlocks.
    for rank, index in execution_order(schedule):
        action = schedule.ranks[rank].actions[index]
        recv, send = schedule.action_messages(rank, action)
        start = max(free_at[rank], arrival[recv] if recv is not None else 0.0)
        end = start + (forward_time if action.op == FORWARD else backward_time)
        free_at[rank] = end
        if send is not None:
            # A rank handing a tensor to itself (pp=1) pays no network latency.
            same_rank = schedule.owner_of(send.dst_stage)[0] == rank
            arrival[send] = end + (0.0 if same_rank else p2p_latency)
        timed.append(TimedAction(rank, action.op, action.microbatch, action.chunk, start, end))

    makespan = max(free_at)
    busy = schedule.microbatches * schedule.vpp * (forward_time + backward_time)
    ratios = tuple((makespan - busy) / busy for _ in schedule.ranks)
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
    )
