"""Split layers of different cost over the p x v virtual stages (Llama 3 paper, sections 3.1.2 and 3.2).

The paper balances its pipelines by hand twice: one layer fewer on the first stage (it holds the most
warm-up micro-batches) and on the last (it also runs the output head and the loss), and, in multimodal
training, one virtual stage per "N frozen self-attention layers + 1 trainable cross-attention layer",
because a cross-attention layer reading thousands of image tokens costs several self-attention layers.

This module does the same from numbers: every layer has a forward and a backward cost and the bytes it
saves for backward; stages are contiguous runs of layers in model order (virtual stage s runs on rank
s % p as chunk s // p); a split is judged by the simulated step of the flexible schedule
(``simulate.Replay``), ties broken by rank 0's peak activation memory (its warm-up micro-batches in flight
times their stages' activation bytes). Candidates: equal layer counts, the paper's fewer-on-the-ends
counts, the paper's grouping (a stage ends at each cross-attention layer) and a cost-balanced split
(the smallest largest stage, then improved one layer move at a time on the simulated step). Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from l3plugin.arguments.checks import check_int

from .layers import layer_ranges
from .plan import BACKWARD, Schedule, with_trainable_stages
from .simulate import Replay

# Two steps within this fraction of the step are equal (floating sums differ in the last bits).
SAME_STEP = 1e-9


@dataclass(frozen=True)
class LayerCost:
    """One layer's (or the embedding's / head's) cost per micro-batch: compute time (or FLOPs) of its
    forward and backward, and the activation bytes it keeps for its backward."""

    forward: float
    backward: float
    activation: float = 0.0


@dataclass(frozen=True)
class Split:
    """One way to cut the layers into virtual stages, and how it runs."""

    name: str
    counts: tuple[int, ...]  # layers per virtual stage, in pipeline order
    makespan: float  # simulated step
    bubble: float  # worst rank's idle / busy
    rank_load: tuple[float, ...]  # compute per rank per step
    stage0_memory: float  # rank 0's peak activation bytes in flight

    @property
    def load_ratio(self) -> float:
        return max(self.rank_load) / min(self.rank_load)

    def stages(self) -> list[list[int]]:
        """Layer indices (0..L-1, model order) of each virtual stage."""
        return [list(ids) for ids in layer_ranges(self.counts)]

    def to_dict(self) -> dict:
        return {"name": self.name, "counts": list(self.counts), "stages": self.stages(), "makespan": self.makespan,
                "bubble": self.bubble, "rank_load": list(self.rank_load), "load_max_over_min": self.load_ratio,
                "stage0_activation_bytes": self.stage0_memory}


class StageSplitter:
    """Judges splits of ``layers`` (with ``embedding`` on the first stage and ``head`` on the last) on one
    schedule; ``balance()`` returns every candidate, best first."""

    def __init__(self, layers: list[LayerCost], schedule: Schedule, *, embedding: LayerCost = LayerCost(0, 0),
                 head: LayerCost = LayerCost(0, 0), p2p_latency: float = 0.0, kinds: str | None = None):
        if len(layers) < schedule.num_stages:
            raise ValueError(f"{len(layers)} layers cannot fill pp x vpp = {schedule.num_stages} virtual stages "
                             f"(each needs at least one layer): lower --vpp or --pp")
        if kinds is not None and len(kinds) != len(layers):
            raise ValueError(f"kinds has {len(kinds)} letters for {len(layers)} layers")
        self.layers, self.schedule, self.embedding, self.head = list(layers), schedule, embedding, head
        self.p2p_latency, self.kinds = p2p_latency, kinds
        self._replays: dict[int, Replay] = {}  # by the first stage with a gradient path, built when first asked
        self.num_stages = schedule.num_stages
        # Rank 0's actions as (stage, +1 forward / -1 backward), for its activation memory.
        self._rank0 = [(schedule.stage_of(0, a.chunk), -1 if a.op == BACKWARD else 1)
                       for a in schedule.ranks[0].actions]

    # -- judging one split ----------------------------------------------------------------------------
    def stage_costs(self, counts) -> list[LayerCost]:
        costs, start = [], 0
        for s, n in enumerate(counts):
            parts = self.layers[start:start + n] + ([self.embedding] if s == 0 else []) \
                + ([self.head] if s == len(counts) - 1 else [])
            costs.append(LayerCost(sum(c.forward for c in parts), sum(c.backward for c in parts),
                                   sum(c.activation for c in parts)))
            start += n
        return costs

    def evaluate(self, name: str, counts) -> Split:
        counts = tuple(counts)
        costs = self.stage_costs(counts)
        times, busy = self._replay(costs).run([(c.forward, c.backward) for c in costs], self.p2p_latency)
        makespan = max(end for _, end in times)
        held = peak = 0.0
        for stage, sign in self._rank0:
            held += sign * costs[stage].activation
            peak = max(peak, held)
        return Split(name, counts, makespan, max((makespan - b) / b for b in busy), tuple(busy), peak)

    def schedule_for(self, costs) -> Schedule:
        """The plan the executor runs for a split with these stage costs: stages before the first with a
        backward cost (a frozen prefix) exchange no gradients, so their no-op backward waits for nothing."""
        first = next((s for s, c in enumerate(costs) if c.backward > 0), len(costs))
        return with_trainable_stages(self.schedule, [s >= first for s in range(self.num_stages)])

    def _replay(self, costs) -> Replay:
        first = next((s for s, c in enumerate(costs) if c.backward > 0), len(costs))
        if first not in self._replays:
            self._replays[first] = Replay(self.schedule_for(costs))
        return self._replays[first]

    def _key(self, split: Split, scale: float):
        return (round(split.makespan / scale / SAME_STEP), split.stage0_memory)

    # -- candidates -----------------------------------------------------------------------------------
    def count_split(self) -> tuple[int, ...]:
        """Equal layer counts (the remainder spread over the middle stages)."""
        base, extra = divmod(len(self.layers), self.num_stages)
        order = _middle_first(self.num_stages)
        return tuple(base + (s in order[:extra]) for s in range(self.num_stages))

    def fewer_ends_split(self) -> tuple[int, ...] | None:
        """The paper's: one layer fewer on the first and the last stage than on the others."""
        rest = len(self.layers) + 2
        if self.num_stages < 3 or rest % self.num_stages or rest // self.num_stages < 2:
            return None
        n = rest // self.num_stages
        return (n - 1,) + (n,) * (self.num_stages - 2) + (n - 1,)

    def grouped_split(self) -> tuple[int, ...] | None:
        """The paper's multimodal grouping: each group ends with a cross-attention layer ("X"), the
        self-attention layers after the last one join the last group; consecutive groups share a stage
        when there are more groups than stages (None unless the stages divide the groups evenly)."""
        if not self.kinds or "X" not in self.kinds:
            return None
        groups, size = [], 0
        for kind in self.kinds:
            size += 1
            if kind == "X":
                groups.append(size)
                size = 0
        groups[-1] += size
        if len(groups) % self.num_stages:
            return None
        per = len(groups) // self.num_stages
        return tuple(sum(groups[s * per:(s + 1) * per]) for s in range(self.num_stages))

    def min_max_stage_split(self) -> tuple[int, ...]:
        """Contiguous stages whose largest compute (forward + backward, embedding and head included) is as
        small as it can be: bisection on that bound, packing greedily from the head backwards."""
        work = [c.forward + c.backward for c in self.layers]
        ends = (self.embedding.forward + self.embedding.backward, self.head.forward + self.head.backward)
        low, high = max(work) + max(ends), sum(work) + sum(ends)
        best = self._pack(work, ends, high)
        for _ in range(60):
            middle = (low + high) / 2
            counts = self._pack(work, ends, middle)
            if counts is None:
                low = middle
            else:
                high, best = middle, counts
        return best

    def _pack(self, work, ends, bound):
        """Greedy from the last layer: fill a stage up to ``bound``; None if it needs more stages. Fewer
        stages than needed are completed by splitting the largest ones (which never raises the max)."""
        counts, load = [0], ends[1]
        for w in reversed(work):
            if counts[-1] and load + w > bound:
                counts.append(0)
                load = 0.0
            counts[-1] += 1
            load += w
        counts.reverse()
        if len(counts) > self.num_stages or sum(work[:counts[0]]) + ends[0] > bound:
            return None
        while len(counts) < self.num_stages:
            s = max(range(len(counts)), key=lambda i: counts[i])
            counts[s:s + 1] = [counts[s] // 2, counts[s] - counts[s] // 2]
        return tuple(counts)

    def improve(self, split: Split, name: str, max_passes: int | None = None) -> Split:
        """Move one layer across one stage border at a time while the simulated step (then rank 0's
        memory) gets better; best move per pass."""
        scale = split.makespan
        best = split
        for _ in range(max_passes or 4 * len(self.layers)):
            moves = []
            for b in range(1, self.num_stages):
                for give, take in ((b - 1, b), (b, b - 1)):
                    if best.counts[give] > 1:
                        counts = list(best.counts)
                        counts[give] -= 1
                        counts[take] += 1
                        moves.append(counts)
            found = min((self.evaluate(name, c) for c in moves), key=lambda s: self._key(s, scale), default=best)
            if self._key(found, scale) >= self._key(best, scale):
                break
            best = found
        return dataclasses.replace(best, name=name)

    def balance(self) -> list[Split]:
        """Every candidate (count, fewer-ends, grouped where they apply, balanced), best first."""
        named = [("count", self.count_split()), ("fewer-ends", self.fewer_ends_split()),
                 ("grouped", self.grouped_split()), ("min-max-stage", self.min_max_stage_split())]
        candidates = [self.evaluate(name, counts) for name, counts in named if counts is not None]
        scale = min(c.makespan for c in candidates)
        start = min(candidates, key=lambda s: self._key(s, scale))
        candidates.append(self.improve(start, "balanced"))
        # Ties list the balanced split first: it is the one chosen.
        return sorted(candidates, key=lambda s: (self._key(s, scale), s.name != "balanced"))


def _middle_first(n: int) -> list[int]:
    """Stage indices from the middle outwards (the ends hold the embedding and the head)."""
    centre = (n - 1) / 2
    return sorted(range(n), key=lambda s: (abs(s - centre), s))


def megatron_layout(counts, pp: int) -> str:
    """Megatron-Core's ``--pipeline-model-parallel-layout`` for a split of plain transformer layers:
    stages in virtual-stage order separated by '|', 'E' the embedding, 't' a layer, 'L' the loss."""
    check_int("pp", pp)
    stages = []
    for s, n in enumerate(counts):
        body = "t" if n == 1 else f"t*{n}"
        stages.append(("E" if s == 0 else "") + (body if n else "") + ("L" if s == len(counts) - 1 else ""))
    return "|".join(stages)
