"""Enumerate 4D layouts, evaluate them with the schedule, and rank them (best first).

Candidates: TP divides the heads, the KV heads and the FFN width (TP larger than a node is listed and
priced at the network rate, the paper's "expensive cross-host TP"); CP = 1 or
divides the sequence into 2*CP equal chunks (the paper's load-balanced CP split); PP x VPP virtual
stages take an even split or one layer fewer on the first and/or last stage; m = sequences /
(DP x micro batch) is a whole number; k (microbatches per virtual stage per round) is p (Megatron's
default), 2p (the paper's threshold for ZeRO-1), or m when m <= 4p (one round). With one chunk per
rank k only sets the ZeRO-2 rounds, so k = m. A layout takes ZeRO-1 if it fits, else ZeRO-2.

CP policy (paper 5.1, "CP replaces DP for long context"): by default CP > 1 is considered only when even
node-wide TP with CP = 1 leaves DP groups fewer than p sequences (sequences x TP < GPUs x micro batch);
if nothing fits or divides the batch without CP, CP is allowed after all (cp_policy "memory").
cp_policy="any" lets the cost model weigh CP at every length (with GQA it often prefers it: the model
has no term for CP's attention efficiency or CP-rank imbalance at short lengths).

Ranking is best-first on a lower bound of the step time: the bubble (p-1)/(m v) of an ideal
interleaved pipeline (the simulated one is never smaller). Layouts whose memory lower bound (static
memory plus the activations in flight at the end of the warm-up) exceeds HBM are dropped unbuilt; the
others are built and simulated only when they reach the head of the queue, so a plan evaluates the
few layouts that can win. Per rank, the in-flight microbatches are tracked per chunk class (first
chunk, middle, last chunk) since only stage 0 and the last stage differ in activation size.

``tp``, ``pp``, ``cp`` pin a dimension (staged planning pins TP and PP, see staged.py). Schedules are
built and simulated through schedules.ScheduleCache.

Layers that differ (``kinds``, ``frozen``, ``image_tokens``; the flags of ``l3plugin balance``): the length of
``kinds`` is the layer count (the model gives the shapes), costs come per layer (layer_profile.py, costs.py),
and, unless every layer costs the same, each (p, v, m, k) also gets StageSplitter's balanced split (named
"balanced"), every layout's bubble is simulated with its own stage times and its activations walked stage
by stage, and the best-first bound drops the ideal bubble (with unequal stages the busiest rank may idle
less than (p-1)/(m v)). CP > 1 is not planned with cross-attention layers (the image tokens' sharding over
CP is not modelled).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from functools import cached_property

from l3plugin.arguments.checks import check_int, check_number
from l3plugin.schedule.layers import layers_per_virtual_stage

from .costs import GIB, Layout, LayoutCosts
from .layer_profile import LayerProfile, balanced_counts, check_layer_flags
from .machine import Hardware
from .models import ModelSpec, load_model
from .schedule_cache import ScheduleCache, warmup_inflight


# "memory": set by plan() when no layout without CP fits (or divides the batch over all GPUs)
CP_POLICIES = ("long-context", "any", "memory")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. ``cp_policy="long-context"`` follows the paper: CP > 1 only when the batch is
    too small for 3D parallelism (see long_context); "any" lets the cost model weigh CP everywhere."""

    model: ModelSpec
    gpus: int
    seq_len: int
    global_batch_tokens: int
    gpus_per_node: int = 8
    hbm_gb: float = 80.0
    micro_batch_size: int = 1
    hardware: Hardware = field(default_factory=Hardware)
    cp_policy: str = "long-context"  # or "any": see cp_allowed
    tp: int | None = None  # pinned sizes (None: searched)
    pp: int | None = None
    cp: int | None = None
    kinds: str | None = None  # one letter per layer (S / X), see layer_costs.py; None: uniform layers
    frozen: str = ""  # letters of what is frozen (S, X, E, H)
    image_tokens: int = 0  # per sample, read by every X layer

    def __post_init__(self):
        object.__setattr__(self, "model", load_model(self.model))
        check_layer_flags(self.kinds, self.frozen, self.image_tokens)
        if self.kinds is not None and len(self.kinds) != self.model.num_layers:
            object.__setattr__(self, "model", replace(self.model, num_layers=len(self.kinds)))
        if self.cross_attention and self.cp and self.cp > 1:
            raise ValueError(f"--cp={self.cp} is not planned for cross-attention layers (X in --kinds): how CP "
                             f"would shard the image tokens is not modelled; use --cp 1 or leave it out")
        for name in ("gpus", "seq_len", "global_batch_tokens", "gpus_per_node", "micro_batch_size"):
            check_int("--" + name.replace("_", "-"), getattr(self, name))
        for name in ("tp", "pp", "cp"):
            if getattr(self, name) is not None:
                check_int("--" + name, getattr(self, name))
        hbm = self.hbm_gb
        check_number("--gpu-memory-gb", hbm, 0, low_open=True, note="GiB per GPU")
        hw = self.hardware
        if self.usable_bytes <= 0:
            need = hw.reserved_gb / hw.usable_fraction
            raise ValueError(f"--gpu-memory-gb={hbm:g} x --usable-memory-fraction={hw.usable_fraction:g} leaves "
                             f"nothing after the {hw.reserved_gb:g} GiB reserved (CUDA context, NCCL): use "
                             f"--gpu-memory-gb > {need:.3g}")
        n, node = self.gpus, self.gpus_per_node
        if n > node and n % node:
            raise ValueError(f"--gpus={n} is not divisible by --gpus-per-node={node}: beyond one node use "
                             f"whole nodes, e.g. {n // node * node} or {(n // node + 1) * node}")
        T, L = self.global_batch_tokens, self.seq_len
        if T % L:
            low, high = T // L * L, (T // L + 1) * L
            raise ValueError(f"--global-batch-tokens={T} is not divisible by --seq-len={L}: the batch must be "
                             f"whole sequences, e.g. {low or high} or {high}")
        if self.cp_policy not in CP_POLICIES:
            raise ValueError(f"--cp-policy={self.cp_policy!r} is invalid: choose one of {', '.join(CP_POLICIES[:2])}")
        if (T // L) % self.micro_batch_size:
            raise ValueError(f"the global batch of {T // L} sequences is not divisible by --micro-batch-size="
                             f"{self.micro_batch_size}: choose a micro batch that divides it")
        pinned = [(name, v) for name, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp)) if v]
        product = math.prod(v for _, v in pinned)
        if pinned and n % product:
            names = " x ".join(f"--{name}" for name, _ in pinned)
            raise ValueError(f"--gpus={n} is not divisible by {names} = {product}: use a multiple of {product} "
                             f"GPUs (e.g. {n // product * product or product} or {(n // product + 1) * product}) "
                             f"or sizes whose product divides {n} (its divisors: {_short_list(divisors(n))})")
        if self.cp and L % (2 * self.cp):
            valid = [c for c in divisors(L // 2) if n % c == 0 and c <= n][-4:]
            raise ValueError(f"--seq-len={L} is not divisible by 2 x --cp = {2 * self.cp}: CP cuts every sequence "
                             f"into 2 x CP equal chunks; CP sizes that divide this length: {_short_list(valid)}, "
                             f"or a length that is a multiple of {2 * self.cp}")

    @property
    def sequences(self) -> int:
        return self.global_batch_tokens // self.seq_len

    @cached_property
    def max_tp(self) -> int:
        model = self.model
        return max(tp for tp in divisors(self.gpus) if tp <= self.gpus_per_node and not any(
            x % tp for x in (model.num_attention_heads, model.num_kv_heads, model.ffn_hidden_size)))

    @property
    def long_context(self) -> bool:
        """Paper 5.1: even with TP across a whole node and CP = 1, DP groups would get fewer sequences
        than pipeline stages (b < p for every p: sequences x TP < GPUs x micro batch)."""
        return self.sequences * self.max_tp < self.gpus * self.micro_batch_size

    @property
    def cp_allowed(self) -> bool:
        """CP replaces DP for long context only (paper 5.1), unless cp_policy="any" or CP is pinned."""
        return self.cp_policy != "long-context" or self.long_context or bool(self.cp and self.cp > 1)

    @property
    def pinned(self) -> bool:
        return any((self.tp, self.pp, self.cp))

    def unpinned(self) -> "PlanRequest":
        return replace(self, tp=None, pp=None, cp=None)

    @property
    def usable_bytes(self) -> float:
        return self.hardware.usable_bytes(self.hbm_gb)

    @property
    def cross_attention(self) -> bool:
        return self.kinds is not None and "X" in self.kinds

    @cached_property
    def profile(self) -> LayerProfile | None:
        if self.kinds is None:
            return None
        return LayerProfile.build(self.model, self.kinds, self.frozen, self.image_tokens, self.seq_len,
                                  self.micro_batch_size)

    @property
    def heterogeneous(self) -> bool:
        """Layers of different cost: balanced splits, per-stage simulation (see the module docstring)."""
        return self.profile is not None and not self.profile.uniform

    def costs(self, layout: Layout) -> LayoutCosts:
        return LayoutCosts(self.model, layout, self.seq_len, self.micro_batch_size, self.gpus_per_node,
                           self.hardware, self.profile)


# ---- enumeration ------------------------------------------------------------------------------
def _short_list(values) -> str:
    values = list(values)
    return ", ".join(map(str, values)) if len(values) <= 8 else ", ".join(map(str, values[:4] + ["..."] + values[-3:]))


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def layer_splits(num_layers: int, pp: int):
    """(vpp, layers per virtual stage, split name) for every vpp with a valid split."""
    if pp == 1:
        yield 1, (num_layers,), "even"
        return
    for vpp in range(1, (num_layers + 2) // pp + 1):
        stages, seen = pp * vpp, set()
        for name, extra, drop_first, drop_last in (("even", 0, 0, 0), ("fewer-first-last", 2, 1, 1),
                                                   ("fewer-first", 1, 1, 0), ("fewer-last", 1, 0, 1)):
            if (num_layers + extra) % stages:
                continue
            per = (num_layers + extra) // stages
            try:  # rejects splits that leave a stage with a negative count or do not add up
                layers = tuple(layers_per_virtual_stage(
                    num_layers, pp, vpp, first_stage=per - 1 if drop_first else None,
                    last_stage=per - 1 if drop_last else None))
            except ValueError:
                continue
            if layers not in seen:
                seen.add(layers)
                yield vpp, layers, name


def group_sizes(pp: int, vpp: int, m: int) -> list[int]:
    if pp == 1 or vpp == 1:
        return [m]
    sizes = [min(pp, m)] + ([2 * pp] if 2 * pp <= m else []) + ([m] if pp < m <= 4 * pp else [])
    return sorted(set(sizes))


def enumerate_layouts(req: PlanRequest):
    model, n = req.model, req.gpus
    for tp in divisors(n):
        if req.tp and tp != req.tp:
            continue
        if any(x % tp for x in (model.num_attention_heads, model.num_kv_heads, model.ffn_hidden_size)):
            continue
        for cp in divisors(n // tp):
            if req.cp and cp != req.cp:
                continue
            if cp > 1 and (not req.cp_allowed or req.seq_len % (2 * cp) or req.cross_attention):
                continue
            for pp in divisors(n // tp // cp):
                if req.pp and pp != req.pp:
                    continue
                dp = n // (tp * cp * pp)
                if pp > model.num_layers + 2 or req.sequences % (dp * req.micro_batch_size):
                    continue
                m = req.sequences // (dp * req.micro_batch_size)
                splits = list(layer_splits(model.num_layers, pp))
                for vpp, layers, split in splits:
                    for k in group_sizes(pp, vpp, m):
                        yield Layout(tp, cp, pp, dp, vpp, k, m, layers, split)
                if req.heterogeneous and pp > 1:
                    yield from _balanced_layouts(req, (tp, cp, pp, dp), m, splits)


def _balanced_layouts(req: PlanRequest, sizes, m: int, splits):
    """StageSplitter's split for each (vpp, k) the count splits have, unless it is one of them."""
    tp, cp, pp, dp = sizes
    for vpp in sorted({vpp for vpp, _, _ in splits if pp * vpp <= req.model.num_layers}):
        known = {layers for v, layers, _ in splits if v == vpp}
        for k in group_sizes(pp, vpp, m):
            counts = balanced_counts(req.profile, pp, vpp, m, k)
            if counts not in known:
                yield Layout(tp, cp, pp, dp, vpp, k, m, counts, "balanced")


# ---- evaluation -------------------------------------------------------------------------------
@dataclass
class Evaluation:
    request: PlanRequest
    layout: Layout
    costs: LayoutCosts
    zero_stage: int
    memory_per_rank: list[dict]  # per PP rank: weights, gradients, optimizer, activations (bytes)
    peak_inflight: int
    bubble_ratio: float | None = None
    times: dict | None = None

    @property
    def memory_bytes(self) -> float:
        return max(sum(r.values()) for r in self.memory_per_rank)

    @property
    def worst_rank(self) -> int:
        totals = [sum(r.values()) for r in self.memory_per_rank]
        return totals.index(max(totals))

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.request.usable_bytes

    @property
    def step_seconds(self) -> float:
        return self.times["step"]

    def comm_bytes(self) -> dict[str, float]:
        """Bytes per GPU per step, per dimension, on the rank that sends the most of each."""
        per_rank = [self.costs.comm_bytes(r, self.zero_stage) for r in range(self.layout.pp)]
        return {dim: max(c[dim] for c in per_rank) for dim in ("tp", "cp", "pp", "dp")}

    def sort_key(self):
        L = self.layout
        return (round(self.step_seconds, 9), L.tp * L.cp * L.pp, L.cp, L.vpp, L.group_size, L.split)


def evaluate(req: PlanRequest, layout: Layout, zero_stage: int | None = None,
             cache: ScheduleCache | None = None, with_time: bool = True) -> Evaluation:
    """Exact memory (and, if it fits or ``zero_stage`` is given, time) of one layout.

    With ``zero_stage=None`` ZeRO-1 is taken when it fits, else ZeRO-2."""
    cache = cache or ScheduleCache()
    costs = req.costs(layout)
    L = layout
    if req.heterogeneous:  # every stage's activations differ: walk the schedule
        activations, inflight = cache.stage_peaks(L.pp, L.vpp, L.microbatches, L.group_size, costs.stage_act)
    else:
        frontier = cache.frontier(L.pp, L.vpp, L.microbatches, L.group_size)
        activations = [costs.activation_bytes(r, frontier[r]) for r in range(L.pp)]
        inflight = max(sum(point) for rank in frontier for point in rank)
    for stage in ((zero_stage,) if zero_stage else (1, 2)):
        memory = [dict(costs.static_bytes(r, stage), activations=activations[r]) for r in range(L.pp)]
        ev = Evaluation(req, layout, costs, stage, memory, inflight)
        if ev.fits:
            break
    if with_time and (ev.fits or zero_stage):
        if req.heterogeneous:
            ev.bubble_ratio = staged_bubble(costs, cache)
        else:
            ev.bubble_ratio = cache.bubble(L.pp, L.vpp, L.microbatches, L.group_size,
                                           costs.mean_bwd / costs.mean_fwd, costs.p2p_s / costs.mean_fwd)
        ev.times = costs.step_seconds(ev.bubble_ratio, ev.zero_stage)
    return ev


def staged_bubble(costs: LayoutCosts, cache: ScheduleCache) -> float:
    """The busiest rank's idle / busy in the schedule simulated with each stage's own times."""
    L = costs.layout
    first = next((s for s, b in enumerate(costs.stage_bwd) if b > 0), costs.num_stages)
    makespan = cache.staged_makespan(L.pp, L.vpp, L.microbatches, L.group_size,
                                     list(zip(costs.stage_fwd, costs.stage_bwd)), costs.p2p_s, first)
    return max(0.0, makespan / max(costs.rank_busy) - 1.0)


def memory_lower_bound(costs: LayoutCosts) -> float:
    """Worst rank's smaller static memory (ZeRO-1 or ZeRO-2) plus its activations at the end of warm-up."""
    L, worst = costs.layout, 0.0
    for r in range(L.pp):
        static = min(sum(costs.static_bytes(r, stage).values()) for stage in (1, 2))
        inflight = warmup_inflight(L.pp, L.vpp, L.microbatches, L.group_size, r)
        worst = max(worst, static + costs.activation_bytes(r, [inflight]))
    return worst


def bubble_lower_bound(layout: Layout, heterogeneous: bool = False) -> float:
    """(p-1)/(m v) for equal stages; with unequal stages only the busiest rank's busy time bounds the step."""
    return 0.0 if heterogeneous else (layout.pp - 1) / (layout.microbatches * layout.vpp)


class NoPlanFits(ValueError):
    pass


LIST_WITHIN = 1.5  # plans estimated slower than this times the best are not worth listing or simulating


def plan(req: PlanRequest, top: int | None = 5, cache: ScheduleCache | None = None,
         within: float | None = LIST_WITHIN) -> list[Evaluation]:
    """Up to ``top`` layouts that fit, best first, no slower than ``within`` x the best.

    ``top=None, within=None`` returns every layout that fits (exhaustive: for small cases). A request
    with pinned sizes that leaves nothing raises NoPlanFits naming the closest feasible layouts."""
    cache = cache or ScheduleCache()
    layouts = list(enumerate_layouts(req))
    if not layouts and not req.cp_allowed:  # CP may be the only way to use every GPU
        return plan(replace(req, cp_policy="memory"), top, cache, within)
    if not layouts:
        if req.pinned:
            raise NoPlanFits(_pinned_message(req, "no layout with these sizes divides the batch into whole "
                                                  "microbatches with a valid layer split", cache))
        raise NoPlanFits(
            f"no layout of --gpus={req.gpus} divides the global batch of {req.sequences} sequences "
            f"(--micro-batch-size={req.micro_batch_size}) into whole microbatches per DP group with a valid "
            f"layer split of {req.model.num_layers} layers; change --gpus or --global-batch-tokens")
    queue, counter, candidates = [], itertools.count(), []
    for layout in layouts:
        costs = req.costs(layout)
        lower = memory_lower_bound(costs)
        candidates.append((lower, next(counter), layout))
        if lower <= req.usable_bytes:
            bound = costs.step_seconds(bubble_lower_bound(layout, req.heterogeneous), 1)["step"]
            heapq.heappush(queue, (bound, next(counter), layout, None))
    results = []
    while queue and (top is None or len(results) < top):
        bound, _, layout, ev = heapq.heappop(queue)
        if results and within is not None and bound > within * results[0].step_seconds:
            break
        if ev is not None:
            results.append(ev)
            continue
        ev = evaluate(req, layout, cache=cache)
        if ev.fits:
            heapq.heappush(queue, (ev.step_seconds, next(counter), layout, ev))
    if not results:
        if not req.cp_allowed:  # the paper's CP rule left nothing that fits: let CP cut activations
            return plan(replace(req, cp_policy="memory"), top, cache, within)
        message = _nothing_fits_message(req, candidates, cache)
        raise NoPlanFits(_pinned_message(req, message, cache) if req.pinned else message)
    return sorted(results, key=Evaluation.sort_key)


def describe(ev: "Evaluation | Layout", zero_stage: int | None = None) -> str:
    L = ev.layout if isinstance(ev, Evaluation) else ev
    zero = ev.zero_stage if isinstance(ev, Evaluation) else zero_stage
    return (f"tp={L.tp} cp={L.cp} pp={L.pp} dp={L.dp} vpp={L.vpp} k={L.group_size}"
            + (f" ZeRO-{zero}" if zero else ""))


def _pinned_message(req: PlanRequest, why: str, cache: ScheduleCache) -> str:
    pins = " ".join(f"--{name} {v}" for name, v in (("tp", req.tp), ("pp", req.pp), ("cp", req.cp)) if v)
    try:
        free = plan(req.unpinned(), top=3, cache=cache)
    except NoPlanFits as exc:
        return f"{pins}: {why}; without the pinned sizes: {exc}"
    closest = "; ".join(f"{describe(ev)} ({ev.memory_bytes / GIB:.1f} GiB, {ev.step_seconds:.2f} s)" for ev in free)
    return f"{pins}: {why}. Closest feasible layouts without the pinned sizes: {closest}"


def _nothing_fits_message(req: PlanRequest, candidates, cache: ScheduleCache, keep: int = 3) -> str:
    closest = []  # the ``keep`` layouts that need the least memory, exact
    for lower, _, layout in sorted(candidates, key=lambda c: c[:2]):
        if len(closest) == keep and lower >= closest[-1].memory_bytes:
            break
        best = min((evaluate(req, layout, zero_stage=stage, cache=cache, with_time=False) for stage in (1, 2)),
                   key=lambda e: e.memory_bytes)
        closest = sorted(closest + [best], key=lambda e: e.memory_bytes)[:keep]
    usable, hw = req.usable_bytes / GIB, req.hardware
    need = closest[0].memory_bytes / GIB
    memory_needed = (need + hw.reserved_gb) / hw.usable_fraction
    listed = "; ".join(f"{describe(ev)} needs {ev.memory_bytes / GIB:.1f} GiB on PP rank {ev.worst_rank}"
                       for ev in closest)
    return (f"no layout fits in --gpu-memory-gb={req.hbm_gb:g} ({usable:.1f} GiB usable after "
            f"{hw.headroom_text()}); the closest is {listed}: {need - usable:.1f} GiB over. "
            f"--gpu-memory-gb >= {memory_needed:.1f} would fit the first; or use more GPUs, a shorter --seq-len "
            f"or a smaller --micro-batch-size")
