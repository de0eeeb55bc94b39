"""`l3plugin plan`: the 4D parallelism planner on the command line (register with add_plan_parser)."""

from __future__ import annotations

import argparse

from l3plugin.arguments.checks import check_number
from l3plugin.arguments.flags import positive_int

from .layer_costs import FREEZABLE, KINDS
from .machine import CP_KV_MODES, MACHINE_NODES, MACHINES
from .models import PRESETS

H100 = MACHINES["h100"]


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _float_flag(flag: str, low: float, high: float | None = None, low_open: bool = True):
    """An argparse type: the flag's text as a float, checked by ``check_number`` (its message, under argparse)."""
    def parse(text: str) -> float:
        try:
            return check_number(flag, _number(text), low, high, low_open=low_open)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="choose TP, CP, PP, DP sizes, the schedule and the ZeRO stage (Llama 3 paper section 5)",
        description="Enumerates 4D layouts for a model, cluster and batch; estimates per-GPU memory "
                    "(bf16 weights, fp32 gradients and optimizer state per ZeRO stage, activations of the "
                    "microbatches the schedule keeps in flight), simulates the pipeline bubble and prices "
                    "per-dimension communication on the machine's links; drops layouts over memory and ranks the "
                    "rest by estimated step time. Order of dimensions, innermost to outermost: TP, CP, PP, DP. "
                    "--keep-tp-pp / --from plan a long-context stage the paper's way (section 5.1).",
)
    parser.add_argument("--model", required=True,
                        help=f"preset ({', '.join(PRESETS)}) or a JSON file with num_layers, hidden_size, "
                             "ffn_hidden_size, num_attention_heads, num_kv_heads [, vocab_size, name]")
    parser.add_argument("--gpus", type=positive_int, required=True, help="number of GPUs")
    parser.add_argument("--seq-len", type=positive_int, required=True, help="tokens per sequence")
    parser.add_argument("--global-batch-tokens", type=positive_int, required=True,
                        help="tokens per optimizer step (a multiple of --seq-len)")
    parser.add_argument("--micro-batch-size", type=positive_int, default=1, help="sequences per microbatch (default 1)")
    parser.add_argument("--cp-policy", choices=("long-context", "any"), default="long-context",
                        help="long-context (the paper's rule): CP > 1 only when even node-wide TP "
                             "leaves DP groups fewer than p sequences, or when nothing fits without it; "
                             "any: let the cost model weigh CP for every sequence length (default long-context)")
    pins = parser.add_argument_group("pinned sizes (searched when omitted)")
    for dim in ("tp", "pp", "cp"):
        pins.add_argument(f"--{dim}", type=positive_int, default=None, help=f"{dim.upper()} size")

    staged = parser.add_argument_group(
        "staged planning (paper 5.1): keep TP/PP (and VPP where it fits) of a short-context plan and trade DP "
        "for the smallest CP that gives every pipeline >= PP micro-batches")
    source = staged.add_mutually_exclusive_group()
    source.add_argument("--keep-tp-pp", action="store_true",
                        help="plan the short-context stage at --base-seq-len first and keep its TP/PP")
    source.add_argument("--from", dest="from_plan", metavar="PLAN.json",
                        help="keep TP/PP of the plan an earlier `l3plugin plan ... --json` wrote")
    staged.add_argument("--base-seq-len", type=positive_int, default=8192,
                        help="sequence length of the short-context stage for --keep-tp-pp, in tokens (default 8192, the "
                             "paper's short-context stage)")

    layers = parser.add_argument_group(
        "layers that differ (as `l3plugin balance` takes them): cost layers by kind, count frozen parameters "
        "without fp32 gradients / optimizer state, and add the cost-balanced split of each layout")
    layers.add_argument("--kinds", default=None,
                        help="one letter per layer in model order (their number replaces the model's num_layers; "
                             "--model gives the shapes): " + ", ".join(f"{k} = {v}" for k, v in KINDS.items()))
    layers.add_argument("--frozen", default="", help="letters of what is frozen: " + ", ".join(
        f"{k} = {v}" for k, v in FREEZABLE.items()) + " (e.g. SEH: a frozen text model)")
    layers.add_argument("--image-tokens", type=int, default=0,
                        help="image tokens per sample I, read by every cross-attention (X) layer")

    machine = parser.add_argument_group(
        "machine (defaults: the h100 preset, H100 SXM datasheet figures; assumptions are printed)")
    machine.add_argument("--machine", choices=sorted(MACHINES), default="h100",
                         help="preset the flags below default to (default h100)")
    nodes = MACHINE_NODES["h100"]
    machine.add_argument("--gpu-memory-gb", "--hbm-gb", dest="hbm_gb", type=_float_flag("--gpu-memory-gb", 0),
                         default=None,
                         help=f"memory per GPU in GiB (h100: {nodes[0]:g}, 80 GB HBM3)")
    machine.add_argument("--usable-memory-fraction", type=_float_flag("--usable-memory-fraction", 0, 1),
                         default=None,
                         help=f"fraction of GPU memory usable before {H100.reserved_gb:g} GiB reserved for the "
                              f"CUDA context and NCCL, in (0, 1] (h100: {H100.usable_fraction:g})")
    machine.add_argument("--peak-tflops", type=_float_flag("--peak-tflops", 0), default=None,
                         help=f"dense BF16 peak per GPU in TFLOPs (h100: {H100.peak_tflops:g})")
    machine.add_argument("--mfu", type=_float_flag("--mfu", 0, 1), default=None,
                         help=f"achieved fraction of peak in forward/backward compute, in (0, 1] (h100: {H100.mfu:g})")
    machine.add_argument("--intra-node-gbps", type=_float_flag("--intra-node-gbps", 0), default=None,
                         help=f"NVLink bandwidth per GPU in GB/s each way (h100: {H100.intra_node_gbps:g}, "
                              f"900 GB/s bidirectional)")
    machine.add_argument("--inter-node-gbps", type=_float_flag("--inter-node-gbps", 0), default=None,
                         help=f"network bandwidth per GPU in GB/s (h100: {H100.inter_node_gbps:g} = 400 Gb/s)")
    machine.add_argument("--gpus-per-node", type=positive_int, default=None,
                         help=f"GPUs per node (h100: {nodes[1]})")
    machine.add_argument("--latency-us", type=_float_flag("--latency-us", 0, low_open=False), default=None,
                         help=f"latency per ring step or P2P message in microseconds (h100: {H100.latency_s * 1e6:g})")
    machine.add_argument("--cp-kv", choices=CP_KV_MODES, default=None,
                         help=f"CP backward: regather K/V (keep only local K/V) or keep the gathered K/V in memory "
                              f"(h100: {H100.cp_kv})")

    parser.add_argument("--top-k", "--top", dest="top", type=positive_int, default=5,
                        help="how many plans to rank (default 5; plans estimated more than 1.5x slower than the best "
                             "are left out)")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true",
                     help="print JSON: request, machine, assumptions, ranked plans, the staged plan")
    out.add_argument("--emit", choices=("megatron", "deepspeed"),
                     help="print Megatron-LM arguments or a DeepSpeed JSON config for the answer")
    parser.set_defaults(func=run_plan)
    return parser


def request_from_args(args):
    from .machine import machine_from_flags
    from .search import PlanRequest

    hardware = machine_from_flags(
        args.machine, peak_tflops=args.peak_tflops, mfu=args.mfu, intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps, latency_us=args.latency_us,
        usable_memory_fraction=args.usable_memory_fraction, cp_kv=args.cp_kv)
    memory, per_node = MACHINE_NODES[args.machine]
    return PlanRequest(model=args.model, gpus=args.gpus, seq_len=args.seq_len,
                       global_batch_tokens=args.global_batch_tokens,
                       gpus_per_node=args.gpus_per_node or per_node, hbm_gb=args.hbm_gb or memory,
                       micro_batch_size=args.micro_batch_size, hardware=hardware, cp_policy=args.cp_policy,
                       tp=args.tp, pp=args.pp, cp=args.cp, kinds=args.kinds, frozen=args.frozen,
                       image_tokens=args.image_tokens)


def run_plan(args) -> int:
    from .report import print_plan

    return print_plan(args, request_from_args(args))
