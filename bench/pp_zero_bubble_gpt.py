"""flexible vs flexible-zb on a real Megatron-Core GPTModel, 2 gloo ranks (one per core), pp 2, k = p.

    .venv/bin/python bench/pp_zero_bubble_gpt.py                         # v 1 and 2, m 2, 4, 8: about 4 minutes
    .venv/bin/python bench/pp_zero_bubble_gpt.py --vpps 2 --microbatches 4 --rounds 9 --json

Three contenders interleaved over rounds: the flexible schedule; flexible-zb as it runs (Megatron's local
linear layers computing through l3plugin.megatron.split_linears, so their weight products move to W); and
flexible-zb with Megatron's own linear Function kept (the layers pinned to it: its one backward does the weight
products in B, what flexible-zb did before split_linears). The model: GPTModel with the local layer spec and
l3plugin's attention (tests/tiny_gpt.py: learned positions, vocabulary 64), fp32, built for each step (outside
the timed part). Printed per (v, m): the step (slowest rank, median), the median of per-round ratios against
flexible (range), each rank's busy time (the executor's own spans, receives excluded), the median B and W of a
last virtual stage (its input needs a gradient) against flexible's backward there, whether every gradient was
identical across the three in every round, and below each row the plans simulated with the step costs the run
measured (the median span of each step kind per virtual stage): zb's step over flexible's, what the plan can give
at those costs; and the most bytes held for the backward at once on the larger rank, by census: the tensors
autograd saved plus, under flexible-zb, the gradients each W step keeps from its B (l3plugin.debug.saved_tensors).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))  # tiny_gpt and the CPU shim

import harness  # noqa: E402

P = 2
CONTENDERS = ("flexible", "flexible-zb", "flexible-zb, Megatron's linear")


def _model(v, layers, hidden, heads, seq):
    """On a rank: (mesh, this rank's model chunks), built for each call (the pool resets the groups between
    calls); the build is outside the timed step."""
    import tiny_gpt as gpt

    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=P, vpp=v if v > 1 else None)
    r = mesh.coords["pp"]
    config = gpt.gpt_config(layers, hidden=hidden, heads=heads, kv_heads=max(1, heads // 4), pp=P,
                            vpp=v if v > 1 else None, k=P)
    return mesh, [gpt.build_gpt(config, pre_process=r == 0 and c == 0, post_process=r == P - 1 and c == v - 1,
                                vp_stage=c if v > 1 else None, seq_len=seq, pp_rank=r) for c in range(v)]


@contextlib.contextmanager
def _weight_steps_counted(census):
    """On a rank: what each W step keeps from its B (the gradients it will start from) counted in ``census``
    until the W step runs."""
    from l3plugin.schedule.split_backward import WeightStep

    init, run = WeightStep.__init__, WeightStep.run

    def counted_init(self, calls, *args, **kwargs):
        init(self, calls, *args, **kwargs)
        self.census_release = census.hold(self.kept_tensors())

    def counted_run(self):
        try:
            run(self)
        finally:
            self.census_release()

    with mock.patch.object(WeightStep, "__init__", counted_init), mock.patch.object(WeightStep, "run", counted_run):
        yield


def _step(v, m, contender, layers, hidden, heads, seq, mbs):
    """On every rank: one timed training step; wall, busy, spans, the most bytes autograd's saved tensors and the
    W steps' kept gradients held at once (census), gradients."""
    import tiny_gpt as gpt

    from l3plugin.debug.saved_tensors import SavedTensorCensus
    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.megatron.split_linears import _local_linear_classes

    mesh, chunks = _model(v, layers, hidden, heads, seq)
    pinned = []
    if contender.endswith("Megatron's linear"):  # an instance _forward_impl: split_linears leaves the layer alone
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, _local_linear_classes()):
                    module._forward_impl = type(module)._forward_impl.__get__(module)
                    pinned.append(module)
    batches = gpt.microbatches(m, mbs, seq)
    waits, census = {}, SavedTensorCensus()
    try:
        with census.hooks, _weight_steps_counted(census):
            timing, _ = harness.barrier_timed(lambda: forward_backward_pipelining_flexible(
                forward_step_func=gpt.forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
                num_microbatches=m, seq_length=seq, micro_batch_size=mbs, waits=waits,
                pipeline_schedule="flexible" if contender == "flexible" else "flexible-zb"), group=mesh.pp_group)
    finally:
        for module in pinned:
            del module._forward_impl
    return {"wall": timing["wall"], "busy": waits["busy_s"], "rank": mesh.coords["pp"], "actions": waits["actions"],
            "peak": census.peak, "grads": gpt.named_grads(chunks)}


def simulated_step_ratios(v, m, costs) -> dict:
    """Per zb contender: the plans simulated with the step costs this run measured (``costs``: {contender:
    {(virtual stage, op): seconds}}), zb's step over flexible's: what the plan gives at these costs."""
    from l3plugin.schedule import build_zero_bubble_schedule
    from l3plugin.schedule.plan import build_schedule
    from l3plugin.schedule.simulate import simulate

    stages = range(P * v)
    flexible = simulate(build_schedule(P, v, m, P),
                        stage_times=[(costs["flexible"][(s, "F")], costs["flexible"][(s, "B")]) for s in stages])
    plan = build_zero_bubble_schedule(P, v, m, P)
    return {c: simulate(plan, stage_times=[tuple(costs[c].get((s, op), 0.0) for op in "FBW") for s in stages]
                        ).makespan / flexible.makespan for c in CONTENDERS[1:]}


def run(pool, args) -> dict:
    figures = {"rows": []}
    print(f"flexible vs flexible-zb on a GPTModel: 2 gloo ranks, pp {P}, k {P}, {args.layers} layers, hidden "
          f"{args.hidden}, {args.heads} heads, seq {args.seq}, mbs {args.mbs}, fp32; {args.rounds} rounds after a "
          f"warm-up round. zb: split_linears; zb-M: Megatron's linear Function kept")
    print(f"  {'v':>2} {'m':>2} {'step ms flex / zb / zb-M':>26} {'zb / flex':>20} {'zb-M / flex':>20} "
          f"{'busy ms r0/r1 flex | zb | zb-M':>32} {'stage':>5} {'B / flex bwd zb | zb-M':>24} "
          f"{'W zb | zb-M':>12} {'identical':>9}")
    for v in args.vpps:
        for m in args.microbatches:
            def run_one(contender):
                return pool.run(_step, v, m, contender, args.layers, args.hidden, args.heads, args.seq, args.mbs,
                                timeout=1800)

            times, differ = harness.rounds_with_gradients_checked(CONTENDERS, run_one, args.rounds)
            walls = {c: [max(r["wall"] for r in ranks) for ranks in times[c]] for c in CONTENDERS}
            step = {c: statistics.median(walls[c]) for c in CONTENDERS}
            busy = {c: [statistics.median(ranks[r]["busy"] for ranks in times[c]) for r in range(P)]
                    for c in CONTENDERS}
            ratios = {c: harness.ratio_stats(walls[c], walls["flexible"]) for c in CONTENDERS[1:]}
            medians = {c: harness.span_medians(times[c], P) for c in CONTENDERS}
            peak_mb = {c: max(r["peak"] for ranks in times[c] for r in ranks) / 1e6 for c in CONTENDERS}
            stage = P * v - 1  # the last virtual stage: its input needs a gradient, so its backward splits
            backward = medians["flexible"][(stage, "B")]
            split = {c: (medians[c].get((stage, "B"), 0.0) / backward, medians[c].get((stage, "W"), 0.0) / backward)
                     for c in CONTENDERS[1:]}
            row = {"v": v, "m": m, "step_ms": {c: 1000 * step[c] for c in CONTENDERS},
                   "over_flexible": ratios, "busy_ms": {c: [1000 * b for b in busy[c]] for c in CONTENDERS},
                   "stage": stage, "b_w_over_flexible_backward": split,
                   "stage_costs_ms": {c: {f"{s}{op}": 1000 * t for (s, op), t in sorted(medians[c].items())}
                                      for c in CONTENDERS},
                   "simulated_step_ratio_measured_costs": simulated_step_ratios(v, m, medians),
                   "peak_held_mb": peak_mb,
                   "identical_gradients": not differ}
            figures["rows"].append(row)
            zb, zbm = CONTENDERS[1], CONTENDERS[2]
            print(f"  {v:>2} {m:>2} {' / '.join(f'{1000 * step[c]:.0f}' for c in CONTENDERS):>26} "
                  f"{harness.ratio_text(ratios[zb]):>20} {harness.ratio_text(ratios[zbm]):>20} "
                  f"{' | '.join('/'.join(f'{1000 * b:.0f}' for b in busy[c]) for c in CONTENDERS):>32} {stage:>5} "
                  f"{split[zb][0]:>10.2f} | {split[zbm][0]:<11.2f} {split[zb][1]:>5.2f} | {split[zbm][1]:<5.2f} "
                  f"{'yes' if not differ else 'NO ' + ', '.join(sorted(differ)):>9}", flush=True)
            print(f"       simulated with the measured step costs, step over flexible: zb "
                  f"{row['simulated_step_ratio_measured_costs'][zb]:.3f}, zb-M "
                  f"{row['simulated_step_ratio_measured_costs'][zbm]:.3f}; most MB held for the backward at once "
                  f"(saved tensors and W's kept gradients, larger rank): "
                  f"{' / '.join(f'{peak_mb[c]:.1f}' for c in CONTENDERS)}", flush=True)
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vpps", type=int, nargs="+", default=[1, 2], help="virtual stages per rank")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8], help="m")
    parser.add_argument("--layers", type=int, default=8, help="transformer layers (divisible by 2 x vpp)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after a warm-up round")
    harness.add_json_argument(parser)
    args = parser.parse_args(argv)
    for v in args.vpps:
        if v < 1 or args.layers % (P * v):
            parser.error(f"--vpps {v}: --layers ({args.layers}) must be divisible by {P} x vpp")
    for m in args.microbatches:
        if m < 1:
            parser.error(f"--microbatches {m}: each m must be >= 1")
    from l3plugin.ranks.pool import RankPool

    with harness.json_output(args.json, "pp_zero_bubble_gpt", argv) as figures:
        with RankPool(P, preload=("megatron.core",)) as pool:
            figures.update(run(pool, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
