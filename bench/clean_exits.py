"""How often scripts that never call ``destroy_process_group`` end with exit 0: with the "l3plugin" key and
without it (stock DeepSpeed, the control), interleaved.

Each run starts 2 ranks on gloo (torchrun's environment variables, no launcher) of one shape:
- ``train``: DeepSpeed ZeRO-2, 3 steps of 2 micro-batches, then the script ends (with the key the step leaves
  its parameter all-gathers for the next forward);
- ``save``: the same, then ``save_checkpoint``;
- ``load``: the same, then ``load_checkpoint`` of a checkpoint damaged on rank 1 (truncated partition), the
  error caught;
- ``comm``: no DeepSpeed; one l3plugin all-gather waited (``comm``) or a torch one, then the end.
Counts the ranks' exit codes per shape and arm (a run fails when a rank's code is not 0; -6 is SIGABRT,
"terminate called without an active exception"), and prints the load average, since aborts are more
frequent under load. Rounds alternate the arms' order (harness.round_order).

    python bench/clean_exits.py --rounds 20 --shapes train,save,load
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import round_order  # noqa: E402

ARMS = ("key", "stock")
SHAPES = ("train", "save", "load", "comm")


# ---- one rank ----------------------------------------------------------------------------------------------
def rank_main(shape: str, arm: str, folder: str) -> None:
    import logging

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if shape == "comm":
        dist.init_process_group("gloo")
        shard = torch.full((1000,), float(dist.get_rank()))
        if arm == "key":
            from l3plugin.collective import comm

            comm.start_all_gather(shard, None, what="the last collective").wait()
        else:
            dist.all_gather_into_tensor(torch.empty(2000), shard)
        return
    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # a ~120 s JIT compile, inference only
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}  # no FusedAdam JIT
    if arm == "key":
        config["l3plugin"] = {"fp32_reduce_zero": True}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    for _ in range(3):
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 13).bfloat16()).float().pow(2).mean())
            engine.step()
    if shape == "save":
        engine.save_checkpoint(folder, tag="t")
    elif shape == "load":
        try:
            engine.load_checkpoint(folder, tag="t")
        except Exception as exc:  # noqa: BLE001 - the shape: a caught checkpoint error, then the end
            print(f"rank {dist.get_rank()}: caught {type(exc).__name__}", file=sys.stderr)


# ---- the runs ----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(shape: str, arm: str, folder: str, timeout: float) -> list:
    """One 2-rank run: the ranks' exit codes ("timeout" for a rank killed after ``timeout`` s)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    if arm == "stock":
        env["L3PLUGIN_NO_AUTOLOAD"] = "1"  # l3plugin not even imported: DeepSpeed as if not installed
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", shape, arm, folder],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for r in range(2)]
    codes, end = [], time.monotonic() + timeout
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(1.0, end - time.monotonic()))
            codes.append(proc.returncode)
            if proc.returncode:
                print(f"  {shape}/{arm}: exit {proc.returncode}: {err.strip().splitlines()[-1:]}", file=sys.stderr)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            codes.append("timeout")
    return codes


def damaged_checkpoint(arm: str, root: str, timeout: float) -> str:
    """A checkpoint saved by ``arm``, rank 1's optimizer partition then cut in half."""
    folder = os.path.join(root, f"damaged-{arm}")
    if any(run_once("save", arm, folder, timeout)):
        raise RuntimeError(f"could not save the checkpoint the load shape damages ({arm})")
    name = os.path.join(folder, "t", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    os.truncate(name, os.path.getsize(name) // 2)
    return folder


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="runs of each shape and arm (default 20)")
    parser.add_argument("--shapes", default="train,save,load", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before its ranks are killed")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes or args.rounds < 1 or not args.timeout > 0:
        parser.error(f"--shapes {args.shapes!r} (known: {', '.join(SHAPES)}), --rounds {args.rounds} (>= 1), "
                     f"--timeout {args.timeout} (> 0)")
    counts = collections.defaultdict(collections.Counter)
    load_before = os.getloadavg()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="clean-exits-") as root:
        damaged = {arm: damaged_checkpoint(arm, root, args.timeout) for arm in ARMS} if "load" in shapes else {}
        for index in range(args.rounds):
            for shape in shapes:
                for arm in round_order(ARMS, index):
                    folder = damaged.get(arm) if shape == "load" else os.path.join(root, f"{shape}-{arm}")
                    codes = run_once(shape, arm, folder, args.timeout)
                    counts[(shape, arm)]["ok" if all(c == 0 for c in codes) else "failed"] += 1
                    for code in codes:
                        if code != 0:
                            counts[(shape, arm)][f"rank exit {code}"] += 1
            so_far = "; ".join(f"{shape}/{arm} {counts[(shape, arm)]['ok']}/{index + 1}" for shape in shapes for arm in ARMS)
            print(f"round {index + 1}/{args.rounds}: load average {os.getloadavg()[0]:.1f}; exit 0 so far: {so_far}",
                  file=sys.stderr, flush=True)  # a run cut short still says what it counted
    print(f"{'shape':<7} {'arm':<6} {'runs':>5} {'exit 0':>7}  failures")
    for shape in shapes:
        for arm in ARMS:
            c = counts[(shape, arm)]
            detail = ", ".join(f"{k}: {v}" for k, v in sorted(c.items()) if k.startswith("rank")) or "-"
            print(f"{shape:<7} {arm:<6} {c['ok'] + c['failed']:>5} {c['ok']:>7}  {detail}")
    print(f"load average (1 min) {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
          f"{time.monotonic() - start:.0f} s; {os.cpu_count()} CPUs")
    return {f"{shape}/{arm}": dict(counts[(shape, arm)]) for shape in shapes for arm in ARMS}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(*sys.argv[2:5])
    else:
        main()
