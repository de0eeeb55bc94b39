"""Per-GPU memory, communication and time of one layout; the schedule supplies in-flight counts.

Units: memory in GiB (2**30 bytes, as torch reports it; --gpu-memory-gb is read the same way), communication
volumes in GB (1e9 bytes) sent per GPU per step, bandwidths in GB/s. Machine figures and assumptions:
machine.py (the report prints them).

Memory (bytes per GPU, per pipeline rank):
    P = parameters of the rank's virtual stages / TP (input embedding on stage 0, output layer and
        final norm on the last stage); g = DP x CP (CP ranks hold the same weights: CP extends DP).
    weights      2 P            bf16 copy used by forward/backward (ZeRO-1/2 never shard it)
    gradients    ZeRO-1: 4 P    fp32 accumulation buffer kept across all microbatches, reduce-scattered
                                in place once per step
                 ZeRO-2: 4 min(P, 2 C) + 4 P / g
                                fp32 buffers of at most two chunks (C = largest chunk's params): the one
                                whose round is accumulating and the previous one being reduce-scattered,
                                freed after its round; plus the fp32 shard the rounds accumulate into
    optimizer    12 P / g       fp32 master weights and Adam's two moments, sharded over DP x CP
    activations  sum over in-flight (microbatch, chunk) forwards of that chunk's activation bytes,
                 at the schedule's worst moment (see search.py), with per microbatch per GPU:
                   per layer  2 B n (6h + 2kv + 3f) / TP + 4 B n heads / TP
                              n = micro_batch * seq / CP tokens; bf16 tensors saved for backward by
                              Megatron's default layer (no recomputation, flash attention, sequence
                              parallel): the two norm inputs and outputs (4h), Q, K, V (h + 2kv), the
                              attention output (h), gate and up (2f), the SwiGLU output (f); fp32
                              softmax statistics per head. At 131K with CP 16 this is the same n as 8K
                              with CP 1: CP shards the sequence as the paper says.
                   CP > 1, --cp-kv keep only: + the all-gathered K and V of the whole sequence for the
                              local heads, kept for backward: 2 B * 2 * micro_batch * seq * (CP-1)/CP * kv / TP
                   last stage + final-norm input and output (2 B n 2h / TP) and the logits, bf16 and
                              fp32 for the loss (6 B n V / TP)
                   stage 0    nothing: the embedding's backward needs only the token ids
    Headroom (``Hardware``): the usable fraction of memory minus a fixed reservation.

Time of one step (seconds; only comparisons between layouts are meant to be trusted):
    A virtual stage's forward = its FLOPs / (TP x CP x peak x MFU) + its TP collectives (2 all-gathers
    and 2 reduce-scatters per layer with sequence parallelism, fully exposed, paper 5.2) + its CP K/V
    all-gather (fully exposed); backward = twice the FLOPs + the mirrored TP collectives + CP's dK/dV
    reduce-scatter (and, with --cp-kv regather, a second K/V all-gather). A ring collective over g ranks
    costs (g-1) x latency + (g-1)/g x bytes / bandwidth: CP's cost grows with the sequence (bytes) and
    with CP (steps; and per-GPU compute shrinks 1/CP while the gathered K/V do not).
    step = max over PP ranks of busy time x (1 + bubble) + exposed DP time, where the bubble ratio
    comes from simulating the schedule with the mean stage times and P2P latency = message / link
    bandwidth (so P2P that k > p hides is not counted), and DP traffic (all-gather bf16 weights +
    reduce-scatter fp32 gradients; ZeRO-2 reduce-scatters once per round) overlaps compute: exposed
    is what exceeds the compute time plus the last chunk's share, which has nothing left to hide behind.
Links: a group whose ranks all sit in one node uses NVLink bandwidth, otherwise the network: TP larger
than a node (allowed, the paper's "expensive cross-host TP") runs its per-layer collectives at the
network rate; CP is next outward, so TP x CP > GPUs per node puts CP on the network.

Layers that differ (``profile``, a layer_profile.LayerProfile from --kinds / --frozen / --image-tokens): each
stage sums its own layers' FLOPs and saved activations (layer_costs.py: a cross-attention layer also reads the
image tokens; a frozen layer's backward is one forward, none in a frozen prefix, which also keeps no
activations), P in the gradient, optimizer and DP terms counts only trainable parameters (frozen ones keep
their bf16 weights), and a layer without a backward has no backward TP / CP collectives. A cross-attention
layer's TP collectives are those of the text tokens (image tokens are replicated over TP); CP > 1 is not
planned for cross-attention models (search.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from l3plugin.schedule.layers import layer_ranges

from .models import ModelSpec

from .machine import GIB, Hardware  # noqa: F401 (GIB re-exported for report.py and tests)

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Layout:
    """Sizes, schedule knobs and layer split of one candidate (ZeRO stage chosen separately)."""

    tp: int
    cp: int
    pp: int
    dp: int
    vpp: int
    group_size: int  # k
    microbatches: int  # m per DP group
    layers: tuple[int, ...]  # per virtual stage s = chunk * pp + rank
    split: str  # "even", "fewer-first-last", "fewer-first" or "fewer-last"

    @property
    def schedule_name(self) -> str:
        if self.pp == 1:
            return "no-pipeline"
        if self.group_size < self.pp:
            return "all-forward-all-backward"
        return "interleaved-1f1b" if self.vpp > 1 else "1f1b"

    def stages_of(self, rank: int) -> list[int]:
        return [chunk * self.pp + rank for chunk in range(self.vpp)]

    def layers_per_rank(self) -> list[int]:
        return [sum(self.layers[s] for s in self.stages_of(r)) for r in range(self.pp)]


def chunk_class(chunk: int, vpp: int) -> int:
    """0: the rank's first chunk, 2: its last chunk (vpp > 1), 1: any other. Only stage 0 (rank 0,
    chunk 0) and the last stage (rank pp-1, chunk vpp-1) differ from the rest, so these three
    classes describe every rank's activation weights."""
    if chunk == 0:
        return 0
    return 2 if chunk == vpp - 1 else 1


class LayoutCosts:
    """Everything about a layout that does not need the schedule."""

    def __init__(self, model: ModelSpec, layout: Layout, seq_len: int, micro_batch_size: int,
                 gpus_per_node: int, hw: Hardware, profile=None):
        self.model, self.layout, self.hw, self.profile = model, layout, hw, profile
        L, m, h = layout, model, model.hidden_size
        self.num_stages = L.pp * L.vpp
        last = self.num_stages - 1
        tokens = micro_batch_size * seq_len / L.cp  # per GPU per microbatch
        # --- activations per microbatch per GPU
        self.gathered_kv = BF16 * 2 * micro_batch_size * seq_len * (L.cp - 1) / L.cp * m.kv_dim / L.tp
        # what the core attention saves: Q, K, V, its output, fp32 softmax statistics (+ the others' K/V)
        self.attention_saved = (BF16 * tokens * (2 * h + 2 * m.kv_dim) / L.tp + FP32 * tokens * m.num_attention_heads
                                / L.tp + (self.gathered_kv if L.cp > 1 and hw.cp_kv == "keep" else 0.0))
        self.act_layer = BF16 * tokens * (4 * h + 3 * m.ffn_hidden_size) / L.tp + self.attention_saved
        self.act_head = (BF16 * tokens * 2 * h + (BF16 + FP32) * tokens * m.vocab_size) / L.tp
        self.stage_act = [L.layers[s] * self.act_layer + (self.act_head if s == last else 0.0)
                          for s in range(self.num_stages)]
        # --- parameters per GPU
        self.stage_params = [(L.layers[s] * m.layer_params + (m.embedding_params if s == 0 else 0)
                              + (m.output_params if s == last else 0)) / L.tp
                             for s in range(self.num_stages)]
        self.stage_trainable = self.stage_params  # parameters with fp32 gradients and optimizer state
        if profile is not None:
            self._per_layer_memory(profile, tokens)
        self.rank_params = [sum(self.stage_params[s] for s in L.stages_of(r)) for r in range(L.pp)]
        self.rank_trainable = [sum(self.stage_trainable[s] for s in L.stages_of(r)) for r in range(L.pp)]
        self.grad_group = L.dp * L.cp
        # --- links: a group inside one node uses NVLink, otherwise the network (see the docstring)
        intra, inter = hw.intra_node_gbps * 1e9, hw.inter_node_gbps * 1e9
        self.tp_bw = intra if L.tp <= gpus_per_node else inter
        self.cp_bw = intra if L.tp * L.cp <= gpus_per_node else inter
        self.pp_bw = intra if L.tp * L.cp * L.pp <= gpus_per_node else inter
        dp_span = L.tp * L.cp * (L.pp * L.dp if L.dp > 1 else 1)
        self.dp_bw = intra if dp_span <= gpus_per_node else inter
        # --- communication per microbatch (bytes per GPU, ring collectives move (g-1)/g)
        self.tp_bytes_per_collective = (L.tp - 1) / L.tp * tokens * h * BF16
        self.cp_bytes_per_collective = self.gathered_kv  # all-gather of K/V, or reduce-scatter of dK/dV
        # CP collectives per layer: forward all-gather; backward reduce-scatter (+ all-gather again)
        self.cp_fwd_collectives, self.cp_bwd_collectives = (1, 2 if hw.cp_kv == "regather" else 1)
        self.p2p_bytes = tokens * h / L.tp * BF16  # sequence-parallel activation (or its gradient)
        self.tp_collective_s = ring_seconds(L.tp, self.tp_bytes_per_collective, self.tp_bw, hw.latency_s)
        self.cp_collective_s = ring_seconds(L.cp, self.cp_bytes_per_collective, self.cp_bw, hw.latency_s)
        self.p2p_s = (hw.latency_s + self.p2p_bytes / self.pp_bw) if L.pp > 1 else 0.0
        # --- per-microbatch stage times: compute, exposed TP and CP collectives (forward, backward)
        rate = hw.peak_tflops * 1e12 * hw.mfu * L.tp * L.cp
        layer_fwd = m.layer_forward_flops(seq_len) * micro_batch_size / rate
        head_fwd = m.output_forward_flops(seq_len) * micro_batch_size / rate
        self.stage_compute, self.stage_tp, self.stage_cp = [], [], []  # forward + backward, per microbatch
        for s in range(self.num_stages):
            n = L.layers[s]
            self.stage_compute.append(3 * (n * layer_fwd + (head_fwd if s == last else 0.0)))
            self.stage_tp.append(2 * (4 * n + (s == last)) * self.tp_collective_s)
            self.stage_cp.append(n * (self.cp_fwd_collectives + self.cp_bwd_collectives) * self.cp_collective_s)
        self.stage_fwd = [self.stage_compute[s] / 3 + self.stage_tp[s] / 2
                          + L.layers[s] * self.cp_fwd_collectives * self.cp_collective_s
                          for s in range(self.num_stages)]
        self.stage_bwd = [self.stage_compute[s] + self.stage_tp[s] + self.stage_cp[s] - self.stage_fwd[s]
                          for s in range(self.num_stages)]
        # TP and CP collectives per microbatch of each stage (both directions)
        self.stage_tp_count = [2 * (4 * L.layers[s] + (s == last)) for s in range(self.num_stages)]
        self.stage_cp_count = [L.layers[s] * (self.cp_fwd_collectives + self.cp_bwd_collectives)
                               for s in range(self.num_stages)]
        if profile is not None:
            self._per_layer_time(profile, rate)

        def per_rank(values):
            return [L.microbatches * sum(values[s] for s in L.stages_of(r)) for r in range(L.pp)]

        self.rank_compute, self.rank_tp, self.rank_cp = (per_rank(self.stage_compute), per_rank(self.stage_tp),
                                                         per_rank(self.stage_cp))
        self.rank_busy = [c + t + p for c, t, p in zip(self.rank_compute, self.rank_tp, self.rank_cp)]
        self.mean_fwd = sum(self.stage_fwd) / self.num_stages
        self.mean_bwd = sum(self.stage_bwd) / self.num_stages

    # ---- layers that differ (--kinds, --frozen: a LayerProfile) ----------------------------------
    def _per_layer_memory(self, profile, tokens: float) -> None:
        """Activations and parameters summed over each stage's own layers: a layer keeps what layer_costs
        says (nothing in a frozen prefix), frozen parameters keep only their bf16 weights."""
        L, m, last = self.layout, self.model, self.num_stages - 1
        shard = L.tp * L.cp
        gathered = self.gathered_kv if L.cp > 1 and self.hw.cp_kv == "keep" else 0.0
        trained = [profile.trainable(kind) for kind in profile.kinds]
        self.stage_act, self.stage_params, self.stage_trainable = [], [], []
        for s, ids in enumerate(layer_ranges(self.layout.layers)):
            saved = [profile.layers[i].activation for i in ids]
            self.stage_act.append(sum(saved) / shard + sum(a > 0 for a in saved) * gathered
                                  + (profile.head.activation / shard if s == last else 0.0))
            ends = [(m.embedding_params, profile.trainable("E"))] * (s == 0) \
                + [(m.output_params, profile.trainable("H"))] * (s == last)
            self.stage_params.append((len(ids) * m.layer_params + sum(n for n, _ in ends)) / L.tp)
            self.stage_trainable.append((sum(trained[i] for i in ids) * m.layer_params
                                         + sum(n for n, t in ends if t)) / L.tp)

    def _per_layer_time(self, profile, rate: float) -> None:
        """Stage forward / backward from the layers' FLOPs; a layer without a backward (frozen, nothing
        trainable before it) runs none of its backward TP / CP collectives either."""
        last = self.num_stages - 1
        tp_s, cp_s = self.tp_collective_s, self.cp_collective_s
        cp_f, cp_b = self.cp_fwd_collectives, self.cp_bwd_collectives
        self.stage_fwd, self.stage_bwd, self.stage_tp_count, self.stage_cp_count = [], [], [], []
        self.stage_compute, self.stage_tp, self.stage_cp = [], [], []
        for s, ids in enumerate(layer_ranges(self.layout.layers)):
            parts = [profile.layers[i] for i in ids] + [profile.embedding] * (s == 0) + [profile.head] * (s == last)
            flops_f, flops_b = sum(c.forward for c in parts), sum(c.backward for c in parts)
            n_b = sum(profile.layers[i].backward > 0 for i in ids)
            head_b = s == last and profile.head.backward > 0
            tp_f, tp_b = 4 * len(ids) + (s == last), 4 * n_b + head_b
            self.stage_tp_count.append(tp_f + tp_b)
            self.stage_cp_count.append(len(ids) * cp_f + n_b * cp_b)
            self.stage_compute.append((flops_f + flops_b) / rate)
            self.stage_tp.append((tp_f + tp_b) * tp_s)
            self.stage_cp.append(self.stage_cp_count[-1] * cp_s)
            self.stage_fwd.append(flops_f / rate + tp_f * tp_s + len(ids) * cp_f * cp_s)
            self.stage_bwd.append(flops_b / rate + tp_b * tp_s + n_b * cp_b * cp_s)

    # ---- memory ---------------------------------------------------------------------------------
    def class_weights(self, rank: int) -> tuple[float, float, float]:
        """Activation bytes per in-flight microbatch of the rank's chunk classes (see chunk_class). With
        layers that differ the middle chunks differ too: the smallest of them (a lower bound)."""
        stages = self.layout.stages_of(rank)
        middle = min(self.stage_act[s] for s in stages[1:-1]) if len(stages) > 2 else 0.0
        return (self.stage_act[stages[0]], middle, self.stage_act[stages[-1]])

    def activation_bytes(self, rank: int, frontier) -> float:
        """Worst in-flight activations of a rank; ``frontier`` lists (class 0, 1, 2) in-flight counts."""
        w = self.class_weights(rank)
        return max(n0 * w[0] + n1 * w[1] + n2 * w[2] for n0, n1, n2 in frontier)

    def static_bytes(self, rank: int, zero_stage: int) -> dict[str, float]:
        """bf16 weights of every parameter; fp32 gradients and optimizer state of the trainable ones."""
        P, g = self.rank_trainable[rank], self.grad_group
        if zero_stage == 1:
            grads = FP32 * P
        else:
            largest_chunk = max(self.stage_trainable[s] for s in self.layout.stages_of(rank))
            grads = FP32 * min(P, 2 * largest_chunk) + FP32 * P / g
        return {"weights": BF16 * self.rank_params[rank], "gradients": grads, "optimizer": 3 * FP32 * P / g}

    # ---- communication --------------------------------------------------------------------------
    def reduce_scatters(self, zero_stage: int) -> int:
        """Gradient reduce-scatters per chunk per step: once (ZeRO-1) or once per round (ZeRO-2)."""
        L = self.layout
        return 1 if zero_stage == 1 else math.ceil(L.microbatches / L.group_size)

    def comm_bytes(self, rank: int, zero_stage: int) -> dict[str, float]:
        """Bytes each GPU of PP rank ``rank`` sends per step, per dimension."""
        L, last = self.layout, self.num_stages - 1
        tp = L.microbatches * sum(self.stage_tp_count[s] for s in L.stages_of(rank)) * self.tp_bytes_per_collective
        cp = L.microbatches * sum(self.stage_cp_count[s] for s in L.stages_of(rank)) * self.cp_bytes_per_collective
        sends = sum((s != last) + (s != 0) for s in L.stages_of(rank)) if L.pp > 1 else 0
        pp = L.microbatches * sends * self.p2p_bytes
        g = self.grad_group
        dp = (g - 1) / g * self.rank_trainable[rank] * (FP32 * self.reduce_scatters(zero_stage) + BF16)
        return {"tp": tp, "cp": cp, "pp": pp, "dp": dp}

    def dp_seconds(self, rank: int, zero_stage: int) -> tuple[float, float]:
        """(total DP time per step, the last chunk's share that cannot overlap) for a rank."""
        g = self.grad_group
        if g == 1:
            return 0.0, 0.0
        P = self.rank_trainable[rank]  # frozen parameters are neither reduced nor re-gathered
        if not P:
            return 0.0, 0.0
        gather = ring_seconds(g, (g - 1) / g * P * BF16, self.dp_bw, self.hw.latency_s)
        scatter = ring_seconds(g, (g - 1) / g * P * FP32, self.dp_bw, self.hw.latency_s)
        total = gather + self.reduce_scatters(zero_stage) * scatter
        share = max(self.stage_trainable[s] for s in self.layout.stages_of(rank)) / P
        return total, (gather + scatter) * share

    def step_seconds(self, bubble_ratio: float, zero_stage: int) -> dict[str, float]:
        """Step time and its terms on the busiest PP rank (what the ranking table shows)."""
        busiest = max(range(self.layout.pp), key=self.rank_busy.__getitem__)
        busy = self.rank_busy[busiest]
        pipeline = busy * (1.0 + bubble_ratio)
        dp_exposed = 0.0
        for rank in range(self.layout.pp):
            total, tail = self.dp_seconds(rank, zero_stage)
            dp_exposed = max(dp_exposed, max(0.0, total - pipeline) + tail)
        return {"step": pipeline + dp_exposed, "pipeline": pipeline, "dp_exposed": dp_exposed,
                "busiest_rank_busy": busy, "compute": self.rank_compute[busiest],
                "tp_exposed": self.rank_tp[busiest], "cp_exposed": self.rank_cp[busiest],
                "bubble": busy * bubble_ratio}


def ring_seconds(group: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """A ring collective over ``group`` ranks moving ``nbytes`` per GPU: group-1 steps."""
    return (group - 1) * latency + nbytes / bandwidth if group > 1 else 0.0
