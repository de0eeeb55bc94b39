"""The HF examples run as launched in their README (torchrun, 2 CPU ranks, 2 steps) and train with the CP
attention from the DeepSpeed key alone."""

import math

import pytest

import accelerate  # noqa: E402,F401 (the "hf" test extra, installed by make test: missing, it fails here, never skips)

from test_examples import run_torchrun  # noqa: E402  (tests/test_examples.py)

SCRIPTS = ("train_trainer.py", "train_accelerate.py")


def run_example(script, tmp_path):
    extra = ["--output-dir", str(tmp_path)] if script == "train_trainer.py" else []
    return run_torchrun(2, f"examples/huggingface/{script}", "--steps", "2", "--docs-per-row", "12", *extra,
                        timeout=300)


def ahead_runs(tmp_path_factory, selected):
    """Both examples' torchruns (nearly all of each is its ranks importing torch, transformers and DeepSpeed, one
    core each, and the launcher waiting), queued in the background when the session starts (tests/runs_ahead.py)."""
    return {f"test_hf_example_trains_two_steps_with_cp[{script}]":
            (lambda script=script: run_example(script, tmp_path_factory.mktemp(script.removesuffix(".py"))))
            for script in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS)
def test_hf_example_trains_two_steps_with_cp(script, ahead, request):
    out = ahead.result(request.node.name)
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2, out
    assert all(line.endswith("attention l3plugin_all_gather_cp") for line in steps), out
    assert all(math.isfinite(float(line.split("loss ")[1].split()[0])) for line in steps), out
