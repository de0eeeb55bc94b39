"""The zero-bubble schedule (--pipeline-schedule flexible-zb) on real gloo ranks: each backward split into B and
W, gradients and losses bit-identical to the flexible schedule with the same k and to a serial run."""

import pytest
import torch

import tiny_gpt as gpt
import toy_pipeline as toy
from test_flexible_pipeline import HIDDEN, MBS, SEQ, check_sync_record, run_with_sync_hooks, toy_config
from test_frozen_layers import frozen_layers
from test_gpt_pipeline import assert_gpt_matches_serial, gpt_flexible_step, gpt_serial_step, session_run


def grid(p):
    """(v, m, k, frozen model) for pp ``p``: v 1-2, m in {1, p, 2p+1}, k in {1, p, p+1} (k <= m); a frozen prefix
    and frozen middle stages at m = 2p+1. k = p + 1 is left out at v = 1, where its plans (flexible and
    zero-bubble) are those of k = p (test_v1_k_above_p_plans_as_k_equals_p)."""
    cases = [(v, m, k, None) for v in (1, 2) for m in (1, p, 2 * p + 1) for k in sorted({1, p, p + 1})
             if k <= m and not (v == 1 and k == p + 1)]
    if p > 2:  # v = 1 at m < 2p+1 only at pp 2 (the same (m, k) relations to p; pp 4 runs them at v = 2)
        cases = [c for c in cases if c[0] == 2 or c[1] == 2 * p + 1]
    return cases + [(2, 2 * p + 1, p, "prefix"), (2, 2 * p + 1, p + 1, "middle")]


@pytest.mark.parametrize("p", [2, 4])
def test_v1_k_above_p_plans_as_k_equals_p(p):
    """Without virtual stages k only picks 1F1B (k >= p) or all-forward-all-backward (k < p): the grid's k = p + 1
    at v = 1 would run the very plans of k = p, on every rank."""
    from l3plugin.schedule import build_zero_bubble_schedule
    from l3plugin.schedule.plan import build_schedule

    m = 2 * p + 1
    assert build_schedule(p, 1, m, p + 1).ranks == build_schedule(p, 1, m, p).ranks
    assert build_zero_bubble_schedule(p, 1, m, p + 1).ranks == build_zero_bubble_schedule(p, 1, m, p).ranks


def run_both(p, cases):
    """On every rank, for each case: one step of the flexible and one of the flexible-zb schedule over the toy
    model; this rank's losses and gradients of each, and how many B steps were split and W steps ran."""
    from unittest import mock

    from l3plugin.megatron import pipeline
    from l3plugin.mesh.groups import init_mesh

    split_b = mock.patch.object(pipeline, "backward_input", wraps=pipeline.backward_input)
    results, vpp = [], None
    for v, m, k, model in cases:
        if v != vpp:
            mesh, vpp = init_mesh(pp=p, vpp=v if v > 1 else None), v
        layers = 2 * p * v
        frozen = frozen_layers(model, p, v) if model else ()
        batches = toy.make_microbatches(m, SEQ, MBS, HIDDEN)
        case = {}
        for schedule in ("flexible", "flexible-zb"):
            chunks = toy.build_chunks(toy_config(p, v, layers, k), num_layers=layers, hidden=HIDDEN,
                                      pp_rank=mesh.coords["pp"], pp_size=p, vpp_size=v, frozen=frozen)
            with split_b as spy:
                case[schedule] = toy.flexible_step(chunks, batches, seq_length=SEQ, micro_batch_size=MBS,
                                                   pipeline_schedule=schedule)
                case[schedule]["split"] = spy.call_count
        results.append(case)
    return results


def expected_splits(p, v, m, k, model, rank):
    """B steps of ``rank`` the zero-bubble plan splits (its stages with W steps, m each)."""
    from l3plugin.schedule import build_zero_bubble_schedule

    layers = 2 * p * v
    frozen = frozen_layers(model, p, v) if model else set()
    stages = toy.split_layers(layers, p * v)
    trainable = [any(lid not in frozen for lid in ids) for ids in stages]
    plan = build_zero_bubble_schedule(p, v, m, k, trainable=trainable)
    return sum(1 for a in plan.ranks[rank].actions if a.op == "W")


@pytest.mark.parametrize("p", [2, 4])
def test_zero_bubble_matches_flexible_and_serial_bitwise(ranks, p):
    cases = grid(p)
    per_rank = ranks.run(p, run_both, p, cases, timeout=240)
    for i, (v, m, k, model) in enumerate(cases):
        layers = 2 * p * v
        frozen = frozen_layers(model, p, v) if model else ()
        flexible = [r[i]["flexible"] for r in per_rank]
        split = [r[i]["flexible-zb"] for r in per_rank]
        for rank, (a, b) in enumerate(zip(flexible, split)):  # the same k: bit for bit
            assert a["split"] == 0 and b["split"] == expected_splits(p, v, m, k, model, rank), (v, m, k, model)
            assert a["grads"].keys() == b["grads"].keys(), (v, m, k, model)
            for lid in a["grads"]:
                assert all(torch.equal(x, y) for x, y in zip(a["grads"][lid], b["grads"][lid])), (v, m, k, lid)
            assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
        toy.assert_matches_serial(split, toy.make_microbatches(m, SEQ, MBS, HIDDEN), num_layers=layers,
                                  hidden=HIDDEN, frozen=frozen)


def test_zero_bubble_grad_sync_hooks_fire_after_a_chunks_last_w(ranks):
    # ZeRO's reduce-scatters and DDP's sync: once the chunk's (round's) gradients are final, i.e. after its last W.
    p, v, m, k = 2, 2, 7, 3
    results = ranks.run(p, run_with_sync_hooks, p, v, m, k, "flexible-zb", timeout=120)
    check_sync_record(results, p, v, m, k)


def test_gpt_pp2_vpp2_zero_bubble_matches_flexible_and_serial(ranks):
    m, k, layers = 5, 3, 4
    split = ranks.run(2, gpt_flexible_step, 2, 2, m, k, layers, None, "flexible-zb", timeout=180)
    # The flexible and the serial run of test_gpt_pipeline's k>p case (the same arguments), run once a session.
    flexible = session_run(ranks, 2, gpt_flexible_step, 2, 2, m, k, layers)
    for a, b in zip(flexible, split):
        assert a["grads"].keys() == b["grads"].keys()
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"]), [
            n for n in a["grads"] if not torch.equal(a["grads"][n], b["grads"][n])]
    assert_gpt_matches_serial(split, session_run(ranks, 1, gpt_serial_step, m, layers)[0], m)


def test_split_refuses_what_it_cannot_run():
    from types import SimpleNamespace

    from l3plugin.megatron.split_linears import check_split_config

    with pytest.raises(NotImplementedError, match="delay_wgrad_compute"):
        check_split_config(SimpleNamespace(delay_wgrad_compute=True))
    with pytest.raises(ValueError, match="gradient_accumulation_fusion"):
        check_split_config(SimpleNamespace(gradient_accumulation_fusion=True))
    with pytest.raises(ValueError, match="recompute_granularity='full'.*selective"):
        check_split_config(SimpleNamespace(recompute_granularity="full"))
    with pytest.raises(ValueError, match=r"recompute_modules=\['mlp'\]"):
        check_split_config(SimpleNamespace(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]))
    check_split_config(SimpleNamespace(recompute_granularity="selective", recompute_modules=["core_attn"]))
    check_split_config(gpt.gpt_config(2))  # Megatron's defaults: fine
