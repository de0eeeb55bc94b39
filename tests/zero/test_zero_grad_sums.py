"""add_grad_sum (framework-neutral): a weight tied across two "stages" whose neighbours differ, each stage
with its own 2-rank reduction group. With ``own_bucket`` the copies' shards line up and the summed reduced
gradient is the total, bit-identical on both stages; without it the layouts differ and every rank refuses."""

import pytest
import torch

TIED = 6


def tied_stages(own_bucket, stage):
    """Ranks 0, 1: stage A (params x, t); ranks 2, 3: stage B (params t, y); t tied across (0, 2), (1, 3). The result,
    or the error this rank raised (its type and message); the four groups made here are destroyed either way (the
    pool replaces workers that keep many, and a call that raises)."""
    import torch.distributed as dist

    from l3plugin.zero.optimizer import FP32ReduceZero

    rank = dist.get_rank()
    stage_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tie_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    try:
        is_a = rank < 2
        torch.manual_seed(0)
        tied = torch.nn.Parameter(torch.randn(TIED))
        other = torch.nn.Parameter(torch.randn(10 if is_a else 4))
        params = [other, tied] if is_a else [tied, other]
        zero = FP32ReduceZero(torch.optim.SGD(params, lr=0.1), stage_groups[0 if is_a else 1], stage=stage,
                              own_bucket=[tied] if own_bucket else (), bucket_numel=100)  # else: one bucket each
        zero.add_grad_sum([tied], tie_groups[rank % 2], what="tied weight")
        x = torch.randn(TIED, generator=torch.Generator().manual_seed(rank))
        own = torch.autograd.grad((tied * x).pow(2).sum() + other.sum(), tied)[0]
        ((tied * x).pow(2).sum() + other.sum()).backward()
        zero.end_of_round(params, True)
        zero.finish_grad_sync()
        return {"own": own, "final": zero.full_grad(tied)}
    except Exception as exc:  # noqa: BLE001 - the refusal test reads every rank's error
        return f"{type(exc).__name__}: {exc}"
    finally:
        dist.barrier()  # every rank done with the groups (or failed) before any destroys them
        for group in stage_groups + tie_groups:
            dist.destroy_process_group(group)


@pytest.mark.parametrize("stage", [1, 2])
def test_tied_copies_in_their_own_buckets_sum_to_the_total_bit_identically(ranks, stage):
    out = ranks.run(4, tied_stages, True, stage, timeout=120)
    assert all(isinstance(r, dict) for r in out), out
    # Stage A averages ranks 0, 1 over its group, stage B ranks 2, 3; the tie sums the two stages.
    total = (out[0]["own"] + out[1]["own"]) / 2 + (out[2]["own"] + out[3]["own"]) / 2
    for r in out:
        assert torch.allclose(r["final"], total, atol=1e-6)
        assert torch.equal(r["final"], out[0]["final"])


def test_tied_copies_at_different_offsets_are_refused_on_every_rank(ranks):
    errors = ranks.run(4, tied_stages, False, 1, timeout=120)
    assert all(isinstance(e, str) for e in errors), errors  # every rank raised
    text = "\n".join(errors)
    assert "tied weight (here param1)" in text and "ended differently" in text
