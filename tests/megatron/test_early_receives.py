"""Early receives (l3plugin.schedule.receives) on real gloo ranks: the flexible executor posts every receive at
its planned point, finishes (no deadlock, also when ranks run at uneven speeds) and gives bit for bit the
losses and gradients of the agreed-order executor and of a serial run."""

import pytest
import torch

import toy_pipeline as toy

HIDDEN, SEQ, MBS = 8, 4, 2


def run_step(pp, vpp, m, k, early, jitter, mesh=None):
    """On every rank: one flexible step, receives posted early or in the agreed pair order; ``jitter``: each
    forward sleeps up to that many seconds (seeded per rank and microbatch) so ranks drift apart. ``mesh``: the
    one already built for (pp, vpp), else built here."""
    import random
    import time

    from megatron.core.transformer import TransformerConfig

    from l3plugin.mesh.groups import init_mesh
    from l3plugin.schedule.plan import build_schedule
    from l3plugin.schedule.receives import receive_posts

    mesh = mesh or init_mesh(pp=pp, vpp=vpp if vpp > 1 else None)
    rank = mesh.coords["pp"]
    config = TransformerConfig(
        num_layers=2 * pp * vpp, hidden_size=HIDDEN, num_attention_heads=1, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, pipeline_dtype=torch.float32,
        microbatch_group_size_per_vp_stage=k, batch_p2p_comm=False, deallocate_pipeline_outputs=True)
    chunks = toy.build_chunks(config, num_layers=2 * pp * vpp, hidden=HIDDEN, pp_rank=rank, pp_size=pp,
                              vpp_size=vpp)
    batches = toy.make_microbatches(m, SEQ, MBS, HIDDEN)
    rng = random.Random(1000 * rank + m)

    def forward_step(data_iterator, model):
        time.sleep(rng.uniform(0, jitter))
        return toy.forward_step(data_iterator, model)

    waits = {}
    result = toy.flexible_step(chunks, batches, seq_length=SEQ, micro_batch_size=MBS, forward_step_func=forward_step,
                               receive_posting="early" if early else "agreed", waits=waits)
    planned = receive_posts(build_schedule(pp, vpp, m, k), rank)
    return {**result, "waits": waits,
            "planned_peak": planned.peak_inflight(), "budget": planned.budget}


GRID = [
    # (p, v, m, k)
    (2, 2, 4, 1),   # k < p: all-forward-all-backward
    (2, 2, 8, 2),   # k = p
    (2, 2, 8, 3),   # k = 1.5p
    (2, 3, 7, 4),   # k = 2p, a last group of 3
    (2, 4, 6, 3),   # k = 1.5p, v = 4
    (3, 2, 6, 2),   # k < p, three ranks: receives from two peers
    (4, 2, 8, 4),   # k = p
    (4, 2, 8, 6),   # k = 1.5p
    (4, 1, 5, 4),   # v = 1
]


DRIFT = [(2, 2, 8, 3), (3, 2, 6, 3), (4, 2, 8, 6), (4, 2, 6, 2)]
# Every step of the two tests below, (p, v, m, k, early, jitter): the first test runs them all, one call to the
# ranks per p with the steps one after another (the mesh built once per (p, v)); each test checks its own.
STEPS = ([(*case, early, 0.0) for case in GRID for early in (True, False)]
         + [(*case, True, 0.02) for case in DRIFT])


def run_steps(cases):
    """``run_step(*case)`` for each case (all at one p) in turn on this rank."""
    from l3plugin.mesh.groups import init_mesh

    out, mesh, shape = [], None, None
    for case in cases:
        if tuple(case[:2]) != shape:
            shape = tuple(case[:2])
            mesh = init_mesh(pp=shape[0], vpp=shape[1] if shape[1] > 1 else None)
        out.append(run_step(*case, mesh=mesh))
    return out


@pytest.fixture(scope="module")
def steps(ranks):
    """{case: every rank's run_step result} for STEPS."""
    done = {}
    for p in sorted({case[0] for case in STEPS}):
        mine = sorted((case for case in STEPS if case[0] == p), key=lambda case: case[1])
        done.update(zip(mine, zip(*ranks.run(p, run_steps, mine, timeout=300))))
    return {case: list(results) for case, results in done.items()}


@pytest.mark.parametrize("p,v,m,k", GRID, ids=[f"p{p}v{v}m{m}k{k}" for p, v, m, k in GRID])
def test_early_receives_are_bit_identical_and_post_as_planned(steps, p, v, m, k):
    early, agreed = steps[p, v, m, k, True, 0.0], steps[p, v, m, k, False, 0.0]
    toy.assert_matches_serial(early, toy.make_microbatches(m, SEQ, MBS, HIDDEN), num_layers=2 * p * v,
                              hidden=HIDDEN)
    for a, b in zip(early, agreed):
        assert a["losses"] == b["losses"]
        assert a["grads"].keys() == b["grads"].keys()
        for layer in a["grads"]:
            assert all(torch.equal(x, y) for x, y in zip(a["grads"][layer], b["grads"][layer])), layer
    for rank, result in enumerate(early):
        waits = result["waits"]
        # The executor's own account: as many receive buffers posted at once as the plan says.
        assert waits["peak_posted_receives"] == result["planned_peak"], (rank, waits, result["planned_peak"])
        assert waits["peak_posted_bytes"] == result["planned_peak"] * SEQ * MBS * HIDDEN * 4
        assert waits["recv_count"] >= 0 and waits["recv_s"] >= 0 and (waits["recv_s"] > 0) == (waits["recv_count"] > 0)
    assert any(result["waits"]["recv_count"] > 0 for result in early)  # the later ranks wait for the pipeline fill


@pytest.mark.parametrize("p,v,m,k", DRIFT)
def test_early_receives_finish_when_ranks_drift(steps, p, v, m, k):
    """Forwards sleeping 0-20 ms at random: other interleavings of posts, sends and waits, same results."""
    drifting = steps[p, v, m, k, True, 0.02]
    toy.assert_matches_serial(drifting, toy.make_microbatches(m, SEQ, MBS, HIDDEN), num_layers=2 * p * v,
                              hidden=HIDDEN)


def posting_on_gloo():
    """What each receive_posting gives on this harness's gloo group (auto: early) and for an unknown one."""
    import torch.distributed as dist

    from l3plugin.schedule.p2p import posts_receives_early

    chosen = {mode: posts_receives_early(dist.group.WORLD, torch.device("cpu"), mode)
              for mode in ("auto", "early", "agreed")}
    try:
        posts_receives_early(dist.group.WORLD, torch.device("cpu"), "eager")
    except ValueError as exc:
        chosen["error"] = str(exc)
    return chosen


def test_receive_posting_is_an_option_with_auto_early_on_gloo(ranks):
    for chosen in ranks.run(2, posting_on_gloo, timeout=60):
        assert chosen == {"auto": True, "early": True, "agreed": False,
                          "error": "receive_posting='eager' is invalid: must be one of auto, early, agreed (auto: "
                                   "early on gloo, the agreed pair order elsewhere)"}
