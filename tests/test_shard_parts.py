"""zero/full_tensors.py's copy_part_to_shard: the one whole-parameter-to-shard copy (ZeRO's set_full_*, the
Megatron dist-checkpointing and DeepSpeed universal-checkpoint readers). Checked against the shards' own
layout: writing every rank's part of every whole parameter and laying the shards end to end gives the
bucket's parameters back, padding left zero."""

import torch

from l3plugin.zero.buffers import plan_buckets
from l3plugin.zero.full_tensors import copy_part_to_shard


def test_every_ranks_parts_rebuild_the_bucket():
    shapes = [(3, 5), (7,), (2, 2, 2)]  # 30 elements over 4 ranks: shards of 8, 2 of padding
    world = 4
    slots, (spec,) = plan_buckets([(0, 0, torch.bfloat16, s) for s in shapes], world, bucket_numel=10**6)
    wholes = [torch.randn(s, dtype=torch.float64) for s in shapes]
    shards = [torch.zeros(spec.shard_numel, dtype=torch.float32) for _ in range(world)]
    for rank, shard in enumerate(shards):
        for slot, whole in zip(slots, wholes):
            part = spec.shard_part(slot, rank)
            if part:
                piece = copy_part_to_shard(shard, whole, part)
                a, b, _ = part
                assert piece.dtype == torch.float64 and torch.equal(piece, whole.reshape(-1)[a:b])
    flat = torch.cat(shards)
    expected = torch.cat([w.reshape(-1) for w in wholes]).float()
    assert torch.equal(flat[:spec.numel], expected)  # every element once, in the shard's dtype
    assert not flat[spec.numel:].any()  # padding untouched
