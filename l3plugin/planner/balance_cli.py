"""`l3plugin balance`: split layers of different cost (self- and cross-attention, frozen or trainable) over the
pipeline's virtual stages, and show the candidates side by side (register with add_balance_parser)."""

from __future__ import annotations

import argparse
import json
import sys

from l3plugin.arguments.flags import positive_int
from l3plugin.schedule.balance import LayerCost, StageSplitter, megatron_layout
from l3plugin.schedule.plan import build_schedule

from .layer_costs import FREEZABLE, KINDS, model_layer_costs
from .models import PRESETS, load_model


SPEC_HINT = "l3plugin.megatron.multimodal.multimodal_block_spec(config, kinds, vp_stage=...)"


def add_balance_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "balance", help="split layers of different cost over the pipeline's virtual stages (paper 3.1.2, 3.2)",
        description="Cuts the model's layers into pp x vpp contiguous virtual stages (stage s on rank s %% pp, "
                    "chunk s // pp) so that the simulated step of the flexible schedule is shortest, rank 0's "
                    "activation memory breaking ties; prints that split beside equal layer counts, the paper's "
                    "one-fewer-on-the-ends counts and its multimodal grouping (N self-attention + 1 "
                    "cross-attention layer per stage). Costs come from FLOPs (--model, --text-seq, "
                    "--image-tokens) or from measured times (--costs).")
    parser.add_argument("--kinds", required=True,
                        help="one letter per layer in model order: " + ", ".join(f"{k} = {v}" for k, v in
                                                                                KINDS.items()))
    parser.add_argument("--frozen", default="", help="letters of what is frozen: " + ", ".join(
        f"{k} = {v}" for k, v in FREEZABLE.items()) + " (e.g. SEH: a frozen text model)")
    parser.add_argument("--pp", type=positive_int, required=True, help="pipeline-parallel size p")
    parser.add_argument("--vpp", type=positive_int, default=1, help="virtual stages per rank v (default 1)")
    parser.add_argument("--microbatches", type=positive_int, required=True, help="micro-batches per step m")
    parser.add_argument("--group-size", type=positive_int, default=None, help="k (default min(p, m))")
    parser.add_argument("--model", default="llama3-8b",
                        help=f"shapes for the FLOPs: a preset ({', '.join(PRESETS)}) or a JSON model file")
    parser.add_argument("--text-seq", type=positive_int, default=None, help="text tokens per sample T")
    parser.add_argument("--image-tokens", type=int, default=0, help="image tokens per sample I (X layers)")
    parser.add_argument("--costs", metavar="FILE",
                        help='measured costs instead of FLOPs: JSON {"layers": [[forward, backward], ...], '
                             '"embedding": [f, b], "head": [f, b]} (seconds per micro-batch)')
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--png", metavar="FILE", help="draw the chosen split's timeline (needs matplotlib)")
    parser.set_defaults(func=run_balance)
    return parser


def _measured(path: str, num_layers: int):
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--costs {path!r} cannot be read: {exc}") from None

    def pair(value, what):
        if (not isinstance(value, list) or len(value) != 2
                or not all(isinstance(x, (int, float)) and x >= 0 for x in value)):
            raise ValueError(f"--costs {path!r}: {what}={value!r} must be [forward, backward], numbers >= 0")
        return LayerCost(float(value[0]), float(value[1]))

    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list) or len(layers) != num_layers:
        raise ValueError(f"--costs {path!r}: 'layers' must list {num_layers} [forward, backward] pairs (one per "
                         f"letter of --kinds)")
    return (pair(data.get("embedding", [0, 0]), "embedding"),
            [pair(v, f"layers[{i}]") for i, v in enumerate(layers)], pair(data.get("head", [0, 0]), "head"))


def run_balance(args) -> int:
    try:
        return _run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from .layer_costs import check_kinds

    check_kinds(args.kinds, args.frozen)
    if args.costs:
        embedding, layers, head = _measured(args.costs, len(args.kinds))
    else:
        if args.text_seq is None:
            raise ValueError("--text-seq is required for FLOP costs (or give measured --costs)")
        embedding, layers, head = model_layer_costs(load_model(args.model), args.kinds, text_seq=args.text_seq,
                                                    image_tokens=args.image_tokens, frozen=args.frozen)
    schedule = build_schedule(args.pp, args.vpp, args.microbatches, args.group_size)
    splitter = StageSplitter(layers, schedule, embedding=embedding, head=head, kinds=args.kinds)
    splits = splitter.balance()
    best = splits[0]
    # Megatron's layout has one letter for any decoder layer: with cross-attention layers the per-index kinds come
    # from l3plugin.megatron.multimodal.multimodal_block_spec.
    layout = megatron_layout(best.counts, args.pp)
    if args.json:
        print(json.dumps({"stages": best.stages(), "chosen": best.name, "pp": args.pp, "vpp": args.vpp,
                          "microbatches": args.microbatches, "group_size": schedule.group_size,
                          "megatron_layout": layout, "layer_spec": SPEC_HINT if "X" in args.kinds else None,
                          "candidates": [s.to_dict() for s in splits]}))
    else:
        _print(args, schedule, splits, layout)
    if args.png:
        from l3plugin.schedule import render_png, simulate

        costs = splitter.stage_costs(best.counts)
        render_png(simulate(splitter.schedule_for(costs), stage_times=[(c.forward, c.backward) for c in costs]),
                   args.png)
        if not args.json:
            print(f"wrote {args.png}")
    return 0


def _print(args, schedule, splits, layout) -> None:
    best = splits[0]
    print(f"{len(args.kinds)} layers ({', '.join(f'{args.kinds.count(k)} {k}' for k in KINDS if k in args.kinds)}"
          f"{'; frozen: ' + args.frozen if args.frozen else ''}) over pp={args.pp} x vpp={args.vpp} virtual "
          f"stages, m={args.microbatches}, k={schedule.group_size}")
    print(f"{'candidate':<14} {'step':>6} {'bubble':>7} {'rank load max/min':>18} {'rank-0 act.':>12}  layers per "
          "virtual stage")
    for split in splits:
        print(f"{split.name:<14} {split.makespan / best.makespan:6.3f} {split.bubble:7.3f} "
              f"{split.load_ratio:18.3f} {split.stage0_memory / max(best.stage0_memory, 1e-30):12.3f}  "
              f"{' '.join(map(str, split.counts))}")
    print(f"(step and rank-0 activations relative to {best.name})\n\nchosen: {best.name}")
    for s, layer_ids in enumerate(best.stages()):
        rank, chunk = s % args.pp, s // args.pp
        print(f"  virtual stage {s:<3} rank {rank:<3} chunk {chunk}: layers {layer_ids[0]}-{layer_ids[-1]} "
              f"{''.join(args.kinds[i] for i in layer_ids)}")
    print(f"Megatron-LM: --pipeline-model-parallel-layout \"{layout}\"")
    if "X" in args.kinds:
        print(f"  ('t' is any decoder layer: build each chunk's block with {SPEC_HINT}, which gives layer i the kind "
              f"--kinds[i]; or pass the layer lists above, --json \"stages\", to your own model builder)")
