"""Zero-bubble flexible schedule vs the flexible schedule, simulated (no processes): docs/pipeline.md's table.

    .venv/bin/python bench/pp_zero_bubble.py                  # p 16, v 4 and 8, m 8..64: markdown table
    .venv/bin/python bench/pp_zero_bubble.py --pp 8 --vpps 2 4 --microbatches 4 8 16 32

Per (costs, v, m), k = min(p, m): worst rank's idle / busy of the flexible plan and of the zero-bubble plan
(l3plugin/schedule/zero_bubble.py) at its default memory bound and their ratio; the busiest rank's idle / busy
(uneven stages: what the step pays beyond the busiest rank's work) and the step ratio; the most
microbatch-chunks of activations any rank holds (forward to weight gradient), equal by construction. Costs:
- uniform: F = B = W = 1 per chunk (the flexible plan runs B + W = 2 as one backward);
- multimodal: `l3plugin balance`'s FLOP costs (l3plugin/planner/layer_costs.py) of a Llama-3-405B-shaped text
  model with a trainable cross-attention layer after every 4 frozen self-attention layers (157 layers),
  embedding and head frozen, 192 text tokens and 3000 image tokens per micro-batch, split by `balance` on the
  flexible plan at m = 2p; a trainable layer's backward is B = its forward plus W = its forward, a frozen
  layer's is B alone (its input gradient; none before the first trainable layer).
Then, where m fits their rule, the bubble rates torch's zero-bubble schedules publish (docs/pipeline.md
says where each comes from). Prints the table; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from l3plugin.planner.layer_costs import model_layer_costs  # noqa: E402
from l3plugin.planner.models import load_model  # noqa: E402
from l3plugin.schedule.balance import StageSplitter  # noqa: E402
from l3plugin.schedule.plan import build_schedule, with_trainable_stages  # noqa: E402
from l3plugin.schedule.simulate import simulate  # noqa: E402
from l3plugin.schedule.zero_bubble import build_zero_bubble_schedule  # noqa: E402

KINDS = ("SSSSX" * 32)[:157]  # 126 self-attention layers (Llama 3 405B's), 31 cross-attention layers


def multimodal_stage_times(pp: int, vpp: int, microbatches: int) -> list[tuple[float, float, float]]:
    """(F, B, W) per virtual stage of the balanced split, in units of the mean stage forward."""
    embedding, layers, head = model_layer_costs(load_model("llama3-405b"), KINDS, text_seq=192, image_tokens=3000,
                                                frozen="SEH")
    splitter = StageSplitter(layers, build_schedule(pp, vpp, microbatches), embedding=embedding, head=head,
                             kinds=KINDS)
    counts = splitter.balance()[0].counts
    triples, start = [], 0
    for stage, n in enumerate(counts):
        parts = layers[start:start + n] + ([embedding] if stage == 0 else []) + ([head] if stage == len(counts) - 1
                                                                                  else [])
        start += n
        b = sum(min(c.forward, c.backward) for c in parts)  # the input gradient: one matmul like the forward
        triples.append((sum(c.forward for c in parts), b, sum(c.backward for c in parts) - b))
    unit = sum(f for f, _, _ in triples) / len(triples)
    return [(f / unit, b / unit, w / unit) for f, b, w in triples]


def torch_formulas(p: int, m: int) -> dict[str, str]:
    """Published bubble rates at T_F = T_B = T_W (docs/pipeline.md), where m fits the schedule's rule."""
    rounds = max(1, m // p)
    return {
        "ZB1P (v 1)": f"{(p - 1) / (3 * m):.4f}" if m % rounds == 0 and m >= p else "m < p",
        "ZBV (v 2)": "0",
        "DualPipeV (v 2)": f"{(p - 1) / (3 * m):.4f}" if m >= 2 * p else "m < 2p",
    }


def rows(pp: int, vpps, microbatches, costs: str):
    for vpp in vpps:
        times = multimodal_stage_times(pp, vpp, 2 * pp) if costs == "multimodal" else None
        for m in microbatches:
            trainable = [w > 0 for _, _, w in times] if times else [True] * (pp * vpp)
            flexible = with_trainable_stages(build_schedule(pp, vpp, m), trainable)
            split = build_zero_bubble_schedule(pp, vpp, m, trainable=trainable, stage_times=times)
            kwargs = {"stage_times": times} if times else {"backward_time": 1.0, "weight_time": 1.0}
            a, b = simulate(flexible, **kwargs), simulate(split, **kwargs)
            busiest = max(a.busy)  # the same in both plans: the same steps, the same costs
            yield (costs, vpp, m, flexible.group_size, a.bubble_ratio, b.bubble_ratio, a.makespan / busiest - 1,
                   b.makespan / busiest - 1, b.makespan / a.makespan, max(a.peak_inflight), max(b.peak_inflight),
                   torch_formulas(pp, m) if costs == "uniform" else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--vpps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32, 48, 64])
    parser.add_argument("--costs", nargs="+", choices=("uniform", "multimodal"), default=["uniform", "multimodal"])
    args = parser.parse_args(argv)
    print("| costs | v | m | k | flexible | flexible-zb | zb / flexible | busiest rank: flexible / zb "
          "| step zb / flexible | peak in flight (chunks) | ZB1P (v 1) | ZBV (v 2) | DualPipeV (v 2) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for costs in args.costs:
        for (name, v, m, k, flex, zb, flex_busiest, zb_busiest, step, peak_flex, peak_zb,
             formulas) in rows(args.pp, args.vpps, args.microbatches, costs):
            peak = f"{peak_zb}" if peak_zb == peak_flex else f"{peak_flex} / {peak_zb}"
            published = " | ".join(formulas.values()) if formulas else "- | - | -"
            print(f"| {name} | {v} | {m} | {k} | {flex:.4f} | {zb:.4f} | {zb / flex:.3f} | {flex_busiest:.4f} / "
                  f"{zb_busiest:.4f} | {step:.3f} | {peak} | {published} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
