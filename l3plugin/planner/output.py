"""What `l3plugin plan` prints: the free search's ranking, the staged plan, the trade-off, the assumptions.

Free search only: the ranking, why #1, and at long context where the paper's staged layout (the rule of
staged.py applied to the short-context plan at --base-seq-len) ranks. With --keep-tp-pp / --from the
staged plan is the answer, followed by the free ranking and the same comparison.
"""

from __future__ import annotations

from dataclasses import replace

from .machine import assumptions
from .report import (TABLE_NOTE, deepspeed_config, dumps, format_table, header, megatron_args, reasons,
                     request_record, to_record, trade_off)
from .search import NoPlanFits, PlanRequest, ScheduleCache, plan
from .staged import base_from_search, load_base, rank_in_free_search, staged_plan


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
