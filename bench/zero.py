"""DeepSpeed ZeRO variants side by side on CPU ranks: stock stage 1 and 2, stock BF16_Optimizer with fp32
communication, and l3plugin's FP32-reducing ZeRO-1/2, on the same bf16 model and the same data.

    .venv/bin/python bench/zero.py                         # 2 and 4 ranks, defaults below
    .venv/bin/python bench/zero.py --worlds 2 --layers 4   # quicker

Prints a table, asserts nothing. Columns, per rank:
- step ms: one optimizer step of --gas micro-batches (median of --steps steps after a warm-up step; the
  machine is shared, so expect noise);
- +RSS MB: peak resident memory growth of the rank from building the engine to the end of the timed steps
  (fresh processes per row; CPU has no allocator statistics, so this includes allocator slack);
- grad MB: l3plugin's own peak of gradient buffers (fp32 full buckets + reduced shards), from its counter;
- wire MB: bytes this rank sends in one step with ring collectives (all-reduce 2(W-1)/W x input,
  reduce-scatter (W-1)/W x input, all-gather (W-1) x input); then the calls per operation and dtype with
  their input MB;
- grad err: relative error of the reduced gradient (DeepSpeed's safe_get_full_grad after the last
  micro-batch's backward) against an fp64 accumulation of the same bf16 micro-batch gradients, step 0.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from l3plugin.testing.ranks import RankPool  # noqa: E402

VARIANTS = [
    ("stock ZeRO-1 (bf16 accum, bf16 comm)", 1, None, {}),
    ("stock ZeRO-2 (bf16 accum, bf16 comm)", 2, None, {}),
    ("stock BF16_Optimizer ZeRO-1 (fp32 accum+comm)", 1, None,
     {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}),
    ("l3plugin ZeRO-1 (fp32 accum, fp32 reduce-scatter)", 1, {"fp32_reduce_zero": True}, {}),
    ("l3plugin ZeRO-2 (no rounds: reduces at the boundary)", 2, {"fp32_reduce_zero": True}, {}),
]


def _deepspeed():
    import logging

    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # ~120 s JIT compile, inference only
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    import l3plugin.deepspeed  # noqa: F401
    return deepspeed


def _model(width, layers):
    import torch

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 1))


def _batch(rank, step, mb, width):
    import torch

    g = torch.Generator().manual_seed(100_000 * rank + 1000 * step + mb)
    return torch.randn(4, width, generator=g).bfloat16()


def _engine(stage, plugin, extra, width, layers, gas):
    deepspeed = _deepspeed()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "steps_per_print": 10**9, **extra}
    if plugin:
        cfg["l3plugin"] = plugin
    model = _model(width, layers)
    with contextlib.redirect_stdout(io.StringIO()):  # BF16_Optimizer prints memory reports
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def _loss(out):
    return out.float().pow(2).mean()


def timed_run(stage, plugin, extra, width, layers, gas, steps):
    """Step time, peak RSS growth, gradient-buffer peak and the collectives of one step, on this rank."""
    import torch.distributed as dist
    from deepspeed.comm import comm as ds_comm

    from l3plugin.zero.comm import record_collectives

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine = _engine(stage, plugin, extra, width, layers, gas)
    rank = dist.get_rank()
    cdb = ds_comm.cdb  # DeepSpeed cached these torch functions: spy on its copies too
    extra_targets = [(cdb, "all_gather_function", "all_gather_into_tensor"),
                     (cdb, "reduce_scatter_function", "reduce_scatter_tensor")]
    times, log = [], None
    for step in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        with record_collectives(extra_targets) as rec:
            for mb in range(gas):
                engine.backward(_loss(engine(_batch(rank, step, mb, width))))
                engine.step()
        if step:
            times.append(time.perf_counter() - start)
            log = rec
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    zero = getattr(engine.optimizer, "zero", None)
    by_op = {}
    for c in log:
        key = f"{c.op.replace('_into_tensor', '').replace('_tensor', '')} {str(c.dtype).replace('torch.', '')}"
        calls, size = by_op.get(key, (0, 0))
        by_op[key] = (calls + 1, size + c.bytes)
    return {"optimizer": type(engine.optimizer).__name__, "step_ms": 1000 * statistics.median(times),
            "rss_mb": (rss - rss0) / 1024, "grad_mb": zero.memory.peak / 2**20 if zero else None,
            "comm": by_op, "wire_mb": log.wire_bytes / 2**20}


def gradient_error(stage, plugin, extra, width, layers, gas):
    """Relative error of the reduced gradient vs fp64 at step 0 (safe_get_full_grad before the step)."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    engine = _engine(stage, plugin, extra, width, layers, gas)
    replica = _model(width, layers).bfloat16()
    acc = {p: torch.zeros(p.shape, dtype=torch.float64) for p in replica.parameters()}

    def hook(p):
        acc[p].add_(p.grad.double())
        p.grad = None

    for p in replica.parameters():
        p.register_post_accumulate_grad_hook(hook)
    rank = dist.get_rank()
    for mb in range(gas):
        x = _batch(rank, 0, mb, width)
        (_loss(replica(x)) / gas).backward()
        engine.backward(_loss(engine(x)))
        if mb < gas - 1:
            engine.step()
    num = den = 0.0
    for p, q in zip(engine.module.parameters(), replica.parameters()):
        ref = acc[q]
        dist.all_reduce(ref)
        ref /= dist.get_world_size()
        got = safe_get_full_grad(p).double()
        num += (got - ref).pow(2).sum().item()
        den += ref.pow(2).sum().item()
    return (num / den) ** 0.5


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--gas", type=int, default=32, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    args = parser.parse_args()
    params = args.layers * (args.width ** 2 + args.width) + args.width + 1
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) + head = {params / 1e6:.2f} M bf16 params; "
          f"{args.gas} micro-batches of 4 per step; AdamW (torch); CPU, gloo, 1 thread per rank\n")
    header = (f"{'ranks':>5}  {'variant':<52} {'optimizer':<24} {'step ms':>8} {'+RSS MB':>8} {'grad MB':>8} "
              f"{'wire MB':>8} {'grad err':>9}  collectives per step (calls, input MB)")
    print(header)
    print("-" * len(header))
    for world in args.worlds:
        for name, stage, plugin, extra in VARIANTS:
            with RankPool(world) as pool:  # fresh processes: the RSS high-water mark starts clean
                timing = pool.run(timed_run, stage, plugin, extra, args.width, args.layers, args.gas,
                                  args.steps, timeout=1800)[0]
                err = pool.run(gradient_error, stage, plugin, extra, args.width, args.layers, args.gas,
                               timeout=1800)[0]
            comm = ", ".join(f"{op}: {n}, {b / 2**20:.1f}" for op, (n, b) in sorted(timing["comm"].items()))
            grad_mb = "-" if timing["grad_mb"] is None else f"{timing['grad_mb']:.1f}"
            print(f"{world:>5}  {name:<52} {timing['optimizer']:<24} {timing['step_ms']:>8.0f} "
                  f"{timing['rss_mb']:>8.0f} {grad_mb:>8} {timing['wire_mb']:>8.1f} {err:>9.1e}  {comm}",
                  flush=True)
        print()


if __name__ == "__main__":
    main()
