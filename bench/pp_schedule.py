"""Pipeline schedules side by side: bubble ratio and peak in-flight microbatches (simulated), and a real
CPU run timing l3plugin's flexible schedule against Megatron-Core's stock interleaved schedule.

    .venv/bin/python bench/pp_schedule.py              # everything (simulation + 4-rank CPU run)
    .venv/bin/python bench/pp_schedule.py --no-real    # simulation tables only (seconds)

Prints tables, asserts nothing. Simulation costs: forward 1, backward 2, P2P latency 0 or 0.1 forward.
"Bubble" is the paper's idle / (forward + backward) time of the worst rank; "in-flight" is the peak
number of microbatch activations a rank holds (in units of one chunk's activations), worst rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from l3plugin.schedule.plan import build_schedule  # noqa: E402
from l3plugin.schedule.simulate import simulate  # noqa: E402


def stock_accepts(p, v, m, k):
    """Whether Megatron-Core 0.16.1's interleaved schedule accepts (p, v, m, k) (schedules.py:995-1015)."""
    if k < p:
        return False  # stock has no all-forward-all-backward fallback (v=1 would run 1F1B instead)
    if v == 1:
        return True
    final = m % k
    return p <= k <= m and not (0 < final < p)


def variants(p, v, m):
    """(name, vpp, k) of the schedules compared for one (p, v, m)."""
    rows = [("all-fwd-all-bwd, GPipe (v=1)", 1, 1), ("1F1B (v=1)", 1, min(p, m)),
            (f"flexible k=p/2={p // 2} (AFAB)", v, p // 2),
            (f"Megatron interleaved (k=p={p})", v, p)]
    for factor, label in ((1.5, "1.5p"), (2, "2p")):
        k = int(p * factor)
        rows.append((f"flexible k={label}={k}", v, k))
    return [(name, vv, k) for name, vv, k in rows if 1 <= k <= m]


def simulation_table(settings, latencies):
    header = (f"{'p':>3} {'v':>2} {'m':>3}  {'schedule':<30} {'stock?':>6} "
              + " ".join(f"{'bubble@lat=' + str(lat):>14}" for lat in latencies) + f" {'in-flight':>9}")
    print(header)
    print("-" * len(header))
    for p, v, m in settings:
        for name, vv, k in variants(p, v, m):
            sched = build_schedule(p, vv, m, k)
            bubbles = [simulate(sched, 1.0, 2.0, lat).bubble_ratio for lat in latencies]
            inflight = max(plan.peak_inflight() for plan in sched.ranks)
            ok = "yes" if stock_accepts(p, vv, m, k) else "NO"
            print(f"{p:>3} {vv:>2} {m:>3}  {name:<30} {ok:>6} "
                  + " ".join(f"{b:>14.3f}" for b in bubbles) + f" {inflight:>9}")
        print()


def real_run(steps, hidden, seq, mbs):
    """4 gloo ranks, pp=4 vpp=2, m=8, k=4: the same model and data under both schedules, alternating."""
    from l3plugin.testing.ranks import RankPool

    print(f"Real CPU run: 4 gloo ranks, pp=4 vpp=2 m=8 k=4, toy model hidden={hidden} seq={seq} "
          f"micro-batch={mbs}, {steps} steps each, alternating")
    with RankPool(4, preload=("megatron.core",)) as pool:
        times = pool.run(_timed_steps, steps, hidden, seq, mbs, timeout=1800)
    flex = [max(rank["flexible"][i] for rank in times) for i in range(steps)]
    stock = [max(rank["stock"][i] for rank in times) for i in range(steps)]
    f_med, s_med = statistics.median(flex), statistics.median(stock)
    print(f"  median step time  flexible {f_med * 1e3:8.1f} ms   stock {s_med * 1e3:8.1f} ms   "
          f"ratio flexible/stock {f_med / s_med:.3f}")
    print(f"  identical gradients: {all(rank['identical'] for rank in times)}")


def _timed_steps(steps, hidden, seq, mbs):
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.mesh import init_mesh
    from l3plugin.testing import toy_pipeline as toy
    from l3plugin.testing.megatron_cpu_shim import stock_schedules_on_cpu

    p, v, m, k, layers = 4, 2, 8, 4, 16
    mesh = init_mesh(pp=p, vpp=v)
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=1,
                               pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v,
                               pipeline_dtype=torch.float32, microbatch_group_size_per_vp_stage=k,
                               batch_p2p_comm=False, deallocate_pipeline_outputs=True)
    chunks = toy.build_chunks(config, num_layers=layers, hidden=hidden, pp_rank=mesh.coords["pp"],
                              pp_size=p, vpp_size=v)
    batches = toy.make_microbatches(m, seq, mbs, hidden)
    stock_fn = get_forward_backward_func()
    out = {"flexible": [], "stock": [], "identical": True}

    def step(fn):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        dist.barrier(group=mesh.pp_group)
        start = time.perf_counter()
        fn(forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks],
           model=chunks, num_microbatches=m, seq_length=seq, micro_batch_size=mbs)
        dist.barrier(group=mesh.pp_group)
        return time.perf_counter() - start, {lid: g[0] for c in chunks for lid, g in c.grads().items()}

    with stock_schedules_on_cpu():
        for i in range(steps + 1):  # the first pair warms up and is not counted
            tf, gf = step(forward_backward_pipelining_flexible)
            ts, gs = step(stock_fn)
            out["identical"] &= all(torch.equal(gf[lid], gs[lid]) for lid in gf)
            if i:
                out["flexible"].append(tf)
                out["stock"].append(ts)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-real", action="store_true", help="skip the multi-process CPU run")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    latencies = (0.0, 0.1)
    print("== Paper settings (p = 16) ==")
    simulation_table([(16, v, m) for v in (2, 4, 8) for m in (16, 32, 48)], latencies)
    print("== Small settings (p = 4) ==")
    simulation_table([(4, 2, m) for m in (4, 6, 8, 9, 12)] + [(4, 3, 10)], latencies)
    if not args.no_real:
        real_run(args.steps, args.hidden, args.seq, mbs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
