"""deepspeed.utils.safe_get_full_grad and engine.get_global_grad_norm answer like stock DeepSpeed's ZeRO-1/2
(the stock engine is the reference, run in the same process on the same data)."""

import pytest
import torch
import torch.distributed as dist

from ds_models import batch, ds_config, engine_for, loss_of


def _grad_timeline(stage, ours):
    """safe_get_full_grad of one weight before/between/after micro-batches, then an overflowing step."""
    import l3plugin.deepspeed as l3ds
    from deepspeed.utils import safe_get_full_grad

    if not ours:
        l3ds.uninstall()
    try:
        engine = engine_for(ds_config(stage, gas=2, plugin={"fp32_reduce_zero": True} if ours else None))
        weight = engine.module[2].weight
        rank = dist.get_rank()
        out = {"optimizer": type(engine.optimizer).__name__}

        def probe(tag):
            try:
                out[tag] = safe_get_full_grad(weight).detach().clone()
            except ValueError as exc:
                out[tag] = f"ValueError: {exc}"

        probe("before_backward")
        engine.backward(loss_of(engine(batch(rank, 0, 0))))
        engine.step()  # not a boundary: only counts
        probe("between_microbatches")
        engine.backward(loss_of(engine(batch(rank, 0, 1))))
        probe("after_last_backward")
        engine.step()
        probe("after_step")
        bad = batch(rank, 1, 0)
        bad[0, 0] = float("inf")
        for x in (bad, batch(rank, 1, 1)):
            engine.backward(loss_of(engine(x)))
            engine.step()
        out["overflow_norm"] = engine.get_global_grad_norm()
        out["skipped_steps"] = engine.skipped_steps
        out["finite_after_overflow"] = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
        return out
    finally:
        if not ours:
            l3ds.install()


def both(stage):
    return {"stock": _grad_timeline(stage, False), "ours": _grad_timeline(stage, True)}


NO_GRAD = "ValueError: Gradients are only available immediately after backward and before engine step"


@pytest.mark.parametrize("stage", [1, 2])
def test_safe_get_full_grad_and_overflow_norm_like_stock(ranks, stage):
    for r in ranks.run(2, both, stage, timeout=120):
        stock, ours = r["stock"], r["ours"]
        assert stock["optimizer"] == "DeepSpeedZeroOptimizer" and ours["optimizer"] == "DeepSpeedFP32ReduceZero"
        for tag in ("before_backward", "after_step"):  # stock's error, same type and words
            assert stock[tag] == NO_GRAD and ours[tag].startswith(NO_GRAD), (tag, stock[tag], ours[tag])
        if stage == 1:  # stock returns this rank's bf16 gradient so far; ours the same sum kept in fp32
            assert stock["between_microbatches"].dtype == torch.bfloat16
            assert ours["between_microbatches"].dtype == torch.float32
            assert torch.equal(ours["between_microbatches"], stock["between_microbatches"].float())
        else:  # stock raises; ours gives the reduced gradient so far
            assert stock["between_microbatches"] == NO_GRAD
            assert ours["between_microbatches"].dtype == torch.float32
        a, b = ours["after_last_backward"], stock["after_last_backward"]
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        assert torch.allclose(a, b, rtol=0, atol=1e-2 * b.abs().max().item())  # stock reduces in bf16
        assert stock["overflow_norm"] == ours["overflow_norm"] == float("inf")
        assert stock["skipped_steps"] == ours["skipped_steps"] == 1
        assert stock["finite_after_overflow"] and ours["finite_after_overflow"]
