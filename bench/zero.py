"""Stock DeepSpeed ZeRO-1/2 against l3plugin's FP32-reducing ZeRO-1/2, measured side by side on 2 CPU ranks (gloo).

    .venv/bin/python bench/zero.py            # ~25M-param bf16 model, gas 4 and 8, 5 rounds
    .venv/bin/python bench/zero.py --quick    # tiny model, 2 rounds: a smoke run (--rounds 1: one)
    .venv/bin/python bench/zero.py --wire 4gbit   # on an emulated wire (root): traffic costs wall time, not CPU

Every variant uses zero_optimization {reduce_bucket_size, allgather_bucket_size: --bucket, overlap_comm (true unless
the name says "no overlap"), contiguous_gradients: true} and torch AdamW; "ours" adds the top-level key "l3plugin":
{"fp32_reduce_zero": true} and the options its name says ("ours ZeRO-2" alone: the defaults, carrying the last
carry_buckets reduce-scatters into the next micro-batch; "carry_buckets 0 (before)": the previous default). One
RankPool(2) serves the run. Per gas, each variant's engine is built once in the workers and kept (ENGINES; its three
steps there are the warm-up); then every round runs every variant once (bench/harness.py's interleaved rounds: the
order of VARIANTS, each "ours" next to the run it is compared with, rotated by one variant per round). Everything
printed is measured; nothing is computed from a model of the hardware. Asserts nothing; --json: every figure as JSON
on stdout, the tables on stderr. Columns:

- step ms: wall time of one optimizer step (--gas x forward, engine.backward, engine.step), slower rank, median.
- ratio: per round, step time / that of the stock variant of the same stage (ours ZeRO-1 vs stock ZeRO-1, every
  ZeRO-2 variant vs stock ZeRO-2) in the same round; the median of these per-round ratios (their range).
- exposed ms: per round, step time minus the time of the same step of the same engine, run right after it
  inside l3plugin.debug.local_collectives(p2p=True) (every collective and point-to-point message replaced by
  a local copy; receives get zeros); median.
- exp/coll: per round, exposed ms / exposed ms of the same configuration with overlap_comm false (blocking
  collectives: its exposed time is the time spent in collectives); median (range). The fraction of the communication
  that overlap fails to hide (ours only: stock has no such twin here).
- CPU busy: per round, the CPU seconds both ranks' processes spent in the normal step (every thread: compute
  and gloo's workers; time.process_time) over (CPU cores x step wall time); median. Near 1.0 the cores were never
  idle, so communication, which on gloo is CPU work (copies, sums, loopback TCP), can only overlap compute by
  taking cores from it.
- grad B/param: live-tensor census between micro-batches (after a micro-batch's engine.step(), before the next
  forward) at every micro-batch boundary of the engine's second step, the largest: the tensors of gc.get_objects()
  plus every module parameter's .grad (autograd keeps an untouched .grad on the C++ side, where gc does not see it;
  a tensor no Python object holds is waited for, up to 1 s, as gloo's worker drops a finished collective's buffer),
  unique storages by data_ptr, storage bytes summed; minus the storages alive before this engine was built (other
  engines, data), the module parameters, the base torch optimizer's parameters and state, DeepSpeed's
  single_partition_of_fp32_groups and bit16_groups_flat. Bytes per model parameter, larger rank. --census-detail
  prints what remained. (Taken at every boundary: after the first micro-batch ZeRO-2 has no shard yet for buckets it
  carries, nor reduce_every for any bucket.)
- held after the step: the same census right after a step (pending parameter all-gathers), B/param, larger rank.
- in bwd/all: gradient reductions (reduce-scatter, all-reduce, reduce of more than one element, and on gloo
  l3plugin's point-to-point exchange sends; scalars are norms and overflow flags) started while a loss.backward() ran, i.e. from autograd's gradient hooks,
  overlapping the rest of backward, and how many the step made (rank 0, the recorded third step).
- grad err: relative L2 error of safe_get_full_grad after the first step's last backward, against an fp64 sum of
  the same bf16 micro-batch gradients (a bf16 replica of the model, same data) averaged over the ranks.
- coll MB/step: input bytes handed to collectives in the recorded step (l3plugin.debug.record_collectives, rank 0)
  per op (RS reduce-scatter, AR all-reduce, AG all-gather, R reduce, P2P point-to-point sends) and dtype (on
  gloo ours reduce-scatters by a point-to-point exchange, l3plugin/collective/comm.py: P2P there).
- where ours waits (a second table): per rank, the median ms per step blocked in the optimizer's waits (WAITS).
--wire RATE runs everything on an emulated wire (bench/wire.py; --wire-mode per-rank, the default: each rank its
own full-duplex link at RATE each way; shared: one loopback bus at RATE); --variants picks a subset.
--emulated-compute MS adds MS of emulated accelerator compute per micro-batch: after every Linear the rank sleeps
its share (a third in the forward, two thirds in the backward), so the CPU is free for the communication, as
while a GPU computes. With a small --micro-batch (little CPU compute) it separates what the schedule hides from
what gloo's CPU work (the exchange's sums and copies, the emulated link) takes from a CPU-bound compute on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness  # noqa: E402
import wire  # noqa: E402
from l3plugin.ranks.pool import RankPool  # noqa: E402

# name: (stage, l3plugin options or None for stock, overlap_comm, extra DeepSpeed config); "half" = gas // 2
VARIANTS = {
    "stock ZeRO-1": (1, None, True, {}),
    "ours ZeRO-1": (1, {}, True, {}),
    "ours ZeRO-1 no overlap": (1, {}, False, {}),
    "ours ZeRO-1 overlap_param_gather off (before)": (1, {"overlap_param_gather": False}, True, {}),
    "stock ZeRO-2": (2, None, True, {}),
    "ours ZeRO-2": (2, {}, True, {}),  # the defaults (carry_bytes: 1/32 of the shard; buckets <= 1/16 of the model)
    # The defaults before: the 3 buckets started last carried whatever their size, buckets as the config gives them.
    "ours ZeRO-2 carry_buckets 3, buckets as given (before)": (2, {"carry_buckets": 3, "bucket_numel": "given"}, True,
                                                               {}),
    "ours ZeRO-2 carry_buckets 0": (2, {"carry_buckets": 0}, True, {}),
    **{f"ours ZeRO-2 carry_buckets {n}": (2, {"carry_buckets": n}, True, {}) for n in (1, 3, 5)},
    "ours ZeRO-2 no overlap": (2, {}, False, {}),
    "ours ZeRO-2 overlap_param_gather off (before)": (2, {"overlap_param_gather": False}, True, {}),
    "ours ZeRO-2 carry_reductions": (2, {"carry_reductions": True}, True, {}),
    "stock ZeRO-2 fp32 grad_accum": (2, None, True, {"data_types": {"grad_accum_dtype": "fp32"}}),
    "ours ZeRO-2 reduce_every=gas/2": (2, {"reduce_every": "half"}, True, {}),
}
STOCK_OF_STAGE = {1: "stock ZeRO-1", 2: "stock ZeRO-2"}
DEEPSPEED_BUCKET = 500_000_000  # zero_optimization.reduce_bucket_size's default
# The blocking twin of each overlapped "ours" (its exposed time is its communication time: exp/coll's denominator).
NO_OVERLAP_TWIN = {name: f"ours ZeRO-{stage} no overlap" for name, (stage, plugin, overlap, _) in VARIANTS.items()
                   if plugin is not None and overlap and plugin.get("reduce_every") != "half"}
# isend: on gloo l3plugin's reduce-scatter is a point-to-point exchange (one isend per peer and bucket)
REDUCTIONS = ("reduce_scatter_tensor", "reduce_scatter", "all_reduce", "all_reduce_coalesced", "reduce", "isend")
SHORT_OP = {"isend": "P2P", "reduce_scatter_tensor": "RS", "reduce_scatter": "RS", "all_reduce": "AR", "all_gather_into_tensor": "AG",
            "all_gather": "AG", "reduce": "R", "broadcast": "B"}

# -- worker side: these run inside the RankPool processes --------------------------------------------------
ENGINES: dict = {}  # variant name -> DeepSpeed engine, for the current gas
BATCHES: list = []  # this rank's micro-batches (the same data every step)


def quiet_deepspeed():
    import logging

    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # ~120 s JIT compile, inference only
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    import l3plugin.deepspeed  # noqa: F401  (installs the "l3plugin" config key)
    return deepspeed


def cached_comm_functions():
    """DeepSpeed cached these torch functions at init: patch its copies too (recording, local copies)."""
    from deepspeed.comm import comm as ds_comm

    return [(ds_comm.cdb, "all_gather_function", "all_gather_into_tensor"),
            (ds_comm.cdb, "reduce_scatter_function", "reduce_scatter_tensor")]


EMULATED_COMPUTE_MS = [0.0]  # --emulated-compute: this worker's sleep per micro-batch (set_emulated_compute)


def set_emulated_compute(ms):
    EMULATED_COMPUTE_MS[0] = ms


def make_model(width, layers):
    """layers x (Linear + Tanh) + Linear(width, 1); with --emulated-compute a DeviceTime after every Linear
    sleeps its share of the micro-batch's time (a third in the forward, two thirds in the backward)."""
    import torch

    torch.manual_seed(0)
    share = EMULATED_COMPUTE_MS[0] / 1000 / (layers + 1)
    mods = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), DeviceTime(share), torch.nn.Tanh())]
    mods += [torch.nn.Linear(width, 1), DeviceTime(share)]
    return torch.nn.Sequential(*[m for m in mods if m is not None])


def device_time(x, seconds):
    """x, passed through a stand-in for compute on an accelerator: the host thread waits (sleeps: the CPU is free
    for the communication, as it is while a GPU computes) seconds / 3 here and 2 seconds / 3 in the backward,
    before the backward of what made x (that layer's gradient hooks fire after its share of time)."""
    import torch

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(seconds / 3)
            return x.clone()  # not a view: a later in-place op on it (Megatron's residual adds) stays legal

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * seconds / 3)
            return grad

    return Sleep.apply(x)


def DeviceTime(seconds):
    """A module applying ``device_time``; None (no module) when seconds is 0."""
    import torch

    class DeviceTimeModule(torch.nn.Module):
        def forward(self, x):
            return device_time(x, seconds)

    return DeviceTimeModule() if seconds > 0 else None


def loss_of(out):
    return out.float().pow(2).mean()


def build_engine(name, gas, micro_batch, width, layers, bucket):
    stage, plugin, overlap, extra = VARIANTS[name]
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": gas,
           "bf16": {"enabled": True}, "steps_per_print": 10**9,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                 "overlap_comm": overlap, "contiguous_gradients": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, **extra}
    if bucket is None:  # DeepSpeed's defaults (reduce_bucket_size 5e8)
        del cfg["zero_optimization"]["reduce_bucket_size"], cfg["zero_optimization"]["allgather_bucket_size"]
    if plugin is not None:
        cfg["l3plugin"] = {"fp32_reduce_zero": True, **plugin}
        if plugin.get("reduce_every") == "half":
            cfg["l3plugin"]["reduce_every"] = max(1, gas // 2)
        if plugin.get("bucket_numel") == "given":
            cfg["l3plugin"]["bucket_numel"] = bucket or DEEPSPEED_BUCKET
    model = make_model(width, layers)
    engine, *_ = quiet_deepspeed().initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def train_step(engine, between_micro_batches=None):
    for i, x in enumerate(BATCHES):
        engine.backward(loss_of(engine(x)))
        engine.step()  # only counts, except after the last micro-batch
        if i < len(BATCHES) - 1 and between_micro_batches is not None:
            between_micro_batches()


def measure_compute(width, layers, micro_batch):
    """(ms of forward+backward of one micro-batch of the plain bf16 model, median of 5; its parameter count)."""
    import torch

    model, x, times = make_model(width, layers).bfloat16(), torch.randn(micro_batch, width).bfloat16(), []
    for _ in range(6):
        start = time.perf_counter()
        loss_of(model(x)).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return 1000 * statistics.median(times[1:]), sum(p.numel() for p in model.parameters())


# How long the census waits for tensors that only C++ still holds to be let go (see python_held).
SETTLE_S = 1.0


def python_held(tensors):
    """ids of the ``tensors`` that Python holds: referred to by a gc-tracked object that is not one of them (a
    container, a frame), or by a tensor so held (its traversed references, its .grad, which autograd keeps on the
    C++ side, and its ._base). The others are held only by C++: a tensor saved by a live autograd graph, or a
    collective's buffer that gloo's worker thread has finished with and not yet dropped (it drops the work only
    after waking the waiter); a view of such a buffer holds the buffer only through C++ as well."""
    import torch

    by_id = {id(t): t for t in tensors}
    held, links = set(), {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some deprecated torch objects warns, as .grad of non-leaves
        for obj in gc.get_objects():
            if obj is not tensors and obj is not by_id:  # the census's own
                refs = [id(r) for r in gc.get_referents(obj) if isinstance(r, torch.Tensor)]
                if id(obj) in by_id:
                    links[id(obj)] = refs
                else:
                    held.update(refs)
        todo = list(held)
        while todo:
            t = by_id.get(todo.pop())
            for r in [] if t is None else links.get(id(t), []) + [id(x) for x in (t._base, t.grad) if x is not None]:
                if r not in held:
                    held.add(r)
                    todo.append(r)
    return held


def live_tensors(modules=(), settle_s=SETTLE_S):
    """{storage data_ptr: (storage bytes, the largest tensor on it)} of every live tensor (see module doc).

    gc.get_objects() hands each tensor a Python reference. One that only C++ held, a gloo worker about to drop a
    finished all-reduce's buffer, is then kept alive by the census itself: stock ZeRO-2 read 4.00 instead of 2.00
    B/param between micro-batches in about 1 census of 10 (its one bucket's flat bf16 buffer) when the census came
    first. Those tensors are held weakly and waited for, up to ``settle_s``; the ones alive then are counted."""
    import weakref

    import torch

    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some deprecated torch objects warns
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    held = python_held(tensors)
    only_cpp = [weakref.ref(t) for t in tensors if id(t) not in held]
    tensors = [t for t in tensors if id(t) in held]  # the strong references to the others go here
    deadline = time.monotonic() + settle_s
    while any(r() is not None for r in only_cpp) and time.monotonic() < deadline:
        time.sleep(0.001)
    tensors += [t for t in (r() for r in only_cpp) if t is not None]
    found = {}
    for t in tensors + [p.grad for m in modules for p in m.parameters() if p.grad is not None]:
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # sparse, meta, fake tensors left by torch.compile, ...
            continue
        if ptr and (ptr not in found or t.numel() > found[ptr][1].numel()):
            found[ptr] = (storage.nbytes(), t)
    return found


def known_state(engine):
    """Storages that are not gradient state: parameters, optimizer parameters and state, flat fp32/bf16 groups."""
    import torch

    known = list(engine.module.parameters())
    base = getattr(engine.optimizer, "optimizer", None)
    if base is not None:
        known += [p for group in base.param_groups for p in group["params"]]
        known += [v for state in base.state.values() for v in state.values() if torch.is_tensor(v)]
    for attr in ("single_partition_of_fp32_groups", "bit16_groups_flat"):
        known += list(getattr(engine.optimizer, attr, None) or [])
    return {t.untyped_storage().data_ptr() for t in known}


def gradient_error(engine, gas, width, layers):
    """Run the engine's first step next to an fp64 reference of the rank-averaged gradient; the relative error."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    replica = make_model(width, layers).bfloat16()
    reference = {p: torch.zeros(p.shape, dtype=torch.float64) for p in replica.parameters()}

    def accumulate(p):
        reference[p].add_(p.grad.double())
        p.grad = None

    hooks = [p.register_post_accumulate_grad_hook(accumulate) for p in replica.parameters()]
    num = den = 0.0
    for i, x in enumerate(BATCHES):
        (loss_of(replica(x)) / gas).backward()
        engine.backward(loss_of(engine(x)))
        if i == gas - 1:
            for p, q in zip(engine.module.parameters(), replica.parameters()):
                ref = reference[q]
                dist.all_reduce(ref)
                ref /= dist.get_world_size()
                num += (safe_get_full_grad(p).double() - ref).pow(2).sum().item()
                den += ref.pow(2).sum().item()
        engine.step()
    for hook in hooks:  # held by autograd, a hook would keep the replica and the reference alive
        hook.remove()
    return (num / den) ** 0.5


def prepare_variant(name, gas, micro_batch, width, layers, bucket):
    """Build the engine; step 1 measures the gradient error, step 2 the census, step 3 is recorded. Keep it."""
    import torch
    import torch.distributed as dist

    from l3plugin.debug import record_collectives

    if len(BATCHES) != gas or BATCHES[0].shape != (micro_batch, width):
        seed = 1000 * dist.get_rank()
        BATCHES[:] = [torch.randn(micro_batch, width, generator=torch.Generator().manual_seed(seed + i)).bfloat16()
                      for i in range(gas)]
    before = live_tensors([e.module for e in ENGINES.values()])  # held until the census: no address reuse
    engine = build_engine(name, gas, micro_batch, width, layers, bucket)
    error = gradient_error(engine, gas, width, layers)

    census = {}  # the largest boundary's {storage: (bytes, "dtype(shape)" of its largest tensor)}; labels only:
    # a tensor kept here would stay alive into the next boundary's census

    def take_census(into=census):
        with torch._C.DisableTorchFunction():  # past the parameter-gather guard: counting must not complete them
            excluded = set(before) | known_state(engine) | {x.untyped_storage().data_ptr() for x in BATCHES}
            found = {ptr: (nbytes, f"{str(t.dtype).replace('torch.', '')}{tuple(t.shape)}")
                     for ptr, (nbytes, t) in live_tensors([engine.module]).items() if ptr not in excluded}
        if sum(nbytes for nbytes, _ in found.values()) > sum(nbytes for nbytes, _ in into.values()):
            into.clear()
            into.update(found)

    train_step(engine, between_micro_batches=take_census)
    take_census(after_step := {})  # the same census right after the step: pending parameter all-gathers, inputs
    step_bytes = sum(nbytes for nbytes, _ in after_step.values())
    detail = {}  # "dtype(shape)" of the largest tensor on a storage -> [storages, bytes]
    for nbytes, label in census.values():
        counts = detail.setdefault(label, [0, 0])
        counts[0], counts[1] = counts[0] + 1, counts[1] + nbytes
    grad_bytes = sum(nbytes for nbytes, _ in census.values())
    del before, census, after_step

    in_backward = set()  # log indices of the collectives started while a loss.backward() ran
    original_backward = torch.Tensor.backward

    def marked_backward(self, *args, **kwargs):
        first = len(log)
        result = original_backward(self, *args, **kwargs)
        in_backward.update(range(first, len(log)))
        return result

    with record_collectives(extra_targets=cached_comm_functions()) as log:
        torch.Tensor.backward = marked_backward
        try:
            train_step(engine)
        finally:
            torch.Tensor.backward = original_backward
    reductions = {i for i, c in enumerate(log) if c.op in REDUCTIONS and c.numel > 1}
    comm = {}  # "op dtype" -> input bytes
    for c in log:
        if not c.bytes:  # receives hand over nothing: what they get is counted at the sender
            continue
        dtype = str(c.dtype).replace("torch.", "").replace("bfloat", "bf").replace("float", "fp")
        key = f"{SHORT_OP.get(c.op, c.op)} {dtype}"
        comm[key] = comm.get(key, 0) + c.bytes
    ENGINES[name] = engine
    return {"optimizer": type(engine.optimizer).__name__, "grad_error": error, "grad_bytes": grad_bytes,
            "step_bytes": step_bytes,
            "detail": detail, "comm": comm, "reductions": len(reductions),
            "in_backward": len(reductions & in_backward)}


def timed_round(name):
    """(step seconds, the same step with every collective replaced by a local copy, CPU seconds this process
    (all its threads: compute and the gloo workers) spent in the normal step) of one engine, this rank."""
    from l3plugin.debug import local_collectives

    engine = ENGINES[name]
    with waits_timed(engine) as waits:
        timing, _ = harness.barrier_timed(lambda: train_step(engine))
    normal, cpu = timing["own"], timing["busy"]
    with local_collectives(extra_targets=cached_comm_functions(), p2p=True):
        start = time.perf_counter()
        train_step(engine)
        local = time.perf_counter() - start
    return normal, local, cpu, waits


# Where ours blocks on communication: (method of FP32ReduceZero, label). _complete waits for one bucket's
# reduce-scatter (during backward when its buffer is written again, at a backward's end, at the step);
# finish_grad_sync is the step's sync and the end-of-backward one with carry_buckets 0 (launches and _complete
# waits); wait_reductions_but_latest the end-of-backward wait that carries the last buckets; wait_param_gather
# completes parameter all-gathers (in the forward with overlap_param_gather); all_gather_params includes
# the gathers' waits otherwise. A rank waiting longer than its peer also waits for the peer's compute.
WAITS = (("_complete", "RS waits"), ("finish_grad_sync", "finish_grad_sync (backward ends, step)"),
         ("wait_reductions_but_latest", "backward ends carrying"),
         ("wait_param_gather", "AG waits in fwd"), ("all_gather_params", "AG in step"))


def waits_timed(engine):
    """Seconds this rank spends inside the WAITS methods during the block ({} for stock engines)."""
    from l3plugin.zero.optimizer import FP32ReduceZero

    if not hasattr(engine.optimizer, "zero"):
        return contextlib.nullcontext({})
    return harness.timed_methods(FP32ReduceZero, [method for method, _ in WAITS], {})


def collectives_alone(params, bucket, repeats=3, gather=True):
    """(wall s, CPU s) of what ours sends per reduction and per step with no compute beside it: the fp32
    reduce-scatter of every bucket (started together, then waited, as in a backward) and (``gather``) the bf16
    parameter all-gather; medians."""
    import torch
    import torch.distributed as dist

    from l3plugin.collective import comm

    world = dist.get_world_size()
    sizes = [min(bucket, params - start) for start in range(0, params, bucket)]
    grads = [torch.ones(-(-n // world) * world) for n in sizes]
    shards = [torch.ones(-(-n // world), dtype=torch.bfloat16) for n in sizes]

    def reduce_scatter():
        for flight in [comm.start_reduce_scatter_sum(g, dist.group.WORLD, torch.float32, tag=i)
                       for i, g in enumerate(grads)]:
            flight.wait()

    ops = {"fp32 reduce-scatter of all buckets": reduce_scatter}
    if gather:
        ops["bf16 parameter all-gather"] = lambda: [f.wait() for f in [comm.start_all_gather(s, dist.group.WORLD)
                                                                        for s in shards]]
    return wire.time_collectives_alone(1, repeats, ops=ops)


def free_engines():
    ENGINES.clear()
    BATCHES.clear()
    gc.collect()


# -- parent side ------------------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gas", type=int, nargs="+", default=[4, 8], help="gradient accumulation steps")
    # --quick's sizes, and the full run's: an option given explicitly wins over both.
    sizes = {"rounds": (5, 2), "width": (2048, 256), "layers": (6, 2), "micro_batch": (64, 16)}
    parser.add_argument("--rounds", type=int, help="timed rounds (every variant once per round; default 5, --quick 2)")
    parser.add_argument("--width", type=int, help="default 2048 (--quick: 256)")
    parser.add_argument("--layers", type=int, help="default 6 (--quick: 2)")
    parser.add_argument("--micro-batch", type=int, help="samples per micro-batch per rank (default 64, --quick 16)")
    parser.add_argument("--bucket", nargs="+", help="reduce/allgather bucket sizes, each timed and "
                        "counted: elements, 1/N (of the model's parameters) or default (DeepSpeed's, 5e8: the keys "
                        "left out); default 1e6 (--quick: 2e4)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds: a smoke run (the sizes given "
                        "explicitly stay)")
    parser.add_argument("--census-detail", action="store_true", help="print what the gradient census counted")
    parser.add_argument("--variants", nargs="+", metavar="NAME", help="run only these variants (names as printed; "
                        "their baselines are added)")
    add_emulated_compute_argument(parser, "after every Linear")
    wire.add_argument(parser)
    harness.add_json_argument(parser)
    args = parser.parse_args(argv)
    link = wire.enter(args.wire, "bfloat16", args.wire_mode)
    if args.variants:
        unknown = [n for n in args.variants if n not in VARIANTS]
        if unknown:
            parser.error(f"--variants {unknown}: valid names are {list(VARIANTS)}")
        wanted = set(args.variants)
        wanted |= {STOCK_OF_STAGE[VARIANTS[n][0]] for n in args.variants} | {NO_OVERLAP_TWIN.get(n) for n in args.variants}
        for name in [n for n in VARIANTS if n not in wanted]:
            del VARIANTS[name]
    for name, (full, quick) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.bucket = checked_buckets(parser, args.bucket or (["2e4"] if args.quick else ["1e6"]))
    with harness.json_output(args.json, "zero", argv) as figures:
        run(args, link, figures)


def add_emulated_compute_argument(parser, where: str) -> None:
    """--emulated-compute MS (this bench's and zero_megatron.py's): sleeps ``where``, checked >= 0."""
    def milliseconds(text):
        value = float(text)
        if not 0 <= value < 1e6:
            raise argparse.ArgumentTypeError(f"{text}: give milliseconds >= 0 (0: none)")
        return value

    parser.add_argument("--emulated-compute", type=milliseconds, default=0.0, metavar="MS",
                        help=f"add MS of emulated accelerator compute per micro-batch ({where} the ranks sleep their "
                        "share: a third in the forward, two thirds in the backward), keeping the CPU free for the "
                        "communication as on a GPU; use it with a small micro-batch (default 0: CPU compute only)")


def emulated_text(ms: float) -> str:
    """What the compute line adds for --emulated-compute ("" without)."""
    return f"; {ms:.0f} ms of it emulated accelerator compute, the CPU free" if ms else ""


def bucket_elements(spec: str, params: int) -> int | None:
    """--bucket's value in elements: None for DeepSpeed's default (the keys left out)."""
    if spec == "default":
        return None
    if spec.startswith("1/"):  # rounded up to a multiple of 16 (stock wants a multiple of its alignment)
        return -(-params // (16 * int(spec[2:]))) * 16
    return int(float(spec))


def checked_buckets(parser, specs: list[str]) -> list[str]:
    """--bucket's values, each checked by ``bucket_elements`` (a parser error names a bad one)."""
    for spec in specs:
        try:
            bucket_elements(spec, 1)
        except ValueError:
            parser.error(f"--bucket {spec!r}: give elements (1e6), a share of the model (1/16) or default")
    return specs


def run(args, link, figures):
    """Every table, for every bucket size and gas; figures: what they print (bytes, seconds). With several bucket
    sizes the tables are keyed "gas, buckets SIZE"."""
    figures.update(width=args.width, layers=args.layers, micro_batch=args.micro_batch, buckets=args.bucket,
                   emulated_compute_ms=args.emulated_compute,
                   rounds=args.rounds, rate_bits=link.rate, wire_mode=link.mode, gas={})
    began = time.perf_counter()
    # DeepSpeed, and the compiler modules its first initialize imports (its Muon optimizer's torch.compile), once
    # in the pool's fork server rather than in every rank: seconds each
    with RankPool(2, preload=("deepspeed", "torch._inductor.compile_fx"), **link.pool_options(2)) as pool:
        pool.run(set_emulated_compute, args.emulated_compute, timeout=60)
        compute = pool.run(measure_compute, args.width, args.layers, args.micro_batch, timeout=300)
        params = figures["params"] = compute[0][1]
        figures["forward_backward_ms"] = max(ms for ms, _ in compute)
        sizes = {spec: bucket_elements(spec, params) for spec in args.bucket}
        figures["bucket"] = sizes[args.bucket[0]] or DEEPSPEED_BUCKET
        print(f"model: {args.layers} x (Linear({args.width}, {args.width}) + Tanh) + Linear({args.width}, 1) = "
              f"{params / 1e6:.1f}M bf16 params; AdamW (torch); 2 gloo ranks, 1 thread each; buckets "
              + ", ".join(f"{spec} ({n or DEEPSPEED_BUCKET:,} elements)" for spec, n in sizes.items())
              + f"; {args.rounds} rounds\nmicro-batch {args.micro_batch} samples per rank: forward+backward "
              f"{max(ms for ms, _ in compute):.0f} ms (plain bf16 model, both ranks at once, slower rank"
              + emulated_text(args.emulated_compute) + "); "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
        print(link.describe())
        results = pool.run(collectives_alone, params, min(sizes[args.bucket[0]] or params, params), timeout=600)
        figures["collectives_alone_s"] = {}
        for name in results[0]:
            wall, cpu = max(r[name][0] for r in results), max(r[name][1] for r in results)
            figures["collectives_alone_s"][name] = {"wall": wall, "cpu": cpu}
            print(f"  alone on this wire, no compute: {name}: {1000 * wall:.0f} ms wall, {1000 * cpu:.0f} ms CPU "
                  f"(slower rank, median; buckets {args.bucket[0]})", flush=True)
        for spec, bucket in sizes.items():
            for gas in args.gas:
                key = str(gas) if len(sizes) == 1 else f"{gas}, buckets {spec}"
                info = {name: pool.run(prepare_variant, name, gas, args.micro_batch, args.width, args.layers,
                                       bucket, timeout=1800) for name in VARIANTS}
                rounds = harness.interleaved_rounds(VARIANTS, lambda name: pool.run(timed_round, name, timeout=1800),
                                                    args.rounds, warmup=0)  # prepare_variant's steps warmed up
                step, exposed, busy, waits = {}, {}, {}, {}  # waits: per round, per rank {method: seconds}
                for name, results in rounds.items():
                    step[name] = [max(r[0] for r in per_rank) for per_rank in results]
                    exposed[name] = [t - max(r[1] for r in per_rank) for t, per_rank in zip(step[name], results)]
                    # Both ranks' CPU seconds over what the machine's cores offer in the step's wall time.
                    busy[name] = [sum(r[2] for r in per_rank) / (os.cpu_count() * t)
                                  for t, per_rank in zip(step[name], results)]
                    waits[name] = [[r[3] for r in per_rank] for per_rank in results]
                pool.run(free_engines, timeout=300)
                figures["gas"][key] = {"rows": print_table(key, args, params, info, step, exposed, busy),
                                       "waits_ms": print_waits(key, waits), "bucket": bucket or DEEPSPEED_BUCKET,
                                       "load_average": os.getloadavg()[0]}
                print(f"(load average {os.getloadavg()[0]:.1f} at the end of gas {key})", flush=True)
        print_memory(figures["gas"], params)
        harness.report_wire_traffic(link, figures)
    figures["run_time_s"] = time.perf_counter() - began
    print(f"\ntotal run time {figures['run_time_s']:.0f} s")


def print_memory(tables, params):
    """Gradient memory between micro-batches (the census) of every variant at every bucket size, in one table,
    with the share of the communication left exposed beside it."""
    keys = list(tables)
    print("\ngradient B/param between micro-batches (census, larger rank) / exp/coll, per table: " + "; ".join(keys))
    for row in tables[keys[0]]["rows"]:
        cells = []
        for key in keys:
            other = next(r for r in tables[key]["rows"] if r["variant"] == row["variant"])
            fraction = other["exposed_over_collectives"]
            cells.append(f"{other['grad_bytes_per_param']:.2f} / " + (f"{fraction['median']:.2f}" if fraction else "-"))
        print(f"  {row['variant']:<52} " + " | ".join(cells), flush=True)


def print_waits(gas, waits):
    """Per rank, the median ms ours spent blocked in each WAITS method per step: which rank waits, and where.
    Returns {variant: {label: [rank 0 ms, rank 1 ms]}}."""
    table = {}
    print(f"\ngas {gas}, where ours waits per step (ms, median of rounds), rank 0 / rank 1: "
          + ", ".join(label for _, label in WAITS))
    for name, rounds in waits.items():
        if not rounds or not rounds[0][0]:
            continue
        cells, table[name] = [], {}
        for method, label in WAITS:
            per_rank = table[name][label] = [statistics.median(1000 * r[rank].get(method, 0.0) for r in rounds)
                                             for rank in range(2)]
            cells.append(f"{label} {per_rank[0]:.0f} / {per_rank[1]:.0f}")
        print(f"  {name:<52} " + "; ".join(cells), flush=True)
    return table


def print_table(gas, args, params, info, step, exposed, busy):
    """Print one gas's table; return its rows. Ratios: the median of per-round ratios with their range (the
    machine is shared: the spread says how much)."""
    rows = []
    header = (f"{'gas ' + str(gas):<52} {'optimizer':<24} {'step ms':>7} {'ratio (range)':>16} {'exposed ms':>10} "
              f"{'exp/coll (range)':>17} {'CPU busy':>8} {'grad B/param':>12} {'in bwd/all':>10} {'grad err':>8}  coll MB/step")
    print(f"\n{header}\n{'-' * len(header)}")
    for name, (stage, _, _, _) in VARIANTS.items():
        rank0, baseline, twin = info[name][0], STOCK_OF_STAGE[stage], NO_OVERLAP_TWIN.get(name)
        row = {"variant": name, "optimizer": rank0["optimizer"], "step_ms": 1000 * statistics.median(step[name]),
               "ratio": harness.ratio_stats(step[name], step[baseline]) if name != baseline else None,
               "baseline": baseline, "exposed_ms": 1000 * statistics.median(exposed[name]),
               "exposed_over_collectives": harness.ratio_stats(exposed[name], exposed[twin]) if twin else None,
               "cpu_busy": statistics.median(busy[name]),
               "grad_bytes_per_param": max(r["grad_bytes"] for r in info[name]) / params,
               "after_step_bytes_per_param": max(r["step_bytes"] for r in info[name]) / params,
               "reductions_in_backward": rank0["in_backward"], "reductions": rank0["reductions"],
               "grad_error": rank0["grad_error"], "collective_bytes": rank0["comm"]}
        rows.append(row)
        ratio = harness.ratio_text(row["ratio"], 2) if row["ratio"] else "-"
        fraction = harness.ratio_text(row["exposed_over_collectives"], 2) if twin else "-"
        comm = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(rank0["comm"].items()))
        print(f"{name:<52} {rank0['optimizer']:<24} {row['step_ms']:>7.0f} {ratio:>16} {row['exposed_ms']:>10.0f} "
              f"{fraction:>17} {row['cpu_busy']:>8.2f} {row['grad_bytes_per_param']:>12.2f} "
              f"{rank0['in_backward']:>5}/{rank0['reductions']:<4} {rank0['grad_error']:>8.1e}  {comm}; held after "
              f"the step {row['after_step_bytes_per_param']:.2f} B/param", flush=True)
    if args.census_detail:
        for name in VARIANTS:
            for rank, r in enumerate(info[name]):
                largest = sorted(r["detail"].items(), key=lambda kv: -kv[1][1])
                print(f"  census {name}, rank {rank}: " + "; ".join(
                    f"{n} x {label} = {b / 1e6:.2f} MB" for label, (n, b) in largest[:8]))
    return rows


if __name__ == "__main__":
    sys.exit(main())
