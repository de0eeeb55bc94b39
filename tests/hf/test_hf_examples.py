"""The HF examples run as launched in their README (torchrun, 2 CPU ranks, 2 steps) and train with the CP
attention from the DeepSpeed key alone."""

import math

import pytest

import accelerate  # noqa: E402,F401 (the "hf" test extra, installed by make test: missing, it fails here, never skips)

from test_examples import run_torchrun  # noqa: E402  (tests/test_examples.py)


@pytest.mark.parametrize("script", ["train_trainer.py", "train_accelerate.py"])
def test_hf_example_trains_two_steps_with_cp(script, tmp_path):
    extra = ["--output-dir", str(tmp_path)] if script == "train_trainer.py" else []
    out = run_torchrun(2, f"examples/huggingface/{script}", "--steps", "2", "--docs-per-row", "12", *extra,
                       timeout=300)
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2, out
    assert all(line.endswith("attention l3plugin_all_gather_cp") for line in steps), out
    assert all(math.isfinite(float(line.split("loss ")[1].split()[0])) for line in steps), out
