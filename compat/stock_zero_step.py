"""Stock DeepSpeed's own ZeRO-1/2 steps (fp32 and bf16) on 2 gloo CPU ranks, with no l3plugin imported: tells a
stock bug from ours. Run with a compat venv's python, e.g.
  L3PLUGIN_NO_AUTOLOAD=1 OMP_NUM_THREADS=1 .compat/venvs/ds0.18-hf5.24/bin/python compat/stock_zero_step.py
(DeepSpeed 0.18.9 + torch 2.13: every step raises 'Output 0 of Split is a view and is being modified inplace')."""
import os
import sys
import traceback

import torch
import torch.multiprocessing as mp


def worker(rank, port, stage, bf16, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import deepspeed
    assert not [m for m in sys.modules if m == "l3plugin" or m.startswith("l3plugin.")], "l3plugin imported"
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    try:
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        for mb in range(4):
            x = torch.randn(2, 13)
            x = x.bfloat16() if bf16 else x
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        result = f"ok ({type(engine.optimizer).__name__})"
    except Exception as exc:
        result = f"{type(exc).__name__}: {str(exc).splitlines()[0]}\n" + "".join(traceback.format_exc().splitlines(True)[-8:])
    out.put((rank, result))


if __name__ == "__main__":
    import deepspeed

    print("deepspeed", deepspeed.__version__, "torch", torch.__version__, "l3plugin imported:",
          [m for m in sys.modules if m == "l3plugin" or m.startswith("l3plugin.")], "L3PLUGIN_NO_AUTOLOAD",
          os.environ.get("L3PLUGIN_NO_AUTOLOAD"))
    for i, (stage, bf16) in enumerate([(1, False), (2, False), (1, True), (2, True)]):
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, 29700 + i, stage, bf16, q)) for r in range(2)]
        [p.start() for p in procs]
        res = dict(q.get(timeout=600) for _ in procs)
        [p.join(60) for p in procs]
        print(f"stage {stage} {'bf16' if bf16 else 'fp32'}: rank 0 {res[0]}")
