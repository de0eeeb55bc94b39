"""examples/megatron_deepspeed: the check's own logic without Megatron-DeepSpeed (not on PyPI, so no test runs it;
docs/verified.md has the run): cpu_run.py's launcher shim and stand-ins, check.py's verdicts on given losses."""

import importlib.util
import sys
import types
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent.parent / "examples" / "megatron_deepspeed"


def load(name):
    spec = importlib.util.spec_from_file_location(f"mds_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchrun_is_made_to_look_like_deepspeeds_launcher(monkeypatch):
    cpu_run = load("cpu_run")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--bf16"])
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_SIZE", "")  # recorded, so the LOCAL_SIZE the call sets is removed after the test
    monkeypatch.delenv("LOCAL_SIZE")
    cpu_run.launched_like_deepspeed()
    assert sys.argv == ["pretrain_gpt.py", "--bf16", "--local_rank", "3"]
    import os

    assert os.environ["LOCAL_SIZE"] == "4"
    cpu_run.launched_like_deepspeed()  # given already: not twice
    assert sys.argv.count("--local_rank") == 1


def test_a_stand_in_raises_naming_itself(monkeypatch):
    cpu_run = load("cpu_run")
    monkeypatch.setitem(sys.modules, "mds_gone", types.ModuleType("placeholder"))
    cpu_run._stand_in("mds_gone", ("f",), "why")
    with pytest.raises(NotImplementedError, match="mds_gone is a stand-in .*: why"):
        sys.modules["mds_gone"].f()


def result(losses, engine="l3plugin.deepspeed.optimizer.DeepSpeedFP32ReduceZero", start=1):
    return {"rc": 0, "losses": dict(enumerate(losses, start)), "engines": {("PipelineEngine", engine, 1)},
            "refused": False, "log": "x.log"}


def verdict(check, **results):
    return check.report(results, types.SimpleNamespace(iters=4, tol=5e-4))


def test_resume_must_be_bit_equal_and_ours_near_stock(capsys):
    check = load("check")
    stock = result([6.9, 6.8, 6.7, 6.6], engine="deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer")
    ours = [6.9, 6.8001, 6.7001, 6.6001]
    good = dict(stock_z1=stock, ours_z1=result(ours), ours_z1_first=result(ours[:2]),
                ours_z1_resume=result(ours[2:], start=3),
                stock_z2_refused={"rc": 1, "losses": {}, "engines": set(), "refused": True, "log": "x.log"})
    assert verdict(check, **good) == 0
    bad_resume = dict(good, ours_z1_resume=result([6.7001, 6.6001 + 1e-15], start=3))
    assert verdict(check, **bad_resume) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL:") == 1 and "ours_z1_resume" in out.split("FAIL:")[-1]
    far = dict(good, ours_z1=result([6.9, 6.8, 6.7, 6.601]))
    assert verdict(check, **far) == 1
    assert "stock_z1 6.6 against ours_z1 6.601, |diff| 0.001 > 0.0005" in capsys.readouterr().out
    stock_optimizer = dict(good, ours_z1=result(ours, engine="deepspeed.runtime.zero.stage_1_and_2.X"))
    assert verdict(check, **stock_optimizer) == 1
    not_refused = dict(good, stock_z2_refused={"rc": 0, "losses": {}, "engines": set(), "refused": False,
                                               "log": "x.log"})
    assert verdict(check, **not_refused) == 1
