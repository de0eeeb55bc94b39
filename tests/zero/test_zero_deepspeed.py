"""deepspeed.initialize with "l3plugin": {"fp32_reduce_zero": true} on real gloo ranks (DeepSpeedEngine)."""

import pytest
import torch
import torch.distributed as dist

from ds_models import batch, ds_config, engine_for, loss_of, make_mlp, reduced_grad_error, train
from stock_bugs import SKIP_IF_STOCK_ZERO_STEP_FAILS
from zero_models import collectives_by_kind

ON = {"fp32_reduce_zero": True}


def grad_errors(stage, gas=32):
    """Error vs fp64 of the reduced gradient (safe_get_full_grad after the last backward), fp32 and bf16."""
    out = {}
    for name, plugin in (("fp32", ON), ("bf16", {**ON, "accumulate_dtype": "bf16", "reduce_dtype": "bf16"})):
        engine = engine_for(ds_config(stage, gas=gas, plugin=plugin))
        out[name] = reduced_grad_error(engine, gas)
        out[name + "_optimizer"] = type(engine.optimizer).__name__
    return out


def collectives_of_a_step(stage):
    from l3plugin.debug import record_collectives

    engine = engine_for(ds_config(stage, gas=8, plugin={**ON, "bucket_numel": 400}, clip=1.0))
    train(engine, 1)  # warm-up step outside the recording
    with record_collectives() as log:
        train(engine, 1, first_step=1)
    buckets = engine.optimizer.zero.buckets
    kinds = collectives_by_kind(log, buckets)
    return {"buckets": len(buckets), "rs": [d for d, _ in kinds["rs"]], "ag": [d for d, _ in kinds["ag"]],
            "ar": kinds["ar"], "other": kinds["other"]}


def accessors_after_training(stage):
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param)

    engine = engine_for(ds_config(stage, plugin=ON))
    train(engine, 2)
    p = engine.module[2].weight
    fp32 = safe_get_full_fp32_param(p)
    exp_avg = safe_get_full_optimizer_state(p, "exp_avg")
    safe_set_full_fp32_param(p, fp32 + 1)
    back = safe_get_full_fp32_param(p)
    return {"fp32_dtype": str(fp32.dtype), "shape_ok": fp32.shape == p.shape == exp_avg.shape,
            "bf16_is_rounded_fp32": torch.equal(p.detach(), fp32.bfloat16()),
            "set_ok": torch.equal(back, fp32 + 1), "exp_avg_nonzero": bool(exp_avg.abs().sum() > 0),
            "grad_norm": engine.get_global_grad_norm()}


def _snapshot(engine):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {n: (p.detach().clone(), safe_get_full_fp32_param(p),
                *[safe_get_full_optimizer_state(p, k) for k in p._hp_mapping.get_optim_state_keys()])
            for n, p in engine.module.named_parameters()}


def checkpoint_leg(stage, save_dir, load_dir, train_before, train_after, first_step):
    """Optionally load, snapshot, train, optionally save, train more; return snapshots."""
    engine = engine_for(ds_config(stage, plugin=ON, scheduler=True, clip=1.0), seed=1 if load_dir else 0)
    if load_dir:
        path, _ = engine.load_checkpoint(load_dir)
        assert path is not None
    loaded = _snapshot(engine)
    train(engine, train_before, first_step=first_step)
    if save_dir:
        engine.save_checkpoint(save_dir, tag="t")
    saved = _snapshot(engine)
    train(engine, train_after, first_step=first_step + train_before)
    return {"loaded": loaded, "saved": saved, "final": _snapshot(engine), "lr": engine.get_lr(),
            "steps": engine.global_steps}


def same(a, b):
    return a.keys() == b.keys() and all(len(a[n]) == len(b[n]) and all(torch.equal(x, y) for x, y in zip(a[n], b[n]))
                                        for n in a)


def export_and_finetune_stock(stage, save_dir):
    """Train with the plugin, save; rebuild fp32 weights with DeepSpeed's zero_to_fp32 and fine-tune one
    step with stock DeepSpeed while l3plugin's patches are removed."""
    import l3plugin.deepspeed as l3ds
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine = engine_for(ds_config(stage, plugin=ON))
    train(engine, 2)
    engine.save_checkpoint(save_dir, tag="t")
    exported = l3ds.export_fp32_state_dict(engine)
    dist.barrier()
    rebuilt = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t")
    l3ds.uninstall()
    try:
        model = make_mlp(seed=5)
        model.load_state_dict(rebuilt)
        stock = engine_for(ds_config(stage), model=model)
        start = {n: p.detach().clone() for n, p in stock.module.named_parameters()}
        train(stock, 1, first_step=2)
        moved = any(not torch.equal(start[n], p) for n, p in stock.module.named_parameters())
        stock_type = type(stock.optimizer).__name__
    finally:
        l3ds.install()
    return {"same_export": all(torch.equal(exported[k], rebuilt[k]) for k in exported) and
            set(exported) == set(rebuilt),
            "fp32": all(v.dtype == torch.float32 for v in rebuilt.values()),
            "starts_from_export": all(torch.equal(start[n], rebuilt[n].bfloat16()) for n in start),
            "moved": moved, "stock_optimizer": stock_type}


def torch_style_backward(stage):
    """loss.backward() (DeepSpeed's torch-style backward) trains exactly like engine.backward(loss)."""
    results = []
    for torch_style in (False, True):
        engine = engine_for(ds_config(stage, plugin=ON))
        for step in range(2):
            for mb in range(4):
                loss = loss_of(engine(batch(dist.get_rank(), step, mb)))
                loss.backward() if torch_style else engine.backward(loss)
                engine.step()
        results.append([p.detach().clone() for p in engine.module.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*results))


def error_of(cfg_kwargs, plugin):
    try:
        engine_for(ds_config(plugin=plugin, **cfg_kwargs))
    except Exception as exc:  # noqa: BLE001 - the message is what we check
        return f"{type(exc).__name__}: {exc}"
    return None


def optimizer_without_key(stage, plugin):
    return type(engine_for(ds_config(stage, plugin=plugin)).optimizer).__name__


# -- tests -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2])
def test_reduced_gradients_match_fp64_at_32_microbatches(ranks, stage):
    errors = ranks.run(2, grad_errors, stage, timeout=180)[0]
    assert errors["fp32_optimizer"] == "DeepSpeedFP32ReduceZero"
    assert errors["fp32"] <= 1e-6, errors
    assert errors["bf16"] > 1e-4, errors
    print(f"DeepSpeed stage {stage}: relative gradient error vs fp64 at 32 micro-batches: l3plugin fp32 "
          f"{errors['fp32']:.1e}, l3plugin bf16 {errors['bf16']:.1e}")


@pytest.mark.parametrize("stage", [1, 2])
def test_collectives_of_a_deepspeed_step(ranks, stage):
    """8 micro-batches: one fp32 reduce-scatter per bucket at the boundary (ZeRO-1) or every micro-batch
    (ZeRO-2, reduce_every=1 by default, like stock ZeRO-2)."""
    for rec in ranks.run(2, collectives_of_a_step, stage, timeout=120):
        assert rec["buckets"] > 1
        assert rec["rs"] == ["torch.float32"] * rec["buckets"] * (1 if stage == 1 else 8)
        assert rec["ag"] == ["torch.bfloat16"] * rec["buckets"]
        assert rec["ar"] == [1], rec  # the gradient norm only
        assert rec["other"] == []


@pytest.mark.parametrize("stage", [1, 2])
def test_public_accessors(ranks, stage):
    for r in ranks.run(2, accessors_after_training, stage, timeout=120):
        assert r["fp32_dtype"] == "torch.float32" and r["shape_ok"] and r["set_ok"] and r["exp_avg_nonzero"]
        assert r["bf16_is_rounded_fp32"] and r["grad_norm"] > 0


@pytest.fixture(scope="module")
def straight(ranks, tmp_path_factory):
    """``straight(stage)``: (folder, rank 0's checkpoint_leg) of 2 steps, a save of tag t, 2 more steps; run on first
    use and shared (the resize test starts from the stage-2 save)."""
    cache = {}

    def get(stage):
        if stage not in cache:
            folder = str(tmp_path_factory.mktemp(f"straight{stage}"))
            cache[stage] = folder, ranks.run(2, checkpoint_leg, stage, folder, None, 2, 2, 0, timeout=120)[0]
        return cache[stage]
    return get


@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_resume_is_bit_exact(ranks, straight, stage):
    folder, first = straight(stage)
    resumed = ranks.run(2, checkpoint_leg, stage, None, folder, 2, 0, 2, timeout=120)[0]
    assert same(first["saved"], resumed["loaded"])
    assert same(first["final"], resumed["saved"])
    assert first["lr"] == resumed["lr"] and first["steps"] == resumed["steps"] == 4


def test_dp_resize_2_to_4_to_2(ranks, straight, tmp_path):
    a, first = straight(2)  # 2 steps on 2 ranks, saved (then 2 more steps, which change nothing saved)
    b = tmp_path / "b"
    second = ranks.run(4, checkpoint_leg, 2, str(b), a, 1, 0, 2, timeout=120)
    third = ranks.run(2, checkpoint_leg, 2, None, str(b), 0, 0, 3, timeout=120)[0]
    assert all(same(first["saved"], r["loaded"]) for r in second)  # every rank sees the whole state
    assert same(second[0]["saved"], third["loaded"])
    assert third["steps"] == 3 and third["lr"] == second[0]["lr"]


@SKIP_IF_STOCK_ZERO_STEP_FAILS  # the fine-tuning is stock ZeRO
@pytest.mark.parametrize("stage", [1, 2])
def test_export_and_finetune_with_stock_deepspeed(ranks, tmp_path, stage):
    for r in ranks.run(2, export_and_finetune_stock, stage, str(tmp_path), timeout=120):
        assert r["same_export"] and r["fp32"] and r["starts_from_export"] and r["moved"]
        assert r["stock_optimizer"] in ("DeepSpeedZeroOptimizer", "BF16_Optimizer")


def _deepspeed_before(version: str) -> bool:
    from importlib.metadata import version as installed  # deepspeed itself is not imported in pytest's process
    from packaging.version import Version

    return Version(installed("deepspeed")) < Version(version)


@pytest.mark.skipif(_deepspeed_before("0.18"), reason="DeepSpeed < 0.18 has no torch-style backward (stock neither: "
                                                        "engine.backward(loss) is its only backward)")
@pytest.mark.parametrize("stage", [1, 2])
def test_torch_style_backward(ranks, stage):
    assert all(ranks.run(2, torch_style_backward, stage, timeout=120))


def optimizers_without_key(cases):
    return [optimizer_without_key(stage, plugin) for stage, plugin in cases]


def test_without_the_key_deepspeed_is_stock(ranks):
    cases = [(1, None), (2, {"fp32_reduce_zero": False}), (2, ON)]
    assert ranks.run(2, optimizers_without_key, cases)[0] == ["DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer",
                                                             "DeepSpeedFP32ReduceZero"]


BAD = [
    ({"stage": 3}, ON, "only stage 1 and 2 are supported"),
    ({"stage": 0}, ON, "only stage 1 and 2 are supported"),
    ({"stage": 2, "fp16": {"enabled": True}, "bf16": {"enabled": False}}, ON, "only bf16 is supported"),
    ({"stage": 1, "bf16": {"enabled": False}}, ON, 'set "bf16": {"enabled": true}'),
    ({"stage": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, ON,
     "offload is not supported"),
    ({"stage": 1, "communication_data_type": "bf16"}, ON, "reduce_dtype"),
    ({"stage": 1}, {**ON, "bucket_size": 10}, "unknown option(s) ['bucket_size']"),
    ({"stage": 1}, {**ON, "reduce_dtype": "fp16"}, 'must be "fp32" or "bf16"'),
    ({"stage": 1}, True, "must be an object"),
    ({"stage": 1}, {"fp32_reduce_zero": "yes"}, '"l3plugin.fp32_reduce_zero" must be True or False, got \'yes\''),
]


def errors_of(cases):
    return [error_of(cfg, plugin) for cfg, plugin in cases]


def test_bad_input_is_a_clear_error(ranks):
    messages = ranks.run(2, errors_of, [(cfg, plugin) for cfg, plugin, _ in BAD], timeout=120)[0]
    for (cfg, plugin, expected), message in zip(BAD, messages):
        assert message is not None and expected in message, (cfg, plugin, message)
        if "unknown option" in expected:
            assert "fp32_reduce_zero" in message and "reduce_dtype" in message  # lists the valid ones
        elif "must be" not in expected:
            assert "Supported with" in message  # says what is supported
