"""bench/measured_timeline.py: recorded step calls labelled by the rank's plan and drawn like a simulation."""

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))

import measured_timeline as mt  # noqa: E402

from l3plugin.schedule.plan import build_schedule, with_trainable_stages  # noqa: E402


def fake_calls(schedule, rank, step=1.0):
    """Back-to-back calls in plan order, forward 1 s and backward 2 s."""
    calls, t = [], 0.0
    for action in mt.executed_actions(schedule, rank):
        length = step if action.op == "F" else 2 * step
        calls.append((action.op, t, t + length))
        t += length
    return calls


def test_calls_take_the_plan_labels_and_a_frozen_prefix_makes_no_backward_call():
    schedule = with_trainable_stages(build_schedule(2, 2, 4, 2), (False, True, True, True))
    assert sum(a.op == "B" for a in mt.executed_actions(schedule, 0)) == 4  # chunk 0 of rank 0 (stage 0) skipped
    per_rank = [mt.label(schedule, r, fake_calls(schedule, r)) for r in range(2)]
    result = mt.timeline(schedule, per_rank)
    assert result.busy == (8 * 1 + 4 * 2, 8 * 1 + 8 * 2) and result.makespan == 24
    assert result.forward_time == 1 and result.backward_time == 2
    assert [a.microbatch for a in result.actions if a.rank == 1][:2] == [0, 1]


def test_calls_that_do_not_follow_the_plan_are_refused():
    schedule = build_schedule(2, 1, 3, 2)
    calls = fake_calls(schedule, 0)
    with pytest.raises(RuntimeError, match="rank 0: 5 recorded calls do not follow its 6 planned actions"):
        mt.label(schedule, 0, calls[:-1])
