"""PipelineEngine (pp=2 x dp=2, a weight tied across the two stages) with the FP32-reducing ZeRO, stage 1 and 2."""

import copy
import os
import re

import pytest
import torch
import torch.distributed as dist

from ds_models import ds_config, quiet_deepspeed


WIDTH, GAS, STEPS, CLIP = 8, 4, 2, 0.05  # CLIP binds: checks the norm summed over both stages


def loss_fn(out, label):
    return (out.float() - label).pow(2).mean()


def tied_output(module, x):
    """The second use of the tied weight through a forward_fn: outside the tied module's own forward."""
    return torch.nn.functional.linear(x, module.weight)


def layers(tied_forward_fn=False):
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    last = (TiedLayerSpec("tied", torch.nn.Linear, WIDTH, WIDTH, bias=False, forward_fn=tied_output)
            if tied_forward_fn else TiedLayerSpec("tied", torch.nn.Linear, WIDTH, WIDTH, bias=False))
    return [TiedLayerSpec("tied", torch.nn.Linear, WIDTH, WIDTH, bias=False), LayerSpec(torch.nn.Linear, WIDTH, WIDTH),
            LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, WIDTH, WIDTH), LayerSpec(torch.nn.Tanh), last]


def micro_batch(dp_rank, step, mb):
    g = torch.Generator().manual_seed(1000 * dp_rank + 10 * step + mb)
    return torch.randn(2, WIDTH, generator=g).bfloat16(), torch.randn(2, WIDTH, generator=g)


def reference_masters(init, dp_size):
    """Serial fp32-master AdamW on fp64-accumulated gradients of all DP ranks' data, from the pipeline's
    initial weights ``init`` (tied, linear1 w/b, linear2 w/b); the tied weight's two uses are separate
    copies whose gradients are added in fp64."""
    mods = [torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)]
    mods = [m.bfloat16() for m in mods]
    with torch.no_grad():
        for p, v in zip([mods[0].weight, mods[1].weight, mods[1].bias, mods[2].weight, mods[2].bias], init):
            p.copy_(v)
    tied_copy = copy.deepcopy(mods[0])
    params = [mods[0].weight, mods[1].weight, mods[1].bias, mods[2].weight, mods[2].bias]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        acc = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
        for dp in range(dp_size):
            for mb in range(GAS):
                x, y = micro_batch(dp, step, mb)
                h = torch.tanh(mods[2](torch.tanh(mods[1](mods[0](x)))))
                (loss_fn(tied_copy(h), y) / GAS).backward()
                grads = [p.grad for p in params]
                grads[0] = grads[0].double() + tied_copy.weight.grad.double()
                for a, g in zip(acc, grads):
                    a += g.double()
                for p in params + [tied_copy.weight]:
                    p.grad = None
        grads = [a / dp_size for a in acc]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads)).item()  # the tied weight counted once
        coef = min(1.0, CLIP / (norm + 1e-6))
        assert coef < 1.0
        for m, g in zip(masters, grads):
            m.grad = (g * coef).float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(params + [tied_copy.weight], masters + [masters[0]]):
                p.copy_(m)
    return [m.detach() for m in masters]


def pipe_engine(stage, plugin, seed=0):
    deepspeed = quiet_deepspeed()
    import l3plugin.deepspeed  # noqa: F401
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(seed)
    module = PipelineModule(layers=layers(), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    cfg = ds_config(stage, gas=GAS, plugin=plugin, clip=CLIP)
    engine, *_ = deepspeed.initialize(model=module, config=cfg, model_parameters=module.parameters())
    return engine


def train(engine, steps, first_step=0):
    dp_rank = engine.grid.get_data_parallel_id()
    for step in range(first_step, first_step + steps):
        engine.train_batch(iter([micro_batch(dp_rank, step, mb) for mb in range(GAS)]))


def snapshot(engine):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {n: (p.detach().clone(), safe_get_full_fp32_param(p),
                *[safe_get_full_optimizer_state(p, k) for k in p._hp_mapping.get_optim_state_keys()])
            for n, p in engine.module.named_parameters()}


def between_engines():
    """What the rank pool does after each call (DeepSpeed's global mpu dropped): the next engine in this call
    starts as the first of a call would. This module's engines all run in one call (every_pipeline_run): each
    PipelineEngine leaves 6 process groups, and the pool replaces workers that keep more than 16 after a call,
    whose next call imports DeepSpeed again (seconds per rank)."""
    from l3plugin.ranks.worker import _reset_framework_state

    dist.barrier()
    _reset_framework_state()


def pipeline_checkpoint(stage, save_dir, load_dir):
    """Leg 1 (save_dir): train, save, train. Leg 2 (load_dir): other init, load, train. Final snapshots."""
    engine = pipe_engine(stage, {"fp32_reduce_zero": True}, seed=0 if save_dir else 1)
    if load_dir:
        assert engine.load_checkpoint(load_dir)[0] is not None
    else:
        train(engine, 1)
        engine.save_checkpoint(save_dir, tag="t")
    train(engine, 1, first_step=1)
    return snapshot(engine)


def checkpoint_and_resume(stage, folder):
    """Both legs of pipeline_checkpoint, one after the other (the save is complete on every rank first)."""
    straight = pipeline_checkpoint(stage, folder, None)
    between_engines()
    return straight, pipeline_checkpoint(stage, None, folder)


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# (stage, reduce_every, options) of test_pipeline_overlap_is_bit_identical. reduce_every > 1 (ZeRO-2 reducing every
# N micro-batches: the optimizer's epilogue counts them, whichever engine calls it) is test_zero_overlap.py's
# test_overlap_is_bit_identical_and_starts_reductions_during_backward with reduce_every 2 and 3; (2, 1, {}) here is
# PipelineEngine calling that epilogue.
OVERLAP_CASES = [(1, 1, {}), (2, 1, {}), (2, 1, {"overlap_param_gather": False})]
# ZeRO-2 only: l3plugin's checkpoint layout has no stage branch (the stage is a recorded field); ZeRO-1's resume
# is test_zero_deepspeed.py's test_checkpoint_resume_is_bit_exact[1].
CHECKPOINT_STAGES = [2]


def every_pipeline_run(overlap_cases, checkpoint_stages, folder):
    """Every engine of this module, in one call (see between_engines): per overlap case (blocking, overlapped),
    per checkpoint stage (straight, resumed), saved under folder/zero<stage>."""
    out = {"overlap": [], "checkpoint": []}
    for stage, reduce_every, options in overlap_cases:
        out["overlap"].append(blocking_and_overlapped(stage, reduce_every, options))
        between_engines()
    for stage in checkpoint_stages:
        out["checkpoint"].append(checkpoint_and_resume(stage, os.path.join(folder, f"zero{stage}")))
        between_engines()
    return out


@pytest.fixture(scope="module")
def pipeline_runs(ranks, tmp_path_factory):
    """every_pipeline_run on 4 ranks: ({overlap case: [(blocking, overlapped) per rank]}, checkpoint folder,
    {stage: [(straight, resumed) per rank]})."""
    folder = tmp_path_factory.mktemp("pipeline")
    per_rank = ranks.run(4, every_pipeline_run, OVERLAP_CASES, CHECKPOINT_STAGES, str(folder), timeout=480)
    overlap = {_case_key(*case): [r["overlap"][i] for r in per_rank] for i, case in enumerate(OVERLAP_CASES)}
    checkpoint = {stage: [r["checkpoint"][i] for r in per_rank] for i, stage in enumerate(CHECKPOINT_STAGES)}
    return overlap, folder, checkpoint


def _case_key(stage, reduce_every, options):
    return stage, reduce_every, tuple(sorted(options.items()))


@pytest.mark.parametrize("stage", [1, 2])
def test_pipeline_engine_with_tied_weights(pipeline_runs, stage):
    """fp32 masters within 1e-5 of the fp64 reference on every stage (DeepSpeed 0.18 divides the earlier stages'
    gradients by the accumulation steps twice unless l3plugin's _backward_prologue_per_tensor row is applied).
    The engines: those of test_pipeline_overlap_is_bit_identical (several buckets per stage), blocking and
    overlapped, which that test finds bit-identical; the blocking one is checked here."""
    results = [blocking for blocking, _ in pipeline_runs[0][_case_key(stage, 1, {})]]
    assert {r["optimizer"] for r in results} == {"DeepSpeedFP32ReduceZero"}
    by_stage = {0: [r for r in results if r["stage_id"] == 0], 1: [r for r in results if r["stage_id"] == 1]}
    assert len(by_stage[0]) == len(by_stage[1]) == 2
    first, last = by_stage[0][0], by_stage[1][0]
    names = [(first, "tied_modules.tied.weight"), (first, "1.weight"), (first, "1.bias"), (last, "3.weight"),
             (last, "3.bias")]
    assert torch.equal(first["init"][names[0][1]], last["init"][names[0][1]])
    ref = reference_masters([r["init"][n] for r, n in names], first["dp_size"])
    errors = {n: relative(r["fp32"][n], want) for (r, n), want in zip(names, ref)}
    assert max(errors.values()) < 1e-5, errors
    for group in by_stage.values():  # DP replicas agree
        assert all(torch.equal(group[0]["bf16"][n], group[1]["bf16"][n]) for n in group[0]["bf16"])
    tied = "tied_modules.tied.weight"  # and so do the copies of the tied weight on the two stages
    assert torch.equal(first["fp32"][tied], last["fp32"][tied]) and torch.equal(first["bf16"][tied], last["bf16"][tied])


@pytest.mark.parametrize("stage", CHECKPOINT_STAGES)
def test_pipeline_checkpoint_resume_is_bit_exact(pipeline_runs, stage):
    _, folder, checkpoint = pipeline_runs
    saved = folder / f"zero{stage}"
    straight, resumed = zip(*checkpoint[stage])
    # Crash-consistent save under PipelineEngine too: every rank's manifest lists its layer files, all verify.
    import glob
    import json

    from l3plugin.checkpoint.commit import verify_tag

    manifests = sorted(glob.glob(str(saved / "t" / "l3plugin-manifest-rank*.json")))
    assert len(manifests) == 4, manifests
    recorded = {name for m in manifests for name in json.load(open(m))["files"]}
    assert any(name.startswith("layer_") for name in recorded) and any("optim_states" in n for n in recorded)
    verify_tag(str(saved), "t")
    for a, b in zip(straight, resumed):
        assert a.keys() == b.keys()
        assert all(len(a[n]) == len(b[n]) == 4 and all(torch.equal(x, y) for x, y in zip(a[n], b[n])) for n in a)


def pipeline_overlap(stage, overlap, reduce_every, **options):
    """Train with overlap_comm on or off; record, at the first post-backward epilogue, how many bucket
    reductions had been handed to torch.distributed (ZeRO-2: no tied-weight collectives before it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from l3plugin.debug import record_collectives

    plugin = {"fp32_reduce_zero": True, "bucket_numel": 20, **options}  # several buckets per stage
    if stage == 2:
        plugin["reduce_every"] = reduce_every
    deepspeed = quiet_deepspeed()
    import l3plugin.deepspeed  # noqa: F401
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    module = PipelineModule(layers=layers(tied_forward_fn=bool(options)), num_stages=2, loss_fn=loss_fn,
                            partition_method="uniform")
    cfg = ds_config(stage, gas=GAS, plugin=plugin, clip=CLIP)
    cfg["zero_optimization"]["overlap_comm"] = overlap
    engine, *_ = deepspeed.initialize(model=module, config=cfg, model_parameters=module.parameters())
    counts, held, held_bytes = [], [], []  # held: full-size buffers or running reductions left after each backward
    # pass; held_bytes: what the running ones hold
    epilogue = engine.optimizer.after_backward
    zero = engine.optimizer.zero
    dp_ranks = dist.get_process_group_ranks(zero.group)
    slice_sizes = {b.spec.shard_numel for b in zero.buckets}  # gloo: one isend of a 1/W slice per bucket

    def watched():  # the pipeline's own collectives (P2P, loss) run in other groups or sizes
        counts.append(sum(1 for c in log if c.op in ("isend", "reduce_scatter_tensor") and c.group == dp_ranks
                          and c.numel in slice_sizes and c.dtype == torch.float32))
        epilogue()
        held.append(sum(b.full is not None or b.in_flight is not None for b in zero.buckets))
        held_bytes.append(sum(zero._flight_bytes(b) for b in zero.buckets if b.in_flight is not None))

    engine.optimizer.after_backward = watched
    init = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with record_collectives() as log:
        train(engine, STEPS)
    zero.wait_param_gather()  # with overlap_param_gather the last step's gathers land in the next forward
    return {"fp32": {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()},
            "bf16": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "first_count": counts[0], "held": held, "held_bytes": held_bytes, "budget": zero.carry_budget,
            "buckets": len(engine.optimizer.zero.buckets), "init": init, "stage_id": engine.stage_id,
            "optimizer": type(engine.optimizer).__name__, "dp_size": engine.grid.get_data_parallel_world_size()}


def blocking_and_overlapped(stage, reduce_every, options):
    blocking = pipeline_overlap(stage, False, reduce_every, **options)
    between_engines()
    return blocking, pipeline_overlap(stage, True, reduce_every, **options)


@pytest.mark.parametrize("stage,reduce_every,options", OVERLAP_CASES)
def test_pipeline_overlap_is_bit_identical(pipeline_runs, stage, reduce_every, options):
    """With overlap_param_gather (the default) the tied weight's second use goes through a forward_fn (outside
    its module's forward, no pre-hook): the guard must complete it there, so it sees the gathered values."""
    for b, o in pipeline_runs[0][_case_key(stage, reduce_every, options)]:
        assert all(torch.equal(b[k][n], o[k][n]) for k in ("fp32", "bf16") for n in b[k])
        if stage == 2 and reduce_every == 1:  # the first backward's buckets went out during that backward
            assert o["first_count"] == o["buckets"] > 1 and b["first_count"] == 0
            # Real ZeRO-2: between backward passes the fp32 shards plus the full buffers of the buckets whose
            # reduce-scatters are carried into the next micro-batch, what fits in carry_bytes (the default: 1/32
            # of the shard); none after the last. Per step: GAS - 1 backward passes carrying, then the last one
            # and the boundary (which may call the epilogue once more) carrying nothing.
            assert max(o["held_bytes"]) <= o["budget"], (o["held_bytes"], o["budget"])
            carried = o["held"][0]
            pattern = "".join("c" if h == carried else "0" if h == 0 else "x" for h in o["held"])
            assert re.fullmatch(f"(c{{{GAS - 1}}}0+){{{STEPS}}}", pattern) if carried else set(pattern) == {"c"}, \
                o["held"]
            assert b["held"] == [0] * len(b["held"])  # blocking: nothing carried
        if stage == 1:  # ZeRO-1: full-size buffers until the step's last backward pass
            assert o["held"][:GAS - 1] == [o["buckets"]] * (GAS - 1)
