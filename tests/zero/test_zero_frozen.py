"""Frozen parameters under l3plugin's ZeRO behind DeepSpeed's engine: no bucket, no reduce-scatter, no .grad, no
update. (The Megatron-Core path, with a pipeline stage holding nothing trainable: tests/megatron/test_frozen_layers.py.)"""

import torch

from ds_models import ds_config, engine_for, make_mlp, train
from reduce_scatter_census import bytes_handed_to_reduce_scatter


def frozen_first_layer(stage):
    model = make_mlp()
    model[0].requires_grad_(False)  # the first Linear
    engine = engine_for(ds_config(stage, gas=2, plugin={"fp32_reduce_zero": True}), model=model)
    frozen = {name: p.detach().clone() for name, p in engine.module.named_parameters() if not p.requires_grad}
    zero = engine.optimizer.zero
    with bytes_handed_to_reduce_scatter() as handed:
        train(engine, 2)
    params = dict(engine.module.named_parameters())
    return {"bucketed": sorted(name for name, p in params.items() if p in zero.slots),
            "trainable": sorted(name for name, p in params.items() if p.requires_grad),
            "bucket_numel": sum(b.spec.numel for b in zero.buckets),
            "bucket_padded_bytes": sum(b.spec.padded_numel for b in zero.buckets) * 4,
            "trainable_numel": sum(p.numel() for p in params.values() if p.requires_grad),
            "handed_bytes": sum(handed), "calls": len(handed), "buckets": len(zero.buckets),
            "frozen_grads": [params[name].grad for name in frozen],
            "frozen_unchanged": bool(frozen) and all(torch.equal(params[name], value) for name, value in frozen.items())}


def test_deepspeed_frozen_parameters_are_not_bucketed_or_reduced(ranks):
    stage = 2  # ZeRO-1 and 2 with frozen layers under Megatron-Core: tests/megatron/test_frozen_layers.py
    for rank, r in enumerate(ranks.run(2, frozen_first_layer, stage, timeout=180)):
        assert r["bucketed"] == r["trainable"] and "0.weight" not in r["bucketed"], f"rank {rank}: {r['bucketed']}"
        assert r["bucket_numel"] == r["trainable_numel"]
        # 2 steps of 2 micro-batches: ZeRO-1 reduces once per step, ZeRO-2 after every micro-batch.
        reductions = 2 * (2 if stage == 2 else 1)
        assert r["calls"] == reductions * r["buckets"]
        # Padded to a multiple of the 2 ranks: at most one element per bucket more than the trainable ones.
        padded = r["bucket_padded_bytes"]
        assert r["handed_bytes"] == reductions * padded and padded <= (r["trainable_numel"] + r["buckets"]) * 4
        assert all(g is None for g in r["frozen_grads"]) and r["frozen_unchanged"], f"rank {rank}"
