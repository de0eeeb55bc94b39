"""DeepSpeed training with l3plugin's FP32-reducing ZeRO-1/2: the config's "l3plugin" key is the only change.

    torchrun --nproc-per-node 2 examples/deepspeed/train.py --config examples/deepspeed/ds_config.json

Same script on GPUs (NCCL). With the key, gradients are accumulated over the 8 micro-batches in fp32 and
reduce-scattered in fp32; without it (delete the key) DeepSpeed runs exactly as stock. At the end the
fp32 weights are exported as a plain state dict that stock DeepSpeed or torch can fine-tune from.
"""

import argparse
import json
import os
import sys
from datetime import timedelta

import torch

# "l3plugin": {"fp32_reduce_zero": true} in the config is honoured without an import (the package's startup
# hook installs l3plugin.deepspeed when deepspeed is imported); the explicit import below is for runs with
# L3PLUGIN_NO_AUTOLOAD=1 or l3plugin only on PYTHONPATH, and is harmless otherwise.
import l3plugin.deepspeed  # noqa: F401


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "ds_config.json"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--export", default=None, help="write the fp32 state dict here at the end")
    args = p.parse_args()
    import deepspeed

    if not torch.cuda.is_available():
        # On CPU DeepSpeed JIT-compiles a shared-memory all-reduce op (~2 min, used only for inference)
        # on first init; this CPU example does not need it.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    # An explicit timeout: a hung peer fails the job in minutes, not the default 30 (l3plugin's ZeRO
    # collectives are bounded separately by "l3plugin": {"wait_timeout": seconds}, 600 by default).
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               timeout=timedelta(minutes=10))
    config = json.load(open(args.config))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, gas = engine.global_rank, engine.gradient_accumulation_steps()
    gen = torch.Generator().manual_seed(1 + rank)
    target = torch.nn.Linear(32, 1)  # the function to learn, same on every rank
    for step in range(args.steps):
        total = 0.0
        for _ in range(gas):
            x = torch.randn(engine.train_micro_batch_size_per_gpu(), 32, generator=gen)
            y = target(x).detach()
            x, y = x.to(engine.device, torch.bfloat16), y.to(engine.device)
            loss = (engine(x).float() - y).pow(2).mean()
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary
            total += loss.item()
        if rank == 0:
            print(f"step {step}: loss {total / gas:.5f} optimizer {type(engine.optimizer).__name__}", flush=True)
    if args.export:
        state = l3plugin.deepspeed.export_fp32_state_dict(engine)  # collective: every rank calls it
        if rank == 0:
            torch.save(state, args.export)
            print(f"exported {len(state)} fp32 tensors to {args.export}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # a gloo group left to the interpreter's exit can abort


if __name__ == "__main__":
    main()
