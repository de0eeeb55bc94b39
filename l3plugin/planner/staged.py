"""Staged planning (paper 5.1, "4D parallelism for long context"): the long-context stage keeps the
short-context plan's TP and PP and replaces DP by CP.

Why TP and PP stay: at 131K the batch is 128 sequences, so with b >= 1 CP can replace neither TP nor PP;
growing TP past a node puts its per-layer collectives on the network, and growing PP at the rate DP
shrinks does not fix the bubble. Which CP: a pipeline wants at least PP micro-batches,
B / (N / (TP PP CP)) >= PP, i.e. CP >= N / (TP B) (per micro batch of one sequence); the smallest
such CP moves the least CP traffic. VPP (and k, the ZeRO stage) are kept where they still fit;
otherwise the closest VPP that fits, and if none fits at that CP, the next CP that does (CP also
shards activations).

The base plan comes from an earlier ``l3plugin plan --json`` (``--from``) or is planned here at
``--base-seq-len`` (``--keep-tp-pp``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from l3plugin.arguments.checks import check_int

from .costs import GIB, Layout
from .search import (Evaluation, NoPlanFits, PlanRequest, ScheduleCache, describe, divisors, enumerate_layouts,
                     evaluate, plan)


@dataclass(frozen=True)
class Base:
    """The short-context plan a long-context stage starts from."""

    tp: int
    pp: int
    vpp: int
    source: str
    cp: int = 1
    dp: int | None = None
    group_size: int | None = None
    seq_len: int | None = None
    model: str | None = None


def base_from_record(record, source: str) -> Base:
    if not isinstance(record, dict):
        raise ValueError(f"{source}: expected a plan record (an object with tp, pp, vpp), got {type(record).__name__}")
    missing = [key for key in ("tp", "pp", "vpp") if key not in record]
    if missing:
        raise ValueError(f"{source}: the plan record lacks {missing}; write it with `l3plugin plan ... --json`")
    for key in ("tp", "pp", "vpp"):
        try:
            check_int(key, record[key])
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    return Base(tp=record["tp"], pp=record["pp"], vpp=record["vpp"], source=source, cp=record.get("cp", 1),
                dp=record.get("dp"), group_size=record.get("group_size"), seq_len=record.get("seq_len"),
                model=record.get("model"))


def load_base(path: str) -> Base:
    """The answer of a ``--json`` run: its staged plan if it made one, else its #1."""
    source = f"--from {path}"
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise ValueError(f"{source}: no such file; write one with `l3plugin plan ... --json > {path}`") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON: {exc}") from None
    if isinstance(data, dict) and "plans" in data:
        request = data.get("request", {})
        answer = data["staged"] if data.get("answer") == "staged" else (data["plans"] or [None])[0]
        if answer is None:
            raise ValueError(f"{source}: the file lists no plans")
        answer = {"seq_len": request.get("seq_len"), "model": request.get("model"), **answer}
        return base_from_record(answer, source)
    if isinstance(data, list):  # a bare list of records
        if not data:
            raise ValueError(f"{source}: the file lists no plans")
        return base_from_record(data[0], source)
    return base_from_record(data, source)


def base_from_search(req: PlanRequest, base_seq_len: int, cache: ScheduleCache) -> Base:
    """--keep-tp-pp: plan the short-context stage (same GPUs, token budget and machine) and keep it."""
    if req.global_batch_tokens % base_seq_len:
        raise ValueError(f"--base-seq-len={base_seq_len} does not divide --global-batch-tokens="
                         f"{req.global_batch_tokens}: the short-context stage must hold whole sequences")
    short = replace(req.unpinned(), seq_len=base_seq_len, cp_policy="long-context")
    best = plan(short, top=1, cache=cache)[0]
    L = best.layout
    return Base(tp=L.tp, pp=L.pp, vpp=L.vpp, cp=L.cp, dp=L.dp, group_size=L.group_size, seq_len=base_seq_len,
                model=req.model.name, source=f"the {base_seq_len}-token plan ({describe(best)})")


@dataclass
class StagedPlan:
    evaluation: Evaluation
    base: Base
    rule_cp: int  # smallest CP with micro-batches per pipeline >= PP
    reasons: list[str] = field(default_factory=list)


def staged_plan(req: PlanRequest, base: Base, cache: ScheduleCache | None = None) -> StagedPlan:
    cache = cache or ScheduleCache()
    if req.cross_attention:
        raise ValueError("--keep-tp-pp / --from trade DP for CP, which is not planned for cross-attention layers "
                         "(X in --kinds): plan without them")
    tp, pp, n, model = base.tp, base.pp, req.gpus, req.model
    if base.model and base.model != model.name:
        raise ValueError(f"{base.source} was planned for model {base.model}, this request is for {model.name}: "
                         f"plan the short-context stage of {model.name} first")
    bad = [x for x in (model.num_attention_heads, model.num_kv_heads, model.ffn_hidden_size) if x % tp]
    if bad or pp > model.num_layers + 2:
        raise ValueError(f"{base.source}: TP={tp} x PP={pp} does not shard {model.name} (TP must divide the heads "
                         f"and KV heads, PP at most {model.num_layers + 2} stages)")
    if n % (tp * pp):
        raise ValueError(f"--gpus={n} is not divisible by TP x PP = {tp} x {pp} = {tp * pp} kept from {base.source}: "
                         f"use a multiple of {tp * pp} GPUs, e.g. {max(tp * pp, n // (tp * pp) * tp * pp)} or "
                         f"{(n // (tp * pp) + 1) * tp * pp}")
    B, mbs = req.sequences, req.micro_batch_size
    bound = n * mbs / (tp * B)  # B / (N / (TP PP CP)) >= PP  <=>  CP >= N / (TP B), per micro batch
    rejected, valid = [], []
    for cp in divisors(n // (tp * pp)):
        dp = n // (tp * pp * cp)
        if req.seq_len % (2 * cp):
            rejected.append(f"CP={cp}: --seq-len {req.seq_len} does not split into {2 * cp} chunks")
        elif B % (dp * mbs):
            rejected.append(f"CP={cp}: DP={dp} does not divide {B} sequences")
        elif B // (dp * mbs) < pp:
            rejected.append(f"CP={cp}: m = {B // (dp * mbs)} < PP={pp}")
        else:
            valid.append(cp)
    if not valid:
        closest = "; ".join(f"{describe(ev)} ({ev.step_seconds:.2f} s)" for ev in _free(req, cache, 3))
        raise NoPlanFits(f"keeping TP={tp} PP={pp} from {base.source}, no CP gives every pipeline >= PP={pp} "
                         f"micro-batches ({'; '.join(rejected[-3:])}): the batch of {B} sequences is too small for "
                         f"{n} GPUs at this TP x PP. Closest feasible layouts (free search): {closest}")
    rule_cp = valid[0]
    reasons = [
        f"Kept from {base.source}: TP={tp}, PP={pp}. Paper 5.1: with {B} sequences per step CP can replace neither "
        f"TP nor PP (b >= 1), TP beyond a {req.gpus_per_node}-GPU node crosses hosts, and more PP does not fix "
        f"the bubble, so CP replaces DP.",
        f"Rule: micro-batches per pipeline m = B / (N / (TP PP CP)) = {B} x {tp} x {pp} x CP / {n} >= PP = {pp} "
        f"needs CP >= N / (TP B) = {_num(bound)}; the smallest valid CP is {rule_cp}, DP = {n // (tp * pp * rule_cp)}"
        + (f" (rejected: {'; '.join(rejected[-2:])})" if rejected else "") + ".",
    ]
    for cp in valid:
        chosen, note = _fit_vpp(req, base, cp, cache)
        if chosen is not None:
            break
        reasons.append(f"CP={cp}: {note}; CP also shards activations, so the next valid CP is tried.")
    else:
        raise NoPlanFits(f"keeping TP={tp} PP={pp} from {base.source}, no CP of {valid} fits in "
                         f"--gpu-memory-gb={req.hbm_gb:g}: {note}")
    reasons.append(note)
    reasons.append(_cp_traffic(req, chosen, valid))
    return StagedPlan(chosen, base, rule_cp, reasons)


def _fit_vpp(req: PlanRequest, base: Base, cp: int, cache: ScheduleCache):
    """The fastest fitting layout at this CP with the base's VPP, else with the closest VPP that fits."""
    pinned = replace(req.unpinned(), tp=base.tp, pp=base.pp, cp=cp, cp_policy="any")
    by_vpp = {}
    for layout in enumerate_layouts(pinned):
        by_vpp.setdefault(layout.vpp, []).append(layout)
    order = sorted(by_vpp, key=lambda v: (v != base.vpp, abs(math.log(v / base.vpp)), -v))
    least = None
    for vpp in order:
        evaluations = [evaluate(pinned, layout, cache=cache) for layout in by_vpp[vpp]]
        fitting = [ev for ev in evaluations if ev.fits]
        if fitting:
            best = min(fitting, key=Evaluation.sort_key)
            if vpp == base.vpp:
                return best, (f"VPP={vpp} kept: {describe(best)} fits in {best.memory_bytes / GIB:.1f} of "
                              f"{req.usable_bytes / GIB:.1f} usable GiB.")
            return best, (f"VPP={base.vpp} no longer fits; VPP={vpp} is the closest that does: {describe(best)}, "
                          f"{best.memory_bytes / GIB:.1f} of {req.usable_bytes / GIB:.1f} usable GiB.")
        least = min([least] * (least is not None) + evaluations, key=lambda e: e.memory_bytes)
    if least is None:
        return None, "no layer split or micro-batch grouping exists"
    return None, (f"no VPP fits: the least memory is {describe(least)} at {least.memory_bytes / GIB:.1f} GiB > "
                  f"{req.usable_bytes / GIB:.1f} usable")


def _cp_traffic(req: PlanRequest, ev: Evaluation, valid: list[int]) -> str:
    """Why the smallest CP: CP bytes and exposed time per GPU per step against the next valid CP."""
    L = ev.layout
    mine = ev.comm_bytes()["cp"] / 1e9
    text = (f"CP={L.cp} moves {mine:.1f} GB of K/V per GPU per step ({ev.times['cp_exposed']:.2f} s exposed)")
    larger = [cp for cp in valid if cp > L.cp]
    if not larger:
        return text + "."
    cp2 = larger[0]
    dp2 = req.gpus // (L.tp * L.pp * cp2)
    other = Layout(L.tp, cp2, L.pp, dp2, L.vpp, L.group_size, req.sequences // (dp2 * req.micro_batch_size),
                   L.layers, L.split)
    costs = req.costs(other)
    theirs = max(costs.comm_bytes(r, ev.zero_stage)["cp"] for r in range(L.pp)) / 1e9
    smallest = "the smallest CP that keeps m >= PP" + (" and fits" if L.cp > valid[0] else "")
    return (text + f"; CP={cp2} would move {theirs:.1f} GB ({max(costs.rank_cp):.2f} s exposed): {smallest} "
            f"minimises CP communication.")


def _free(req: PlanRequest, cache: ScheduleCache, top: int) -> list[Evaluation]:
    try:
        return plan(req.unpinned(), top=top, cache=cache)
    except NoPlanFits:
        return []


def rank_in_free_search(ev: Evaluation, best: Evaluation, cache: ScheduleCache) -> tuple[int, list[Evaluation]]:
    """(1-based rank of ``ev`` among all fitting layouts of the free search, those faster than it)."""
    req = replace(best.request, tp=None, pp=None, cp=None)
    within = ev.step_seconds / best.step_seconds * (1 + 1e-9)
    faster = [e for e in plan(req, top=None, cache=cache, within=within)
              if e.step_seconds < ev.step_seconds and e.layout != ev.layout]
    return len(faster) + 1, faster


def term_differences(ev: Evaluation, best: Evaluation) -> dict[str, float]:
    """``ev`` minus ``best``, per step-time term (s) and memory (GiB)."""
    out = {key: ev.times[key] - best.times[key]
           for key in ("step", "compute", "bubble", "tp_exposed", "cp_exposed", "dp_exposed")}
    out["memory_gb"] = (ev.memory_bytes - best.memory_bytes) / GIB
    return out


def _num(x: float) -> str:
    return f"{x:g}" if x == int(x) else f"{x:.2f}"
