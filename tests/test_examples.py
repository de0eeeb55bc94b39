"""Every example runs (small, CPU, gloo), so none can rot."""

import os
import sys
from pathlib import Path

import pytest

from l3plugin.ranks import run_command

ROOT = Path(__file__).resolve().parent.parent


def run_torchrun(nproc, script, *args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone", str(ROOT / script), *args]
    done = run_command(cmd, timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def test_megatron_example_trains_with_the_flexible_schedule():
    out = run_torchrun(2, "examples/megatron/train_flexible_pp.py", "--pp", "2", "--vpp", "2",
                       "--microbatches", "5", "--group-size", "3", "--steps", "2")
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


def test_deepspeed_example_uses_the_plugin_with_the_key(tmp_path):
    import torch

    export = tmp_path / "fp32.pt"
    out = run_torchrun(2, "examples/deepspeed/train.py", "--steps", "3", "--export", str(export))
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("DeepSpeedFP32ReduceZero" in line for line in steps), out
    # The export is a plain state dict: stock torch (and so stock DeepSpeed) can fine-tune from it.
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 1))
    model.load_state_dict(torch.load(export))
    # Without the key DeepSpeed runs its own optimizer: tests/zero/test_zero_deepspeed.py (in the suite's workers,
    # not a second torchrun of this script).
