"""The image encoder placed three ways under the flexible schedule (paper, section 3.2, figure 6), on gloo ranks
against one process running the same model, data and encoder shares: a Megatron-Core text model with frozen
self-attention layers and trainable gated cross-attention layers (l3plugin/megatron/multimodal.py) reading the
image tokens of a small ViT (l3plugin/demo/multimodal_model.py).

Losses and the cross-attention gradients match bit for bit (the text side sums in the same order); the encoder's
gradients match to 1e-6 (fp32 rounding: its image-token gradients are summed per stage, then over stages, where the
serial run sums them per micro-batch)."""

import dataclasses

import pytest
import torch

from l3plugin.demo.multimodal import MultimodalRun, train, with_balanced_split

PLACEMENTS = ("pipeline", "broadcast", "replicated")
SEQ = MultimodalRun.seq_len


def run_for(v, m, k, placement, **kwargs):
    """One layer per virtual stage, self-attention (frozen) and cross-attention in turn: the first stage holds only
    a frozen self-attention layer, and at v = 2 a frozen stage sits between trainable ones (its backward carries
    the input gradient through); micro-batches with 2, 0, 1, 2, 1 images (one without images, totals not
    divisible by P). Chunks of several layers, self- and cross-attention mixed: the balanced split below."""
    return MultimodalRun(kinds="SX" * v, pp=2, vpp=v, microbatches=m, group_size=k, placement=placement, **kwargs)


def train_each(runs):
    """``train`` for each (run, steps, pipelined) in turn on this rank (one call to the ranks for many runs)."""
    return [train(run, steps, pipelined) for run, steps, pipelined in runs]


@pytest.fixture(scope="module")
def trained(ranks):
    """``trained(world, [(run, steps, pipelined), ...])``: every rank's ``train`` result for each, each
    configuration trained once per module and the ones not yet trained in one call to the ranks (the one-process
    runs are shared: the data-parallel test reads the grid's)."""
    done = {}

    def get(world, wanted, timeout=300):
        missing = [w for w in dict.fromkeys(wanted) if (world, w) not in done]
        if missing:
            for w, per_rank in zip(missing, zip(*ranks.run(world, train_each, missing, timeout=timeout))):
                done[world, w] = list(per_rank)
        return [done[world, w] for w in wanted]

    return get


def fp32_close(reference) -> dict:
    """fp32 rounding of a different summation order: 1e-6 of the tensor's largest element (worst seen: 3e-7)."""
    return {"rtol": 1e-6, "atol": 1e-6 * float(reference.detach().abs().max())}


def assert_matches_one_process(run, pipelined, serial):
    from l3plugin.debug.numerics import assert_bitwise_equal

    text = {name: g for r in pipelined for name, g in r["text"].items()}
    assert text.keys() == serial["text"].keys()
    assert text and all(run.kinds[int(n.split(".")[2])] == "X" for n in text), sorted(text)  # only X layers train

    def flat(losses, named):
        return {**{f"loss[{i}]": x for i, x in enumerate(losses)}, **{n: named[n] for n in sorted(named)}}

    assert_bitwise_equal(flat(pipelined[-1]["losses"], text), flat(serial["losses"], serial["text"]))
    holders = range(run.pp) if run.placement == "replicated" else [0]
    for rank in holders:
        got = pipelined[rank]["encoder"]
        assert got.keys() == serial["encoder"].keys(), f"pipeline rank {rank}"
        for name, g in got.items():
            assert g.abs().max() > 0, f"rank {rank}: encoder {name} got no gradient"
            torch.testing.assert_close(g, serial["encoder"][name], **fp32_close(serial["encoder"][name]),
                                       msg=lambda s, n=name, r=rank: f"rank {r} encoder {n}: {s}")
    for rank, r in enumerate(pipelined):
        assert r["frozen_grads"] and all(g is None for g in r["frozen_grads"]), f"pipeline rank {rank}"
        if rank not in holders:
            assert r["encoder"] == {}, f"pipeline rank {rank} ran the encoder under {run.placement}"


# Each (micro-batches, group size) once or twice over v = 1 and 2: 4 of the 6 products. m5k3 (totals not divisible by
# P) runs at v = 2 only, m3k1 (groups of one) at v = 1 only, m4k2 at both: the dropped v1m5k3 and v2m3k1 take no path
# these do not (v changes the chunks per rank, the grouping is per micro-batch either way).
GRID = [(1, 4, 2), (1, 3, 1), (2, 4, 2), (2, 5, 3)]


GRID_RUNS = [run_for(v, m, k, placement) for v, m, k in GRID for placement in PLACEMENTS]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("v,m,k", GRID, ids=[f"p2v{v}m{m}k{k}" for v, m, k in GRID])
def test_encoder_placements_match_one_process(trained, v, m, k, placement):
    """Losses and the cross-attention gradients bit for bit (the text side sums in the same order); the
    encoder's gradients to fp32 rounding (1e-6) (its image-token gradients are summed per stage, then over stages,
    where the one-process run sums them per micro-batch). Every case of the grid runs in one call to the ranks
    (and one to the single process); each case is checked here."""
    run = run_for(v, m, k, placement)
    pipelined = trained(2, [(r, 1, True) for r in GRID_RUNS])[GRID_RUNS.index(run)]
    serial = trained(1, [(r, 1, False) for r in GRID_RUNS])[GRID_RUNS.index(run)][0]
    assert_matches_one_process(run, pipelined, serial)


@pytest.mark.parametrize("placement", ["replicated", "pipeline"])
def test_balanced_uneven_split_matches_one_process(trained, placement):
    """The split `l3plugin balance` picks (uneven layers per virtual stage, given to Megatron as its
    pipeline layout) trains the same model: here 1, 2, 2, 1 layers, S | SX | SX | X (a frozen self-attention
    layer before a cross-attention layer in two chunks)."""
    run = with_balanced_split(MultimodalRun(kinds="SSXSXX", pp=2, vpp=2, microbatches=5, group_size=3,
                                            placement=placement))
    assert len(set(run.counts)) > 1 and max(run.counts) > 1, run.counts  # uneven, chunks of several layers
    [pipelined], [[serial]] = trained(2, [(run, 1, True)]), trained(1, [(run, 1, False)])
    assert_matches_one_process(run, pipelined, serial)


def test_replicated_encoders_stay_identical_over_steps(trained):
    """Three SGD steps: each pipeline rank's encoder replica saw different images, yet the replicas stay bit
    for bit equal (their gradients are summed over PP), and equal the one-process run."""
    run, steps = dataclasses.replace(run_for(2, 5, 3, "replicated"), lr=0.5), 3
    [pipelined], [[serial]] = trained(2, [(run, steps, True)]), trained(1, [(run, steps, False)])
    first, second = (r["encoder_params"] for r in pipelined)
    initial = dict(run.encoder().named_parameters())
    for name in first:
        assert torch.equal(first[name], second[name]), f"encoder replicas differ in {name}"
        torch.testing.assert_close(first[name], serial["encoder_params"][name], **fp32_close(first[name]))
        assert not torch.equal(first[name], initial[name]), f"{name} did not change in {steps} steps"
    torch.testing.assert_close(torch.tensor(pipelined[-1]["step_losses"]), torch.tensor(serial["step_losses"]),
                               rtol=1e-5, atol=1e-7)


def multimodal_misuse():
    """The errors a user meets building the multimodal model wrongly, as strings."""
    import dataclasses

    from l3plugin.demo import multimodal_model as mm
    from l3plugin.megatron.multimodal import multimodal_block_spec
    from l3plugin.mesh.groups import init_mesh

    init_mesh()
    config = mm.mllama_config("SX")
    errors = {}
    attempts = {
        "kinds": lambda: multimodal_block_spec(config, "SY"),
        "length": lambda: multimodal_block_spec(config, "SXS"),
        "cp": lambda: multimodal_block_spec(dataclasses.replace(config, context_parallel_size=2), "SX"),
        "bias": lambda: mm.build_text_chunk(dataclasses.replace(config, add_bias_linear=True), "SX"),
        "encoder_elsewhere": lambda: mm.build_text_chunk(config, "SX", encoder=mm.TinyViT()),
        "no_encoder": lambda: mm.build_text_chunk(config, "SX", carry_image_tokens=4),
        "no_index": lambda: mm.build_text_chunk(config, "SX", carry_image_tokens=4, encoder=mm.TinyViT())(
            torch.zeros(1, SEQ, dtype=torch.long), torch.arange(SEQ)[None], None),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


def test_misuse_is_refused_with_the_fix(ranks):
    errors = ranks.run(1, multimodal_misuse, timeout=120)[0]
    expected = {
        "kinds": "kinds='SY' is invalid: one letter per layer in model order, S = self-attention layer",
        "length": "kinds has 3 letters but the model has num_layers=2",
        "cp": "context_parallel_size=2: cross-attention layers run without context parallelism",
        "bias": "cross-attention layers need add_bias_linear=False",
        "encoder_elsewhere": "encoder is given to a chunk that is not the first stage of a pipeline placement",
        "no_encoder": "the first chunk of the pipeline placement needs the encoder",
        "no_index": "the pipeline placement needs image_index on every chunk",
    }
    for name, start in expected.items():
        assert errors[name] is not None and errors[name].startswith(start), (name, errors[name])


def test_replicated_encoder_gradients_are_summed_over_data_parallel_too(trained):
    """pp 2 x dp 2, both DP replicas seeing the same images: each encoder replica's gradient is the sum over
    PP and DP, twice the one-process gradient (doubling is exact in fp32)."""
    run = run_for(2, 5, 3, "replicated")
    [pipelined], [[serial]] = trained(4, [(run, 1, True)]), trained(1, [(run, 1, False)])
    for rank, r in enumerate(pipelined):
        assert r["encoder"].keys() == serial["encoder"].keys(), f"rank {rank}"
        for name, g in r["encoder"].items():
            torch.testing.assert_close(g, 2 * serial["encoder"][name], **fp32_close(2 * serial["encoder"][name]),
                                       msg=lambda s, n=name, q=rank: f"rank {q} encoder {n}: {s}")
