"""Megatron-Core GPTModel with l3plugin's core_attention: cp=2 on gloo matches cp=1 (loss and grads)."""

import pytest
import torch

from l3plugin.testing import tiny_gpt as gpt

SEQ = 16
LAYOUTS = {"one-document": [0, SEQ], "paper-3-3-8-2": [0, 3, 6, 14, 16], "tiny-docs": [0, 1, 2, 5, 9, 10, 13, 16]}


def gpt_step(cp, cu, dtype):
    """Loss (mean over the full sequence's masked tokens) and full-model grads summed over CP ranks."""
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams

    from l3plugin.cp import sharding
    from l3plugin.mesh import init_mesh

    mesh = init_mesh(cp=cp, dp=2 // cp)
    config = gpt.gpt_config(2, cp=cp, params_dtype=dtype)
    model = gpt.build_gpt(config, seq_len=SEQ).to(dtype)
    batch = gpt.microbatches(1, 1, SEQ)[0]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    batch["position_ids"] = sharding.position_ids_per_document(cu_t, SEQ)[None]
    den = batch["loss_mask"].sum()
    if cp > 1:
        batch = sharding.shard_batch(batch, cp, mesh.coords["cp"])
    packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                             max_seqlen_q=SEQ, max_seqlen_kv=SEQ)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                      packed_seq_params=packed)
    loss = (per_token.to(dtype) * batch["loss_mask"].to(dtype)).sum() / den
    loss.backward()
    total = loss.detach().clone()
    grads = gpt.named_grads([model])
    if cp > 1:  # CP extends DP for parameters: gradients are summed over the CP group
        dist.all_reduce(total, group=mesh.cp_group)
        for g in grads.values():
            dist.all_reduce(g, group=mesh.cp_group)
    return {"loss": total, "grads": grads}


# Megatron's RoPE moves its frequencies to torch.cuda.current_device() (rotary_pos_embedding.py:162),
# so on CPU the model uses learned absolute positions; on GPUs RoPE's CP slicing uses the same layout.
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt_cp2_matches_cp1(ranks, layout):
    dtype = torch.float64
    cp2 = ranks.run(2, gpt_step, 2, LAYOUTS[layout], dtype, timeout=120)
    cp1 = ranks.run(2, gpt_step, 1, LAYOUTS[layout], dtype, timeout=120)[0]
    for r in cp2:
        assert abs(float(r["loss"] - cp1["loss"])) < 1e-12
        assert r["grads"].keys() == cp1["grads"].keys()
        for name, ref in cp1["grads"].items():
            err = float((r["grads"][name] - ref).abs().max())
            assert err < 1e-12, f"{name}: {err}"


def test_attention_dropout_is_refused():
    from megatron.core.transformer.enums import AttnMaskType

    from l3plugin.megatron.attention import AllGatherCPCoreAttention

    config = gpt.gpt_config(2)
    with pytest.raises(ValueError, match="attention_dropout=0.1 is not supported"):
        AllGatherCPCoreAttention(config, 1, AttnMaskType.causal, "self", attention_dropout=0.1,
                                 pg_collection=object())
