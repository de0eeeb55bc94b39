"""How often scripts that never call ``destroy_process_group`` end with exit 0: with the "l3plugin" key and
without it (stock DeepSpeed, the control), interleaved.

Each run starts 2 ranks on gloo (torchrun's environment variables, no launcher) of one shape:
- ``train``: DeepSpeed ZeRO-2, 3 steps of 2 micro-batches, then the script ends (with the key the step leaves
  its parameter all-gathers for the next forward);
- ``save``: the same, then ``save_checkpoint``;
- ``load``: the same, then ``load_checkpoint`` of a checkpoint damaged on rank 1 (truncated partition), the
  error caught;
- ``comm``: no DeepSpeed; one l3plugin all-gather waited (``comm``) or a torch one, then the end;
- ``example``: ``examples/deepspeed/train.py`` as tests/test_examples.py launches it (torchrun --standalone,
  2 steps, ``--export``; it ends with ``barrier()`` and ``destroy_process_group()``); stock: its config without
  the key, no export (the export needs l3plugin's optimizer);
- ``megatron``: a Megatron-Core script at pp 1, dp 2 (tests/toy_pipeline.py's 4-layer Linear+tanh model, 3 steps
  of 3 micro-batches), then the end, no ``destroy_process_group``: with the key ``l3plugin.megatron.install
  ("flexible")``, l3plugin's ZeRO-2 (``megatron_zero`` + ``attach_to_schedule``, its parameter all-gathers
  left for the next forward) and the flexible schedule (called directly: the selector answers it at pp > 1
  only); stock: Megatron's own selector (``forward_backward_no_pipelining``, on CPU through
  tests/megatron_cpu_shim.py), gradients all-reduced by torch, SGD;
- ``hf``: ``examples/huggingface/train_trainer.py`` (HF Trainer, DeepSpeed ZeRO-2, CP 2 from the key) as
  tests/hf/test_hf_examples.py launches it (torchrun --standalone, 2 steps, 12 documents a row; it ends with
  ``destroy_process_group()``); stock: its config without the key.
Counts the ranks' exit codes per shape and arm (a run fails when a rank's code is not 0; -6 is SIGABRT,
"terminate called without an active exception"; for ``example`` and ``hf`` the launcher's code, 1 when a rank
failed, with the ranks' codes from its report), and prints the load average, since aborts are more frequent under load.
Rounds alternate the arms' order (harness.round_order); ``--stock-rounds`` runs the control in fewer rounds,
spread evenly. ``--hog 0,19`` runs one busy loop per listed nice level beside the runs (issue 56: the aborts
came under load; the suite runs its background jobs at nice 19).

    python bench/clean_exits.py --rounds 100 --stock-rounds 30 --shapes example,train,save,load --hog 0,19
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import round_order  # noqa: E402

ARMS = ("key", "stock")
SHAPES = ("train", "save", "load", "comm", "example", "megatron", "hf")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = {"example": ("deepspeed", "train.py"), "hf": ("huggingface", "train_trainer.py")}  # (folder, script)


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
    if shape == "megatron":
        return megatron_main(arm)
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


def megatron_main(arm: str) -> None:
    """The ``megatron`` shape on this rank (see the module docstring); ends without destroy_process_group."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "tests"))  # toy_pipeline.py (and megatron_cpu_shim.py for stock)
    import toy_pipeline as toy
    from megatron.core.transformer import TransformerConfig

    dist.init_process_group("gloo")
    hidden, layers, m, steps = 32, 4, 3, 3
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=1,
                               pipeline_dtype=torch.float32, microbatch_group_size_per_vp_stage=1)
    batches = toy.make_microbatches(m, 4, 2, hidden)
    if arm == "key":
        import l3plugin.megatron
        from l3plugin.megatron import forward_backward_pipelining_flexible
        from l3plugin.megatron.zero import attach_to_schedule, megatron_zero
        from l3plugin.mesh.groups import init_mesh

        l3plugin.megatron.install("flexible")
        init_mesh(dp=dist.get_world_size())
        chunks = toy.build_chunks(config, num_layers=layers, hidden=hidden, pp_rank=0, pp_size=1)
        zero = megatron_zero(chunks, torch.optim.SGD([q for c in chunks for q in c.parameters()], lr=0.1), stage=2)
        attach_to_schedule(config, zero)
        for _ in range(steps):
            forward_backward_pipelining_flexible(forward_step_func=toy.forward_step, data_iterator=[iter(batches)],
                                                 model=chunks, num_microbatches=m, seq_length=4, micro_batch_size=2)
            zero.step()
        return
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_cpu_shim import stock_schedules_on_cpu

    ps.initialize_model_parallel(create_gloo_process_groups=False)
    chunk = toy.ToyChunk(config, range(layers), hidden, is_first=True, is_last=True)
    optimizer = torch.optim.SGD(chunk.parameters(), lr=0.1)
    group = ps.get_data_parallel_group()
    for _ in range(steps):
        optimizer.zero_grad()
        with stock_schedules_on_cpu():
            get_forward_backward_func()(forward_step_func=toy.forward_step, data_iterator=iter(batches),
                                        model=[chunk], num_microbatches=m, seq_length=4, micro_batch_size=2)
        for p in chunk.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= dist.get_world_size(group)
        optimizer.step()


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


def run_example(shape: str, arm: str, folder: str, timeout: float) -> list:
    """The example of ``shape`` (EXAMPLES) under torchrun as the tests run it (tests/test_examples.py,
    tests/hf/test_hf_examples.py): [the launcher's exit code] followed by the failed ranks' codes from its report
    ("timeout" when killed after ``timeout`` s)."""
    os.makedirs(folder, exist_ok=True)
    example = os.path.join(ROOT, "examples", EXAMPLES[shape][0])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.join(example, EXAMPLES[shape][1]), "--steps", "2"]
    if shape == "hf":
        cmd += ["--docs-per-row", "12", "--output-dir", folder]
    if arm == "key":
        if shape == "example":
            cmd += ["--export", os.path.join(folder, "fp32.pt")]
    else:
        with open(os.path.join(example, "ds_config.json")) as f:
            config = json.load(f)
        config.pop("l3plugin")
        stock = os.path.join(folder, "ds_config_stock.json")
        with open(stock, "w") as f:
            json.dump(config, f)
        cmd += ["--config", stock]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # the session holds the launcher and its ranks: one kill
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return ["timeout"]
    if proc.returncode == 0:
        return [0]
    ranks = [int(code) for code in re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", err, re.M)]  # the report's lines
    print(f"  {shape}/{arm}: exit {proc.returncode}, ranks {ranks}: "
          f"{[line for line in err.splitlines() if 'terminate' in line or 'Error' in line][:2]}", file=sys.stderr)
    return [proc.returncode, *ranks]


def start_hogs(nice_levels) -> list:
    """One busy loop per nice level; each dies with this process (PR_SET_PDEATHSIG) or at the end of main."""
    def child(level):
        def setup():
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no hog outlives the bench
            os.nice(level)
        return setup
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=child(level))
            for level in nice_levels]


def stock_round(index: int, rounds: int, stock_rounds: int) -> bool:
    """Whether round ``index`` runs the stock arm: ``stock_rounds`` of ``rounds``, spread evenly."""
    return (index + 1) * stock_rounds // rounds != index * stock_rounds // rounds


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
    parser.add_argument("--stock-rounds", type=int, default=None, help="rounds that also run stock (default all)")
    parser.add_argument("--hog", default="", help="nice levels of busy loops run beside, e.g. 0,19 (default none)")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    stock_rounds = args.rounds if args.stock_rounds is None else args.stock_rounds
    try:
        hogs = [int(level) for level in args.hog.split(",") if level.strip()]
    except ValueError:
        hogs = None
    if bad or not shapes or args.rounds < 1 or not args.timeout > 0 or not 0 <= stock_rounds <= args.rounds \
            or hogs is None or any(not 0 <= level <= 19 for level in hogs):
        parser.error(f"--shapes {args.shapes!r} (known: {', '.join(SHAPES)}), --rounds {args.rounds} (>= 1), "
                     f"--timeout {args.timeout} (> 0), --stock-rounds {args.stock_rounds} (0 to --rounds), "
                     f"--hog {args.hog!r} (nice levels 0-19, comma-separated)")
    counts = collections.defaultdict(collections.Counter)
    load_before = os.getloadavg()
    start = time.monotonic()
    hog_procs = start_hogs(hogs)
    try:
        with tempfile.TemporaryDirectory(prefix="clean-exits-") as root:
            damaged = {arm: damaged_checkpoint(arm, root, args.timeout)
                       for arm in ARMS if arm == "key" or stock_rounds} if "load" in shapes else {}
            for index in range(args.rounds):
                arms = [arm for arm in round_order(ARMS, index)
                        if arm == "key" or stock_round(index, args.rounds, stock_rounds)]
                for shape in shapes:
                    for arm in arms:
                        t0 = time.monotonic()
                        folder = damaged.get(arm) if shape == "load" else os.path.join(root, f"{shape}-{arm}")
                        codes = (run_example(shape, arm, folder, args.timeout) if shape in EXAMPLES
                                 else run_once(shape, arm, folder, args.timeout))
                        counts[(shape, arm)]["ok" if all(c == 0 for c in codes) else "failed"] += 1
                        counts[(shape, arm)]["seconds"] += time.monotonic() - t0
                        for code in codes[1:] if shape in EXAMPLES else codes:
                            if code != 0:
                                counts[(shape, arm)][f"rank exit {code}"] += 1
                so_far = "; ".join(f"{shape}/{arm} {counts[(shape, arm)]['ok']}/{_runs(counts[(shape, arm)])}"
                                   for shape in shapes for arm in ARMS)
                print(f"round {index + 1}/{args.rounds}: load average {os.getloadavg()[0]:.1f}; exit 0 so far: "
                      f"{so_far}", file=sys.stderr, flush=True)  # a run cut short still says what it counted
    finally:
        for hog in hog_procs:
            hog.kill()
            hog.wait(timeout=10)
    print(f"{'shape':<7} {'arm':<6} {'runs':>5} {'exit 0':>7} {'s/run':>6}  failures")
    for shape in shapes:
        for arm in ARMS:
            c = counts[(shape, arm)]
            detail = ", ".join(f"{k}: {v}" for k, v in sorted(c.items()) if k.startswith("rank")) or "-"
            per_run = f"{c['seconds'] / _runs(c):.1f}" if _runs(c) else "-"
            print(f"{shape:<7} {arm:<6} {_runs(c):>5} {c['ok']:>7} {per_run:>6}  {detail}")
    print(f"load average (1 min) {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
          f"{time.monotonic() - start:.0f} s; {os.cpu_count()} CPUs; hogs at nice {hogs or 'none'}")
    return {f"{shape}/{arm}": dict(counts[(shape, arm)]) for shape in shapes for arm in ARMS}


def _runs(counter) -> int:
    return counter["ok"] + counter["failed"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(*sys.argv[2:5])
    else:
        main()
