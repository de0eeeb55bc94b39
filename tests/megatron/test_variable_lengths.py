"""Variable-length micro-batches in the flexible schedule, called the way RL frameworks call Megatron.

verl's Megatron engine builds ``TransformerConfig(variable_seq_lengths=True, ...)`` and calls
``get_forward_backward_func()(..., num_microbatches=n, seq_length=1, micro_batch_size=1, forward_only=...)`` with a
different n every call (token-balanced batches, n not a multiple of p) and micro-batches of different lengths, for
log-prob passes (forward-only, under no_grad) and for training. Here: every such call on real gloo ranks equals a
serial run bit for bit, for p in {2, 3, 4}, v in {1, 2, 3}, m from 1 to 2p + 1 and k below, at and above p, with
both receive postings (early: gloo's; agreed: the pair order NCCL needs), in one pool of workers that keeps its
model chunks' configuration and changes m and k (and the posting) from call to call as an RL loop does.

Which (v, m, k) run where (``RL_RUNS``; the calls of both postings at one p run in one call to the ranks): at p = 2
every one, under one posting or the other; at p = 3 (early) and
at p = 4 (under each posting) every v and every k, each v with one m, the m in three of the classes of m against p
(1, below p, p, between p and 2p, 2p, above 2p); the two postings at p = 4 together in five. Every class of m meets
each posting at some p. The plans themselves, and both postings' orders, are checked for every configuration
without processes (tests/schedule: test_schedule_properties, test_receive_posts, test_comm_order).
"""

import pytest
import torch

import toy_pipeline as toy

HIDDEN = 8
MIN_LEN, MAX_LEN = 3, 9  # tokens per micro-batch, as in the issue's reproduction


def varlen_microbatches(m: int, seed: int) -> list[dict]:
    """m micro-batches of one sequence each, lengths drawn from MIN_LEN..MAX_LEN ([s, 1, h], Megatron's layout)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (m,), generator=gen).tolist()
    return [toy.make_microbatches(1, length, 1, HIDDEN, seed=seed * 101 + i)[0] for i, length in enumerate(lengths)]


def grid(p: int) -> list[tuple[int, int, int]]:
    """(v, m, k) for one p: m = 1..2p+1, k = 1 (< p), p and p + 1 where k <= m (k = p with m < p: Megatron's
    default, which the schedule turns into one group of m)."""
    return [(v, m, k) for v in (1, 2, 3) for m in range(1, 2 * p + 2) for k in (1, p, p + 1) if k <= m or k == p]


def varlen_config(p, v, k, num_layers):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=1, pipeline_model_parallel_size=p,
        virtual_pipeline_model_parallel_size=v if v > 1 else None, pipeline_dtype=torch.float32,
        microbatch_group_size_per_vp_stage=k, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=True)


def run_rl_calls(p, calls):
    """On every rank: for each (v, m, k, receive posting, seed), a forward-only log-prob pass under no_grad, then a
    training pass, both through ``get_forward_backward_func()`` as verl calls it. Returns this rank's losses and
    gradients per call, and the activations the forward-only passes kept (must be none)."""
    from megatron.core import pipeline_parallel

    import l3plugin.megatron as l3m
    from l3plugin.mesh.groups import init_mesh

    out, v_now = [], None
    l3m.install("flexible")
    try:
        for v, m, k, receive_posting, case in calls:
            if v != v_now:
                mesh, v_now = init_mesh(pp=p, vpp=v if v > 1 else None), v
            layers = 2 * p * v
            config = varlen_config(p, v, k, layers)
            chunks = toy.build_chunks(config, num_layers=layers, hidden=HIDDEN, pp_rank=mesh.coords["pp"],
                                      pp_size=p, vpp_size=v)
            batches = varlen_microbatches(m, seed=case)
            step = pipeline_parallel.get_forward_backward_func()
            assert step is l3m.forward_backward_pipelining_flexible
            kwargs = dict(forward_step_func=toy.forward_step, model=chunks, num_microbatches=m, seq_length=1,
                          micro_batch_size=1, receive_posting=receive_posting)
            with torch.no_grad():
                logprob = step(data_iterator=[iter(batches) for _ in chunks], forward_only=True, **kwargs)
            kept = sum(p_.grad is not None for c in chunks for p_ in c.parameters())
            train = step(data_iterator=[iter(batches) for _ in chunks], forward_only=False, **kwargs)
            out.append({"forward_only": [d["loss"] for d in logprob], "losses": [d["loss"] for d in train],
                        "grads": {lid: g for c in chunks for lid, g in c.grads().items()}, "grads_after_fwd": kept})
    finally:
        l3m.uninstall()
    return out


def check_cases(p, cases, results):
    for case, (v, m, k) in enumerate(cases):
        batches = varlen_microbatches(m, seed=case)
        per_rank = [r[case] for r in results]
        where = f"p={p} v={v} m={m} k={k}"
        assert all(r["grads_after_fwd"] == 0 for r in per_rank), where  # the log-prob pass kept no gradients
        # The log-prob losses equal the training pass's, which equal the serial run's (below).
        assert len(per_rank[-1]["forward_only"]) == len(per_rank[-1]["losses"]) == m, where
        assert all(torch.equal(a, b) for a, b in zip(per_rank[-1]["forward_only"], per_rank[-1]["losses"])), where
        toy.assert_matches_serial(per_rank, batches, num_layers=2 * p * v, hidden=HIDDEN)


def m_class(p, m):
    """Where m stands against p: the schedule's warm-up, groups and final group change at these bounds."""
    return ("1" if m == 1 else "< p" if m < p else "p" if m == p else "< 2p" if m < 2 * p else "2p" if m == 2 * p
            else "> 2p")


def every_k(p, *v_m):
    """Every k of ``grid(p)`` for each (v, m); k = p + 1 is left out at v = 1, where it is the plan of k = p (without
    virtual stages k only picks 1F1B, k >= p, or all-forward-all-backward, k < p)."""
    return [case for case in grid(p) if case[:2] in v_m and not (case[0] == 1 and case[2] == p + 1)]


# {id: (p, receive posting, cases)}: one call per id (docstring). At p = 4 the early posting takes m < p, between p
# and 2p, and 2p + 1; the agreed one m < p, p and 2p. Final groups shorter than p, where the plan is list-scheduled:
# (2, 7, 3), (3, 4, 3), (2, 9, 4), (3, 6, 4), (3, 6, 5) and (2, 8, 5).
RL_RUNS = {
    "p2-early": (2, "early", [c for c in grid(2) if c[1] % 2 == 0]),
    "p2-agreed": (2, "agreed", [c for c in grid(2) if c[1] % 2 == 1]),
    "p3-early": (3, "early", every_k(3, (1, 1), (2, 7), (3, 4))),
    "p4-early": (4, "early", every_k(4, (1, 3), (2, 9), (3, 6))),
    "p4-agreed": (4, "agreed", every_k(4, (1, 4), (2, 8), (3, 2))),
}


@pytest.fixture(scope="module")
def rl_calls(ranks):
    """{id of RL_RUNS: every rank's results per case}: at each p the calls of both postings in one call to the
    ranks, ordered by v (the mesh is built once per v; m, k and the posting change from call to call)."""
    done = {}
    for p in sorted({p for p, _, _ in RL_RUNS.values()}):
        calls = sorted(((*case, posting, i, name) for name, (q, posting, cases) in RL_RUNS.items() if q == p
                        for i, case in enumerate(cases)), key=lambda call: call[0])
        per_rank = ranks.run(p, run_rl_calls, p, [call[:5] for call in calls], timeout=300)
        for j, call in enumerate(calls):
            done.setdefault(call[-1], {})[call[-2]] = [results[j] for results in per_rank]
    return {name: [[by_case[i][rank] for i in range(len(by_case))] for rank in range(RL_RUNS[name][0])]
            for name, by_case in done.items()}


@pytest.mark.parametrize("name", RL_RUNS)
def test_rl_call_pattern_matches_serial_bitwise(rl_calls, name):
    p, _, cases = RL_RUNS[name]
    check_cases(p, cases, rl_calls[name])


def test_grid_covers_the_issue():
    runs = {(p, posting): cases for p, posting, cases in RL_RUNS.values()}
    assert set(runs[2, "early"]) | set(runs[2, "agreed"]) == set(grid(2))  # all of p = 2
    assert {m for _, m, _ in grid(2)} == set(range(1, 6))
    for posting in ("early", "agreed"):
        cases = [(p, *case) for (p, mine), some in runs.items() if mine == posting for case in some]
        assert {v for _, v, _, _ in cases} == {1, 2, 3}
        assert {m_class(p, m) for p, _, m, _ in cases} == {"1", "< p", "p", "< 2p", "2p", "> 2p"}, posting
        assert {(k > p) - (k < p) for p, *_, k in cases} == {-1, 0, 1}, posting
        for p in {p for p, *_ in cases}:  # at every p: every v, and k below, at and above p
            here = [(v, k) for q, v, _, k in cases if q == p]
            assert {v for v, _ in here} == {1, 2, 3} and {(k > p) - (k < p) for _, k in here} == {-1, 0, 1}, p


def runs_stock_and_flexible(cases):
    """``run_stock_and_flexible(*case)`` for each case (all at one p) in turn on this rank."""
    return [run_stock_and_flexible(*case) for case in cases]


def run_stock_and_flexible(p, v, m, k):
    """On every rank: one training step of stock Megatron (CPU shim) and one of the flexible schedule, each on
    fresh chunks, with the same variable-length micro-batches (verl's keywords)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.mesh.groups import init_mesh
    from megatron_cpu_shim import stock_schedules_on_cpu

    mesh = init_mesh(pp=p, vpp=v if v > 1 else None)
    batches = varlen_microbatches(m, seed=99)
    out = {}
    for name in ("stock", "flexible"):
        config = varlen_config(p, v, k, 2 * p * v)
        chunks = toy.build_chunks(config, num_layers=2 * p * v, hidden=HIDDEN, pp_rank=mesh.coords["pp"],
                                  pp_size=p, vpp_size=v)
        kwargs = dict(forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks],
                      model=chunks if v > 1 else chunks[0], num_microbatches=m, seq_length=1, micro_batch_size=1)
        if name == "stock":
            with stock_schedules_on_cpu():
                result = get_forward_backward_func()(**kwargs)
        else:
            result = forward_backward_pipelining_flexible(**kwargs)
        out[name] = {"losses": [d["loss"] for d in result],
                     "grads": {lid: g for c in chunks for lid, g in c.grads().items()}}
    return out


# Where stock accepts the configuration (k >= p, every group full); p = 2 with virtual stages is left out: stock's
# batched shape exchange there has the same-peer hazard of NVIDIA/Megatron-LM#750 (upstream-facts.md).
STOCK = [(2, 1, 5, 2), (4, 1, 6, 4), (4, 2, 8, 4)]


@pytest.fixture(scope="module")
def stock_steps(ranks):
    """{case of STOCK: every rank's stock and flexible steps}: one call to the ranks per p."""
    done = {}
    for p in sorted({case[0] for case in STOCK}):
        cases = [case for case in STOCK if case[0] == p]
        done.update(zip(cases, zip(*ranks.run(p, runs_stock_and_flexible, cases, timeout=240))))
    return done


@pytest.mark.parametrize("p,v,m,k", STOCK, ids=[f"p{p}v{v}m{m}k{k}" for p, v, m, k in STOCK])
def test_variable_lengths_match_stock_megatron_and_serial(stock_steps, p, v, m, k):
    results = list(stock_steps[p, v, m, k])
    batches = varlen_microbatches(m, seed=99)
    for name in ("stock", "flexible"):
        toy.assert_matches_serial([r[name] for r in results], batches, num_layers=2 * p * v, hidden=HIDDEN)


def step_error(**step_kwargs):
    """On a rank: one flexible step with our waits bounded at 2 s; its error as text (type, message and the
    executor's notes), or None if it ran."""
    import os

    from l3plugin.megatron import forward_backward_pipelining_flexible

    import threading

    from l3plugin.schedule import p2p

    os.environ["L3PLUGIN_WAIT_TIMEOUT"] = "2"
    try:
        forward_backward_pipelining_flexible(**step_kwargs)
    except Exception as exc:  # noqa: BLE001 - the test reads each rank's message
        p2p._stop_receivers_at_exit()  # what the exit does (collective/at_exit.py) after a caught error
        alive = sum(t.name.startswith("l3plugin-shapes-from-") for t in threading.enumerate())
        return "\n".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", []),
                          f"shape threads alive after the exit hook: {alive}"])
    finally:
        del os.environ["L3PLUGIN_WAIT_TIMEOUT"]
    return None


def run_fixed_config_with_varying_lengths():
    """p = 2: micro-batches of 4 and 6 tokens with variable_seq_lengths off (seq_length=4): rank 0 must refuse
    to send micro-batch 1 naming the fix; rank 1, left waiting, must fail too (within the wait bound)."""
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=2)
    config = varlen_config(2, 1, 2, 4)
    config.variable_seq_lengths = False
    chunks = toy.build_chunks(config, num_layers=4, hidden=HIDDEN, pp_rank=mesh.coords["pp"], pp_size=2)
    batches = [toy.make_microbatches(1, length, 1, HIDDEN, seed=i)[0] for i, length in enumerate((4, 6))]
    return step_error(forward_step_func=toy.forward_step, data_iterator=[iter(batches)], model=chunks,
                      num_microbatches=2, seq_length=4, micro_batch_size=1)


def test_lengths_that_vary_without_the_flag_fail_on_every_rank(ranks):
    first, second = ranks.run(2, run_fixed_config_with_varying_lengths, timeout=60)
    assert first is not None and "the activation of microbatch 1 (stage 0 -> 1) has shape (6, 1, 8)" in first, first
    assert "messages are (4, 1, 8)" in first and "config.variable_seq_lengths=True" in first, first
    # Rank 1 does not hang: its wait is bounded (CommTimeout naming rank 0), or gloo reports rank 0's side gone.
    assert second is not None and ("pipeline rank 0" in second or "Connection closed by peer" in second), second


def run_with_a_bad_micro_batch(bad):
    """p = 2, v = 2, variable lengths: micro-batch ``bad`` breaks a rule of the user's forward step (as a length
    that sequence parallelism cannot split would). Returns each rank's error text."""
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=2, vpp=2)
    config = varlen_config(2, 2, 2, 8)
    chunks = toy.build_chunks(config, num_layers=8, hidden=HIDDEN, pp_rank=mesh.coords["pp"], pp_size=2, vpp_size=2)
    batches = varlen_microbatches(5, seed=3)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if model.is_first and batch is batches[bad]:
            raise ValueError(f"sequence length {batch['x'].shape[0]} is not divisible by the TP size 4")
        return toy.forward_step(iter([batch]), model)

    return step_error(forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
                      num_microbatches=5, seq_length=1, micro_batch_size=1)


def test_an_error_in_a_micro_batch_names_it_and_no_rank_hangs(ranks):
    first, second = ranks.run(2, run_with_a_bad_micro_batch, 3, timeout=60)
    assert first is not None and "not divisible by the TP size 4" in first, first
    assert ("in the forward of micro-batch 3 of 5 (model chunk 0, virtual stage 0) on pipeline rank 0" in first), first
    assert second is not None and ("pipeline rank 0" in second or "Connection closed by peer" in second), second
    for text in (first, second):  # the step raised before finish(): the exit hook stops its shape threads
        assert "shape threads alive after the exit hook: 0" in text, text


def run_tp_inputs(lengths_by_tp_rank, sequence_parallel):
    """tp = 2, pp = 1, variable lengths: a token-id model whose micro-batch m has lengths_by_tp_rank[tp rank][m]
    tokens. Returns this rank's error text (with the executor's notes), or None if the step ran."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer import TransformerConfig

    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(tp=2)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, tensor_model_parallel_size=2,
                               sequence_parallel=sequence_parallel, variable_seq_lengths=True,
                               moe_token_dispatcher_type="alltoall", pipeline_dtype=torch.float32)

    class TokenChunk(torch.nn.Module):
        model_type = ModelType.encoder_or_decoder

        def __init__(self):
            super().__init__()
            self.config, self.embedding = config, torch.nn.Embedding(16, HIDDEN)

        def set_input_tensor(self, _tensor):
            pass

        def forward(self, input_ids):
            return self.embedding(input_ids)

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        return model(ids), lambda out: (out.float().pow(2).mean(), {"loss": out.detach().sum()})

    lengths = lengths_by_tp_rank[mesh.coords["tp"]]
    batches = [torch.arange(n)[None] % 16 for n in lengths]
    return step_error(forward_step_func=forward_step, data_iterator=iter(batches), model=[TokenChunk()],
                      num_microbatches=len(batches), seq_length=1, micro_batch_size=1)


def test_micro_batches_that_differ_across_tp_or_do_not_split_for_sp_are_named_on_every_rank(ranks):
    # Micro-batch 1 has 6 tokens on TP rank 0 and 7 on TP rank 1: both ranks refuse it, naming it and the shapes.
    for text in ranks.run(2, run_tp_inputs, [[4, 6, 4], [4, 7, 4]], False, timeout=60):
        assert text is not None and "got inputs of shapes [(1, 6), (1, 7)] (TP rank order)" in text, text
        assert "in the forward of micro-batch 1 of 3" in text, text
    # Sequence parallelism: 5 tokens do not split over TP 2 (micro-batch 2).
    for text in ranks.run(2, run_tp_inputs, [[4, 6, 5], [4, 6, 5]], True, timeout=60):
        assert text is not None and "a micro-batch of 5 tokens on this rank (after CP)" in text, text
        assert "must be a multiple of 2" in text and "in the forward of micro-batch 2 of 3" in text, text
    # The same micro-batches on both TP ranks, each a multiple of 2: the step runs.
    assert ranks.run(2, run_tp_inputs, [[4, 6, 8], [4, 6, 8]], True, timeout=60) == [None, None]


def run_frozen_prefix(p, v, m, k, frozen, postings):
    """Variable lengths with a frozen prefix (no gradient messages into it): one training step on this rank per
    receive posting (on one mesh)."""
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=p, vpp=v if v > 1 else None)
    layers, out = 2 * p * v, {}
    for receive_posting in postings:
        config = varlen_config(p, v, k, layers)
        chunks = toy.build_chunks(config, num_layers=layers, hidden=HIDDEN, pp_rank=mesh.coords["pp"], pp_size=p,
                                  vpp_size=v, frozen=frozen)
        out[receive_posting] = toy.flexible_step(chunks, varlen_microbatches(m, seed=5), seq_length=1,
                                                 micro_batch_size=1, receive_posting=receive_posting)
    return out


FROZEN_PREFIX = (4, 2, 5, 4, tuple(range(6)))  # p, v, m, k, frozen layers: stages 0-2 of 8 frozen


@pytest.fixture(scope="module")
def frozen_prefix_steps(ranks):
    """Every rank's step under each receive posting, both in one call to the ranks."""
    return ranks.run(FROZEN_PREFIX[0], run_frozen_prefix, *FROZEN_PREFIX, ["early", "agreed"], timeout=120)


@pytest.mark.parametrize("receive_posting", ["early", "agreed"])
def test_variable_lengths_with_a_frozen_prefix_match_serial(frozen_prefix_steps, receive_posting):
    p, v, m, k, frozen = FROZEN_PREFIX
    results = [r[receive_posting] for r in frozen_prefix_steps]
    toy.assert_matches_serial(results, varlen_microbatches(m, seed=5), num_layers=2 * p * v, hidden=HIDDEN,
                              frozen=frozen)
