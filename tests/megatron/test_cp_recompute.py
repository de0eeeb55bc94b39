"""Megatron-Core's own activation recompute around l3plugin's CP attention (cp 2 on gloo): the result equals the
run without recompute, bit for bit, and no rank waits on a collective its peer never posts.

Megatron recomputes through ``tensor_parallel.checkpoint`` (a reentrant autograd Function): the whole layer with
``recompute_granularity="full"``, only the core attention with ``"selective"`` and ``recompute_modules=
["core_attn"]``. The balanced layout over these documents gives the two ranks different numbers of local ranges,
the shape that hung under HF's checkpointing (tests/cp/test_cp_checkpointing.py). On CPU the CUDA RNG state that
Megatron saves around the recompute is absent (tests/megatron_cpu_shim.py recompute_on_cpu); dropout is 0.
"""

import pytest
import torch

import tiny_gpt as gpt

SEQ = 32
DOCUMENTS = {"paper-3-3-8-2": [0, 6, 12, 28, 32], "tiny-docs": [0, 1, 2, 5, 9, 10, 13, 16, 17, 30, 31, 32]}
RECOMPUTE = {
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
}


def gpt_step(cu, recompute, cp_layout):
    """Loss and full-model gradients (summed over CP) of one step of a 2-layer GPT at cp 2, fp32."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from l3plugin.cp import sharding
    from l3plugin.demo.model import build_chunk
    from l3plugin.mesh.groups import init_mesh
    from megatron_cpu_shim import recompute_on_cpu

    mesh = init_mesh(cp=2)
    torch.manual_seed(0)
    config = gpt.gpt_config(2, cp=2, **RECOMPUTE[recompute])
    model = build_chunk(config, vocab=gpt.VOCAB, seq_len=SEQ, pre_process=True, post_process=True,
                        position_embedding_type="rope", cp_layout=cp_layout)
    batch = gpt.microbatches(1, 1, SEQ)[0]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    batch["position_ids"] = sharding.position_ids_per_document(cu_t, SEQ)[None]
    den = batch["loss_mask"].sum()
    batch = sharding.shard_batch(batch, 2, mesh.coords["cp"], layout=cp_layout, cu_seqlens=cu_t)
    packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                             max_seqlen_q=SEQ, max_seqlen_kv=SEQ)
    from l3plugin.megatron.attention import AllGatherCPCoreAttention

    forwards, stock_forward = [], AllGatherCPCoreAttention.forward

    def counted(self, *args, **kwargs):
        forwards.append(None)
        return stock_forward(self, *args, **kwargs)

    AllGatherCPCoreAttention.forward = counted
    try:
        with recompute_on_cpu():
            per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                              packed_seq_params=packed)
            out = gpt.cp_loss_and_grads(model, per_token, batch["loss_mask"], den, torch.float32, mesh.cp_group)
    finally:
        AllGatherCPCoreAttention.forward = stock_forward
    return out | {"attention_forwards": len(forwards)}


def all_steps(cases):
    return {case: gpt_step(*case) for case in cases}


CASES = [(tuple(cu), recompute, layout) for cu in DOCUMENTS.values() for recompute in RECOMPUTE
         for layout in ("balanced", "2cp")]


@pytest.fixture(scope="module")
def runs(ranks):
    return ranks.run(2, all_steps, CASES, timeout=240)


@pytest.mark.parametrize("layout", ["balanced", "2cp"])
@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("documents", list(DOCUMENTS))
def test_megatron_recompute_with_cp_equals_no_recompute(runs, documents, recompute, layout):
    cu = tuple(DOCUMENTS[documents])
    for rank, done in enumerate(runs):
        got, want = done[(cu, recompute, layout)], done[(cu, "none", layout)]
        assert torch.equal(got["loss"], want["loss"]), (rank, got["loss"], want["loss"])
        # each layer's attention ran again in the backward (the recompute happened), and once only
        assert (got["attention_forwards"], want["attention_forwards"]) == (4, 2), rank
        assert got["grads"].keys() == want["grads"].keys()
        for name, ref in want["grads"].items():
            assert torch.equal(got["grads"][name], ref), (rank, name, float((got["grads"][name] - ref).abs().max()))
