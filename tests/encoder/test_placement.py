"""Who encodes which images: the plan alone (no processes); and the shipped multimodal demo, run as a user types it."""

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from l3plugin.encoder import PLACEMENTS, check_placement, image_shares
from l3plugin.encoder.placement import share_size
from l3plugin.ranks.pool import run_command
from runs_ahead import time_allowed  # tests/runs_ahead.py


@given(st.integers(0, 40), st.integers(1, 9))
def test_shares_cover_every_image_once_in_order_in_blocks_of_the_gather_size(num_images, pp):
    shares = image_shares(num_images, pp)
    assert len(shares) == pp
    assert [i for s in shares for i in s] == list(range(num_images))  # each image once, rank order = image order
    size = share_size(num_images, pp)
    assert all(len(s) <= size for s in shares)
    # Rank r's block starts at r * size: the first num_images rows of the padded all-gather are the images.
    assert all(s.start == min(r * size, num_images) for r, s in enumerate(shares))


def test_uneven_shares_are_padded_at_the_end():
    assert [len(s) for s in image_shares(5, 2)] == [3, 2]
    assert [len(s) for s in image_shares(1, 4)] == [1, 0, 0, 0]
    assert [len(s) for s in image_shares(0, 3)] == [0, 0, 0]


@pytest.mark.parametrize("args,message", [((-1, 2), "num_images=-1 is out of range"),
                                          ((4, 0), "pp_size=0 is out of range")])
def test_bad_shares_name_the_parameter(args, message):
    with pytest.raises(ValueError, match=message):
        image_shares(*args)


def test_placement_names():
    assert set(PLACEMENTS) == {"pipeline", "broadcast", "replicated"}
    assert check_placement("replicated") == "replicated"
    with pytest.raises(ValueError, match="encoder placement 'vit' is invalid: one of pipeline"):
        check_placement("vit")


def test_multimodal_demo_refuses_the_text_demo_flags(capsys):
    from l3plugin.cli import main

    assert main(["demo", "--multimodal", "--tp", "2", "--zero-stage", "1"]) == 2
    assert "--tp, --zero-stage: not used by --multimodal (pipeline ranks only, fp32)" in capsys.readouterr().err
    assert main(["demo", "--multimodal", "--dtype", "bf16"]) == 2


def ahead_runs(tmp_path_factory, selected):
    """The shipped multimodal demo as a user types it (a fresh interpreter, its own ranks and one-process run),
    queued in the background when the session starts (tests/runs_ahead.py): most of its 30 s leave a core idle."""
    results = tmp_path_factory.mktemp("multimodal-demo")
    return {"test_multimodal_demo_as_shipped_matches_one_process": lambda: (results, run_command(
        [sys.executable, "-m", "l3plugin", "demo", "--multimodal", "--results", str(results),
         "--timeout", str(time_allowed(300))], timeout=time_allowed(600)))}


def test_multimodal_demo_as_shipped_matches_one_process(ahead):
    """`l3plugin demo --multimodal` as a user runs it, with its defaults (30 steps): the pipelined run stays within
    the demo's tolerance of one process and learns (a learning rate in the chaotic regime made it fail after 20
    steps). One run of the command end to end (its ranks, its one-process run, its check, its summary); the test
    reads both loss curves back from the summary and checks them itself."""
    import json

    from l3plugin.cli import build_parser

    results, done = ahead.result("test_multimodal_demo_as_shipped_matches_one_process")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    summary = json.loads((results / "multimodal_summary.json").read_text())
    losses, reference = summary["losses"], summary["reference_losses"]
    steps = build_parser().parse_args(["demo", "--multimodal"]).steps
    assert len(losses) == len(reference) == steps == 30
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= summary["tolerance"], summary
    assert losses[-1] < losses[0]  # learns
