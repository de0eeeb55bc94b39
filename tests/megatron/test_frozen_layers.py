"""Frozen layers under the flexible schedule on real gloo ranks: losses and trainable gradients equal the serial
run bit for bit, frozen parameters get no .grad, and a frozen prefix runs no backward at all."""

import pytest
import torch

import toy_pipeline as toy
from reduce_scatter_census import bytes_handed_to_reduce_scatter
from test_flexible_pipeline import HIDDEN, MBS, SEQ, toy_config


def frozen_layers(model: str, p: int, v: int) -> set[int]:
    """Layer ids frozen in each test model (2 layers per virtual stage, 2 * p * v layers)."""
    layers = 2 * p * v
    if model == "prefix":  # the first half of the stages and the first layer of the next one
        return set(range(layers // 2 + 1))
    if model == "middle":  # trainable ends, frozen in between: input gradients cross the frozen layers
        return set(range(2, layers - 2)) if p * v > 2 else {1, 2}
    if model == "all":
        return set(range(layers))
    raise ValueError(model)


def run_frozen(p, v, m, k, model, skip=True):
    """On every rank: one step of the flexible schedule over the toy model with ``model``'s layers frozen.
    Returns losses, trainable grads, the frozen parameters' .grad, and per stage / layer what the backward
    touched. ``skip=False`` plans every stage as trainable: the executor before it knew about frozen layers."""
    import contextlib
    from unittest import mock

    from l3plugin.megatron import forward_backward_pipelining_flexible, pipeline
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=p, vpp=v if v > 1 else None)
    layers, frozen = 2 * p * v, frozen_layers(model, p, v)
    config = toy_config(p, v, layers, k)
    rank = mesh.coords["pp"]
    chunks = toy.build_chunks(config, num_layers=layers, hidden=HIDDEN, pp_rank=rank, pp_size=p, vpp_size=v,
                              frozen=frozen)
    stage_of = {id(chunk): c * p + rank for c, chunk in enumerate(chunks)}
    inputs_need_grad = {s: [] for s in stage_of.values()}  # stage -> requires_grad of each received input
    layer_backwards = {lid: 0 for chunk in chunks for lid in chunk.layer_ids}
    for chunk in chunks:
        for lid, layer in zip(chunk.layer_ids, chunk.layers):
            layer.register_full_backward_hook(lambda *_, lid=lid: layer_backwards.__setitem__(
                lid, layer_backwards[lid] + 1))

    def forward_step(data_iterator, model):
        if model.input_tensor is not None:
            inputs_need_grad[stage_of[id(model)]].append(model.input_tensor.requires_grad)
        return toy.forward_step(data_iterator, model)

    batches = toy.make_microbatches(m, SEQ, MBS, HIDDEN)
    real = pipeline.trainable_stages
    every_stage = mock.patch.object(pipeline, "trainable_stages", lambda *a: (True,) * len(real(*a)))
    with contextlib.nullcontext() if skip else every_stage:
        out = forward_backward_pipelining_flexible(
            forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
            num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS)
    grads = {}
    for chunk in chunks:
        grads.update(chunk.grads())
    frozen_grads = [q.grad for chunk in chunks for lid, layer in zip(chunk.layer_ids, chunk.layers)
                    if lid in frozen for q in layer.parameters()]
    return {"losses": [d["loss"] for d in out], "grads": grads, "frozen_grads": frozen_grads,
            "inputs_need_grad": inputs_need_grad, "layer_backwards": layer_backwards}


GRID = [(p, v, m, k) for p, v in [(2, 1), (2, 2)] for m, k in [(4, 2), (5, 3), (3, 1)]]
MODELS = ["prefix", "middle"]


def run_frozen_cases(cases):
    """``run_frozen`` for each (p, v, m, k, model) in turn on this rank: one call to the ranks for the grid."""
    return [run_frozen(*case) for case in cases]


@pytest.fixture(scope="module")
def frozen_grid(ranks):
    """Every rank's ``run_frozen`` result for each case of GRID x MODELS (all at p 2), all run in one call to the
    ranks."""
    cases = [(*case, model) for case in GRID for model in MODELS]
    return dict(zip(cases, zip(*ranks.run(2, run_frozen_cases, cases, timeout=240))))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("p,v,m,k", GRID, ids=[f"p{p}v{v}m{m}k{k}" for p, v, m, k in GRID])
def test_frozen_layers_match_serial_and_skip_the_frozen_prefix(frozen_grid, p, v, m, k, model):
    results = list(frozen_grid[p, v, m, k, model])
    layers, frozen = 2 * p * v, frozen_layers(model, p, v)
    toy.assert_matches_serial(results, toy.make_microbatches(m, SEQ, MBS, HIDDEN), num_layers=layers,
                              hidden=HIDDEN, frozen=frozen)
    first_trainable = min(set(range(layers)) - frozen)
    first_grad_stage = first_trainable // 2
    for rank, r in enumerate(results):
        assert r["frozen_grads"] and all(g is None for g in r["frozen_grads"]), f"pipeline rank {rank}"
        assert not set(r["grads"]) & frozen, f"pipeline rank {rank}"
        # An activation carries a gradient only into stages after the first trainable one.
        for stage, flags in r["inputs_need_grad"].items():
            assert flags == ([stage > first_grad_stage] * m if stage else []), (rank, stage, flags)
        # Autograd runs through a layer once per microbatch, except before the first trainable layer: never.
        for lid, calls in r["layer_backwards"].items():
            assert calls == (m if lid >= first_trainable else 0), (rank, lid, calls)


def test_every_layer_frozen_runs_no_backward(ranks):
    p, v, m, k = 2, 2, 3, 2
    results = ranks.run(p, run_frozen, p, v, m, k, "all", timeout=120)
    ref_losses, _ = toy.serial_reference(toy.make_microbatches(m, SEQ, MBS, HIDDEN), num_layers=2 * p * v,
                                         hidden=HIDDEN, frozen=frozen_layers("all", p, v))
    assert all(torch.equal(a, b) for a, b in zip(results[-1]["losses"], ref_losses, strict=True))
    for r in results:
        assert r["grads"] == {} and all(g is None for g in r["frozen_grads"])
        assert not any(r["layer_backwards"].values()) and not any(any(f) for f in r["inputs_need_grad"].values())


def test_without_the_trainable_flags_the_frozen_prefix_ran_backward(ranks, frozen_grid):
    """The probe sees the difference: planned as if every stage trained (the executor before frozen layers were
    known), stage 1's frozen layers compute input gradients for every microbatch; the trainable gradients are
    the same (the run with the flags: the grid's p2v2m4k2-prefix case)."""
    p, v, m, k = 2, 2, 4, 2
    skipped = frozen_grid[p, v, m, k, "prefix"]
    full = ranks.run(p, run_frozen, p, v, m, k, "prefix", False, timeout=120)
    assert full[1]["layer_backwards"][2] == full[1]["layer_backwards"][3] == m  # stage 1: layers 2, 3 (frozen)
    assert skipped[1]["layer_backwards"][2] == skipped[1]["layer_backwards"][3] == 0
    for a, b in zip(skipped, full):
        assert a["grads"].keys() == b["grads"].keys()
        assert all(torch.equal(x, y) for lid in a["grads"] for x, y in zip(a["grads"][lid], b["grads"][lid]))


def zero_frozen_step(stage, p, v, m, k, model):
    """pp x dp = p x 2: one step of the flexible schedule and l3plugin's ZeRO (SGD) over the toy model with
    ``model``'s layers frozen; every DP rank sees the same data. Returns what was bucketed and reduce-scattered."""
    import torch.distributed as dist

    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.megatron.zero import attach_to_schedule, megatron_zero
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=p, vpp=v if v > 1 else None, dp=dist.get_world_size() // p)
    layers, frozen = 2 * p * v, frozen_layers(model, p, v)
    config = toy_config(p, v, layers, k)
    chunks = toy.build_chunks(config, num_layers=layers, hidden=HIDDEN, pp_rank=mesh.coords["pp"], pp_size=p,
                              vpp_size=v, frozen=frozen)
    params = [q for chunk in chunks for q in chunk.parameters()]  # frozen ones too: the optimizer may hold them
    zero = megatron_zero(chunks, torch.optim.SGD(params, lr=0.1), stage=stage, bucket_numel=10_000)
    attach_to_schedule(config, zero)
    with bytes_handed_to_reduce_scatter() as handed:
        batches = toy.make_microbatches(m, SEQ, MBS, HIDDEN)
        forward_backward_pipelining_flexible(
            forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
            num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS)
        zero.step()
    layer_of = {q: lid for chunk in chunks for lid, layer in zip(chunk.layer_ids, chunk.layers)
                for q in layer.parameters()}
    return {"bucketed": sorted({layer_of[q] for b in zero.buckets for q in b.params}),
            "buckets": len(zero.buckets), "handed_bytes": sum(handed),
            "trainable_bytes": sum(q.numel() * q.element_size() for q in params if q.requires_grad),
            "frozen_grads": [q.grad for q in params if not q.requires_grad],
            "weights": {lid: layer.weight.detach().clone() for chunk in chunks
                        for lid, layer in zip(chunk.layer_ids, chunk.layers)}}


@pytest.mark.parametrize("stage,v", [(1, 1), (2, 2)], ids=["zero1-v1", "zero2-v2"])
def test_zero_buckets_and_reduces_only_trainable_parameters(ranks, stage, v):
    p, m, k = 2, 5, 3  # 2 rounds of k microbatches per chunk
    results = ranks.run(2 * p, zero_frozen_step, stage, p, v, m, k, "prefix", timeout=180)
    frozen = frozen_layers("prefix", p, v)
    _, ref = toy.serial_reference(toy.make_microbatches(m, SEQ, MBS, HIDDEN), num_layers=2 * p * v, hidden=HIDDEN,
                                  frozen=frozen)
    rounds = 2 if stage == 2 else 1
    for rank, r in enumerate(results):
        assert not set(r["bucketed"]) & frozen, f"rank {rank}: frozen layers bucketed: {r['bucketed']}"
        assert r["handed_bytes"] == rounds * r["trainable_bytes"], f"rank {rank}: {r}"  # even sizes: no padding
        assert all(g is None for g in r["frozen_grads"]), f"rank {rank}"
        for lid, weight in r["weights"].items():
            w0, _ = toy.layer_weights(lid, HIDDEN)
            expected = w0 if lid in frozen else w0 - 0.1 * ref[lid][0]
            assert torch.allclose(weight, expected, atol=1e-6), (rank, lid)
    if v == 1:  # pipeline rank 0 holds only frozen layers: no bucket, no reduce-scatter, but it took part in the step
        assert results[0]["buckets"] == 0 and results[0]["handed_bytes"] == 0


def gpt_frozen(chunks, frozen_prefix):
    """Freeze the parameters of a GPTModel's chunks whose global name starts with one of ``frozen_prefix``."""
    from l3plugin.demo.model import global_name

    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if global_name(chunk, name).startswith(frozen_prefix):
                p.requires_grad_(False)


def gpt_trainable_grads(chunks):
    from l3plugin.demo.model import global_name

    return {global_name(ch, n): p.grad.clone() for ch in chunks for n, p in ch.named_parameters() if p.requires_grad}


GPT_FROZEN = ("embedding.", "decoder.layers.0.", "decoder.layers.1.", "decoder.layers.2.self_attention.")


def gpt_frozen_step(p, v, m, k):
    """A real Megatron-Core GPTModel (4 layers, pp 2 x vpp 2) with the embedding, layers 0-1 and layer 2's
    attention frozen: stages 0 and 1 are a frozen prefix, stage 2 the first trainable one."""
    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.mesh.groups import init_mesh
    import tiny_gpt as gpt

    mesh = init_mesh(pp=p, vpp=v)
    r = mesh.coords["pp"]
    config = gpt.gpt_config(4, pp=p, vpp=v, k=k)
    chunks = [gpt.build_gpt(config, pre_process=r == 0 and c == 0, post_process=r == p - 1 and c == v - 1,
                            vp_stage=c, seq_len=16) for c in range(v)]
    gpt_frozen(chunks, GPT_FROZEN)
    received = []
    for chunk in chunks:
        chunk.decoder.register_forward_pre_hook(lambda module, *_: received.append(
            (module.layers[0].layer_number, module.input_tensor is not None and module.input_tensor.requires_grad)))
    out = forward_backward_pipelining_flexible(
        forward_step_func=gpt.forward_step, data_iterator=[iter(gpt.microbatches(m, 2, 16)) for _ in chunks],
        model=chunks, num_microbatches=m, seq_length=16, micro_batch_size=2)
    return {"grads": gpt_trainable_grads(chunks), "losses": [d["lm loss"] for d in out], "received": received,
            "frozen_grads": [q.grad for ch in chunks for q in ch.parameters() if not q.requires_grad]}


def gpt_frozen_serial(m):
    from l3plugin.mesh.groups import init_mesh
    import tiny_gpt as gpt

    init_mesh()  # one rank: no communication
    model = gpt.build_gpt(gpt.gpt_config(4), seq_len=16)
    gpt_frozen([model], GPT_FROZEN)
    losses = []
    for batch in gpt.microbatches(m, 2, 16):
        out, reduce = gpt.forward_step(iter([batch]), model)
        loss, stats = reduce(out)
        losses.append(stats["lm loss"])
        (loss / m).backward()
    return {"grads": gpt_trainable_grads([model]), "losses": losses}


def test_gpt_model_with_a_frozen_prefix_matches_serial(ranks):
    from l3plugin.debug.numerics import assert_bitwise_equal

    p, v, m, k = 2, 2, 5, 3
    pipelined = ranks.run(p, gpt_frozen_step, p, v, m, k, timeout=180)
    serial = ranks.run(1, gpt_frozen_serial, m, timeout=180)[0]
    grads = {name: g for r in pipelined for name, g in r["grads"].items()}
    assert grads.keys() == serial["grads"].keys() and not any(name.startswith(GPT_FROZEN) for name in grads)

    def flat(losses, named):
        return {**{f"loss[{i}]": x for i, x in enumerate(losses)}, **{n: named[n] for n in sorted(named)}}

    assert_bitwise_equal(flat(pipelined[-1]["losses"], grads), flat(serial["losses"], serial["grads"]))
    for rank, r in enumerate(pipelined):
        assert r["frozen_grads"] and all(g is None for g in r["frozen_grads"]), f"pipeline rank {rank}"
        # Layer numbers 1..4 (stage s holds layer s + 1): inputs carry a gradient only into stage 3.
        for layer_number, needs_grad in r["received"]:
            assert needs_grad == (layer_number == 4), (rank, layer_number, needs_grad)
