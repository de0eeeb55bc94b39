"""Causal ring attention over the "2cp" layout: the baseline bench/cp_attention.py times against the all-gather
kernel (written for that benchmark; see its docstring). K/V (and in the backward dK/dV) travel the ring while
each rank attends its queries to the visiting chunks with torch's CPU flash ops, merging partial results by
log-sum-exp; it computes the same work-proportional pieces as the all-gather kernel."""

from __future__ import annotations

import torch

from l3plugin.cp.layout import make_layout
from l3plugin.cp.sharding import document_metadata


def ring_step(q, k, v, g, cu, seq_len, cp, rank):
    """On every rank of a cp-rank group: a function running one forward and backward of ring attention on this
    rank's shard (q, k, v [s/cp, heads, dim], output gradient g) and returning (out, [dq, dk, dv])."""
    import torch.distributed as dist

    from l3plugin.cp.kernels import pack_heads, query_blocks, unpack_heads

    nxt, prv = (rank + 1) % cp, (rank - 1) % cp
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    rep = q.size(1) // k.size(1)  # GQA as in the kernel: query heads of one K/V head stacked along the rows
    c = q.size(0) // 2
    metas = document_metadata(cu, seq_len, cp, rank, causal=True)

    def heads_first(kv):  # [2, s, hkv, d] -> two [1, hkv, s, d]
        return [t.transpose(0, 1)[None].contiguous() for t in kv]

    def rotate(t, tag):
        buf = torch.empty_like(t)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt, tag=tag),
                                       dist.P2POp(dist.irecv, buf, prv, tag=tag)])
        return reqs, buf

    def pieces(s):
        """(local q rows, visiting kv rows, additive mask or None) with work in them, at ring step s."""
        owner = (rank - s) % cp
        for a, meta in enumerate(metas):
            for b in query_blocks(meta, c, causal=True):
                pos_q = torch.arange(meta.start + b.q_lo, meta.start + b.q_hi)
                for j, (k0, k1) in enumerate(make_layout("2cp", seq_len, cp).rank_ranges(owner)):
                    lo, hi = max(b.k_lo, k0), min(b.k_hi, k1)
                    if lo >= hi:
                        continue
                    pos_k = torch.arange(lo, hi)
                    allowed = (doc[pos_q][:, None] == doc[pos_k][None, :]) & (pos_k[None, :] <= pos_q[:, None])
                    mask = None if bool(allowed.all()) else torch.zeros(allowed.shape).masked_fill(
                        ~allowed, float("-inf")).repeat(rep, 1)
                    yield (slice(a * c + b.q_lo, a * c + b.q_hi), slice(j * c + lo - k0, j * c + hi - k0), mask)

    def step():
        plans = [list(pieces(s)) for s in range(cp)]  # masks built once, kept for the backward
        kv = torch.stack([k, v]).contiguous()
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"))
        for s in range(cp):
            reqs, incoming = rotate(kv, 1) if s < cp - 1 else ([], None)
            kb, vb = heads_first(kv)
            for rows, cols, mask in plans[s]:
                o, l = flash(pack_heads(q[rows], rep), kb[:, :, cols], vb[:, :, cols], attn_mask=mask)
                o, l = unpack_heads(o, rep), unpack_heads(l, rep)
                new = torch.logaddexp(lse[rows], l)
                out[rows] = out[rows] * (lse[rows] - new).exp()[..., None] + o * (l - new).exp()[..., None]
                lse[rows] = new
            for r in reqs:
                r.wait()
            kv = incoming
        # Backward: K/V travel the ring again. A chunk's owner keeps its own part of the chunk's dK/dV;
        # the accumulator starts at the next rank and follows the chunk one hop behind, waited only after
        # the next step's compute, then goes home: cp - 1 hops, the last one exposed.
        kv = torch.stack([k, v]).contiguous()
        dq = torch.zeros_like(q)
        d_reqs, dkv_in = [], None
        for s in range(cp):
            reqs, incoming = rotate(kv, 1) if s < cp - 1 else ([], None)
            kb, vb = heads_first(kv)
            dkv = torch.zeros_like(kv)  # this step's part of the visiting chunk's dK/dV
            for rows, cols, mask in plans[s]:
                gq, gk, gv = flash_bwd(pack_heads(g[rows], rep), pack_heads(q[rows], rep), kb[:, :, cols],
                                       vb[:, :, cols], pack_heads(out[rows], rep), pack_heads(lse[rows], rep),
                                       0.0, False, attn_mask=mask)
                dq[rows] += unpack_heads(gq, rep)
                dkv[0, cols] += gk[0].transpose(0, 1)
                dkv[1, cols] += gv[0].transpose(0, 1)
            if s == 0:
                own = dkv
            else:
                for r in d_reqs:
                    r.wait()
                if s > 1:
                    dkv += dkv_in  # what the ranks before on the ring added to this chunk
                d_reqs, dkv_in = rotate(dkv, 2)  # to the chunk's next visitor, or home after the last
            for r in reqs:
                r.wait()
            kv = incoming
        for r in d_reqs:
            r.wait()
        dkv = own + dkv_in if cp > 1 else own
        return out, [dq, dkv[0], dkv[1]]

    return step
