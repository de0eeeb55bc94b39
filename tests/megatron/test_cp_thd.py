"""Megatron-Core THD packed sequences with CP 2: AllGatherCPCoreAttention takes q/k/v and PackedSeqParams as
Megatron builds them (every document padded to a multiple of 2cp, split into 2cp pieces, rank i holding pieces
i and 2cp-1-i of each; q/k/v [t, heads, dim]), with Megatron's own THD RoPE (rope_utils), and equals a
single-process fp64 dense reference over the UNPADDED sequence (per-document RoPE positions, document + causal
mask): outputs and gradients, padding tokens zero. The per-document split and the RoPE positions are written
here from the convention (not from l3plugin's code)."""

import math
import types

import pytest
import torch

import tiny_gpt as gpt

HEADS, KV_HEADS, DIM = 4, 2, 8
CASES = {
    # name: (document lengths, give cu_seqlens_q_padded)
    "odd-lengths": ([5, 11, 3, 17, 1, 7], True),  # every document padded; one of length 1
    "one-document": ([13], True),
    "multiples-no-padded": ([4, 8, 12, 4], False),  # no padding needed: cu_seqlens_q alone, as Megatron allows
    "one-token-docs": ([1, 1, 1, 2, 9], True),
}


def padded_lengths(lengths, cp):
    return [math.ceil(n / (2 * cp)) * 2 * cp for n in lengths]


def cumulative(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def local_positions(padded, cp, rank):
    """Megatron's / TE's THD split, from the convention: per document, pieces rank and 2cp-1-rank."""
    out, start = [], 0
    for n in padded:
        piece = n // (2 * cp)
        for p in (rank, 2 * cp - 1 - rank):
            out.extend(range(start + p * piece, start + (p + 1) * piece))
        start += n
    return torch.tensor(out)


def global_tensors(lengths, padded):
    """q, k, v, upstream gradient over the PADDED sequence (padding: junk) and the real positions there."""
    gen = torch.Generator().manual_seed(7)
    total = sum(padded)
    q = torch.randn(total, HEADS, DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(total, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(total, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    grad = torch.randn(total, HEADS * DIM, generator=gen, dtype=torch.float64)
    real, start = [], 0
    for n, p in zip(lengths, padded):
        real.extend(range(start, start + n))
        start += p
    pad = torch.ones(total, dtype=torch.bool)
    pad[real] = False
    for t in (q, k, v):
        t[pad] *= 10  # junk that must not reach a real token
    return q, k, v, grad, torch.tensor(real)


def rope_freqs(n):
    inv = 1.0 / (10000 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM))
    f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    return torch.cat([f, f], dim=-1)  # [n, DIM], Megatron's non-interleaved layout


def rope_reference(x, positions):
    """Rotary embedding at ``positions`` (rotate-half form), written from its definition."""
    f = rope_freqs(int(positions.max()) + 1)[positions][:, None, :]
    half = DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cos(f) + rotated * torch.sin(f)


def dense_reference(lengths, q, k, v, grad, rope):
    """One process, the unpadded sequence: per-document RoPE, document + causal mask, GQA by repetition."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    qr, kr = (rope_reference(q, pos), rope_reference(k, pos)) if rope else (q, k)
    kr, vr = kr.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", qr, kr) / math.sqrt(DIM)
    n = len(pos)
    allowed = (doc[:, None] == doc[None, :]) & (torch.arange(n)[None, :] <= torch.arange(n)[:, None])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", probs, vr).reshape(n, -1)
    (out * grad).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def thd_step(lengths, give_padded, rope):
    """On each CP rank: Megatron's THD inputs for this rank, Megatron's THD RoPE, l3plugin's core attention,
    forward and backward; returns the local results with their positions in the padded sequence."""
    import torch.distributed as dist
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from l3plugin.megatron.attention import AllGatherCPCoreAttention

    group = dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    padded = padded_lengths(lengths, cp)
    q, k, v, grad, _real = global_tensors(lengths, padded)
    mine = local_positions(padded, cp, rank)
    q, k, v = (t[mine].clone().requires_grad_() for t in (q, k, v))
    cu, cu_padded = cumulative(lengths), cumulative(padded)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu_padded if give_padded else None,
                             cu_seqlens_kv_padded=cu_padded if give_padded else None,
                             max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
    config = gpt.gpt_config(1, hidden=HEADS * DIM, heads=HEADS, kv_heads=KV_HEADS, cp=cp)
    qr, kr = q, k
    if rope:  # as Megatron's SelfAttention does for THD: offsets cu_seqlens_q_padded, else cu_seqlens_q
        freqs = rope_freqs(max(padded))[:, None, None, :]
        offsets = params.cu_seqlens_q_padded if give_padded else params.cu_seqlens_q
        qr = apply_rotary_pos_emb(q, freqs, config, cu_seqlens=offsets, cp_group=group)
        kr = apply_rotary_pos_emb(k, freqs, config, cu_seqlens=offsets, cp_group=group)
    attention = AllGatherCPCoreAttention(config, 1, AttnMaskType.causal, "self",
                                         pg_collection=types.SimpleNamespace(cp=group))
    out = attention(qr, kr, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    (out * grad[mine]).sum().backward()
    return {"positions": mine, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("rope", [True, False], ids=["megatron-thd-rope", "no-rope"])
@pytest.mark.parametrize("case", list(CASES))
def test_thd_cp2_matches_dense_reference(ranks, case, rope):
    lengths, give_padded = CASES[case]
    results = ranks.run(2, thd_step, lengths, give_padded, rope, timeout=120)
    padded = padded_lengths(lengths, 2)
    q, k, v, grad, real = global_tensors(lengths, padded)
    ref = dense_reference(lengths, q[real], k[real], v[real], grad[real], rope)
    unpadded_index = {int(p): i for i, p in enumerate(real)}
    seen = []
    for r in results:
        seen.extend(r["positions"].tolist())
        is_real = torch.tensor([int(p) in unpadded_index for p in r["positions"]])
        rows = torch.tensor([unpadded_index[int(p)] for p in r["positions"] if int(p) in unpadded_index])
        for got, want in zip((r["out"], r["dq"], r["dk"], r["dv"]), ref):
            want = want.reshape(len(real), *got.shape[1:])
            err = float((got[is_real] - want[rows]).abs().max())
            assert err < 1e-12, (case, err)
            assert not got[~is_real].any()  # padding: zero output, zero gradient
    assert sorted(seen) == list(range(sum(padded)))  # the two ranks hold every position once
    if case == "odd-lengths":
        assert sum(padded) > sum(lengths)  # the case exercises padding


def test_thd_layout_is_megatrons_per_document_split():
    """l3plugin's per-document layout holds exactly the positions of the convention's split, in order."""
    from l3plugin.cp.layout import per_document_layout

    for lengths in ([5, 11, 3, 17, 1, 7], [13], [1, 1, 1, 2, 9]):
        for cp in (1, 2, 3, 4):
            padded = padded_lengths(lengths, cp)
            layout = per_document_layout(cumulative(padded), cp)
            for rank in range(cp):
                assert torch.equal(layout.indices(rank), local_positions(padded, cp, rank))


def gpt_thd_step(cp, lengths, dtype=torch.float64):
    """A 2-layer GPTModel (RoPE, GQA) on one packed sequence: at cp > 1 in Megatron's THD form (padded
    documents, per-document split, PackedSeqParams "thd"); at cp 1 in l3plugin's sbhd form over the unpadded
    sequence (global RoPE positions). Loss (token mean over the real tokens) and CP-summed gradients."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from l3plugin.demo.model import build_chunk
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(cp=cp)  # cp 2 on two ranks, cp 1 (the reference) on one
    n = sum(lengths)
    padded = padded_lengths(lengths, cp) if cp > 1 else lengths
    config = gpt.gpt_config(2, cp=cp, params_dtype=dtype)
    model = build_chunk(config, vocab=gpt.VOCAB, seq_len=sum(padded), pre_process=True, post_process=True,
                        position_embedding_type="rope").to(dtype)
    rope = model.rotary_pos_emb  # its inv_freq is a plain fp32 attribute: in fp64 both RoPE forms agree to 1e-15
    rope.inv_freq = rope.inv_freq.to(dtype)
    batch = gpt.microbatches(1, 1, n)[0]
    den = batch["loss_mask"].sum()
    cu = cumulative(lengths)
    if cp > 1:
        _q, _k, _v, _g, real = global_tensors(lengths, padded)
        full = {key: torch.zeros(1, sum(padded), dtype=value.dtype) for key, value in batch.items()}
        for key, value in batch.items():
            full[key][:, real] = value  # padding: token 0, loss mask 0
        mine = local_positions(padded, cp, mesh.coords["cp"])
        batch = {key: value[:, mine] for key, value in full.items()}
        cu_padded = cumulative(padded)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                                 cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
    else:
        packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=packed)
    return gpt.cp_loss_and_grads(model, per_token, batch["loss_mask"], den, dtype, mesh.cp_group)


@pytest.mark.parametrize("lengths", [[5, 11, 3, 17, 1, 7], [2, 30]], ids=["odd-lengths", "two-documents"])
def test_gpt_thd_cp2_matches_cp1(ranks, lengths):
    """Megatron's whole THD path (embedding, squeeze, THD RoPE with the padded offsets, output reshape, loss)
    at CP 2 equals CP 1 over the unpadded sequence. RoPE differs in form (per document at CP 2, global
    positions at CP 1) but not in value within a document: fp64 agrees to 1e-12."""
    cp2 = ranks.run(2, gpt_thd_step, 2, lengths, timeout=120)
    cp1 = ranks.run(1, gpt_thd_step, 1, lengths, timeout=120)[0]
    gpt.assert_equal_to_cp1(cp2, cp1)


BAD_INPUTS = {
    # name: (micro-batch size, cu_seqlens_q, cu_seqlens_q_padded, expected message); 14 local tokens, cp 2: S = 28
    "micro-batch-2": (2, [0, 12, 28], None,
                      r"qkv_format='thd' with micro-batch size 2 \(query shape \(14, 2, 4, 8\)\): a THD batch is one "
                      r"packed sequence, micro-batch size must be 1"),
    "cu-not-at-sequence-end": (1, [0, 12, 20], None,
                               r"cu_seqlens_q \(no cu_seqlens_q_padded given\)=\[0, 12, 20\] ends at 20, but the "
                               r"packed sequence has 14 local tokens x cp 2 = 28: the last \(padded\) offset must be"),
    "padded-not-local-length": (1, [0, 5, 19], [0, 8, 32], r"cu_seqlens_q_padded=\[0, 8, 32\] ends at 32, but the "
                                r"packed sequence has 14 local tokens x cp 2 = 28"),
    "padded-not-multiple-of-2cp": (1, [0, 5, 19], [0, 6, 28], r"cu_seqlens_q_padded=\[0, 6, 28\] gives document 0 a "
                                   r"padded length of 6, not a multiple of 2 x cp = 4"),
    "odd-documents-without-padded": (1, [0, 5, 28], None, r"cu_seqlens_q \(no cu_seqlens_q_padded given\)=\[0, 5, 28\] "
                                     r"gives document 0 a padded length of 5, not a multiple of 2 x cp = 4.*give "
                                     r"cu_seqlens_q_padded"),
    "document-longer-than-padded": (1, [0, 9, 19], [0, 8, 28], r"cu_seqlens_q=\[0, 9, 19\] gives document 0 9 tokens "
                                    r"but cu_seqlens_q_padded=\[0, 8, 28\] only 8"),
}


def bad_thd_forward(micro_batch, cu, cu_padded):
    """Every rank calls the core attention with the same bad input; returns its error (None if it ran), then
    every rank meets in a barrier: nothing is left waiting in a collective."""
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from l3plugin.megatron.attention import AllGatherCPCoreAttention

    group = dist.group.WORLD
    config = gpt.gpt_config(1, hidden=HEADS * DIM, heads=HEADS, kv_heads=KV_HEADS, cp=2)
    attention = AllGatherCPCoreAttention(config, 1, AttnMaskType.causal, "self",
                                         pg_collection=types.SimpleNamespace(cp=group))
    shape = (14, micro_batch) if micro_batch > 1 else (14,)
    q = torch.randn(*shape, HEADS, DIM, dtype=torch.float64)
    k, v = (torch.randn(*shape, KV_HEADS, DIM, dtype=torch.float64) for _ in range(2))
    to = (lambda x: None if x is None else torch.tensor(x, dtype=torch.int32))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=to(cu), cu_seqlens_kv=to(cu),
                             cu_seqlens_q_padded=to(cu_padded), cu_seqlens_kv_padded=to(cu_padded),
                             max_seqlen_q=28, max_seqlen_kv=28)
    try:
        attention(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        message = None
    except ValueError as exc:
        message = str(exc)
    dist.barrier(group)
    return message


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_thd_input_is_named_on_every_rank(ranks, case):
    import re

    micro_batch, cu, cu_padded, expected = BAD_INPUTS[case]
    messages = ranks.run(2, bad_thd_forward, micro_batch, cu, cu_padded, timeout=60)
    for message in messages:
        assert message is not None and re.search(expected, message), message


def test_good_thd_input_runs_where_the_bad_ones_fail(ranks):
    """Control for the test above: the same call with consistent offsets raises nothing."""
    assert ranks.run(2, bad_thd_forward, 1, [0, 5, 19], [0, 8, 28], timeout=60) == [None, None]


def gpt_zigzag_step(form, lengths=(5, 11, 3, 17, 1, 7), dtype=torch.float64):
    """What Megatron-LM 0.19's pretrain_gpt gives the model with --dataloader-inter-document-masking at CP 2:
    the packed sequence sharded by the per-sequence zigzag (= l3plugin's "2cp" layout: documents cross chunk
    borders, nothing padded) and PackedSeqParams("thd", cu_seqlens_q=<global, unpadded>, no padded offsets,
    max_seqlen=<longest document>). ``form``: "thd" as given, "route" as l3plugin's flags route passes it on
    (batch_hooks.sbhd_from_thd), "cp1": one CP rank, the unsharded sequence in sbhd."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from l3plugin.cp.sharding import shard_batch
    from l3plugin.demo.model import build_chunk
    from l3plugin.megatron.batch_hooks import sbhd_from_thd
    from l3plugin.mesh.groups import init_mesh

    cp = 1 if form == "cp1" else 2
    mesh = init_mesh(cp=cp)  # cp 2 on two ranks, cp 1 (the reference) on one
    n = sum(lengths)
    config = gpt.gpt_config(2, cp=cp, params_dtype=dtype)
    model = build_chunk(config, vocab=gpt.VOCAB, seq_len=n, pre_process=True, post_process=True,
                        position_embedding_type="rope").to(dtype)
    model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.to(dtype)
    batch = gpt.microbatches(1, 1, n)[0]
    den = batch["loss_mask"].sum()
    cu = cumulative(lengths)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    if cp > 1:
        batch = shard_batch(batch, cp, mesh.coords["cp"])
    packed = packed if form == "thd" else sbhd_from_thd(packed)
    try:
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                          packed_seq_params=packed)
    except RuntimeError as exc:
        return {"error": str(exc)}
    return gpt.cp_loss_and_grads(model, per_token, batch["loss_mask"], den, dtype, mesh.cp_group)


def test_inter_document_masking_batch_crashes_thd_rope_and_runs_as_the_route_passes_it(ranks):
    """The core_v0.19.0 crash, at the Megatron-Core level: Megatron's THD RoPE splits each rank's 22 tokens by
    cu_seqlens // cp, which add up to 21 with odd documents. As l3plugin's route passes it on (sbhd, max_seqlen S)
    the same batch equals CP 1 (fp64)."""
    crashed = ranks.run(2, gpt_zigzag_step, "thd", timeout=120)
    for r in crashed:
        assert "split_with_sizes expects split_sizes to sum exactly to 22" in r["error"], r
    route = ranks.run(2, gpt_zigzag_step, "route", timeout=120)
    cp1 = ranks.run(1, gpt_zigzag_step, "cp1", timeout=120)[0]
    gpt.assert_equal_to_cp1(route, cp1)


def test_sbhd_from_thd_keeps_the_boundaries_and_sizes_rope_by_the_sequence():
    from megatron.core.packed_seq_params import PackedSeqParams

    from l3plugin.megatron.batch_hooks import sbhd_from_thd

    cu = cumulative([5, 11, 3, 17, 1, 7])
    out = sbhd_from_thd(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=17,
                                        max_seqlen_kv=17))
    assert (out.qkv_format, out.max_seqlen_q, out.max_seqlen_kv) == ("sbhd", 44, 44)
    assert out.cu_seqlens_q is cu and out.cu_seqlens_kv is cu
