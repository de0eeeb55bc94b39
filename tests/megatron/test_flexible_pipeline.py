"""The flexible schedule on real gloo ranks: bit-identical to a serial run and to stock Megatron."""

import pytest
import torch

import toy_pipeline as toy

HIDDEN, SEQ, MBS = 8, 4, 2


def toy_config(pp, vpp, num_layers, group_size):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=1,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_dtype=torch.float32, microbatch_group_size_per_vp_stage=group_size,
        batch_p2p_comm=False, deallocate_pipeline_outputs=True)


def meshes_for(cases):
    """(case, mesh) for each case in turn, ``init_mesh(pp=case[0], vpp=case[1])`` built again only where the two
    change: one call to the ranks runs many steps on fresh chunks, as a training job runs many steps."""
    from l3plugin.mesh.groups import init_mesh

    mesh, shape = None, None
    for case in cases:
        if tuple(case[:2]) != shape:
            shape = tuple(case[:2])
            mesh = init_mesh(pp=shape[0], vpp=shape[1] if shape[1] > 1 else None)
        yield case, mesh


def run_pipeline(pp, vpp, m, k, num_layers, layers_per_stage=None, stock=False, forward_only=False, mesh=None):
    """On every rank: one step of the flexible (or stock) schedule; this rank's grads and losses. ``mesh``: the
    one already built for (pp, vpp), else built here."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.mesh.groups import init_mesh
    from megatron_cpu_shim import stock_schedules_on_cpu

    mesh = mesh or init_mesh(pp=pp, vpp=vpp if vpp > 1 else None)
    config = toy_config(pp, vpp, num_layers, k)
    chunks = toy.build_chunks(config, num_layers=num_layers, hidden=HIDDEN, pp_rank=mesh.coords["pp"],
                              pp_size=pp, vpp_size=vpp, layers_per_stage=layers_per_stage)
    batches = toy.make_microbatches(m, SEQ, MBS, HIDDEN)
    kwargs = dict(forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks],
                  model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS,
                  forward_only=forward_only)
    if stock:
        with stock_schedules_on_cpu():
            out = get_forward_backward_func()(**kwargs)
    else:
        out = forward_backward_pipelining_flexible(**kwargs)
    grads = {}
    if not forward_only:
        for chunk in chunks:
            grads.update(chunk.grads())
    return {"losses": [d["loss"] for d in out], "grads": grads}


def run_pipelines(cases):
    """``run_pipeline(*case)`` for each case (all at one p) in turn on this rank."""
    return [run_pipeline(*case, mesh=mesh) for case, mesh in meshes_for(cases)]


def pipeline_case(p, v, m, k, num_layers=None, layers_per_stage=None, stock=False, forward_only=False):
    """run_pipeline's arguments as a hashable key (2 layers per virtual stage unless given)."""
    return (p, v, m, k, num_layers or 2 * p * v, tuple(layers_per_stage) if layers_per_stage else None, stock,
            forward_only)


@pytest.fixture(scope="module")
def pipelines(ranks):
    """``pipelines(cases)``: {case: every rank's run_pipeline result} for pipeline_case keys, each case run once per
    module, the ones not yet run in one call to the ranks per p (sorted by v: the mesh is built once per (p, v))."""
    done = {}

    def get(cases):
        missing = sorted({c for c in cases if c not in done}, key=lambda c: (c[0], c[1]))
        for p in sorted({c[0] for c in missing}):
            mine = [c for c in missing if c[0] == p]
            done.update(zip(mine, zip(*ranks.run(p, run_pipelines, mine, timeout=240))))
        return {c: list(done[c]) for c in cases}

    return get


def assert_matches_serial(results, m, num_layers):
    toy.assert_matches_serial(results, toy.make_microbatches(m, SEQ, MBS, HIDDEN), num_layers=num_layers,
                              hidden=HIDDEN)


GRID = [
    # (p, v, m, k)         what it covers
    (2, 1, 5, 2),          # v=1, k=p: Megatron's 1F1B
    (2, 2, 4, 2),          # k=p interleaved, pp=2 (the same-peer hazard)
    (2, 2, 3, 1),          # k<p: all-forward-all-backward, pp=2
    (2, 2, 7, 3),          # k>p, m not a multiple of k (last group of 1 < p)
    (2, 3, 1, 1),          # m<p with v=3
    (4, 1, 3, 3),          # m<p, v=1
    (4, 2, 9, 4),          # k=p, m=9: a last group of 1 (stock refuses)
    (4, 2, 8, 6),          # k>p: extra warm-up
    (4, 3, 6, 2),          # k<p, v=3
    (4, 2, 2, 2),          # m<p with virtual stages
]


UNEVEN = [1, 2, 2, 2, 2, 2, 2, 1]  # one fewer layer on the first and the last stage, as the paper does
STOCK_GRID = [(2, 1, 4, 2), (2, 2, 4, 2), (2, 2, 6, 3), (4, 2, 8, 4), (4, 2, 10, 5)]
# Every step of the serial, uneven, stock and forward-only tests below: the first of them runs all (one call to the
# ranks per p), each test checks its own. (2, 2, 4, 2) is in GRID and STOCK_GRID: one flexible run serves both.
STEPS = ([pipeline_case(*case) for case in GRID] + [pipeline_case(4, 2, 6, 4, sum(UNEVEN), UNEVEN)]
         + [pipeline_case(*case, stock=stock) for case in STOCK_GRID for stock in (False, True)]
         + [pipeline_case(2, 2, 5, 2, 8, forward_only=True)])


@pytest.mark.parametrize("p,v,m,k", GRID, ids=[f"p{p}v{v}m{m}k{k}" for p, v, m, k in GRID])
def test_flexible_matches_serial_bitwise(pipelines, p, v, m, k):
    layers = 2 * p * v
    results = pipelines(STEPS)[pipeline_case(p, v, m, k)]
    assert_matches_serial(results, m, layers)


def test_uneven_layers_per_stage(pipelines):
    # One fewer layer on the first and the last stage, as the paper does for embedding and output.
    p, v, m, k = 4, 2, 6, 4
    results = pipelines(STEPS)[pipeline_case(p, v, m, k, sum(UNEVEN), UNEVEN)]
    assert_matches_serial(results, m, sum(UNEVEN))


@pytest.mark.parametrize("p,v,m,k", STOCK_GRID, ids=[f"p{p}v{v}m{m}k{k}" for p, v, m, k in STOCK_GRID])
def test_flexible_matches_stock_megatron_bitwise(pipelines, p, v, m, k):
    steps = pipelines(STEPS)
    ours, stock = steps[pipeline_case(p, v, m, k)], steps[pipeline_case(p, v, m, k, stock=True)]
    for a, b in zip(ours, stock):
        assert a["grads"].keys() == b["grads"].keys()
        for lid in a["grads"]:
            assert all(torch.equal(x, y) for x, y in zip(a["grads"][lid], b["grads"][lid]))
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))


def test_forward_only_returns_the_losses(pipelines):
    p, v, m, k = 2, 2, 5, 2
    results = pipelines(STEPS)[pipeline_case(p, v, m, k, 8, forward_only=True)]
    ref_losses, _ = toy.serial_reference(toy.make_microbatches(m, SEQ, MBS, HIDDEN), num_layers=8,
                                         hidden=HIDDEN)
    assert results[0]["losses"] == [] and all(torch.equal(a, b) for a, b in zip(results[-1]["losses"], ref_losses))


def bad_input_messages(inputs):
    """The executor's error for each bad (num_microbatches, group_size) (raised before any communication, on every
    rank), one after another on one mesh."""
    out = []
    for (_, _, m, k), mesh in meshes_for([(2, 2, m, k) for m, k in inputs]):
        try:
            run_pipeline(2, 2, m, k, 8, mesh=mesh)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    return out


BAD_INPUTS = [
    (0, 2, "num_microbatches=0 is out of range: must be an integer >= 1"),
    (4, 5, "group_size=5 is out of range: must be an integer in 1..num_microbatches (=4)"),
    (4, 0, "group_size=0 is out of range: must be an integer in 1..num_microbatches (=4)"),
]


@pytest.fixture(scope="module")
def bad_input_texts(ranks):
    """Every rank's message for each of BAD_INPUTS, all in one call to the ranks."""
    per_rank = ranks.run(2, bad_input_messages, [(m, k) for m, k, _ in BAD_INPUTS], timeout=60)
    return {(m, k): [texts[i] for texts in per_rank] for i, (m, k, _) in enumerate(BAD_INPUTS)}


@pytest.mark.parametrize("m,k,message", BAD_INPUTS)
def test_bad_input_names_parameter_value_and_range(bad_input_texts, m, k, message):
    for text in bad_input_texts[m, k]:
        assert text is not None and message in text, text


def run_with_sync_hooks(p, v, m, k, pipeline_schedule="flexible"):
    """Records when the schedule calls grad_sync_func / round_grad_sync_start_func / round_grad_sync_func and
    enables DDP sync."""
    import contextlib

    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=p, vpp=v if v > 1 else None)
    layers = 2 * p * v
    config = toy_config(p, v, layers, k)
    chunks = toy.build_chunks(config, num_layers=layers, hidden=HIDDEN, pp_rank=mesh.coords["pp"],
                              pp_size=p, vpp_size=v)
    record = {"grad_sync": [], "rounds": [], "starts": [], "accumulations": {c: [] for c in range(v)}}
    state = {"sync": True}

    @contextlib.contextmanager
    def no_sync():
        state["sync"] = False
        try:
            yield
        finally:
            state["sync"] = True

    def grads_of(c):
        return {lid: g for lid, g in chunks[c].grads().items()}

    def grad_sync(c):
        return lambda params: record["grad_sync"].append((c, grads_of(c)))

    def round_sync(c, params, round_id, is_last_round):
        record["rounds"].append((c, round_id, is_last_round, grads_of(c)))

    def round_start(c, params, round_id, is_last_round):  # how many microbatches chunk c has accumulated
        record["starts"].append((c, round_id, is_last_round, len(record["accumulations"][c])))

    for c, chunk in enumerate(chunks):
        chunk.layers[0].weight.register_post_accumulate_grad_hook(
            lambda param, c=c: record["accumulations"][c].append(state["sync"]))
    config.no_sync_func = no_sync
    config.round_grad_sync_func = round_sync
    config.round_grad_sync_start_func = round_start
    batches = toy.make_microbatches(m, SEQ, MBS, HIDDEN)
    kwargs = dict(forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks],
                  model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS,
                  pipeline_schedule=pipeline_schedule)
    forward_backward_pipelining_flexible(**kwargs)  # DDP-style: no grad_sync_func
    ddp_accumulations = {c: list(flags) for c, flags in record["accumulations"].items()}
    config.round_grad_sync_start_func = None
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    record["rounds"].clear()
    config.grad_sync_func = [grad_sync(c) for c in range(v)]
    kwargs["data_iterator"] = [iter(batches) for _ in chunks]
    forward_backward_pipelining_flexible(**kwargs)
    del record["accumulations"]
    record["ddp_accumulations"] = ddp_accumulations
    return record


@pytest.mark.parametrize("p,v,m,k", [(2, 2, 7, 3), (4, 2, 6, 2), (2, 2, 3, 1)], ids=["k>p", "k<p", "k=1"])
def test_grad_sync_hooks_fire_at_chunk_and_round_ends(ranks, p, v, m, k):
    check_sync_record(ranks.run(p, run_with_sync_hooks, p, v, m, k, timeout=120), p, v, m, k)


def check_sync_record(results, p, v, m, k):
    """``run_with_sync_hooks``' records: each hook once where a chunk's (round's) gradients are final."""
    batches = toy.make_microbatches(m, SEQ, MBS, HIDDEN)
    num_rounds = -(-m // k)
    for rec in results:
        # DDP contract: gradient sync is enabled only while the chunk's last microbatch accumulates.
        for c, flags in rec["ddp_accumulations"].items():
            assert flags == [False] * (m - 1) + [True], (c, flags)
        # grad_sync_func: once per chunk, when its gradients are final.
        assert sorted(c for c, _ in rec["grad_sync"]) == list(range(v))
        # round hook: every (chunk, round) once; the chunk's gradients then hold exactly the
        # microbatches of rounds 0..j (bitwise equal to a serial prefix).
        assert sorted((c, j) for c, j, _, _ in rec["rounds"]) == [(c, j) for c in range(v) for j in range(num_rounds)]
        for c in range(v):  # and each chunk's rounds in order (k = 1: every microbatch opens a round)
            assert [j for c2, j, _, _ in rec["rounds"] if c2 == c] == list(range(num_rounds)), c
        # start hook: every (chunk, round) once, right before the round's last backward (one microbatch left).
        assert [(c, j, last) for c, j, last, _ in rec["starts"]] == [(c, j, last) for c, j, last, _ in rec["rounds"]]
        for c, j, _, accumulated in rec["starts"]:
            assert accumulated == min(m, (j + 1) * k) - 1, (c, j, accumulated)
        for c, j, is_last, grads in rec["rounds"]:
            assert is_last == (j == num_rounds - 1)
            _, ref = toy.serial_reference(batches[: min(m, (j + 1) * k)], num_layers=2 * p * v,
                                          hidden=HIDDEN, loss_divisor=m)
            for lid, (w, b) in grads.items():
                assert torch.equal(w, ref[lid][0]) and torch.equal(b, ref[lid][1]), (c, j, lid)
        for c, grads in rec["grad_sync"]:
            _, ref = toy.serial_reference(batches, num_layers=2 * p * v, hidden=HIDDEN)
            assert all(torch.equal(w, ref[lid][0]) for lid, (w, _) in grads.items())


def run_with_param_sync(p, v, m, k, stock, mesh=None):
    """This rank's sequence of forwards and ``config.param_sync_func`` calls, as (kind, chunk)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.mesh.groups import init_mesh
    from megatron_cpu_shim import stock_schedules_on_cpu

    mesh = mesh or init_mesh(pp=p, vpp=v if v > 1 else None)
    layers = 2 * p * v
    config = toy_config(p, v, layers, k)
    chunks = toy.build_chunks(config, num_layers=layers, hidden=HIDDEN, pp_rank=mesh.coords["pp"],
                              pp_size=p, vpp_size=v)
    chunk_ids = {id(chunk): c for c, chunk in enumerate(chunks)}
    events = []

    def forward_step(data_iterator, model):
        events.append(("forward", chunk_ids[id(model)]))
        return toy.forward_step(data_iterator, model)

    def param_sync(c):
        def start(params):
            assert list(params) == list(chunks[c].parameters())
            events.append(("param_sync", c))
        return start

    config.param_sync_func = [param_sync(c) for c in range(v)] if v > 1 else param_sync(0)
    batches = toy.make_microbatches(m, SEQ, MBS, HIDDEN)
    kwargs = dict(forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
                  model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS)
    if stock:
        with stock_schedules_on_cpu():
            get_forward_backward_func()(**kwargs)
    else:
        forward_backward_pipelining_flexible(**kwargs)
        before = len(events)
        kwargs["data_iterator"] = [iter(batches) for _ in chunks]
        forward_backward_pipelining_flexible(**kwargs, forward_only=True)
        assert all(kind == "forward" for kind, _ in events[before:]), "param sync in forward-only"
        del events[before:]
    return events


PARAM_SYNC_GRID = [(2, 1, 4, 2), (2, 3, 4, 2), (2, 4, 6, 3), (4, 3, 8, 4)]


def runs_with_param_sync(cases):
    """``run_with_param_sync(*case)`` for each case (all at one p) in turn on this rank."""
    return [run_with_param_sync(*case, mesh=mesh) for case, mesh in meshes_for(cases)]


@pytest.fixture(scope="module")
def param_sync_runs(ranks):
    """{(p, v, m, k, stock): every rank's events} for PARAM_SYNC_GRID, ours and stock's: one call to the ranks per p."""
    done = {}
    for p in sorted({case[0] for case in PARAM_SYNC_GRID}):
        cases = [(*case, stock) for case in PARAM_SYNC_GRID if case[0] == p for stock in (False, True)]
        done.update(zip(cases, zip(*ranks.run(p, runs_with_param_sync, cases, timeout=240))))
    return done


@pytest.mark.parametrize("p,v,m,k", PARAM_SYNC_GRID, ids=[f"p{p}v{v}m{m}k{k}" for p, v, m, k in PARAM_SYNC_GRID])
def test_param_sync_func_is_called_where_stock_calls_it(param_sync_runs, p, v, m, k):
    # Megatron-LM sets config.param_sync_func (--overlap-param-gather --align-param-gather) so that the
    # schedule starts each chunk's parameter all-gather ahead of its first forward.
    ours, stock = param_sync_runs[p, v, m, k, False], param_sync_runs[p, v, m, k, True]
    for rank, (a, b) in enumerate(zip(ours, stock)):
        assert a == b, f"pipeline rank {rank}: ours {a}\nstock {b}"
        synced = [c for kind, c in a if kind == "param_sync"]
        assert synced == (list(range(v)) if v > 1 else []), (rank, synced)
        for c in synced:  # started before the chunk's first forward
            assert a.index(("param_sync", c)) < a.index(("forward", c)), (rank, c)
