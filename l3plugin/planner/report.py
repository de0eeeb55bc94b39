"""What `l3plugin plan` prints: the free search's ranking, the staged plan, the reasons, the trade-off, the
assumptions (text or JSON), or the Megatron-LM arguments / DeepSpeed config of the answer (--emit).

Free search only: the ranking, why #1, and at long context where the paper's staged layout (the rule of
staged.py applied to the short-context plan at --base-seq-len) ranks. With --keep-tp-pp / --from the
staged plan is the answer, followed by the free ranking and the same comparison.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace
from fractions import Fraction

from .balance_cli import SPEC_HINT
from .costs import GIB
from .layer_report import layers_text, stage_lines, stage_lists
from .machine import assumptions
from .search import (Evaluation, NoPlanFits, PlanRequest, ScheduleCache, bubble_lower_bound, enumerate_layouts,
                     evaluate, memory_lower_bound, plan)
from .staged import StagedPlan, base_from_search, load_base, rank_in_free_search, staged_plan, term_differences


def dumps(obj) -> str:
    """Indented JSON with lists of numbers kept on one line."""
    text = json.dumps(obj, indent=2)
    return re.sub(r"\[\s+([-0-9.,\s]+?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)


def model_tflops_per_gpu(ev: Evaluation) -> float:
    """Model FLOPs per step (forward + backward = 3 x forward, no recomputation) / step time / GPUs:
    comparable to the paper's measured 400 (8K) and 380 (131K) TFLOPs per GPU."""
    req, m = ev.request, ev.request.model
    per_sequence = 3 * (m.num_layers * m.layer_forward_flops(req.seq_len) + m.output_forward_flops(req.seq_len))
    if req.profile is not None:  # what the layers compute (a frozen layer's backward is one forward, or none)
        per_sequence = req.profile.flops() / req.micro_batch_size
    return req.sequences * per_sequence / ev.step_seconds / req.gpus / 1e12


def exposed_comm_seconds(ev: Evaluation) -> float:
    t = ev.times
    return t["tp_exposed"] + t["cp_exposed"] + t["dp_exposed"]


def to_record(ev: Evaluation, rank: int | None, best: Evaluation | None = None) -> dict:
    L, req = ev.layout, ev.request
    worst = ev.memory_per_rank[ev.worst_rank]
    comm = ev.comm_bytes()
    best = best or ev
    return {
        "rank": rank,
        "tp": L.tp, "cp": L.cp, "pp": L.pp, "dp": L.dp, "vpp": L.vpp,
        "group_size": L.group_size,
        "microbatches_per_dp_group": L.microbatches,
        "micro_batch_size": req.micro_batch_size,
        "zero_stage": ev.zero_stage,
        "schedule": L.schedule_name,
        "split": L.split,
        "layers_per_stage": list(L.layers),
        "layers_per_rank": L.layers_per_rank(),
        "memory_gb": round(ev.memory_bytes / GIB, 3),
        "memory_breakdown_gb": {k: round(v / GIB, 3) for k, v in worst.items()},
        "memory_gb_per_pp_rank": [round(sum(r.values()) / GIB, 3) for r in ev.memory_per_rank],
        "worst_memory_pp_rank": ev.worst_rank,
        "usable_memory_gb": round(req.usable_bytes / GIB, 3),
        "peak_inflight": ev.peak_inflight,
        "bubble_ratio": round(ev.bubble_ratio, 5),
        "step_time_s": round(ev.step_seconds, 5),
        "margin_vs_best": round(ev.step_seconds / best.step_seconds - 1, 5),
        "step_terms_s": {k: round(ev.times[k], 5) for k in STEP_TERMS},
        "exposed_comm_s": round(exposed_comm_seconds(ev), 5),
        "exposed_dp_time_s": round(ev.times["dp_exposed"], 5),
        "model_tflops_per_gpu": round(model_tflops_per_gpu(ev), 1),
        "comm_gb_per_step": {k: round(v / 1e9, 3) for k, v in comm.items()},
        "cp_policy": req.cp_policy,
        **({"stages": stage_lists(L)} if req.kinds is not None else {}),
    }


STEP_TERMS = ("compute", "bubble", "tp_exposed", "cp_exposed", "dp_exposed")


def request_record(req: PlanRequest) -> dict:
    return {"model": req.model.name, "gpus": req.gpus, "seq_len": req.seq_len,
            "global_batch_tokens": req.global_batch_tokens, "sequences": req.sequences,
            "micro_batch_size": req.micro_batch_size, "gpus_per_node": req.gpus_per_node,
            "gpu_memory_gb": req.hbm_gb, "usable_memory_gb": round(req.usable_bytes / GIB, 3),
            "cp_policy": req.cp_policy, "pinned": {"tp": req.tp, "pp": req.pp, "cp": req.cp},
            **({"kinds": req.kinds, "frozen": req.frozen, "image_tokens": req.image_tokens}
               if req.kinds is not None else {})}


def format_table(req: PlanRequest, results: list[Evaluation], best: Evaluation | None = None,
                 labels: list[str] | None = None) -> str:
    """One row per plan: sizes, schedule knobs, memory per GPU, bubble, step time, margin to ``best``
    (default the first row), model TFLOPs per GPU and the exposed TP / CP / DP communication (s)."""
    best = best or results[0]
    head = (f"{'#':>2} {'TP':>3} {'CP':>3} {'PP':>4} {'DP':>5} {'VPP':>3} {'k':>4} {'m':>5} {'ZeRO':>4} "
            f"{'split':<16} {'mem GiB':>7} {'bubble':>6} {'step s':>7} {'vs #1':>7} {'TFLOPs':>6} "
            f"{'TP exp':>6} {'CP exp':>6} {'DP exp':>6}")
    lines = [head]
    for i, ev in enumerate(results, 1):
        L, t = ev.layout, ev.times
        label = labels[i - 1] if labels else str(i)
        lines.append(
            f"{label:>2} {L.tp:>3} {L.cp:>3} {L.pp:>4} {L.dp:>5} {L.vpp:>3} {L.group_size:>4} {L.microbatches:>5} "
            f"{ev.zero_stage:>4} {L.split:<16} {ev.memory_bytes / GIB:>7.1f} {ev.bubble_ratio:>6.1%} "
            f"{ev.step_seconds:>7.2f} {ev.step_seconds / best.step_seconds - 1:>+7.1%} "
            f"{model_tflops_per_gpu(ev):>6.0f} {t['tp_exposed']:>6.2f} {t['cp_exposed']:>6.2f} "
            f"{t['dp_exposed']:>6.2f}")
    return "\n".join(lines)


TABLE_NOTE = ("bubble = simulated idle / busy time; step s = busy x (1 + bubble) + exposed DP; vs #1 = step time "
              "margin to the best; TFLOPs = model FLOPs per GPU per second; TP/CP/DP exp = exposed "
              "communication per step (s) on the busiest PP rank")


def header(req: PlanRequest) -> str:
    return (f"{req.model.name} ({req.model.total_params / 1e9:.1f}B parameters, {req.model.num_layers} layers) "
            f"on {req.gpus} GPUs ({req.gpus_per_node} per node, {req.hbm_gb:g} GiB each, "
            f"{req.usable_bytes / GIB:.1f} GiB usable after {req.hardware.headroom_text()}); "
            f"seq {req.seq_len}, {req.global_batch_tokens} tokens = {req.sequences} sequences per step"
            + (f"; {layers_text(req)}" if req.kinds is not None else ""))


def trade_off(ev: Evaluation, best: Evaluation, rank: int, what: str) -> str:
    """Where ``ev`` ranks in the free search and the terms that make the difference."""
    if rank == 1:
        return f"{what} {_short(ev)} is also the free search's #1."
    d = term_differences(ev, best)
    terms = ", ".join(f"{name} {d[key]:+.2f} s" for key, name in
                      (("bubble", "bubble"), ("cp_exposed", "CP exposed"), ("tp_exposed", "TP exposed"),
                       ("dp_exposed", "DP exposed"), ("compute", "compute")) if abs(d[key]) >= 0.005)
    return (f"{what} {_short(ev)} ranks #{rank} in the free search, {d['step']:+.2f} s "
            f"({ev.step_seconds / best.step_seconds - 1:+.1%}) per step vs #1 {_short(best)}. Terms that differ: "
            f"{terms or 'none by 0.01 s or more'}; memory {d['memory_gb']:+.1f} GiB ({ev.memory_bytes / GIB:.1f} vs "
            f"{best.memory_bytes / GIB:.1f}). Bubble: m={ev.layout.microbatches} microbatches x VPP={ev.layout.vpp} "
            f"over PP={ev.layout.pp} vs m={best.layout.microbatches} x VPP={best.layout.vpp} over "
            f"PP={best.layout.pp}; CP: {ev.comm_bytes()['cp'] / 1e9:.1f} vs {best.comm_bytes()['cp'] / 1e9:.1f} GB "
            f"per GPU per step.")


def _best_other_split(ev: Evaluation, cache: ScheduleCache, limit: int = 6):
    """Best fitting layout with the same TP, CP, PP, DP and the other kind of split (even vs uneven)."""
    L, req = ev.layout, ev.request
    others = [o for o in enumerate_layouts(req) if (o.tp, o.cp, o.pp, o.dp) == (L.tp, L.cp, L.pp, L.dp)
              and (o.split == "even") != (L.split == "even")]
    costs = [(req.costs(o), o) for o in others]
    hopeful = sorted(((c.step_seconds(bubble_lower_bound(o), 1)["step"], i, o) for i, (c, o) in enumerate(costs)
                      if memory_lower_bound(c) <= req.usable_bytes), key=lambda t: t[:2])[:limit]
    fitting = [e for e in (evaluate(req, o, cache=cache) for _, _, o in hopeful) if e.fits]
    return min(fitting, key=lambda e: e.step_seconds, default=None), bool(others)


def reasons(ev: Evaluation, results: list[Evaluation], cache: ScheduleCache,
            cp_alternative: Evaluation | None = None, staged: StagedPlan | None = None) -> list[str]:
    """The top choice explained in plain words, with the numbers behind each decision.

    ``cp_alternative``: the best plan when CP may be used at any sequence length, if it is faster.
    ``staged``: ``ev`` is a staged plan; its rule replaces the TP / CP choice."""
    head = staged.reasons if staged else [_tp_reason(ev), _cp_reason(ev)]
    out = [*head, _batch_reason(ev), *_pipeline_reasons(ev, cache), _zero_reason(ev, cache)]
    mem = ev.memory_per_rank[ev.worst_rank]
    out.append(f"Memory: {ev.memory_bytes / GIB:.1f} GiB on PP rank {ev.worst_rank} = weights "
               f"{mem['weights'] / GIB:.1f} + gradients {mem['gradients'] / GIB:.1f} + optimizer "
               f"{mem['optimizer'] / GIB:.1f} + activations {mem['activations'] / GIB:.1f}.")
    out.append(f"Rank order [TP, CP, PP, DP], innermost to outermost: DP (ZeRO) traffic is outermost because it "
               f"overlaps compute; {ev.times['dp_exposed']:.2f} s of it stays exposed per step.")
    if cp_alternative is not None:
        A, mine, theirs = cp_alternative.layout, ev.comm_bytes(), cp_alternative.comm_bytes()
        out.append(f"Beyond the paper's rule: with CP allowed at this sequence length (--cp-policy any) the model "
                   f"estimates tp={A.tp} cp={A.cp} pp={A.pp} dp={A.dp} vpp={A.vpp} k={A.group_size} "
                   f"ZeRO-{cp_alternative.zero_stage} {1 - cp_alternative.step_seconds / ev.step_seconds:.0%} "
                   f"faster: CP shards activations like TP but, with GQA, moves only K/V "
                   f"({theirs['cp'] / 1e9:.1f} GB CP + {theirs['tp'] / 1e9:.1f} GB TP per GPU per step vs "
                   f"{mine['tp'] / 1e9:.1f} GB TP here). The paper kept CP for long context; its costs at short "
                   f"lengths (attention efficiency, CP-rank imbalance) are not modelled.")
    if len(results) > 1 and staged is None:
        nxt = results[1]
        out.append(f"Runner-up {_short(nxt)}: {nxt.step_seconds / ev.step_seconds - 1:+.1%} step time, "
                   f"{nxt.memory_bytes / GIB:.1f} GiB.")
    return out


def _short(ev: Evaluation) -> str:
    L = ev.layout
    return f"tp={L.tp} cp={L.cp} pp={L.pp} dp={L.dp} vpp={L.vpp} k={L.group_size} ZeRO-{ev.zero_stage}"


def _tp_reason(ev: Evaluation) -> str:
    L, req = ev.layout, ev.request
    if L.tp == 1:
        return "TP=1: the model fits without tensor parallelism, so no layer pays its per-layer collectives."
    tp_s = ev.times["tp_exposed"]
    if L.tp > req.gpus_per_node:
        return (f"TP={L.tp} spans {L.tp // req.gpus_per_node} nodes of {req.gpus_per_node} GPUs: its 2 all-gathers "
                f"and 2 reduce-scatters per layer in each direction run at the network's "
                f"{req.hardware.inter_node_gbps:g} GB/s ({tp_s:.2f} s exposed of the {ev.step_seconds:.2f} s step); "
                f"it still ranks first here, the cross-node penalty included.")
    return (f"TP={L.tp} stays inside one {req.gpus_per_node}-GPU node: tensor parallelism's 2 all-gathers and 2 "
            f"reduce-scatters per layer in each direction sit on the critical path (about {tp_s:.2f} s of the "
            f"{ev.step_seconds:.2f} s step), so they use NVLink ({req.hardware.intra_node_gbps:g} GB/s), not the "
            f"network ({req.hardware.inter_node_gbps:g} GB/s).")


def _batch_reason(ev: Evaluation) -> str:
    L, req = ev.layout, ev.request
    ideal = (L.pp - 1) / (L.microbatches * L.vpp)
    return (f"Batch: {req.sequences} sequences / DP={L.dp} = {req.sequences // L.dp} per DP group = "
            f"m={L.microbatches} microbatches of {req.micro_batch_size}; m {'>=' if L.microbatches >= L.pp else '<'} "
            f"PP={L.pp} (the paper keeps the batch per DP group >= p). Simulated bubble {ev.bubble_ratio:.1%} "
            f"with P2P latency, ideal (p-1)/(m v) = {ideal:.1%}.")


def _cp_reason(ev: Evaluation) -> str:
    L, req = ev.layout, ev.request
    if L.cp == 1:
        if req.long_context:
            return "CP=1: no layout with CP ranked higher."
        return ("CP=1: with TP at the node size every DP group already gets at least p sequences, so context "
                "parallelism (the paper's tool for long context) would only add K/V all-gathers.")
    if req.long_context:
        share = Fraction(req.sequences * req.max_tp, req.gpus * req.micro_batch_size)
        why = (f"even with TP={req.max_tp} and CP=1 each DP group would get only {share} x p microbatches "
               f"(sequences x TP / GPUs), fewer than the p a pipeline needs (paper 5.1)")
    elif req.cp_policy == "memory":
        why = "without CP no layout fits in memory (or splits the batch over all GPUs)"
    else:
        why = "the cost model ranks it fastest (--cp-policy any)"
    return (f"CP={L.cp} replaces DP because {why}: each sequence is cut into {2 * L.cp} chunks (rank i holds "
            f"chunks i and {2 * L.cp - 1}-i, balancing causal attention), activations per GPU shrink {L.cp}x and "
            f"its K/V collectives move {ev.comm_bytes()['cp'] / 1e9:.1f} GB per GPU per step over "
            f"{'NVLink' if L.tp * L.cp <= req.gpus_per_node else 'the network'} "
            f"({ev.times['cp_exposed']:.2f} s exposed).")


def _pipeline_reasons(ev: Evaluation, cache: ScheduleCache) -> list[str]:
    L, req = ev.layout, ev.request
    k, p, stages = L.group_size, L.pp, L.pp * L.vpp
    if p == 1:
        return ["PP=1: the model fits on one pipeline stage, so there is no bubble and no P2P."]
    per = sorted(set(L.layers[1:-1])) or sorted(set(L.layers))
    out = [f"PP={p} x VPP={L.vpp} = {stages} virtual stages of {'/'.join(map(str, per))} layer(s); rank r holds "
           f"stages r, r+{p}, ...: more virtual stages shrink the bubble, each adds P2P."]
    memory = [sum(r.values()) / GIB for r in ev.memory_per_rank]
    busy = ev.costs.rank_busy
    balance = (f"per-rank peak memory {min(memory):.1f}-{max(memory):.1f} GiB, least busy rank at "
               f"{min(busy) / max(busy):.0%} of the busiest")
    other, exists = _best_other_split(ev, cache)
    if L.split == "balanced":
        text = (f"Balanced split (StageSplitter: shortest simulated step with each layer's cost, rank 0's "
                f"activations breaking ties), layers per virtual stage {' '.join(map(str, L.layers))}; {balance}.")
    elif L.split != "even":
        text = (f"Uneven split ({L.split}): the first virtual stage holds {L.layers[0]} layer(s) plus the "
                f"embedding, the last {L.layers[-1]} plus the output layer, since rank 0 keeps the most "
                f"microbatches in flight and the output layer costs compute; {balance}.")
    else:
        text = f"Even split, {L.layers[0]} layer(s) per virtual stage; {balance}."
    kind = "even" if L.split != "even" else "uneven (one layer fewer on an end stage)"
    if other is not None:
        text += (f" Best {kind} split at PP={p}: vpp={other.layout.vpp} k={other.layout.group_size}, "
                 f"{other.memory_bytes / GIB:.1f} GiB, {other.step_seconds / ev.step_seconds - 1:+.1%} step time.")
    else:
        text += f" No {kind} split of {req.model.num_layers} layers at PP={p} " + (
            "fits in memory." if exists else "exists for any VPP.")
    out.append(text)
    if k < p:
        out.append(f"k={k} < p={p}: all-forward-all-backward, every microbatch of a round is in flight.")
        return out
    extra = (k - p) * (L.vpp - 1)
    text = (f"k={k} >= p={p}: {'interleaved ' if L.vpp > 1 else ''}1F1B"
            + (f" with (k-p)(v-1) = {extra} extra warm-up microbatches that hide P2P latency" if extra else "")
            + f"; peak {ev.peak_inflight} chunk-microbatches in flight on the worst rank")
    if ev.peak_inflight >= L.microbatches * L.vpp:
        text += (f" = all m x v = {L.microbatches * L.vpp}: the warm-up already covers every forward, so it runs "
                 f"as all-forward-all-backward")
    out.append(text + ".")
    return out


def _zero_reason(ev: Evaluation, cache: ScheduleCache) -> str:
    L, req = ev.layout, ev.request
    k, p = L.group_size, L.pp
    other = evaluate(req, L, zero_stage=3 - ev.zero_stage, cache=cache, with_time=False)
    if ev.zero_stage == 1:
        rule = ("" if p == 1 else " (paper: ZeRO-1 with 1F1B when k >= 2p"
                + ("" if k >= 2 * p else "; here it fits, so it is kept") + ")")
        return (f"ZeRO-1: fp32 gradients stay whole across microbatches and are reduce-scattered once per step"
                f"{rule}; ZeRO-2 would need {other.memory_bytes / GIB:.1f} GiB and reduce-scatter "
                f"{ev.costs.reduce_scatters(2)} time(s) per step.")
    rule = "" if p == 1 else " (paper: ZeRO-2 with all-forward-all-backward when k < 2p)"
    return (f"ZeRO-2: fp32 gradients live for one round of k microbatches and are reduce-scattered after it"
            f"{rule}; ZeRO-1 would need {other.memory_bytes / GIB:.1f} GiB of the {req.usable_bytes / GIB:.1f} "
            f"usable.")


def megatron_args(ev: Evaluation) -> str:
    L, req, model = ev.layout, ev.request, ev.request.model
    args = [("--num-layers", model.num_layers), ("--hidden-size", model.hidden_size),
            ("--ffn-hidden-size", model.ffn_hidden_size), ("--num-attention-heads", model.num_attention_heads),
            ("--group-query-attention", None), ("--num-query-groups", model.num_kv_heads),
            ("--seq-length", req.seq_len), ("--micro-batch-size", req.micro_batch_size),
            ("--global-batch-size", req.sequences), ("--tensor-model-parallel-size", L.tp)]
    if L.tp > 1:
        args.append(("--sequence-parallel", None))
    args += [("--context-parallel-size", L.cp), ("--pipeline-model-parallel-size", L.pp)]
    notes = [f"# l3plugin plan: tp={L.tp} cp={L.cp} pp={L.pp} dp={L.dp} vpp={L.vpp} k={L.group_size} "
             f"ZeRO-{ev.zero_stage} ({L.schedule_name}, {L.split} split)"]
    if L.cp > 1:  # l3plugin's CP attention, keeping for backward what the memory was planned for (--cp-kv)
        args += [("--cp-comm-type", "l3plugin_all_gather"), ("--l3plugin-cp-kv", req.hardware.cp_kv)]
        notes.append("# CP: l3plugin's all-gather attention (document masks with --reset-attention-mask); "
                     + ("only the local K/V stay for backward, gathered again there" if req.hardware.cp_kv == "regather"
                        else "the gathered K/V stay for backward")
                     + ". Launch with -m l3plugin.megatron.launch (or the pretrain_gpt.py patch)")
    if L.pp > 1:
        even = L.split == "even"
        if L.vpp > 1 and even:
            args.append(("--num-layers-per-virtual-pipeline-stage", L.layers[0]))
        elif L.vpp > 1:
            # --decoder-first/last-pipeline-num-layers count a whole PP rank, so per-virtual-stage
            # splits need Megatron-Core's layout string (virtual stage order, E = embedding, L = loss).
            args.append(("--pipeline-model-parallel-layout", layout_string(L.layers)))
            notes.append("# uneven virtual stages: the layout lists stages 0..pp*vpp-1 (t = one layer)")
        elif not even and len(set(L.layers[1:-1])) > 1:  # a balanced split: middle stages differ
            args.append(("--pipeline-model-parallel-layout", layout_string(L.layers)))
        elif not even:
            args += [("--decoder-first-pipeline-num-layers", L.layers[0]),
                     ("--decoder-last-pipeline-num-layers", L.layers[-1])]
        if L.vpp > 1:
            args.append(("--microbatch-group-size-per-virtual-pipeline-stage", L.group_size))
        args.append(("--pipeline-schedule", "flexible"))
    args += [("--bf16", None), ("--use-distributed-optimizer", None),
             ("--accumulate-allreduce-grads-in-fp32", None)]
    if ev.zero_stage == 2:
        notes.append("# ZeRO-2: reduce-scatter fp32 gradients after every round of k microbatches (l3plugin)")
    if req.cross_attention:
        notes.append(f"# cross-attention layers: 't' is any decoder layer; build each chunk's block with {SPEC_HINT} "
                     f"(layer i gets kind --kinds[i] = {req.kinds})")
    if req.frozen:
        notes.append(f"# frozen ({req.frozen}): set requires_grad=False on those parameters before building the "
                     f"optimizer (the plan gives them no gradients or optimizer state)")
    parts = [name if value is None else f"{name} {shlex.quote(str(value))}" for name, value in args]
    return "\n".join(notes + [" \\\n".join(parts)])


def layout_string(layers) -> str:
    """Megatron-Core's --pipeline-model-parallel-layout for per-virtual-stage layer counts: stages in
    virtual-stage order separated by '|', E = embedding, L = loss, t = one layer; runs of equal middle
    stages are folded as (stage|)*count, which Megatron unrolls."""
    def run(n):
        return "t" * n if n <= 2 else f"t*{n}"
    middle, folded, i = list(layers[1:-1]), [], 0
    while i < len(middle):
        j = i
        while j < len(middle) and middle[j] == middle[i]:
            j += 1
        folded.append(f"({run(middle[i])}|)*{j - i}" if j - i > 1 else run(middle[i]) + "|")
        i = j
    return "E" + run(layers[0]) + "|" + "".join(folded) + run(layers[-1]) + "L"


def deepspeed_config(ev: Evaluation) -> dict:
    """A DeepSpeed config for the plan. Its "l3plugin" block holds only options l3plugin reads (the optimizer and
    CP); the layout (TP, PP, schedule, layers per stage: DeepSpeed's and Megatron's settings, not l3plugin's) is
    recorded under "l3plugin_plan", which neither DeepSpeed nor l3plugin reads."""
    L, req = ev.layout, ev.request
    plugin = {"fp32_reduce_zero": True}
    if L.cp > 1:
        plugin["context_parallel_size"] = L.cp
    return {
        "train_batch_size": req.sequences,
        "train_micro_batch_size_per_gpu": req.micro_batch_size,
        "gradient_accumulation_steps": L.microbatches,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": ev.zero_stage, "reduce_scatter": True, "overlap_comm": True,
                              "contiguous_gradients": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        "l3plugin": plugin,
        "l3plugin_plan": {"tp": L.tp, "cp": L.cp, "pp": L.pp, "dp": L.dp, "vpp": L.vpp, "group_size": L.group_size,
                          "schedule": L.schedule_name, "layers_per_stage": list(L.layers)},
    }


# ---- `l3plugin plan`: which of the above it prints ------------------------------------------------------
def print_plan(args, req: PlanRequest) -> int:
    cache = ScheduleCache()
    staged = None
    if args.keep_tp_pp or args.from_plan:
        if req.pinned:
            raise ValueError("--keep-tp-pp / --from keep TP and PP of the short-context plan and choose CP by the "
                             "paper's rule: drop --tp / --pp / --cp")
        base = load_base(args.from_plan) if args.from_plan else base_from_search(req, args.base_seq_len, cache)
        staged = staged_plan(req, base, cache)
    results = plan(req, top=args.top, cache=cache)
    best = results[0]
    rule = staged or _paper_rule(req, args.base_seq_len, cache)
    rank = rank_in_free_search(rule.evaluation, best, cache)[0] if rule else None
    answer = staged.evaluation if staged else best

    if args.emit == "megatron":
        print(megatron_args(answer))
    elif args.emit == "deepspeed":
        print(dumps(deepspeed_config(answer)))
    elif args.json:
        print(dumps(_json(req, results, rule, rank, answer_is_staged=staged is not None)))
    else:
        _text(req, results, cache, rule, rank, staged is not None)
    return 0


def _paper_rule(req: PlanRequest, base_seq_len: int, cache: ScheduleCache):
    """At long context, the paper's staged layout, to show where it ranks (None when it does not apply)."""
    if not req.long_context or req.pinned or req.seq_len == base_seq_len:
        return None
    try:
        return staged_plan(req, base_from_search(req, base_seq_len, cache), cache)
    except ValueError:  # no short-context plan or no CP that satisfies the rule: nothing to compare
        return None


def _json(req, results, rule, rank, answer_is_staged: bool) -> dict:
    best = results[0]
    data = {"request": request_record(req), "machine": req.hardware.to_dict(),
            "assumptions": assumptions(req.hardware, req.gpus_per_node, req.hbm_gb),
            "answer": "staged" if answer_is_staged else "free",
            "plans": [to_record(ev, i, best) for i, ev in enumerate(results, 1)], "staged": None}
    if rule:
        record = to_record(rule.evaluation, None, best)
        record.update(free_search_rank=rank, kept_from=rule.base.source, rule_cp=rule.rule_cp, reasons=rule.reasons,
                      trade_off=trade_off(rule.evaluation, best, rank, "The staged layout"))
        data["staged"] = record
    return data


def _text(req, results, cache, rule, rank, answer_is_staged: bool) -> None:
    best = results[0]
    print(header(req))
    print()
    if answer_is_staged:
        ev = rule.evaluation
        L = ev.layout
        print(f"Staged plan (paper 5.1), TP/PP kept from {rule.base.source}:")
        print(format_table(req, [ev], best=best, labels=["S"]))
        print()
        print(f"Why tp={L.tp} cp={L.cp} pp={L.pp} dp={L.dp}, vpp={L.vpp}, k={L.group_size}, ZeRO-{ev.zero_stage}:")
        for line in reasons(ev, results, cache, staged=rule):
            print(f"  - {line}")
        print()
    shown, labels = list(results), [str(i) for i in range(1, len(results) + 1)]
    if rule and rank > len(results):
        shown.append(rule.evaluation)
        labels.append("P")
    print(f"Free search, top {len(results)} of the layouts that fit (vs #1 = margin to the best"
          + ("; P = the paper's staged layout" if "P" in labels else "") + "):")
    print(format_table(req, shown, labels=labels))
    print(f"  ({TABLE_NOTE})")
    if rule:
        what = "The staged layout" if answer_is_staged else "The paper's staged layout"
        print(f"  {trade_off(rule.evaluation, best, rank, what)}")
    print()
    if not answer_is_staged:
        L = best.layout
        print(f"Why #1 (tp={L.tp} cp={L.cp} pp={L.pp} dp={L.dp}, vpp={L.vpp}, k={L.group_size}, "
              f"ZeRO-{best.zero_stage}):")
        for line in reasons(best, results, cache, _cp_alternative(best, cache)):
            print(f"  - {line}")
        print()
    if req.kinds is not None:
        answer = rule.evaluation if answer_is_staged else best
        for line in stage_lines(answer, layout_string(answer.layout.layers)):
            print(line)
        print()
    print("Assumptions (step time = busiest PP rank's compute and exposed TP/CP collectives x (1 + simulated bubble) "
          "+ exposed DP traffic; details in l3plugin/planner/costs.py and machine.py):")
    for line in assumptions(req.hardware, req.gpus_per_node, req.hbm_gb):
        print(f"  - {line}")


def _cp_alternative(best, cache):
    """The best plan when CP may also replace DP at short sequence lengths, if it is estimated faster."""
    request = best.request
    if request.cp_allowed:
        return None
    try:
        alternative = plan(replace(request, cp_policy="any"), top=1, cache=cache)[0]
    except NoPlanFits:
        return None
    return alternative if alternative.step_seconds < 0.99 * best.step_seconds else None
