"""`l3plugin plan`: the 4D parallelism planner on the command line (register with add_plan_parser)."""

from __future__ import annotations

import argparse
import math

from l3plugin.cli_args import positive_int

from .models import PRESETS


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{value} is invalid: must be a finite number > 0")
    return value


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="choose TP, CP, PP, DP sizes, the schedule and the ZeRO stage (Llama 3 paper section 5)",
        description="Enumerates 4D layouts for a model, cluster and batch; estimates per-GPU memory "
                    "(bf16 weights, fp32 gradients and optimizer state per ZeRO stage, activations of the "
                    "microbatches the schedule keeps in flight), simulates the pipeline bubble and counts "
                    "per-dimension communication; drops layouts over HBM and ranks the rest by estimated step "
                    "time. Order of dimensions, innermost to outermost: TP, CP, PP, DP.")
    parser.add_argument("--model", required=True,
                        help=f"preset ({', '.join(PRESETS)}) or a JSON file with num_layers, hidden_size, "
                             "ffn_hidden_size, num_attention_heads, num_kv_heads [, vocab_size, name]")
    parser.add_argument("--gpus", type=positive_int, required=True, help="number of GPUs")
    parser.add_argument("--seq-len", type=positive_int, required=True, help="tokens per sequence")
    parser.add_argument("--global-batch-tokens", type=positive_int, required=True,
                        help="tokens per optimizer step (a multiple of --seq-len)")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--hbm-gb", type=_positive_float, default=80.0, help="HBM per GPU in GiB (default 80)")
    parser.add_argument("--micro-batch-size", type=positive_int, default=1,
                        help="sequences per microbatch (default 1)")
    parser.add_argument("--cp-policy", choices=("long-context", "any"), default="long-context",
                        help="long-context (default, the paper's rule): CP > 1 only when even node-wide TP "
                             "leaves DP groups fewer than p sequences, or when nothing fits without it; "
                             "any: let the cost model weigh CP for every sequence length")
    parser.add_argument("--top", type=positive_int, default=5,
                        help="how many plans to list (default 5; plans estimated more than 1.5x slower than "
                             "the best are left out)")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print a JSON list of plans, best first")
    out.add_argument("--emit", choices=("megatron", "deepspeed"),
                     help="print Megatron-LM arguments or a DeepSpeed JSON config for the best plan")
    parser.set_defaults(func=run_plan)
    return parser


def run_plan(args) -> int:
    from .report import deepspeed_config, dumps, format_table, header, megatron_args, reasons, to_record
    from .search import PlanRequest, ScheduleCache, plan

    request = PlanRequest(model=args.model, gpus=args.gpus, seq_len=args.seq_len,
                          global_batch_tokens=args.global_batch_tokens, gpus_per_node=args.gpus_per_node,
                          hbm_gb=args.hbm_gb, micro_batch_size=args.micro_batch_size,
                          cp_policy=getattr(args, "cp_policy", "long-context"))
    cache = ScheduleCache()
    results = plan(request, top=args.top, cache=cache)
    best = results[0]
    if args.emit == "megatron":
        print(megatron_args(best))
    elif args.emit == "deepspeed":
        print(dumps(deepspeed_config(best)))
    elif args.json:
        print(dumps([to_record(ev, i) for i, ev in enumerate(results, 1)]))
    else:
        print(header(best.request))
        print()
        print(format_table(best.request, results))
        print()
        L = best.layout
        print(f"Why #1 (tp={L.tp} cp={L.cp} pp={L.pp} dp={L.dp}, vpp={L.vpp}, k={L.group_size}, "
              f"ZeRO-{best.zero_stage}):")
        for line in reasons(best, results, cache, _cp_alternative(best, cache)):
            print(f"  - {line}")
        print()
        print("Estimates: step time = busiest PP rank's compute and exposed TP/CP collectives x (1 + simulated "
              "bubble) + exposed DP traffic; assumptions in l3plugin/planner/costs.py.")
    return 0


def _cp_alternative(best, cache):
    """The best plan when CP may also replace DP at short sequence lengths, if it is estimated faster."""
    from dataclasses import replace

    from .search import plan

    request = best.request
    if request.cp_allowed:
        return None
    alternative = plan(replace(request, cp_policy="any"), top=1, cache=cache)[0]
    return alternative if alternative.step_seconds < 0.99 * best.step_seconds else None
