"""The main job's training path on 8 gloo ranks (tp2 x cp2 x pp2, flexible schedule, ZeRO-2, RoPE,
uneven layers) matches the single-process reference: fp32, 2 steps, the same check `make demo` makes."""

import argparse

from l3plugin.demo import TOLERANCE, options, train


def parallel_losses(opts, steps):
    train.setup(opts)
    return [train.train_step(step)["loss"] for step in range(steps)]


def test_demo_training_matches_single_process(ranks):
    args = argparse.Namespace(tp=2, cp=2, pp=2, dp=1, vpp=2, group_size=3, microbatches=5, layers=6,
                              seq_len=64, zero_stage=2, dtype="fp32", timeout=300.0, cp_layout="2cp")
    opts = options(args)
    assert opts["layer_counts"] == [1, 2, 2, 1] and opts["layout"] == "Et|tt|tt|tL"
    losses = ranks.run(8, parallel_losses, opts, 2, timeout=300)
    assert all(r == losses[0] for r in losses)  # every rank reports the same global loss
    reference = ranks.run(1, train.reference_losses, opts, 2, timeout=300)[0]  # one process, as `make demo`
    assert max(abs(a - b) for a, b in zip(losses[0], reference)) < TOLERANCE["fp32"]
    assert losses[0][1] < losses[0][0]


def test_demo_with_balanced_cp_layout_matches_single_process(ranks):
    """`l3plugin demo --cp-layout balanced` on a smaller mesh (cp2 x pp2, RoPE, documents dealt to CP ranks
    by work): same losses as the single-process reference."""
    from l3plugin.cp.layout import balanced_layout, two_chunk_layout
    from l3plugin.demo import data

    args = argparse.Namespace(tp=1, cp=2, pp=2, dp=1, vpp=None, group_size=2, microbatches=2, layers=2,
                              seq_len=64, zero_stage=1, dtype="fp32", timeout=300.0, cp_layout="balanced")
    opts = options(args)
    first = data.step_microbatches(0, 0, 1, 64, opts["vocab"])[0]["cu_seqlens"]
    assert balanced_layout(first, 64, 2).ranges != two_chunk_layout(64, 2).ranges  # not the paper's layout
    losses = ranks.run(4, parallel_losses, opts, 2, timeout=300)
    assert all(r == losses[0] for r in losses)
    reference = ranks.run(1, train.reference_losses, opts, 2, timeout=300)[0]
    assert max(abs(a - b) for a, b in zip(losses[0], reference)) < TOLERANCE["fp32"]


def test_the_silenced_upstream_warnings_are_the_ones_megatron_says():
    """`make demo` prints only its own lines: the CPU-meaningless warnings the workers silence are named by their
    text, so each of Megatron-Core's must be what this Megatron-Core says (else the filter silently stops working), and the filter
    must let every other warning through."""
    import warnings
    from pathlib import Path

    import megatron.core

    from l3plugin.ranks.worker import CPU_MEANINGLESS_WARNINGS, silence_cpu_meaningless_warnings

    package = Path(megatron.core.__file__).parent
    source = " ".join(" ".join(path.read_text(errors="replace").replace('"\n', "").replace('"', "").split())
                      for path in package.rglob("*.py"))
    for message, who in CPU_MEANINGLESS_WARNINGS.items():
        assert who != "megatron.core" or message in source, f"Megatron-Core no longer says {message!r}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_cpu_meaningless_warnings()
        for message in CPU_MEANINGLESS_WARNINGS:
            warnings.warn(message + " for maximum speedup", UserWarning)
        warnings.warn("another warning", UserWarning)
    assert [str(w.message) for w in caught] == ["another warning"]


def test_the_demo_bounds_its_ranks_waits_without_changing_the_callers_environment(monkeypatch):
    """``l3plugin.demo.run`` called from Python: its ranks get half the step timeout as their wait bound, the caller's
    environment stays as it was (its own waits keep their bound), and a bound the user set is kept."""
    import os

    from l3plugin.collective import waits
    from l3plugin.demo import ranks_wait_bound

    monkeypatch.delenv(waits.ENV_VAR, raising=False)
    with ranks_wait_bound(30.0):
        assert os.environ[waits.ENV_VAR] == "30.0"
    assert waits.ENV_VAR not in os.environ
    monkeypatch.setenv(waits.ENV_VAR, "7")
    with ranks_wait_bound(30.0):
        assert os.environ[waits.ENV_VAR] == "7"
    assert os.environ[waits.ENV_VAR] == "7"
