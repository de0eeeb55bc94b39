"""Who encodes which images: the plan alone (no processes)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from l3plugin.encoder import PLACEMENTS, check_placement, image_shares
from l3plugin.encoder.placement import share_size


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


def test_multimodal_demo_as_shipped_matches_one_process(ranks, tmp_path, capsys):
    """`l3plugin demo --multimodal` with its defaults (30 steps): the pipelined run stays within the demo's
    tolerance of one process and learns (a learning rate in the chaotic regime made it fail after 20 steps).
    The command runs end to end for 2 steps (its ranks, its check, its summary); the run it reports (the shipped
    model, split, placement and learning rate) then trains the command's default steps on the suite's warm
    workers, pipelined and in one process side by side (the command runs them one after the other)."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from l3plugin.cli import build_parser, main
    from l3plugin.demo.multimodal import MultimodalRun, train

    assert main(["demo", "--multimodal", "--steps", "2", "--results", str(tmp_path)]) == 0, \
        capsys.readouterr().out[-2000:]
    summary = json.loads((tmp_path / "multimodal_summary.json").read_text())
    assert len(summary["losses"]) == 2 and summary["max_abs_difference"] <= summary["tolerance"]
    run = MultimodalRun(**dict(summary["run"], counts=tuple(summary["run"]["counts"])))
    steps = build_parser().parse_args(["demo", "--multimodal"]).steps
    for world_size in (run.pp, 1):  # the pools started here, before the two threads use them
        ranks.pool(world_size)
    with ThreadPoolExecutor(2) as side_by_side:
        pipelined = side_by_side.submit(ranks.run, run.pp, train, run, steps, True, timeout=300)
        one_process = side_by_side.submit(ranks.run, 1, train, run, steps, False, timeout=300)
        losses, reference = pipelined.result()[-1]["step_losses"], one_process.result()[0]["step_losses"]
    assert len(losses) == len(reference) == steps == 30
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= summary["tolerance"]
    assert losses[-1] < losses[0]  # learns
