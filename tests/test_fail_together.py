"""Fail together (l3plugin/collective/fail_together.py): an error on one rank is raised on every rank, at once.

The checkpoint faults are in tests/zero/test_checkpoint_integrity.py; here the agreement itself and the ZeRO
optimizer's setup, where a rank that fails (or holds another model) used to leave its peers in the first
gradient collective.
"""

import pytest
import torch
import torch.distributed as dist

TIMEOUT = 120


def outcome_of(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what we check
        return f"{type(exc).__name__}: {exc}"
    return None


def agree_leg(failing_rank, outcomes):
    from l3plugin.collective.fail_together import agree

    rank = dist.get_rank()
    error = ValueError(f"bad input on rank {rank}") if rank == failing_rank else None
    return outcome_of(lambda: agree(error, what="test step", outcome=outcomes[rank], timeout=30))


def test_agree_raises_on_every_rank(ranks):
    legs = ranks.run(2, agree_leg, 1, ["", ""], timeout=TIMEOUT)
    assert legs[1] == "ValueError: bad input on rank 1"  # its own error, unchanged
    assert legs[0].startswith("PeerFailed: rank 0: test step failed on 1 of 2 ranks")
    assert "rank 1: ValueError: bad input on rank 1" in legs[0]


def test_agree_passes_and_checks_outcomes(ranks):
    assert ranks.run(2, agree_leg, None, ["same", "same"], timeout=TIMEOUT) == [None, None]
    legs = ranks.run(2, agree_leg, None, ["read 3 files", "read nothing"], timeout=TIMEOUT)
    for leg in legs:
        assert "ended differently" in leg and "rank 0: read 3 files" in leg and "rank 1: read nothing" in leg


def zero_setup_leg(case):
    from l3plugin.zero.optimizer import FP32ReduceZero

    rank = dist.get_rank()
    width = 6 if case == "other model" and rank == 1 else 4
    model = torch.nn.Linear(width, 3)
    if case == "no parameters" and rank == 1:
        model.requires_grad_(False)
    return outcome_of(lambda: FP32ReduceZero(torch.optim.AdamW(model.parameters()), bucket_numel=64,
                                            wait_timeout=30))


@pytest.mark.parametrize("case", ["ok", "no parameters", "other model"])
def test_zero_setup_fails_together(ranks, case):
    legs = ranks.run(2, zero_setup_leg, case, timeout=TIMEOUT)
    if case == "ok":
        assert legs == [None, None]
    elif case == "no parameters":  # allowed (a frozen pipeline stage), but not on one rank of the group only
        for leg in legs:
            assert leg.startswith("PeerFailed") and "ZeRO optimizer setup ended differently" in leg
            assert "rank 0: 1 buckets, 15 elements" in leg and "rank 1: 0 buckets, 0 elements" in leg
    else:  # each rank built buckets, but not the same: the first reduce-scatter would not match
        for leg in legs:
            assert leg.startswith("PeerFailed") and "ZeRO optimizer setup ended differently" in leg
            assert "rank 0: 1 buckets, 15 elements" in leg and "rank 1: 1 buckets, 21 elements" in leg
