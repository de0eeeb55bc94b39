"""l3plugin's FP32-reducing ZeRO on the Megatron-Core path (megatron_zero + attach_to_schedule + the flexible
schedule), its variants side by side on 2 CPU ranks (gloo, dp 2, pp 1).

    .venv/bin/python bench/zero_megatron.py --wire auto        # per-rank wire, rate from --comm-share
    .venv/bin/python bench/zero_megatron.py --wire 1gbit --gas 4 8 --rounds 6
    .venv/bin/python bench/zero_megatron.py --quick            # tiny model, 1 round, no wire: a smoke run

The model is the demo's Llama-style Megatron-Core GPTModel (l3plugin.demo.model: RMSNorm, SwiGLU, RoPE, GQA,
word embedding tied to the output layer, bf16 parameters, calculate_per_token_loss), one chunk per rank, torch
AdamW, every option of megatron_zero at its default except bucket_numel (--bucket: a real model has many
buckets of the default 25M elements; this one would have one). One micro-batch per round (pp 1: the flexible
schedule's k = p = 1), so ZeRO-2 reduce-scatters after every micro-batch. Contenders (CONTENDERS), each for
ZeRO-2 and ZeRO-1:

- "blocking": overlap=False, every collective waited where it is started (exp/coll's denominator);
- "round-end start": attach_to_schedule(..., reduce_in_backward=False), the behaviour before reductions were
  started in backward: all of a round's reduce-scatters start after its last backward;
- "default": what megatron_zero + attach_to_schedule do: each bucket's reduce-scatter starts from the gradient
  hook of the round's last backward that completes it; the round end waits for all but the 3 started last
  (carry_buckets), which run on under the next round; the step only starts the parameter all-gathers, each
  completed in the next forward (overlap_param_gather);
- "carry_buckets 0" (ZeRO-2): the same, but the round end waits for every one of the round's reductions;
  "overlap_param_gather off (before)": the step completes its parameter all-gathers (the default before).

One RankPool(2) serves the whole run (on a per-rank wire every rank on its own link, bench/wire.py). Per gas,
each contender is built once in the workers and kept; its first three steps there are the warm-up and give the
recorded figures; then every round runs every contender once (bench/harness.py's interleaved rounds, the order
rotating by one contender per round). Asserts nothing; --json: every figure as JSON on stdout, the tables on
stderr. Columns:

- step ms: wall time of one step (flexible schedule with --gas micro-batches, zero.step()), slower rank, median.
- exposed ms: per round, step time minus the same step of the same contender run right after it inside
  l3plugin.debug.local_collectives(p2p=True) (every collective and point-to-point message a local copy); median.
- exp/coll: per round, exposed ms / exposed ms of the blocking contender of the same stage (whose exposed time is
  the time spent in collectives); median (range). The share of the communication left exposed.
- bound: the least exp/coll any bucket layout or wait policy could reach holding at most the fp32 shard + 5%
  between rounds (harness.exposure_bound, median of rounds): each parameter's gradient goes on the link no
  earlier than its last hook in the round, at the speed of a round's reduce-scatters started back to back
  ("alone" above); what is left at a round end is waited, less what 5% of the shard (4 bytes per element carried)
  lets run on. The JSON also has it at the emulated wire's own rate ("wire"), a looser bound. ZeRO-2 only.
- grad B/param: live-tensor census (bench/zero.py's live_tensors) at the start of micro-batch 1's forward in
  step 2 (micro-batch 0's backward and its round end are done): storages not held before the contender was
  built, minus the parameters, the fp32 master shards, the optimizer state and the data; larger rank.
- in bwd/all: gradient reductions (DP point-to-point exchange sends on gloo) started while a backward ran (from
  gradient hooks), of all the step made (rank 0, step 1).
- waits ms: per rank, ms per step blocked in FP32ReduceZero._complete (waiting a bucket's reduce-scatter:
  at the next accumulation into it, at a round end, in finish_grad_sync), median of rounds; final ms: the
  time in finish_grad_sync (the finalize function: the step's last reductions started and waited).
- identical: the fp32 master shards after the 3 warm-up steps equal the blocking contender's bit for bit.

--emulated-compute MS: the output of every matmul module (each layer's attention and MLP, the output layer) passes
through bench/zero.py's device_time, which sleeps the module's share of MS (by its weights' elements; a third in
the forward, two thirds in the backward): compute that leaves the CPU free for the communication, as while a GPU
computes (use a small --micro-batch / --seq so that the CPU's own is small). Earlier runs (docs/runs/
zero_megatron_defaults_emulated_*.json, zero_megatron_emulated_200mbit_carry1.json) put a layer's whole share on
its output and none on the output layer: a layer's weight gradients were final only after its whole backward
time, later than on a GPU, and the output layer's backward took no time.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness  # noqa: E402
import wire  # noqa: E402
from zero import (add_emulated_compute_argument, bucket_elements, checked_buckets,  # noqa: E402  (bench/zero.py)
                  emulated_text)
from l3plugin.ranks.pool import RankPool  # noqa: E402

# name: (stage, megatron_zero settings, reduce_in_backward)
CONTENDERS = {
    "ZeRO-2 blocking": (2, {"overlap": False}, True),
    "ZeRO-2 round-end start": (2, {}, False),
    "ZeRO-2 carry_buckets 0": (2, {"carry_buckets": 0}, True),
    "ZeRO-2 carry_buckets 1": (2, {"carry_buckets": 1}, True),  # opt-in: the last bucket carried, whatever its size
    "ZeRO-2 overlap_param_gather off (before)": (2, {"overlap_param_gather": False}, True),
    "ZeRO-2 default": (2, {}, True),
    # The default before: the 3 buckets started last carried whatever their size, buckets as given.
    "ZeRO-2 carry_buckets 3, buckets as given (before)": (2, {"carry_buckets": 3, "bucket_numel": "given"}, True),
    "ZeRO-1 blocking": (1, {"overlap": False}, True),
    "ZeRO-1 round-end start": (1, {}, False),
    "ZeRO-1 default": (1, {}, True),
}
BLOCKING = {1: "ZeRO-1 blocking", 2: "ZeRO-2 blocking"}
IDENTICAL = {True: "yes", False: "NO", None: "n/a"}  # None: other buckets than the blocking twin
# The gradient memory the issue allows ZeRO-2 between rounds on this path: the fp32 shard + 5% (the bound's carry).
ALLOWANCE = 0.05
MEGATRON_BUCKET = 25_000_000  # megatron_zero's bucket size before its default was cut to 1/16 of the model

# -- worker side: these run inside the RankPool processes --------------------------------------------------
BUILT: dict = {}  # contender name -> (chunk, zero); for the current gas
BATCHES: list = []  # this rank's micro-batches (the same data every step)


def per_token_loss(loss_mask, per_token):
    """Megatron's calculate_per_token_loss contract: (sum of token losses, token count, stats)."""
    import torch  # in the functions the ranks run: the bench process itself needs no torch

    total = (per_token.float() * loss_mask).sum()
    return total, loss_mask.sum().to(torch.int), {"loss_sum": total.detach()}


def forward_step(data_iterator, model, census=None):
    batch = next(data_iterator)
    if census is not None:
        census(batch)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, functools.partial(per_token_loss, batch["loss_mask"])


def model_config(args, k=None):
    from l3plugin.demo.model import llama_config

    return llama_config(num_layers=args["layers"], hidden=args["hidden"], heads=args["heads"],
                        kv_heads=args["heads"] // 2, ffn=args["ffn"], k=k)


def build_model(args):
    """(this rank's GPTModel chunk, its config): the same weights on every rank and for every contender."""
    from megatron.core import parallel_state as ps

    from l3plugin.demo.model import build_chunk
    from l3plugin.mesh.groups import init_mesh

    if not ps.model_parallel_is_initialized():
        init_mesh(dp=2)  # once: the contenders' optimizers keep its groups
    config = model_config(args)
    chunk = build_chunk(config, vocab=args["vocab"], seq_len=args["seq"], pre_process=True, post_process=True,
                        position_embedding_type="rope", share_embeddings_and_output_weights=True)
    if args.get("emulated_compute_ms"):
        add_emulated_compute(chunk, args["emulated_compute_ms"] / 1000)
    return chunk, config


def add_emulated_compute(chunk, seconds):
    """--emulated-compute: spread ``seconds`` per micro-batch over the chunk's matmuls in proportion to their
    weights' elements (their FLOPs per token): every layer's attention and MLP, and the output layer (the tied
    embedding, vocab x hidden). Each passes its output through device_time, so a module's weight gradients are
    final after its own share of the backward, as on a GPU."""
    modules = [(m, sum(p.numel() for p in m.parameters()))
               for layer in chunk.decoder.layers for m in (layer.self_attention, layer.mlp)]
    modules.append((chunk.output_layer, chunk.shared_embedding_or_output_weight().numel()))
    total = sum(n for _, n in modules)
    for module, n in modules:
        module.register_forward_hook(functools.partial(_emulated_module_time, seconds=seconds * n / total))


def _emulated_module_time(module, inputs, output, seconds):
    from zero import device_time  # bench/zero.py

    if isinstance(output, tuple):  # attention, MLP and output layer return (output, bias)
        return (device_time(output[0], seconds), *output[1:])
    return device_time(output, seconds)


def make_batches(gas, args):
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + gas)
    out = []
    for _ in range(gas):
        tokens = torch.randint(1, args["vocab"], (args["micro_batch"], args["seq"] + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "loss_mask": torch.ones(args["micro_batch"], args["seq"]),
                    "position_ids": torch.arange(args["seq"]).expand(args["micro_batch"], args["seq"])})
    return out


def train_step(name, step_func=forward_step):
    from l3plugin.megatron import forward_backward_pipelining_flexible

    chunk, zero = BUILT[name]
    forward_backward_pipelining_flexible(
        forward_step_func=step_func, data_iterator=[iter(BATCHES)], model=[chunk], num_microbatches=len(BATCHES),
        seq_length=BATCHES[0]["tokens"].shape[1], micro_batch_size=BATCHES[0]["tokens"].shape[0])
    zero.step()


def measure_compute(args):
    """(ms of forward+backward of one micro-batch of the bf16 model, no optimizer: median of 5; params)."""
    chunk, _ = build_model(args)
    batch = make_batches(1, args)[0]
    times = []
    for _ in range(6):
        start = time.perf_counter()
        out, reduce = forward_step(iter([batch]), chunk)
        reduce(out)[0].backward()
        times.append(time.perf_counter() - start)
        chunk.zero_grad(set_to_none=True)
    return 1000 * statistics.median(times[1:]), sum(p.numel() for p in chunk.parameters())


def reduce_scatter_alone(params, bucket):
    """(wall s, CPU s) of one round's fp32 reduce-scatters (every bucket started, then waited), alone."""
    from zero import collectives_alone

    return collectives_alone(params, bucket, gather=False)["fp32 reduce-scatter of all buckets"]


def digest(zero) -> str:
    """SHA-256 of the fp32 master shards, bucket by bucket."""
    sha = hashlib.sha256()
    for bucket in zero.buckets:
        sha.update(bucket.master.detach().numpy().tobytes())
    return sha.hexdigest()


def prepare(name, gas, args):
    """Build the contender and keep it; step 1 is recorded (reductions in backward), step 2 takes the census."""
    from unittest import mock

    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import schedules

    from l3plugin.debug import record_collectives
    from l3plugin.megatron.zero import attach_to_schedule, megatron_zero
    from zero import live_tensors

    if len(BATCHES) != gas:
        BATCHES[:] = make_batches(gas, args)
    before = live_tensors([c for c, _ in BUILT.values()])  # held until the census: no address reuse
    stage, settings, in_backward = CONTENDERS[name]
    chunk, config = build_model(args)
    if settings.get("bucket_numel") == "given" or args["bucket"] is not None:
        settings = {**settings, "bucket_numel": args["bucket"] or MEGATRON_BUCKET}
    zero = megatron_zero([chunk], torch.optim.AdamW(chunk.parameters(), lr=1e-4), stage=stage, **settings)
    attach_to_schedule(config, zero, reduce_in_backward=in_backward)
    BUILT[name] = (chunk, zero)

    marked, backward_step = set(), schedules.backward_step  # the flexible schedule looks it up once per step

    @functools.wraps(backward_step)  # keeps the signature the schedule reads (model_type or not)
    def marked_backward_step(*a, **kw):
        first = len(log)
        result = backward_step(*a, **kw)
        marked.update(range(first, len(log)))
        return result

    with record_collectives() as log, mock.patch.object(schedules, "backward_step", marked_backward_step):
        train_step(name)
    group = dist.get_process_group_ranks(zero.group)
    reductions = [i for i, c in enumerate(log) if c.op == "isend" and c.group == group and c.numel > 1]

    census, forwards = {}, []

    def take_census(batch):
        forwards.append(batch)
        if len(forwards) != 2:
            return
        known = {t.untyped_storage().data_ptr() for t in [*chunk.parameters(), *chunk.buffers()]}
        known |= {b.master.untyped_storage().data_ptr() for b in zero.buckets}
        known |= {v.untyped_storage().data_ptr() for s in zero.optimizer.state.values() for v in s.values()
                  if torch.is_tensor(v)}
        known |= {t.untyped_storage().data_ptr() for b in BATCHES for t in b.values()}
        census.update({p: v for p, v in live_tensors([chunk]).items() if p not in known and p not in before})

    train_step(name, functools.partial(forward_step, census=take_census))
    grad_bytes = sum(nbytes for nbytes, _ in census.values())
    del before, census
    train_step(name)
    return {"reductions": len(reductions), "in_backward": len(set(reductions) & marked),
            "buckets": len(zero.buckets), "elements": sum(b.spec.padded_numel for b in zero.buckets),
            "grad_bytes": grad_bytes, "digest": digest(zero)}


def timed_round(name):
    """(step s, the same step with local collectives s, s blocked in _complete, s in finish_grad_sync, when the
    step's gradients became final and its rounds ended) of one contender, this rank. The last: {"finals":
    (perf_counter, parameter index, elements) per gradient hook, "round_ends": perf_counter per end_of_round}."""
    from l3plugin.debug import local_collectives
    from l3plugin.zero.optimizer import FP32ReduceZero

    chunk, _ = BUILT[name]
    finals, began = [], []
    hooks = [p.register_post_accumulate_grad_hook(
        functools.partial(lambda index, param: finals.append((time.perf_counter(), index, param.numel())), i))
        for i, p in enumerate(chunk.parameters()) if p.requires_grad]
    methods = ["_complete", "finish_grad_sync", "end_of_round"]
    try:
        with harness.timed_methods(FP32ReduceZero, methods, {}, began) as waits:
            timing, _ = harness.barrier_timed(lambda: train_step(name))
    finally:
        for hook in hooks:
            hook.remove()
    record = {"finals": finals, "round_ends": [t for method, t in began if method == "end_of_round"]}
    with local_collectives(p2p=True):
        start = time.perf_counter()
        train_step(name)
        local = time.perf_counter() - start
    return timing["own"], local, waits.get("_complete", 0.0), waits.get("finish_grad_sync", 0.0), record


def free():
    import gc

    BUILT.clear()
    BATCHES.clear()
    gc.collect()


# -- parent side ------------------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gas", type=int, nargs="+", default=[4, 8], help="micro-batches per step")
    # The full run's sizes and --quick's: an option given explicitly wins over both.
    sizes = {"rounds": (5, 1), "layers": (4, 2), "hidden": (256, 64), "ffn": (704, 176), "vocab": (2048, 256),
             "seq": (256, 32)}
    parser.add_argument("--rounds", type=int, help="timed rounds (every contender once per round; default 5, "
                        "--quick 1)")
    parser.add_argument("--layers", type=int, help="default 4 (--quick: 2)")
    parser.add_argument("--hidden", type=int, help="default 256 (--quick: 64)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, help="default 704 (--quick: 176)")
    parser.add_argument("--vocab", type=int, help="default 2048 (--quick: 256)")
    parser.add_argument("--seq", type=int, help="default 256 (--quick: 32)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch per rank")
    parser.add_argument("--bucket", nargs="+", help="bucket sizes, each timed and counted: bucket_numel in "
                        "elements, 1/N (of the model's parameters) or default (bucket_numel left out); default 5e5 "
                        "(--quick: 1e4)")
    parser.add_argument("--comm-share", type=float, default=0.5, help="--wire auto: the share of one "
                        "micro-batch's forward+backward that one round's reduce-scatters alone should take")
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round: a smoke run (the sizes given "
                        "explicitly stay)")
    parser.add_argument("--contenders", nargs="+", metavar="NAME", help="run only these (names as printed; their "
                        "blocking twin is added)")
    add_emulated_compute_argument(parser, "after every attention, MLP and the output layer")
    wire.add_argument(parser)
    harness.add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.contenders:
        unknown = [n for n in args.contenders if n not in CONTENDERS]
        if unknown:
            parser.error(f"--contenders {unknown}: valid names are {list(CONTENDERS)}")
        wanted = set(args.contenders) | {BLOCKING[CONTENDERS[n][0]] for n in args.contenders}
        for name in [n for n in CONTENDERS if n not in wanted]:
            del CONTENDERS[name]
    for name, (full, quick) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.bucket = checked_buckets(parser, args.bucket or (["1e4"] if args.quick else ["5e5"]))
    link = harness.enter_wire(args.wire, "bfloat16", args.wire_mode)
    with harness.json_output(args.json, "zero_megatron", argv) as figures:
        run(args, link, figures)
    return 0


def run(args, link, figures):
    model = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "ffn": args.ffn,
             "vocab": args.vocab, "seq": args.seq, "micro_batch": args.micro_batch, "bucket": None,
             "emulated_compute_ms": args.emulated_compute}
    figures.update(model=model, rounds=args.rounds, gas={}, buckets=args.bucket)
    began = time.perf_counter()
    with RankPool(2, preload=("megatron.core",), keep_state=True, **link.pool_options(2)) as pool:
        compute = pool.run(measure_compute, model, timeout=600)
        params, compute_ms = compute[0][1], max(ms for ms, _ in compute)
        sizes = {spec: bucket_elements(spec, params) for spec in args.bucket}
        model["bucket"] = sizes[args.bucket[0]]
        figures.update(params=params, forward_backward_ms=compute_ms)
        print(f"model: Megatron-Core GPTModel (demo's Llama-style), {args.layers} layers, hidden {args.hidden}, "
              f"ffn {args.ffn}, vocab {args.vocab} tied, {params / 1e6:.2f}M bf16 params; AdamW (torch); dp 2, pp 1, "
              "flexible schedule (a round per micro-batch); buckets "
              + ", ".join(f"{spec} ({n:,} elements)" if n else f"{spec} (bucket_numel left out)"
                          for spec, n in sizes.items())
              + f"; micro-batch "
              f"{args.micro_batch} x {args.seq} tokens per rank: forward+backward {compute_ms:.0f} ms (slower rank"
              + emulated_text(args.emulated_compute) + "); "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)

        def round_alone():
            bucket = min(model["bucket"] or -(-params // 16), params)  # the default: 1/16 of the model
            return max(wall for wall, _ in pool.run(reduce_scatter_alone, params, bucket, timeout=600))

        if link.on and args.wire == "auto":
            figures["calibration"] = harness.calibrate_wire(link, round_alone, args.comm_share * compute_ms / 1000)
        figures.update(rate_bits=link.rate, wire_mode=link.mode)
        alone = figures["round_reduce_scatter_alone_s"] = min(round_alone() for _ in range(3))  # the link's best
        print(link.describe())
        print(f"  one round's fp32 reduce-scatters alone (every bucket, no compute; best of 3): {1000 * alone:.0f} ms "
              f"= {1000 * alone / compute_ms:.0%} of one micro-batch's forward+backward", flush=True)
        # The bound's link speeds: a round's reduce-scatters started back to back on this stack, and (per-rank
        # wire) the rate alone, each rank sending its peer half of every fp32 element.
        link_seconds = {"alone": alone / params}
        if link.mode == "per-rank":
            link_seconds["wire"] = 4 * 8 / 2 / link.rate
        for spec, bucket in sizes.items():
            model["bucket"] = bucket
            for gas in args.gas:
                key = str(gas) if len(sizes) == 1 else f"{gas}, buckets {spec}"
                info = {name: pool.run(prepare, name, gas, model, timeout=1800) for name in CONTENDERS}
                rounds = harness.interleaved_rounds(CONTENDERS, lambda name: pool.run(timed_round, name, timeout=1800),
                                                    args.rounds, warmup=0)  # prepare's steps warmed up
                pool.run(free, timeout=300)
                figures["gas"][key] = {**print_table(key, params, info, rounds, link_seconds), "bucket": bucket}
        harness.report_wire_traffic(link, figures)
    figures["run_time_s"] = time.perf_counter() - began
    print(f"\ntotal run time {figures['run_time_s']:.0f} s")


def bound_stats(name, info, rounds, exposed, link_seconds):
    """ZeRO-2: the least exposed time at the memory the issue allows (the fp32 shard + ALLOWANCE), over the
    blocking twin's exposed time, per round (harness.ratio_stats; "bound_ms": the bound's median), for each link
    speed of ``link_seconds`` ({what: seconds per gradient element})."""
    stage, twin, world = CONTENDERS[name][0], BLOCKING[CONTENDERS[name][0]], 2
    if stage != 2 or name == twin:
        return None
    carried = ALLOWANCE * info[name][0]["elements"] / world  # elements whose 4 fp32 bytes the allowance holds
    out = {}
    for what, seconds in link_seconds.items():
        bounds = [max(harness.exposure_bound(per_rank[r][4]["finals"], per_rank[r][4]["round_ends"], seconds,
                                             carried * seconds) for r in range(world))
                  for per_rank in rounds[name]]
        out[what] = {**harness.ratio_stats(bounds, exposed[twin]), "bound_ms": 1000 * statistics.median(bounds)}
    return out


def print_table(gas, params, info, rounds, link_seconds):
    """Print one gas's table; return its rows."""
    step = {n: [max(r[0] for r in per_rank) for per_rank in results] for n, results in rounds.items()}
    exposed = {n: [t - max(r[1] for r in per_rank) for t, per_rank in zip(step[n], results)]
               for n, results in rounds.items()}
    header = (f"{'gas ' + str(gas):<40} {'step ms':>7} {'exposed ms':>10} {'exp/coll (range)':>17} {'bound':>5} "
              f"{'grad B/param':>12} {'in bwd/all':>10} {'waits ms r0/r1':>14} {'final ms r0/r1':>14} {'identical':>9}")
    print(f"\n{header}\n{'-' * len(header)}")
    rows = []
    for name, (stage, _, _) in CONTENDERS.items():
        rank0, twin = info[name][0], BLOCKING[stage]
        waits = [statistics.median(1000 * per_rank[r][2] for per_rank in rounds[name]) for r in range(2)]
        final = [statistics.median(1000 * per_rank[r][3] for per_rank in rounds[name]) for r in range(2)]
        row = {"contender": name, "step_ms": 1000 * statistics.median(step[name]),
               "exposed_ms": 1000 * statistics.median(exposed[name]),
               "exposed_over_collectives": (harness.ratio_stats(exposed[name], exposed[twin]) if name != twin
                                            else None),
               "grad_bytes_per_param": max(r["grad_bytes"] for r in info[name]) / params,
               "reductions_in_backward": rank0["in_backward"], "reductions": rank0["reductions"],
               "buckets": rank0["buckets"], "waits_ms": waits, "finish_grad_sync_ms": final,
               "exposed_bound": bound_stats(name, info, rounds, exposed, link_seconds),
               # None: another bucket layout than the blocking twin's (other shards: digests not comparable)
               "identical_to_blocking": (all(a["digest"] == b["digest"] for a, b in zip(info[name], info[twin]))
                                         if rank0["buckets"] == info[twin][0]["buckets"] else None)}
        rows.append(row)
        fraction = harness.ratio_text(row["exposed_over_collectives"], 2) if name != twin else "-"
        bound = f"{row['exposed_bound']['alone']['median']:.2f}" if row["exposed_bound"] else "-"
        print(f"{name:<40} {row['step_ms']:>7.0f} {row['exposed_ms']:>10.0f} {fraction:>17} {bound:>5} "
              f"{row['grad_bytes_per_param']:>12.2f} {rank0['in_backward']:>5}/{rank0['reductions']:<4} "
              f"{waits[0]:>6.0f}/{waits[1]:<7.0f} {final[0]:>6.0f}/{final[1]:<7.0f} "
              f"{IDENTICAL[row['identical_to_blocking']]:>9}", flush=True)
    return {"rows": rows}


if __name__ == "__main__":
    sys.exit(main())
