"""FP32-reducing ZeRO driven by the flexible schedule: ZeRO-2 reduce-scatters at every round end,
ZeRO-1 once per step, both in fp32; the updated parameters match a serial run."""

import pytest
import torch

import toy_pipeline as toy

HIDDEN, SEQ, MBS = 8, 4, 2


def marking_backward(log, marked: set):
    """Megatron's backward_step, adding to ``marked`` the indices of ``log()``'s collectives it started (the
    flexible schedule looks schedules.backward_step up once per step: patch it there). ``functools.wraps`` keeps
    its signature, which the schedule reads (model_type or not)."""
    import functools

    from megatron.core.pipeline_parallel import schedules

    original = schedules.backward_step

    @functools.wraps(original)
    def marked_backward_step(*args, **kwargs):
        first = len(log())
        result = original(*args, **kwargs)
        marked.update(range(first, len(log())))
        return result

    return marked_backward_step


def zero_step(stage, p, v, m, k, overlap=True, steps=1, reduce_in_backward=True, mesh=None, **settings):
    from unittest import mock

    import torch.distributed as dist
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import TransformerConfig

    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.megatron.zero import attach_to_schedule, megatron_zero
    from l3plugin.mesh.groups import init_mesh
    from l3plugin.debug import record_collectives

    mesh = mesh or init_mesh(pp=p, vpp=v, dp=dist.get_world_size() // p)
    layers = 2 * p * v
    config = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=1,
                               pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v,
                               pipeline_dtype=torch.float32, microbatch_group_size_per_vp_stage=k,
                               batch_p2p_comm=False)
    chunks = toy.build_chunks(config, num_layers=layers, hidden=HIDDEN, pp_rank=mesh.coords["pp"],
                              pp_size=p, vpp_size=v)
    params = [q for c in chunks for q in c.parameters()]
    zero = megatron_zero(chunks, torch.optim.SGD(params, lr=0.1), stage=stage, bucket_numel=100, overlap=overlap,
                         **settings)
    attach_to_schedule(config, zero, reduce_in_backward=reduce_in_backward)
    finalize, round_end, seen = config.finalize_model_grads_func, config.round_grad_sync_func, {"others": 0, "mine": 0}

    def checked_round_end(chunk, params, round_id, is_last_round):  # only this round's reductions still run
        params = list(params)
        round_end(chunk, params, round_id, is_last_round)
        mine = {b.spec.index for b in zero.buckets_of(params)}
        seen["others"] += sum(b.in_flight is not None and b.spec.index not in mine for b in zero.buckets)
        seen["mine"] = max(seen["mine"], sum(b.in_flight is not None for b in zero.buckets_of(params)))
        held = sum(zero._flight_bytes(b) for b in zero.buckets if b.in_flight is not None)
        seen["bytes"] = max(seen.get("bytes", 0), held)

    config.round_grad_sync_func = checked_round_end
    in_backward = set()  # log indices of the collectives started while a backward ran
    marked_backward_step = marking_backward(lambda: log, in_backward)

    def counting_finalize(*args, **kwargs):  # reductions still running when the last backward is done
        seen["in_flight"] = sum(b.in_flight is not None for b in zero.buckets)
        return finalize(*args, **kwargs)

    config.finalize_model_grads_func = counting_finalize
    batches = toy.make_microbatches(m, SEQ, MBS, HIDDEN)  # every DP rank the same data: easy reference
    for _ in range(steps):  # a later step's forward uses the parameters the previous step gathered
        with record_collectives() as log, mock.patch.object(schedules, "backward_step",
                                                            marked_backward_step):
            in_backward.clear()
            forward_backward_pipelining_flexible(
                forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
                num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS)
            zero.step()
    pending = len(zero._gathers)
    zero.wait_param_gather()
    dp_ranks = dist.get_process_group_ranks(zero.group)
    ops = [(c.op, str(c.dtype), c.numel, "dp" if c.group == dp_ranks else "other", i in in_backward)
           for i, c in enumerate(log)]
    weights = {lid: layer.weight.detach().clone() for c in chunks for lid, layer in zip(c.layer_ids, c.layers)}
    return {"ops": ops, "buckets": len(zero.buckets), "weights": weights, "in_flight": seen["in_flight"],
            "pending": pending, "others_in_flight_after_round_ends": seen["others"],
            "most_in_flight_after_a_round_end": seen["mine"], "most_held_after_a_round_end": seen.get("bytes", 0),
            "carry_budget": zero.carry_budget,
            "chunk_buckets": max(len(zero.buckets_of(list(c.parameters()))) for c in chunks)}


def zero_step_cases(cases):
    """``zero_step(*args, **settings)`` for each (args, settings items) in turn on this rank, on one mesh (every
    case at the same p and v): each builds its own chunks and ZeRO."""
    import torch.distributed as dist

    from l3plugin.mesh.groups import init_mesh

    p, v = cases[0][0][1:3]
    assert all(args[1:3] == (p, v) for args, _ in cases), cases
    mesh = init_mesh(pp=p, vpp=v, dp=dist.get_world_size() // p)
    return [zero_step(*args, mesh=mesh, **dict(settings)) for args, settings in cases]


ROUNDS = (2, 2, 5, 2)  # p, v, m, k of the round tests below: rounds per chunk ceil(5/2) = 3
# (args, settings) of every zero_step the round tests read: blocking, overlapped, reductions after the backward,
# carry_buckets=3, for ZeRO-1 and ZeRO-2.
ROUND_RUNS = [((stage, *ROUNDS, *args), settings) for stage in (1, 2)
              for args, settings in [((False,), ()), ((True,), ()), ((True, 1, False), ()),
                                     ((True, 1, True), (("carry_buckets", 3),))]]


@pytest.fixture(scope="module")
def zero_steps(ranks):
    """``zero_step`` on 4 ranks for each of ROUND_RUNS, all in one call to the ranks: the round-timing test reads
    the overlapped run of the bit-identity test below."""
    done = dict(zip(ROUND_RUNS, zip(*ranks.run(4, zero_step_cases, ROUND_RUNS, timeout=300))))

    def run(*args, **settings):
        return list(done[args, tuple(sorted(settings.items()))])

    return run


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_scatter_timing_follows_the_rounds(zero_steps, stage):
    p, v, m, k = ROUNDS  # rounds per chunk: ceil(5/2) = 3
    results = zero_steps(stage, p, v, m, k, True)  # overlap (the default)
    for r in results:
        # On gloo a bucket's reduce-scatter is a point-to-point exchange in the DP group (l3plugin.collective.comm):
        # with DP = 2, one isend per bucket.
        rs = [op for op in r["ops"] if op[0] == "reduce_scatter_tensor" or (op[0] == "isend" and op[3] == "dp")]
        assert all(dtype == "torch.float32" for _, dtype, _, _, _ in rs)
        assert len(rs) == r["buckets"] * (3 if stage == 2 else 1)
        assert not any(op == "all_reduce" and dtype != "torch.float32" for op, dtype, _, _, _ in r["ops"])
        assert any(op == "all_gather_into_tensor" for op, _, _, _, _ in r["ops"])
    # The same pipeline position on both DP ranks holds identical parameters.
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(results[a]["weights"][lid], results[b]["weights"][lid]) for lid in results[a]["weights"])
    # SGD step on the DP-averaged gradient of identical data = SGD on the serial gradient.
    _, ref = toy.serial_reference(toy.make_microbatches(m, SEQ, MBS, HIDDEN), num_layers=8, hidden=HIDDEN)
    weights = {**results[0]["weights"], **results[1]["weights"]}
    for lid, (gw, _) in ref.items():
        w0, _ = toy.layer_weights(lid, HIDDEN)
        assert torch.allclose(weights[lid], w0 - 0.1 * gw, atol=1e-6), lid


def dp_reductions(ops):
    """(numel, started during a backward) of the gradient reductions in the DP group, in the order issued."""
    return [(numel, during) for op, _, numel, group, during in ops if op == "isend" and group == "dp"]


@pytest.mark.parametrize("stage", [1, 2])
def test_overlapped_round_reductions_are_bit_identical(zero_steps, stage):
    """Overlap (the default): each bucket's reduce-scatter starts from the gradient hook of the round's last
    backward that completes it, so every one starts while a backward runs; with carry_buckets=3 the last rounds'
    reductions are still running when the last backward is done and are waited in the finalize function
    (finish_grad_sync); the default lets run on only what fits in carry_bytes.
    reduce_in_backward=False starts them after the backward (none during one). Both give the blocking path's
    result bit for bit, with the same reductions in the same order."""
    p, v, m, k = ROUNDS  # pp 2 with virtual stages: rounds end at different times on the two stages
    blocking = zero_steps(stage, p, v, m, k, False)
    overlapped = zero_steps(stage, p, v, m, k, True)
    round_end = zero_steps(stage, p, v, m, k, True, 1, False)
    carry_3 = zero_steps(stage, p, v, m, k, True, 1, True, carry_buckets=3)
    for b, o, e, n in zip(blocking, overlapped, round_end, carry_3):
        assert sorted(op[:4] for op in b["ops"]) == sorted(op[:4] for op in o["ops"])
        assert [n for n, _ in dp_reductions(b["ops"])] == [n for n, _ in dp_reductions(o["ops"])]
        assert [n for n, _ in dp_reductions(b["ops"])] == [n for n, _ in dp_reductions(e["ops"])]
        assert o["buckets"] > 1 and all(during for _, during in dp_reductions(o["ops"]))
        assert not any(during for _, during in dp_reductions(b["ops"]) + dp_reductions(e["ops"]))
        for other in (o, e, n):
            assert all(torch.equal(b["weights"][lid], other["weights"][lid]) for lid in b["weights"])
        assert b["in_flight"] == 0 and n["in_flight"] > 0 and e["in_flight"] > 0  # (the default: what fits)
        assert o["others_in_flight_after_round_ends"] == e["others_in_flight_after_round_ends"] == 0
        # Between rounds the reductions still on the wire hold at most carry_bytes (default: 1/32 of the fp32
        # shard); the opt-in carry_buckets=3 keeps the 3 started last, whatever their size.
        assert o["most_held_after_a_round_end"] <= o["carry_budget"]
        assert n["most_in_flight_after_a_round_end"] == min(3, n["chunk_buckets"])


GATHERS = (2, 2, 3, 2)  # p, v, m, k: two rounds per chunk (2 + 1 micro-batches)
GATHER_RUNS = [((stage, *GATHERS, overlap, 3), ()) for stage in (1, 2) for overlap in (False, True)]


@pytest.fixture(scope="module")
def gather_steps(ranks):
    """{(stage, overlap): every rank's zero_step result over 3 steps}, ZeRO-1 and -2, blocking and overlapped: one
    call to the ranks."""
    results = ranks.run(4, zero_step_cases, GATHER_RUNS, timeout=300)
    return {(args[0], args[5]): [r[i] for r in results] for i, (args, _) in enumerate(GATHER_RUNS)}


@pytest.mark.parametrize("stage", [1, 2])
def test_parameter_gathers_overlapped_with_the_next_forward_are_bit_identical(gather_steps, stage):
    """overlap_param_gather (the default): step() only starts the all-gathers, each layer waits for its bucket in
    its forward pre-hook; three steps (two forwards on gathered parameters) equal the blocking path bit for bit."""
    blocking, overlapped = gather_steps[stage, False], gather_steps[stage, True]
    for b, o in zip(blocking, overlapped):
        assert all(torch.equal(b["weights"][lid], o["weights"][lid]) for lid in b["weights"])
        assert b["pending"] == 0 and o["pending"] == o["buckets"]


@pytest.mark.parametrize("name, value", [("reduce_every", 2), ("carry_reductions", True),
                                         ("checkpoint_allow_nonfinite", True), ("checkpoint_fallback", False)])
def test_deepspeed_only_options_are_refused_under_megatron(name, value):
    """They would be accepted and do nothing: the Megatron entry point names them and why."""
    from l3plugin.megatron.zero import megatron_zero

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=rf"{name}={value!r} applies to the DeepSpeed engine only.*drop {name}"):
        megatron_zero([model], torch.optim.SGD(model.parameters(), lr=0.1), **{name: value})


def gpt_zero_steps_both(pp, vpp, m, k, steps=2):
    """``gpt_zero_steps`` blocking, then overlapped, on one mesh: {overlap: result}."""
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=pp, vpp=vpp)
    return {overlap: gpt_zero_steps(pp, vpp, m, k, overlap, steps, mesh) for overlap in (False, True)}


def gpt_zero_steps_per_schedule(pp, vpp, m, k, steps=2):
    """``gpt_zero_steps`` overlapped (the defaults) under flexible, then flexible-zb, on one mesh."""
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=pp, vpp=vpp)
    return {schedule: gpt_zero_steps(pp, vpp, m, k, True, steps, mesh, schedule)
            for schedule in ("flexible", "flexible-zb")}


def gpt_zero_steps(pp, vpp, m, k, overlap, steps=2, mesh=None, pipeline_schedule="flexible"):
    """A tiny GPTModel (word embedding tied to the output layer; one layer per (virtual) pipeline stage, 2 at
    pp 1), dp 2, ZeRO-2 with small buckets, ``steps`` steps of the flexible schedule. Returns the parameters by
    name and whether each DP reduction of the last step started during a backward."""
    from unittest import mock

    import torch.distributed as dist
    from megatron.core.pipeline_parallel import schedules

    import tiny_gpt as gpt
    from l3plugin.debug import record_collectives
    from l3plugin.demo.model import global_name
    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.megatron.zero import attach_to_schedule, megatron_zero
    from l3plugin.mesh.groups import init_mesh

    mesh = mesh or init_mesh(pp=pp, vpp=vpp)
    r, v = mesh.coords["pp"], vpp or 1
    config = gpt.gpt_config(max(2, pp * v), pp=pp, vpp=vpp, k=k)
    chunks = [gpt.build_gpt(config, pre_process=r == 0 and c == 0, post_process=r == pp - 1 and c == v - 1,
                            vp_stage=c if vpp else None, seq_len=16, share_embeddings_and_output_weights=True,
                            pp_rank=r) for c in range(v)]
    params = [q for c in chunks for q in c.parameters()]
    zero = megatron_zero(chunks, torch.optim.SGD(params, lr=0.1), stage=2, bucket_numel=3000, overlap=overlap)
    attach_to_schedule(config, zero)
    in_backward = set()
    marked_backward_step = marking_backward(lambda: log, in_backward)

    for step in range(steps):
        batches = gpt.microbatches(m, 2, 16, seed=100 * step + mesh.coords["dp"])
        with record_collectives() as log, mock.patch.object(schedules, "backward_step",
                                                            marked_backward_step):
            in_backward.clear()
            forward_backward_pipelining_flexible(
                forward_step_func=gpt.forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
                num_microbatches=m, seq_length=16, micro_batch_size=2, pipeline_schedule=pipeline_schedule)
            zero.step()
    dp_ranks = dist.get_process_group_ranks(zero.group)
    return {"params": {global_name(c, n): q.detach().clone() for c in chunks for n, q in c.named_parameters()},
            "buckets": len(zero.buckets),
            "during_backward": [i in in_backward for i, c in enumerate(log) if c.op == "isend" and c.group == dp_ranks]}


@pytest.mark.parametrize("pp, vpp, m, k", [(1, None, 2, 1), (2, 2, 3, 2)], ids=["pp1", "pp2-vpp2"])
def test_gpt_reductions_in_backward_are_bit_identical_to_blocking(ranks, pp, vpp, m, k):
    """GPTModel, dp 2, ZeRO-2 by default (reductions started from the gradient hooks of each round's last
    backward) equals the blocking path bit for bit over 2 steps: pp 1 with a round per micro-batch, and pp 2
    with virtual stages (two rounds per chunk, of 2 and 1 micro-batches; round ends at different times per
    stage; the tied embedding summed over the embedding group in finish_grad_sync). Both paths in one call."""
    both = ranks.run(2 * pp, gpt_zero_steps_both, pp, vpp, m, k, timeout=300)
    blocking, overlapped = [r[False] for r in both], [r[True] for r in both]
    for rank, (b, o) in enumerate(zip(blocking, overlapped)):
        assert o["buckets"] > 2 and o["during_backward"] and all(o["during_backward"]), (rank, o["during_backward"])
        assert not any(b["during_backward"]) and len(b["during_backward"]) == len(o["during_backward"]), rank
        for name, value in b["params"].items():
            assert torch.equal(value, o["params"][name]), (rank, name)


def test_gpt_zero_under_flexible_zb_is_bit_identical_to_flexible(ranks):
    """The same GPTModel, dp 2, pp 2 x vpp 2, ZeRO-2 overlapped: under flexible-zb (Megatron's linears split by
    split_linears, the weight gradients and with them ZeRO's gradient hooks and reduce-scatters in the W steps,
    the round hooks around each round's last W) every parameter after 2 steps equals flexible's bit for bit."""
    for rank, r in enumerate(ranks.run(4, gpt_zero_steps_per_schedule, 2, 2, 3, 2, timeout=300)):
        flexible, split = r["flexible"], r["flexible-zb"]
        assert split["buckets"] > 2 and split["params"].keys() == flexible["params"].keys()
        for name, value in flexible["params"].items():
            assert torch.equal(value, split["params"][name]), (rank, name)
