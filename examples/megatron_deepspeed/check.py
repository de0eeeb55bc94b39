"""Megatron-DeepSpeed's pretrain_gpt.py with l3plugin's "l3plugin" DeepSpeed config key, on CPU (gloo, 4 ranks:
PP 2 x DP 2, bf16, DeepSpeed's PipelineEngine, tied embedding, Megatron-DeepSpeed's own Adam and scheduler).

    PYTHONPATH=<six, pybind11> python check.py /path/to/Megatron-DeepSpeed [--out DIR] [--iters 6] [RUN ...]

Fetches nothing: give it a checkout of deepspeedai/Megatron-DeepSpeed (checked at 4efb479). The interpreter running
this must have torch, deepspeed and l3plugin installed (l3plugin's autoload reads the key; nothing in the script
changes), plus six and pybind11 (Megatron-DeepSpeed's imports and its dataset helpers). Runs (each a torchrun of
cpu_run.py pretrain_gpt.py, its log in --out):

  stock_z1          stock DeepSpeed ZeRO-1 (no key)
  stock_z2_refused  stock ZeRO-2: DeepSpeed's PipelineEngine refuses it (the check wants that refusal)
  ours_fp16_refused --fp16 with the key: l3plugin refuses it with its message (bf16 only)
  ours_z1, ours_z2  the same config with "l3plugin": {"fp32_reduce_zero": true}, ZeRO stage 1 and 2
  ours_z1_first, ours_z1_resume   (and z2) the run stopped after --iters // 2 iterations (--exit-interval, with
                    --save), then resumed from that checkpoint (--load) to --iters

It prints the loss of every iteration side by side (full precision, from rank 0) and exits 1 when:
  - a run of ours did not get l3plugin's optimizer, or stock did not get DeepSpeed's, or a run failed;
  - a resumed run's losses differ from the uninterrupted run's at all (bit-equal: the same numerics);
  - iteration 1 differs between any runs (same weights, same batch, no step yet: bit-equal);
  - ours differ from stock ZeRO-1 by more than --tol (default 5e-4 absolute on the loss, 7x the 7.2e-5 measured
    over 6 iterations: stock reduces the gradients in bf16, ours in fp32, so they drift apart by rounding), or ours
    ZeRO-1 from ours ZeRO-2 (fp32 sums in another order; measured equal) by more than --tol;
  - stock ZeRO-2 or ours with fp16 is not refused with its message.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--micro-batch-size 1 --global-batch-size 8")
# No CUDA/apex kernels, no dropout (nothing random after initialisation), gloo, constant learning rate.
CPU = ("--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
       "--attention-dropout 0 --hidden-dropout 0 --distributed-backend gloo "
       "--lr 1e-3 --lr-decay-style constant --seed 1234 --bf16 "
       "--tokenizer-type NullTokenizer --vocab-size 1023 --split 100,0,0 "
       "--log-interval 1 --eval-iters 0 --eval-interval 100000 --pipeline-model-parallel-size 2")


def ds_config(stage, key, fp16=False):
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 100000,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0, "wall_clock_breakdown": False,
              "fp16" if fp16 else "bf16": {"enabled": True}}
    if key:
        config["l3plugin"] = {"fp32_reduce_zero": True}
    return config


def runs(iters):
    half = iters // 2
    table = {
        "stock_z1": (1, False, ""),
        "stock_z2_refused": (2, False, ""),
        "ours_z1": (1, True, ""),
        "ours_z2": (2, True, ""),
        "ours_fp16_refused": (1, True, "--fp16"),
    }
    for stage in (1, 2):
        ckpt = f"{{out}}/ckpt_z{stage}"
        table[f"ours_z{stage}_first"] = (stage, True, f"--exit-interval {half} --save {ckpt} --save-interval 1000")
        table[f"ours_z{stage}_resume"] = (stage, True, f"--load {ckpt} --save {ckpt} --save-interval 1000")
    return table


ORDER = ["stock_z1", "stock_z2_refused", "ours_fp16_refused", "ours_z1", "ours_z2", "ours_z1_first",
         "ours_z1_resume", "ours_z2_first", "ours_z2_resume"]
LOSS = re.compile(r"\[check\] iteration (\d+): lm loss ([^,]+), grad norm (\S+)")
ENGINE = re.compile(r"\[check\] rank (\d+): (\w+), optimizer (\S+), zero stage (\d)")
REFUSAL = {"stock_z2_refused": "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism",
           "ours_fp16_refused": "l3plugin FP32-reducing ZeRO cannot run this config: fp16 is enabled"}


def run(name, spec, args, data):
    stage, key, extra = spec
    fp16 = "--fp16" in extra.split()
    config = os.path.join(args.out, f"ds_{name}.json")
    with open(config, "w") as f:
        json.dump(ds_config(stage, key, fp16), f, indent=1)
    cpu = [a for a in CPU.split() if not (fp16 and a == "--bf16")]
    command = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                str(args.port), os.path.join(HERE, "cpu_run.py"), "pretrain_gpt.py"]
               + MODEL.split() + cpu + ["--train-iters", str(args.iters), "--data-path", data,
               "--deepspeed", "--deepspeed_config", config, "--zero-stage", str(stage)]
               + extra.format(out=args.out).split())
    log = os.path.join(args.out, f"{name}.log")
    start = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as f:
        f.write(" ".join(command) + "\n")
        f.flush()
        try:
            rc = subprocess.run(command, cwd=args.megatron_deepspeed, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = parse(log, rc, name)
    print(f"== {name}: exit {rc}, {time.time() - start:.0f} s, {sorted(result['engines'])}", flush=True)
    return result


def parse(log, rc, name):
    text = open(log, errors="replace").read()
    losses = {int(i): float(loss) for i, loss, _ in LOSS.findall(text)}
    engines = {(e, o, int(s)) for _, e, o, s in ENGINE.findall(text)}
    return {"rc": rc, "losses": losses, "engines": engines, "refused": name in REFUSAL and REFUSAL[name] in text,
            "log": log}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("megatron_deepspeed", help="checkout of deepspeedai/Megatron-DeepSpeed")
    parser.add_argument("runs", nargs="*", help=f"a subset of {ORDER}")
    parser.add_argument("--out", default=os.path.abspath("megatron_deepspeed_check"))
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--tol", type=float, default=5e-4, help="ours against stock / ZeRO-1 against ZeRO-2")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: compare the logs in --out of an earlier run (exit codes taken as 0)")
    args = parser.parse_intermixed_args()
    args.megatron_deepspeed = os.path.abspath(args.megatron_deepspeed)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(args.out, "data", "tiny_text_document")
    if not os.path.exists(data + ".idx"):
        os.makedirs(os.path.dirname(data), exist_ok=True)
        subprocess.run([sys.executable, os.path.join(HERE, "make_data.py"), args.megatron_deepspeed, data],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    table = runs(args.iters)
    results = {}
    for name in args.runs or ORDER:
        if args.report_only:
            log = os.path.join(args.out, f"{name}.log")
            if os.path.exists(log):
                results[name] = parse(log, 1 if name.endswith("_refused") else 0, name)
            continue
        if name.endswith("_first"):  # a fresh checkpoint directory for each interrupted run
            subprocess.run(["rm", "-rf", os.path.join(args.out, "ckpt_" + name.split("_")[1])], check=True)
        results[name] = run(name, table[name], args, data)
    sys.exit(report(results, args))


def report(results, args):
    failures = []
    names = [n for n in results if results[n]["losses"]]
    print("\niteration  " + "  ".join(f"{n:>22}" for n in names))
    for i in range(1, args.iters + 1):
        row = [results[n]["losses"].get(i) for n in names]
        print(f"{i:>9}  " + "  ".join(f"{'' if v is None else repr(v):>22}" for v in row))

    def fail(message):
        failures.append(message)
        print("FAIL:", message)

    for name, result in results.items():
        stock = name.startswith("stock")
        if name.endswith("_refused"):
            if not result["refused"] or result["rc"] == 0:
                fail(f"{name}: not refused with {REFUSAL[name]!r} (see {result['log']})")
            continue
        if result["rc"] != 0:
            fail(f"{name}: exit {result['rc']} (see {result['log']})")
        want = "deepspeed." if stock else "l3plugin.deepspeed.optimizer.DeepSpeedFP32ReduceZero"
        if not result["engines"] or any(e != "PipelineEngine" or not o.startswith(want)
                                        for e, o, _ in result["engines"]):
            fail(f"{name}: engines {sorted(result['engines'])}, wanted PipelineEngine with {want}")
        half = args.iters // 2
        start, stop = (1, half) if name.endswith("_first") else (half + 1, args.iters) if name.endswith("_resume") \
            else (1, args.iters)
        expected = set(range(start, stop + 1))
        if set(result["losses"]) != expected:
            fail(f"{name}: iterations {sorted(result['losses'])}, wanted {sorted(expected)}")

    def compare(a, b, tol):
        if a not in results or b not in results:
            return
        la, lb = results[a]["losses"], results[b]["losses"]
        for i in sorted(set(la) & set(lb)):
            diff = abs(la[i] - lb[i])
            if diff > tol:
                fail(f"iteration {i}: {a} {la[i]!r} against {b} {lb[i]!r}, |diff| {diff:.3g} > {tol:g}")

    first = {n: r["losses"][1] for n, r in results.items() if 1 in r["losses"]}
    if len(set(first.values())) > 1:
        fail(f"iteration 1 differs between runs: {first}")
    for stage in (1, 2):
        base = f"ours_z{stage}"
        compare(base, f"{base}_first", 0.0)
        compare(base, f"{base}_resume", 0.0)
    compare("stock_z1", "ours_z1", args.tol)
    compare("stock_z1", "ours_z2", args.tol)
    compare("ours_z1", "ours_z2", args.tol)
    for a, b in (("stock_z1", "ours_z1"), ("stock_z1", "ours_z2"), ("ours_z1", "ours_z2")):
        if a in results and b in results:
            la, lb = results[a]["losses"], results[b]["losses"]
            common = set(la) & set(lb)
            if common:
                print(f"max |{a} - {b}| = {max(abs(la[i] - lb[i]) for i in common):.3g}")
    print("OK" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    main()
