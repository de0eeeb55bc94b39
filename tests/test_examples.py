"""Every example runs (small, CPU, gloo), so none can rot."""

import os
import sys
from pathlib import Path

import pytest

from l3plugin.ranks.pool import run_command
from runs_ahead import time_allowed

ROOT = Path(__file__).resolve().parent.parent


def run_torchrun(nproc, script, *args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone", str(ROOT / script), *args]
    done = run_command(cmd, timeout=time_allowed(timeout), env=env, cwd=ROOT)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def ahead_runs(tmp_path_factory, selected):
    """The two torchrun examples (each a launcher and 2 ranks importing torch and Megatron-Core or DeepSpeed on
    one core each), queued in the background when the session starts (tests/runs_ahead.py)."""
    export = tmp_path_factory.mktemp("deepspeed-example") / "fp32.pt"
    return {"test_megatron_example_trains_with_the_flexible_schedule": lambda: run_torchrun(
                2, "examples/megatron/train_flexible_pp.py", "--pp", "2", "--vpp", "2", "--microbatches", "5",
                "--group-size", "3", "--steps", "2"),
            # 2 steps (a step on trained weights) of the config's 8 micro-batches each, then the export.
            "test_deepspeed_example_uses_the_plugin_with_the_key": lambda: (run_torchrun(
                2, "examples/deepspeed/train.py", "--steps", "2", "--export", str(export)), export)}


def post_training_figures(out: str) -> dict:
    """{(mode, step): (micro-batches, lengths, log-prob sum, loss)} from rl_post_training.py's lines."""
    import re

    rows = re.findall(r"^(rl|sft) step (\d+): microbatches (\d+) lengths (\[[\d, ]+\]) logprob_sum (\S+) "
                      r"loss (\S+) \(forward_backward_pipelining_flexible\)$", out, re.M)
    return {(mode, int(step)): (int(m), lengths, float(logp), float(loss))
            for mode, step, m, lengths, logp, loss in rows}


def post_training_lines(argv):
    """On every rank of a pool (its process group as torchrun's would be): the example's loops (its ``train``, all
    of the example but the process-group set-up of ``main``), with l3plugin's install undone after."""
    import importlib.util

    import l3plugin.megatron

    spec = importlib.util.spec_from_file_location("rl_post_training", ROOT / "examples/megatron/rl_post_training.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    try:
        return example.train(example.parse(argv))
    finally:
        l3plugin.megatron.uninstall()


def test_rl_and_sft_post_training_on_cp2_pp2_vpp2_equal_one_process(ranks):
    """The post-training example (variable-length THD micro-batches, m changing every step, a forward-only log-prob
    pass then a training pass; then SFT) at CP 2 x PP 2 x 2 virtual stages equals the same loop in one process to
    fp32 rounding, step after step (the weights after each optimizer step included: the next step reads them).
    One step per mode: the RL step (3 micro-batches, forward-only pass, training pass, optimizer step) and then
    the SFT step (6 micro-batches, on the RL step's weights) already change m and read updated weights."""
    runs = {layout: [line for lines in ranks.run(n, post_training_lines, ["--pp", pp, "--vpp", pp, "--cp", pp,
                                                                          "--steps", "1"], timeout=300)
                     for line in lines]
            for layout, n, pp in (("parallel", 4, "2"), ("single", 1, "1"))}
    parallel, single = (post_training_figures("\n".join(runs[layout])) for layout in ("parallel", "single"))
    assert sorted(parallel) == sorted(single) == [("rl", 0), ("sft", 0)], (parallel, single)
    assert len({parallel[key][0] for key in parallel}) > 1  # the micro-batch count changes from step to step
    for key, (m, lengths, logp, loss) in parallel.items():
        m1, lengths1, logp1, loss1 = single[key]
        assert (m, lengths) == (m1, lengths1), key
        assert abs(logp - logp1) <= 1e-5 * abs(logp1) and abs(loss - loss1) <= 1e-5 * max(abs(loss1), 1e-2), (
            key, parallel[key], single[key])


def test_megatron_example_trains_with_the_flexible_schedule(ahead):
    out = ahead.result("test_megatron_example_trains_with_the_flexible_schedule")
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all("forward_backward_pipelining_flexible" in line for line in lines), out


PATCHED_TAGS = ("core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0")  # docs/verified.md


def test_there_is_a_pretrain_gpt_patch_for_every_verified_tag():
    found = sorted(p.name for p in (ROOT / "patches").glob("megatron-lm-*-pretrain_gpt.patch"))
    assert found == sorted(f"megatron-lm-{tag}-pretrain_gpt.patch" for tag in PATCHED_TAGS)


@pytest.mark.parametrize("tag", PATCHED_TAGS)
def test_patch_adds_only_existing_l3plugin_calls(tag):
    import l3plugin.megatron as l3m

    patch = (ROOT / "patches" / f"megatron-lm-{tag}-pretrain_gpt.patch").read_text()
    added = [line[1:] for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line[1:] for line in patch.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert any("l3plugin.megatron.install()" in line for line in added)
    assert any("l3plugin.megatron.chain_extra_args(" in line for line in added)
    assert [line.strip() for line in removed] == ["extra_args_provider=add_modelopt_args if has_nvidia_modelopt "
                                                  "else None,"]  # the only line changed: chained, not dropped
    assert callable(l3m.install) and callable(l3m.chain_extra_args)


def test_deepspeed_example_uses_the_plugin_with_the_key(ahead):
    import torch

    out, export = ahead.result("test_deepspeed_example_uses_the_plugin_with_the_key")
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("DeepSpeedFP32ReduceZero" in line for line in steps), out
    # The export is a plain state dict: stock torch (and so stock DeepSpeed) can fine-tune from it.
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 1))
    model.load_state_dict(torch.load(export))
    # Without the key DeepSpeed runs its own optimizer: tests/zero/test_zero_deepspeed.py (in the suite's workers,
    # not a second torchrun of this script).
