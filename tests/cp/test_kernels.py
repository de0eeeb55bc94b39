"""CPU attention kernels on one chunk (single process): parity with an fp64 dense reference, work
proportional to the unmasked pairs, the kernel registry."""

import pytest
import torch

from l3plugin.cp import kernels
from l3plugin.cp.kernels import query_blocks, register_kernel, select_kernel
from l3plugin.cp.sharding import ChunkDocuments, document_metadata

S = 96


def random_layout(seq_len, seed, longest):
    """cu_seqlens with random document lengths in 1..longest (many cross block and chunk borders)."""
    gen = torch.Generator().manual_seed(seed)
    cu, pos = [0], 0
    while pos < seq_len:
        pos = min(seq_len, pos + int(torch.randint(1, longest + 1, (1,), generator=gen)))
        cu.append(pos)
    return cu


LAYOUTS = {"one-document": [0, S], "tiny": random_layout(S, 0, 4), "mixed": random_layout(S, 1, 30),
           "long": random_layout(S, 2, 70)}


def allowed(cu, seq_len, causal):
    """Dense [S, S] mask over the full sequence (True = attend), built independently of the kernels."""
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return mask


def dense_reference(q, k, v, mask):
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.size(-1) ** -0.5
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def chunks(cu, causal):
    """Chunks of the 2*cp layout at cp=3: start 0, start > 0, the last chunk."""
    return [m for rank in range(3) for m in document_metadata(cu, S, 3, rank, causal=causal)]


@pytest.mark.parametrize("kernel", ["reference", "cpu-flash"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_dense_fp64_reference(kernel, dtype, causal):
    gen = torch.Generator().manual_seed(3)
    q, g = (torch.randn(S, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(S, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))  # GQA 4/2
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for name, cu in LAYOUTS.items():
        mask = allowed(cu, S, causal)
        for meta in chunks(cu, causal):
            rows = slice(meta.start, meta.end)
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            ref_out = dense_reference(ref[0][rows], ref[1], ref[2], mask[rows])
            ref_out.backward(g[rows])
            ours = [t.to(dtype).requires_grad_() for t in (q[rows], k[:meta.kv_len], v[:meta.kv_len])]
            out = select_kernel(kernel, q)(*ours, meta, causal=causal, softmax_scale=None, block_size=7)
            out.backward(g[rows].to(dtype))
            pairs = [(out, ref_out), (ours[0].grad, ref[0].grad[rows]), (ours[1].grad, ref[1].grad[:meta.kv_len]),
                     (ours[2].grad, ref[2].grad[:meta.kv_len])]
            err = max(float((a.double() - b).detach().abs().max()) for a, b in pairs)
            assert err < tol, f"{kernel} {dtype} causal={causal} {name} chunk [{meta.start}, {meta.end}): {err}"
            assert not ref[1].grad[meta.kv_len:].any()  # keys beyond kv_len are masked for these queries


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_query_blocks_do_work_proportional_to_unmasked_pairs(causal, name):
    cu, block, run = LAYOUTS[name], 16, 4
    mask = allowed(cu, S, causal)
    for meta in chunks(cu, causal):
        rows = meta.end - meta.start
        unmasked = int(mask[meta.start:meta.end].sum())
        # Split at every document and every `run` rows: nothing masked is computed but the causal
        # diagonal of each piece (non-causal: exactly the unmasked pairs).
        exact = query_blocks(meta, rows, causal=causal, block_size=block, call_pairs=0, run_rows=run)
        diagonal = sum((b.q_hi - b.q_lo) * (b.q_hi - b.q_lo - 1) // 2 for b in exact) if causal else 0
        assert sum(b.pairs for b in exact) == unmasked + diagonal
        assert diagonal <= rows * (run - 1) // 2
        # Merged runs: at most call_pairs more per merge.
        merged = query_blocks(meta, rows, causal=causal, block_size=block, call_pairs=20, run_rows=run)
        merges = len(exact) - len(merged)
        assert sum(b.pairs for b in merged) <= sum(b.pairs for b in exact) + 20 * merges
        for pieces in (exact, merged):  # they tile the chunk's rows in order, each within one block
            assert [b.q_lo for b in pieces] == [0] + [b.q_hi for b in pieces[:-1]] and pieces[-1].q_hi == rows
            assert all(b.q_lo // block == (b.q_hi - 1) // block for b in pieces)
            assert all(0 <= b.k_lo < b.k_hi <= meta.kv_len for b in pieces)
            docs = [len(set(cu_index(cu, meta.start + b.q_lo, meta.start + b.q_hi))) for b in pieces]
            assert [b.docs for b in pieces] == docs


def cu_index(cu, first, last):
    """Document index of positions first..last-1."""
    return [max(i for i, c in enumerate(cu) if c <= p) for p in range(first, last)]


@pytest.mark.parametrize("kernel", ["reference", "cpu-flash"])
def test_kernels_compute_only_the_planned_pairs(monkeypatch, kernel):
    """Count the query-key pairs handed to the attention ops, forward and backward: with small documents
    they are a fraction of the full prefix (so a kernel that goes back to masked full-prefix work fails)."""
    computed = []
    if kernel == "reference":  # _sdpa(q, k, v, mask, scale) on [s, h, d]
        sdpa = kernels._sdpa
        monkeypatch.setattr(kernels, "_sdpa", lambda q, k, *rest: (
            computed.append(q.size(0) * k.size(0)), sdpa(q, k, *rest))[1])
    else:  # the CPU ops on [1, heads_kv, rep * rows, d] (rep = 2 here): forward(q, k, ...), backward(g, q, k, ...)
        fwd, bwd = kernels._flash_forward(), kernels._flash_backward()
        monkeypatch.setattr(kernels, "_flash_forward", lambda: lambda q, k, *rest, **kw: (
            computed.append(q.size(2) // 2 * k.size(2)), fwd(q, k, *rest, **kw))[1])
        monkeypatch.setattr(kernels, "_flash_backward", lambda: lambda g, q, k, *rest, **kw: (
            computed.append(q.size(2) // 2 * k.size(2)), bwd(g, q, k, *rest, **kw))[1])
    seq_len, block = 512, 64
    cu = random_layout(seq_len, 4, 40)
    meta = document_metadata(cu, seq_len, 1, 0, causal=True)[1]  # the second half: kv_len = S
    rows = meta.end - meta.start
    q = torch.randn(rows, 4, 8, requires_grad=True)
    k, v = (torch.randn(meta.kv_len, 2, 8, requires_grad=True) for _ in range(2))
    select_kernel(kernel, q)(q, k, v, meta, causal=True, softmax_scale=None, block_size=block).sum().backward()
    planned = sum(b.pairs for b in query_blocks(meta, rows, causal=True, block_size=block))
    unmasked = int(allowed(cu, seq_len, True)[meta.start:meta.end].sum())
    assert sum(computed) == 2 * planned  # forward, then the backward (or the checkpoint's recompute)
    assert planned <= unmasked + (rows // block) * block * block // 2 + kernels.CALL_PAIRS * len(cu)
    assert planned < 0.25 * rows * meta.kv_len  # the full prefix would be rows x kv_len


def test_empty_chunk_and_mismatched_rows():
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    empty = ChunkDocuments(start=4, end=4, kv_len=8, cu_seqlens_q=torch.tensor([0, 0, 0], dtype=torch.int32),
                           cu_seqlens_kv=cu, max_seqlen_q=0, max_seqlen_kv=4)
    k = torch.randn(8, 2, 8)
    for name in ("reference", "cpu-flash"):
        out = kernels.KERNELS[name](torch.randn(0, 4, 8), k, k, empty, causal=True)
        assert out.shape == (0, 4, 8)
    with pytest.raises(ValueError, match=r"q has 3 rows but meta describes queries \[4, 4\)"):
        kernels.cpu_flash_kernel(torch.randn(3, 4, 8), k, k, empty, causal=True)
    with pytest.raises(ValueError, match="k has 5 rows but meta.kv_len=8"):
        kernels.reference_kernel(torch.randn(0, 4, 8), k[:5], k[:5], empty, causal=True)


def test_register_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "KERNELS", dict(kernels.KERNELS))  # registrations stay in this test
    calls = []

    def mine(q, k, v, meta, *, causal, softmax_scale):
        calls.append(meta.start)
        return kernels.reference_kernel(q, k, v, meta, causal=causal, softmax_scale=softmax_scale)

    register_kernel("mine", mine)
    from l3plugin.cp.attention import all_gather_attention

    q = torch.randn(16, 4, 8)
    out = all_gather_attention(q, q[:, :2], q[:, :2], [0, 5, 16], kernel="mine")
    ref = all_gather_attention(q, q[:, :2], q[:, :2], [0, 5, 16], kernel="reference")
    assert calls == [0, 8] and torch.equal(out, ref)
    with pytest.raises(ValueError, match="name='mine' is already registered"):
        register_kernel("mine", mine)
    with pytest.raises(ValueError, match="name='cpu-flash' is already registered"):
        register_kernel("cpu-flash", mine)
    with pytest.raises(ValueError, match="fn=3 is not callable"):
        register_kernel("other", 3)
    with pytest.raises(ValueError, match="name='auto' is invalid"):
        register_kernel("auto", mine)
    with pytest.raises(ValueError, match=r"kernel='nope' is unknown: choose 'auto' or one of .*'mine'"):
        select_kernel("nope", q)


def flash_semantics(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, gqa):
    """What a flash varlen kernel computes from its arguments, written from its contract (test double only):
    per document j, queries cu_q[j]:cu_q[j+1] against keys cu_k[j]:cu_k[j+1], causal aligned bottom-right."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and q.is_contiguous() and k.is_contiguous()
    lens_q, lens_k = torch.diff(cu_q).tolist(), torch.diff(cu_k).tolist()
    assert (max_q, max_k) == (max(lens_q), max(lens_k)) and cu_q[-1] == q.size(0) and cu_k[-1] <= k.size(0)
    assert gqa or k.size(1) == q.size(1), "K/V heads differ from query heads without enable_gqa"
    rep = q.size(1) // k.size(1)
    out = torch.zeros_like(q)
    for j, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        rows, keys = slice(cu_q[j], cu_q[j] + lq), slice(cu_k[j], cu_k[j] + lk)
        mask = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        kj, vj = k[keys].repeat_interleave(rep, dim=1), v[keys].repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows], kj) * (scale or q.size(-1) ** -0.5)
        out[rows] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vj)
    return out


def varlen_of_torch_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    return flash_semantics(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=window_size == (-1, 0),
                           scale=scale, gqa=enable_gqa)


def varlen_of_torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1)):
    return flash_semantics(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=window_size == (-1, 0),
                           scale=scale, gqa=True)  # its flash op takes fewer K/V heads without a flag


def varlen_of_torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return flash_semantics(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal, scale=None,
                           gqa=False)


@pytest.mark.parametrize("varlen", [varlen_of_torch_2_13, varlen_of_torch_2_11, varlen_of_torch_2_10])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_varlen_kernel_hands_over_the_metadata_of_each_chunk(monkeypatch, varlen, causal):
    """kernel 'torch-varlen' with torch's varlen_attn replaced by its contract (CPU has no flash kernel): the
    arguments it passes (each torch release's keywords, GQA, a non-default scale) give the dense fp64 result."""
    import inspect

    monkeypatch.setattr(kernels, "_torch_varlen", lambda: (varlen, frozenset(inspect.signature(varlen).parameters)))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(S, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(S, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))  # GQA 4/2
    for scale in (None, 0.2):
        for name, cu in LAYOUTS.items():
            mask = allowed(cu, S, causal)
            for meta in chunks(cu, causal):
                rows = slice(meta.start, meta.end)
                ref = dense_reference(q[rows] * (scale or 8 ** -0.5) * 8 ** 0.5, k, v, mask[rows])
                out = select_kernel("torch-varlen", q)(q[rows], k[:meta.kv_len], v[:meta.kv_len], meta,
                                                       causal=causal, softmax_scale=scale)
                err = float((out - ref).abs().max())
                assert err < 1e-12, f"{varlen.__name__} causal={causal} scale={scale} {name} [{meta.start}: {err}"


def test_auto_picks_flash_attn_then_torch_varlen_then_te_on_cuda(monkeypatch):
    present = {"flash": True, "torch": True, "te": True}
    monkeypatch.setattr(kernels, "_flash_varlen", lambda: object() if present["flash"] else None)
    monkeypatch.setattr(kernels, "_torch_varlen", lambda: object() if present["torch"] else None)
    monkeypatch.setattr(kernels, "_te_attention_class", lambda: object() if present["te"] else None)
    picks = []
    for absent in ("", "flash", "torch", "te"):
        if absent:
            present[absent] = False
        picks.append(kernels.auto_kernel("cuda", torch.bfloat16, (9, 0)))
    assert picks == ["flash", "torch-varlen", "te", "reference"]
    present.update(torch=True, te=True)
    assert kernels.auto_kernel("cuda", torch.bfloat16, (7, 0)) == "te"  # torch's flash kernels need sm80+
    assert kernels.auto_kernel("cuda", torch.float32, (9, 0)) == "reference"  # flash kernels: fp16/bf16 only
    assert kernels.auto_kernel("cpu", torch.bfloat16) == "cpu-flash"
    assert select_kernel("auto", torch.zeros(1)) is kernels.cpu_flash_kernel
