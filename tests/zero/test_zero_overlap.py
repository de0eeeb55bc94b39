"""Overlapped (asynchronous, bucketed) reduce-scatters and real ZeRO-2 under DeepSpeed's engines.

- overlap on and off give bit-identical gradients, fp32 masters and bf16 parameters (same arithmetic, same
  order), for ZeRO-1, ZeRO-2 every micro-batch and ZeRO-2 every N micro-batches, in DeepSpeedEngine,
  PipelineEngine and the framework-neutral core driven round by round;
- with overlap, the reductions are handed to torch.distributed *during* backward (before the engine's
  post-backward epilogue runs); without it, none are;
- ZeRO-2 holds between micro-batches the fp32 shard plus the reductions it carries into the next micro-batch:
  by default those started last that fit in carry_bytes (1/32 of the shard), with the opt-in carry_buckets N the
  full buffers of the N started last (0: only the shard);
  with reduce_every=N it holds all full buffers inside each window of N; ZeRO-1 holds them across the step;
  safe_get_full_grad between micro-batches waits for a carried bucket and gives what the blocking path gives;
- bad options name the option, the value and the valid range; a collective a peer never joins ends in a
  rank-named error after wait_timeout instead of blocking.
"""

import time

import pytest
import torch
import torch.distributed as dist

from ds_models import batch, ds_config, engine_for, loss_of, reduced_grad_error
from zero_models import all_params, chunk_params, make_chunks, run_rounds

BUCKET = 100  # the MLP (13x24, 24x24, 24x1 + biases, 961 elements) spreads over several buckets
REDUCTIONS = ("reduce_scatter_tensor", "isend")  # gloo: a bucket's reduce-scatter is a point-to-point exchange


def plugin(**options):
    return {"fp32_reduce_zero": True, "bucket_numel": BUCKET, **options}


def config(stage, overlap, gas=4, **options):
    cfg = ds_config(stage, gas=gas, plugin=plugin(**options), clip=1.0)
    cfg["zero_optimization"]["overlap_comm"] = overlap
    return cfg


# -- workers ---------------------------------------------------------------------------------------------
def train_and_watch(stage, overlap, gas=4, steps=2, **options):
    """Train ``steps`` steps; per micro-batch record how many bucket reductions were handed to
    torch.distributed before the engine's post-backward epilogue began, and the gradient state held
    between micro-batches (which buckets have a full buffer, which a reduction in flight). Returns final fp32
    masters, bf16 params, gradient (before the last step), and ``probe``: safe_get_full_grad of the first
    layer's weight (bucket 0, the last one backward completes) after the last step's first micro-batch."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from l3plugin.debug import record_collectives

    engine = engine_for(config(stage, overlap, gas, **options))
    zero = engine.optimizer.zero
    counts_at_epilogue = []
    first = [0]  # where in the log the current micro-batch's collectives start
    epilogue = engine.optimizer.after_backward

    def watched_epilogue():
        counts_at_epilogue.append(sum(1 for c in log[first[0]:] if c.op in REDUCTIONS and c.numel > 1))
        epilogue()

    engine.optimizer.after_backward = watched_epilogue
    between, grads, probe = [], None, None
    rank = dist.get_rank()
    # One recording for the whole run (the log lists every call in order, as it is made): patching the collectives
    # in and out around each micro-batch instead cost a third of the run.
    with record_collectives() as log:
        for step in range(steps):
            for mb in range(gas):
                first[0] = len(log)
                engine.backward(loss_of(engine(batch(rank, step, mb))))
                if mb < gas - 1:
                    engine.step()
                    between.append({"full": [b.spec.index for b in zero.buckets if b.full is not None],
                                    "in_flight": [b.spec.index for b in zero.buckets if b.in_flight is not None],
                                    "bytes": zero.memory.current})
                    if step == steps - 1 and mb == 0:
                        probe = safe_get_full_grad(engine.module[0].weight)
            if step == steps - 1:
                grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
            engine.step()
        zero.wait_param_gather()  # with overlap_param_gather the last step's gathers land in the next forward
    return {"masters": [safe_get_full_fp32_param(p) for p in engine.module.parameters()],
            "params": [p.detach().clone() for p in engine.module.parameters()], "grads": grads,
            "counts": counts_at_epilogue, "between": between, "buckets": len(zero.buckets), "probe": probe,
            "bucket_of_probe": zero.slots[engine.module[0].weight].bucket,
            "shard_bytes": sum(4 * b.spec.shard_numel for b in zero.buckets),
            "full_bytes": [4 * b.spec.padded_numel for b in zero.buckets]}


def fp64_error(stage, gas=8, **options):
    """Relative error vs fp64 of the reduced gradient after ``gas`` micro-batches."""
    return reduced_grad_error(engine_for(config(stage, True, gas, **options)), gas)


def core_rounds(stage, overlap):
    """The framework-neutral core driven round by round (the Megatron-Core path): end_of_round starts the
    reduce-scatter and returns; the result is waited at the next accumulation into the bucket or in step."""
    from l3plugin.zero import FP32ReduceZero

    chunks = make_chunks()
    zero = FP32ReduceZero(torch.optim.AdamW(all_params(chunks), lr=1e-3), stage=stage, bucket_numel=300,
                          chunks=chunk_params(chunks), overlap=overlap)
    in_flight_after_rounds = []
    for step in range(2):
        run_rounds(chunks, zero, step=step, num_mb=8, k=2)
        in_flight_after_rounds.append(sum(b.in_flight is not None for b in zero.buckets))
        zero.step()
    return {"params": [p.detach().clone() for p in all_params(chunks)],
            "masters": [b.master.detach().clone() for b in zero.buckets], "in_flight": in_flight_after_rounds}


def peer_never_joins(timeout):
    """Rank 1 skips the reduction rank 0 waits for: rank 0 must fail after ``timeout`` s, naming itself."""
    from l3plugin.zero import FP32ReduceZero

    chunks = make_chunks(num_chunks=1)
    zero = FP32ReduceZero(torch.optim.SGD(all_params(chunks), lr=0.1), wait_timeout=timeout)
    chunks[0](torch.ones(2, 21, dtype=torch.bfloat16)).float().sum().backward()
    if dist.get_rank() == 0:
        zero.finish_grad_sync()
    # Rank 1 returns at once and idles in the pool, which waits for rank 0's answer before it replaces the workers.
    return "returned"


def error_of(stage, gas=4, zero_config=None, **options):
    cfg = ds_config(stage, gas=gas, plugin={"fp32_reduce_zero": True, **options})
    cfg["zero_optimization"].update(zero_config or {})
    try:
        engine_for(cfg)
    except Exception as exc:  # noqa: BLE001 - the message is what we check
        return f"{type(exc).__name__}: {exc}"
    return None


# -- tests -----------------------------------------------------------------------------------------------
def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def watched(ranks):
    """``watched(stage, overlap, **options)``: train_and_watch's per-rank results (gas 4), run on first use and shared:
    the overlapped runs of test_gradient_memory_between_micro_batches are those of
    test_overlap_is_bit_identical_and_starts_reductions_during_backward with the same options."""
    cache = {}

    def get(stage, overlap, **options):
        key = (stage, overlap, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = ranks.run(2, train_and_watch, stage, overlap, 4, **options, timeout=120)
        return cache[key]
    return get


CARRY_BUCKET_0 = 2000  # bytes: bucket 0 (the first weight, 312 elements) in flight holds 1,872 on gloo, 2 ranks


@pytest.mark.parametrize("stage,options", [(1, {}), (2, {}), (2, {"carry_bytes": CARRY_BUCKET_0}),
                                          (2, {"carry_buckets": 3}), (2, {"reduce_every": 2}),
                                          (2, {"reduce_every": 3}), (1, {"overlap_param_gather": False}),
                                          (2, {"carry_reductions": True}), (2, {"overlap_param_gather": False})])
def test_overlap_is_bit_identical_and_starts_reductions_during_backward(watched, stage, options):
    """(2, {}): the default (what fits in carry_bytes runs on into the next micro-batch: nothing on this model)
    over gas 4, two steps; carry_bytes / carry_buckets / carry_reductions carry bucket 0, which the probe reads."""
    gas = 4
    blocking = watched(stage, False, **options)
    overlapped = watched(stage, True, **options)
    every = options.get("reduce_every", 1) if stage == 2 else gas
    for b, o in zip(blocking, overlapped):
        for key in ("masters", "params", "grads"):
            assert _same(b[key], o[key]), key
        assert torch.equal(b["probe"], o["probe"])  # safe_get_full_grad between micro-batches
        if stage == 2 and every == 1 and {"carry_bytes", "carry_buckets", "carry_reductions"} & set(options):
            assert o["bucket_of_probe"] in o["between"][gas - 1]["in_flight"]
        # Micro-batches that end with a reduction: (mb + 1) % every == 0 or the last one of the step.
        reducing = [(mb + 1) % every == 0 or mb == gas - 1 for _ in range(2) for mb in range(gas)]
        if stage == 1:  # DeepSpeed calls the ZeRO-1 epilogue (reduce_gradients) at the boundary only
            reducing = [r for r in reducing if r]
        # Overlap: every bucket's reduction was handed to torch.distributed before backward ended
        # (a dense model completes every bucket inside backward); blocking: none was.
        assert o["counts"] == [o["buckets"] if r else 0 for r in reducing]
        assert b["counts"] == [0] * len(reducing)
        assert all(held["in_flight"] == [] for held in b["between"])  # blocking: nothing carried
        assert o["buckets"] > 3


@pytest.mark.parametrize("stage,options,carry", [(1, {}, 0), (2, {}, 0), (2, {"carry_bytes": CARRY_BUCKET_0}, 1),
                                                (2, {"carry_buckets": 0}, 0), (2, {"carry_buckets": 2}, 2),
                                                (2, {"reduce_every": 2}, 0)])
def test_gradient_memory_between_micro_batches(watched, stage, options, carry):
    """``carry``: the buckets whose reduce-scatters run on into the next micro-batch (the default budget, 1/32 of
    the 1,924-byte shard, holds none of them)."""
    for r in watched(stage, True, **options):
        assert r["buckets"] > carry
        for mb, held in enumerate(r["between"]):
            mb %= 3  # micro-batches 0..2 of each step (the 4th is followed by the step)
            if stage == 2 and (mb + 1) % options.get("reduce_every", 1) == 0:
                # Real ZeRO-2: the fp32 shard of every bucket, plus the full buffers of the ``carry`` buckets
                # started last (the lowest indices: backward completes them last) whose reduce-scatters run on
                # into the next micro-batch (gloo's point-to-point works finish only when waited: all still
                # count as in flight). Only those: the bound holds whatever the model's size.
                carried = list(range(carry))
                assert held["in_flight"] == carried and held["full"] == carried, (mb, held)
                carried_bytes = sum(r["full_bytes"][:carry])
                if mb >= options.get("reduce_every", 1):  # after the first reduction carried buckets have no shard
                    assert held["bytes"] == r["shard_bytes"] + carried_bytes, (mb, held)
                assert held["bytes"] <= r["shard_bytes"] + carried_bytes, (mb, held)
            else:
                # Inside a window (ZeRO-1: the whole step) the fp32 full-size buffers accumulate, nothing runs.
                assert held["in_flight"] == [] and held["full"] == list(range(r["buckets"])), (mb, held)
                assert held["bytes"] >= sum(r["full_bytes"]), (mb, held)


@pytest.mark.parametrize("stage,options", [(1, {}), (2, {}), (2, {"reduce_every": 4})])
def test_fp32_error_vs_fp64_stays_below_1e_6(ranks, stage, options):
    for err in ranks.run(2, fp64_error, stage, 8, **options, timeout=120):
        assert err < 1e-6, err


def carried_and_gathered(wire_numel):
    """ZeRO-2 with carry_reductions + overlap_param_gather under DeepSpeedEngine: after a non-final micro-batch
    the reductions still running are carried (their buckets in flight, nothing else), and after the step the
    parameter all-gathers are pending until the forward: every parameter is stale before it (the step's
    update is not in it yet) and current after it. ``wire_numel``: a big bucket so some reduction is still
    running at the end of backward (a real exchange, not a local copy)."""
    from l3plugin.zero import FP32ReduceZero  # noqa: F401  (the engine builds it)

    engine = engine_for(config(2, True, 2, carry_reductions=True, overlap_param_gather=True,
                               bucket_numel=wire_numel))
    zero = engine.optimizer.zero
    rank = dist.get_rank()
    engine.backward(loss_of(engine(batch(rank, 0, 0))))
    engine.step()
    carried = {"in_flight": sum(b.in_flight is not None for b in zero.buckets),
               "full": sum(b.full is not None for b in zero.buckets)}
    engine.backward(loss_of(engine(batch(rank, 0, 1))))
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.step()  # the boundary: optimizer step, parameter all-gathers started, not waited
    pending = len(zero._gathers)
    with torch._C.DisableTorchFunction():  # past the guard (a read through it would complete the gather)
        stale = [torch.equal(a, p) for a, p in zip(before, engine.module.parameters())]
    engine(batch(rank, 1, 0))  # the forward's pre-hooks complete every gather
    fresh = [torch.equal(a, p) for a, p in zip(before, engine.module.parameters())]
    return {"carried": carried, "pending": pending, "buckets": len(zero.buckets), "stale": stale, "fresh": fresh,
            "left": len(zero._gathers)}


def test_carried_reductions_and_param_gathers_wait_where_needed(ranks):
    for r in ranks.run(2, carried_and_gathered, 400, timeout=120):
        assert r["carried"]["full"] == r["carried"]["in_flight"]  # only the carried buckets keep full buffers
        assert r["pending"] == r["buckets"] and all(r["stale"])  # nothing written before the forward
        assert r["left"] == 0 and not any(r["fresh"])  # the forward completed every bucket, each changed


def test_carry_and_param_gather_options_are_checked(ranks):
    for message in ranks.run(2, error_of, 2, carry_reductions="yes", timeout=60):
        assert "carry_reductions" in message and "bool" in message
    for message in ranks.run(2, error_of, 1, carry_reductions=True, timeout=60):
        assert "carry_reductions" in message and "stage 1" in message


@pytest.mark.parametrize("stage", [1, 2])
def test_core_rounds_overlap_is_bit_identical(ranks, stage):
    blocking = ranks.run(2, core_rounds, stage, False, timeout=120)
    overlapped = ranks.run(2, core_rounds, stage, True, timeout=120)
    for b, o in zip(blocking, overlapped):
        assert _same(b["params"], o["params"]) and _same(b["masters"], o["masters"])
        # The last rounds' reduce-scatters are still running when the schedule returns (waited in step).
        assert all(n > 0 for n in o["in_flight"]) and b["in_flight"] == [0, 0]


def test_a_peer_that_never_joins_gives_a_rank_named_error(ranks):
    from l3plugin.ranks.pool import RanksFailed

    start = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        ranks.run(2, peer_never_joins, 1.0, timeout=60)  # the reduction never completes: any bound fires
    text = str(err.value)
    assert "rank 0 raised" in text and "CommTimeout" in text
    assert "rank 0: reduce-scatter" in text and "(gradient bucket 0)" in text and "in group ranks [0, 1]" in text
    assert "did not finish within 1 s" in text
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("stage,options,expected", [
    (2, {"reduce_every": 0}, '"l3plugin.reduce_every"=0 is out of range: must be an integer >= 1'),
    (2, {"reduce_every": 1.5}, '"l3plugin.reduce_every" must be int, got 1.5'),
    (2, {"reduce_every": True}, '"l3plugin.reduce_every" must be int, got True'),
    (2, {"reduce_every": 5}, '"l3plugin.reduce_every"=5 is out of range: must be an integer in '
                              '1..gradient_accumulation_steps (=4)'),
    (1, {"reduce_every": 2}, '"l3plugin.reduce_every" is 2 with zero_optimization.stage 1'),
    (2, {"bucket_numel": 0}, '"l3plugin.bucket_numel"=0 is out of range: must be an integer >= 1'),
    (2, {"carry_buckets": -1}, '"l3plugin.carry_buckets"=-1 is out of range: must be an integer >= 0 (buckets whose '
                               'reduce-scatter may run on into the next micro-batch)'),
    (2, {"carry_buckets": 1.5}, '"l3plugin.carry_buckets" must be int, got 1.5'),
    (2, {"carry_buckets": "2"}, '"l3plugin.carry_buckets" must be int, got \'2\''),
    (1, {"carry_buckets": 2}, '"l3plugin.carry_buckets" is 2 with zero_optimization.stage 1; ZeRO-1 reduce-scatters'),
    (2, {"carry_buckets": 1, "carry_reductions": True},
     '"l3plugin.carry_buckets" is 1 with "l3plugin.carry_reductions" true, which carries every bucket: set one'),
    (2, {"carry_bytes": -1}, '"l3plugin.carry_bytes"=-1 is out of range: must be an integer >= 0 (bytes the '
                             'reductions carried into the next micro-batch may hold)'),
    (1, {"carry_bytes": 10}, '"l3plugin.carry_bytes" is 10 with zero_optimization.stage 1; ZeRO-1 reduce-scatters'),
    (2, {"carry_bytes": 10, "carry_buckets": 1}, '"l3plugin.carry_bytes" and "l3plugin.carry_buckets" are both set'),
    (2, {"wait_timeout": 0}, '"l3plugin.wait_timeout"=0 is invalid: must be a finite number of seconds > 0'),
    (2, {"wait_timeout": float("nan")}, '"l3plugin.wait_timeout"=nan is invalid: must be a finite number of'),
])
def test_bad_options_name_the_option_value_and_range(ranks, stage, options, expected):
    for message in ranks.run(2, error_of, stage, 4, **options, timeout=60):
        assert message is not None and expected in message, message


def test_zero_bucket_size_from_deepspeed_is_checked(ranks):
    """Our bucket size defaults to DeepSpeed's reduce_bucket_size, which DeepSpeed itself validates."""
    message = ranks.run(2, error_of, 2, 4, {"reduce_bucket_size": 0}, timeout=60)[0]
    assert "reduce_bucket_size" in message and "greater than 0" in message, message


@pytest.mark.parametrize("kwargs,expected", [
    ({"bucket_numel": 1.7}, "bucket_numel=1.7 is out of range: must be an integer >= 1"),
    ({"bucket_numel": 0}, "bucket_numel=0 is out of range: must be an integer >= 1"),
    ({"clip_grad": float("nan")}, "clip_grad=nan must be a finite number >= 0"),
    ({"wait_timeout": -1}, "wait_timeout=-1 is invalid: must be a finite number of seconds > 0"),
    ({"overlap": "yes"}, "overlap='yes' must be True or False"),
    ({"carry_buckets": -2}, "carry_buckets=-2 is out of range: must be an integer >= 0 (buckets whose"),
    ({"carry_bytes": 1e3, "carry_reductions": True}, "carry_bytes and carry_reductions are both set"),
])
def test_settings_reject_bad_values(kwargs, expected):
    from l3plugin.zero import ZeroSettings

    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        ZeroSettings(**kwargs)
