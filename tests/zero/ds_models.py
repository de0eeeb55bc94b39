"""DeepSpeed engines for the ZeRO tests and the benchmark, without DeepSpeed's slow JIT compiles."""

from __future__ import annotations

import logging
import sys

import torch


def quiet_deepspeed():
    """Import deepspeed with its shm comm op disabled (a ~120 s JIT compile used only by inference)."""
    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")  # reuses the harness' gloo process group
    return deepspeed


def make_mlp(seed=0, width=24):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                               torch.nn.Tanh(), torch.nn.Linear(width, 1))


def batch(rank, step, mb, width_in=13):
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + mb)
    return torch.randn(2, width_in, generator=g).bfloat16()


def loss_of(out):
    return out.float().pow(2).mean()


def ds_config(stage, gas=4, plugin=None, clip=0.0, scheduler=False, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
           # torch_adam: DeepSpeed's FusedAdam would JIT-compile for ~90 s on CPU
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
           "gradient_clipping": clip, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 5}}
    if plugin is not None:
        cfg["l3plugin"] = plugin
    cfg.update(extra)
    return cfg


def engine_for(cfg, seed=0, model=None):
    deepspeed = quiet_deepspeed()
    import l3plugin.deepspeed  # noqa: F401  (installs the config key)

    model = make_mlp(seed) if model is None else model
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def train(engine, steps, first_step=0):
    import torch.distributed as dist

    rank = dist.get_rank()
    gas = engine.gradient_accumulation_steps()
    for step in range(first_step, first_step + steps):
        for mb in range(gas):
            engine.backward(loss_of(engine(batch(rank, step, mb))))
            engine.step()


def reduced_grad_error(engine, gas) -> float:
    """Relative error vs fp64 of the reduced gradient (``safe_get_full_grad`` after the last of ``gas``
    micro-batches) of an engine built from ``make_mlp()``, against a bf16 replica accumulated in fp64."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from zero_models import Fp64Reference, relative_error

    ref_model = make_mlp().bfloat16()
    ref = Fp64Reference(ref_model.parameters())
    for mb in range(gas):
        x = batch(dist.get_rank(), 0, mb)
        (loss_of(ref_model(x)) / gas).backward()
        engine.backward(loss_of(engine(x)))
        if mb < gas - 1:
            engine.step()  # DeepSpeed's idiom: step() every micro-batch, it only counts until the boundary
    return relative_error([safe_get_full_grad(p).float() for p in engine.module.parameters()],
                          ref.mean_over_ranks())
