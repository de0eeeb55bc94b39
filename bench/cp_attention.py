"""All-gather CP attention on this CPU: time per rank for cp=1 and cp=2, speedup, load balance, bytes,
and a ring-attention baseline (written for this benchmark) on the same inputs.

    .venv/bin/python bench/cp_attention.py                 # S = 2048, 4096, 8192 (a few minutes)
    .venv/bin/python bench/cp_attention.py --seq 2048      # one size

Prints tables, asserts nothing. fp32, one packed sequence, heads_q=8, heads_kv=2 (GQA), head_dim=64,
forward + backward. cp=1 runs on both ranks at once (one core each) so the machine is equally loaded.
"Imbalance" is max/min over CP ranks of attention work (query-key pairs inside the mask): causal mask,
and document masks with Llama-like document lengths (log-normal, median ~600 tokens), averaged over
draws. Both all-gather and ring compute dense masked blocks with torch's CPU flash-attention ops, so
document masks do not reduce their time here (a varlen GPU kernel would skip the masked work).
Ring baseline: K/V (and in the backward dK/dV) travel around the ring while each rank attends its
queries to the visiting block (torch's CPU flash kernel, which returns the log-sum-exp), merging
partial results by log-sum-exp; P2P is posted before the block's compute so it overlaps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from l3plugin.cp.sharding import shard_indices  # noqa: E402

HQ, HKV, D = 8, 2, 64


def document_lengths(seq_len, gen):
    cu, pos = [0], 0
    while pos < seq_len:
        n = int(torch.empty(1).log_normal_(6.4, 1.0, generator=gen).clamp(min=16))
        pos = min(seq_len, pos + n)
        cu.append(pos)
    return cu


def rank_work(seq_len, cp, cu):
    """Query-key pairs inside the causal document mask, per CP rank."""
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    start = torch.tensor(cu)[doc]
    per_token = torch.arange(seq_len) - start + 1  # keys each query sees
    return [int(per_token[shard_indices(seq_len, cp, r)].sum()) for r in range(cp)]


def imbalance_table(seqs, draws=20):
    print(f"{'S':>6} {'cp':>3} {'causal max/min':>15} {'documents max/min (mean, worst of ' + str(draws) + ')':>40}")
    for s in seqs:
        for cp in (2, 4):
            causal = rank_work(s, cp, [0, s])
            gen = torch.Generator().manual_seed(s + cp)
            ratios = []
            for _ in range(draws):
                w = rank_work(s, cp, document_lengths(s, gen))
                ratios.append(max(w) / min(w))
            print(f"{s:>6} {cp:>3} {max(causal) / min(causal):>15.3f} "
                  f"{statistics.mean(ratios):>27.3f}, {max(ratios):.3f}")
    print()


# ---- rank functions ---------------------------------------------------------------------------
def _inputs(seq_len, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, HQ, D, generator=gen)
    k = torch.randn(seq_len, HKV, D, generator=gen)
    v = torch.randn(seq_len, HKV, D, generator=gen)
    g = torch.randn(seq_len, HQ, D, generator=gen)
    return q, k, v, g


def _timed(fn, repeats):
    import time

    import torch.distributed as dist

    fn()  # warm-up, not counted
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def all_gather_run(seq_len, cp, cu, kernel, repeats):
    import torch.distributed as dist

    from l3plugin.cp.attention import all_gather_attention

    rank = dist.get_rank()
    group = dist.group.WORLD if cp > 1 else None
    idx = shard_indices(seq_len, cp, rank % cp if cp > 1 else 0)
    q, k, v, g = (t[idx] for t in _inputs(seq_len))

    def step():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = all_gather_attention(*leaves, torch.tensor(cu), group=group, kernel=kernel)
        out.backward(g)
        return out.detach(), [t.grad for t in leaves]

    t, (out, grads) = _timed(step, repeats)
    return {"time": t, "out": out, "grads": grads}


def _mask(pos_q, pos_k, doc):
    allowed = (doc[pos_q][:, None] == doc[pos_k][None, :]) & (pos_k[None, :] <= pos_q[:, None])
    return torch.zeros(allowed.shape).masked_fill(~allowed, -1e9), bool(allowed.any())


def ring_run(seq_len, cp, cu, repeats):
    import torch.distributed as dist

    rank = dist.get_rank()
    nxt, prv = (rank + 1) % cp, (rank - 1) % cp
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    idx = shard_indices(seq_len, cp, rank)
    q, k, v, g = (t[idx] for t in _inputs(seq_len))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    rep = HQ // HKV
    q4, g4 = q.transpose(0, 1)[None], g.transpose(0, 1)[None]  # [1, H, s, d]

    def expand(kv):  # [2, s, hkv, d] -> two [1, HQ, s, d]
        return [t.repeat_interleave(rep, dim=1).transpose(0, 1)[None] for t in kv]

    def rotate(t):
        buf = torch.empty_like(t)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, buf, prv)])
        return reqs, buf

    chunk = q.size(0) // 2

    def blocks(s):
        """(q rows, kv columns, mask) of every (local q chunk, visiting kv chunks) pair with work in it:
        fully masked chunk pairs are skipped, as a ring implementation for causal masks does."""
        mask, _ = _mask(idx, shard_indices(seq_len, cp, (rank - s) % cp), doc)
        for a in range(2):
            rows = slice(a * chunk, (a + 1) * chunk)
            cols = [j for j in range(2) if bool((mask[rows, j * chunk:(j + 1) * chunk] == 0).any())]
            if cols:
                col_idx = torch.cat([torch.arange(j * chunk, (j + 1) * chunk) for j in cols])
                yield a, rows, col_idx, mask[rows][:, col_idx].contiguous()

    def step():
        kv = torch.stack([k, v]).contiguous()
        out, lse = [None, None], [None, None]  # per local q chunk
        for s in range(cp):
            reqs, incoming = rotate(kv) if s < cp - 1 else ([], None)
            kb, vb = expand(kv)
            for a, rows, cols, mask in blocks(s):
                o, l = flash(q4[:, :, rows], kb[:, :, cols], vb[:, :, cols], attn_mask=mask)
                if out[a] is None:
                    out[a], lse[a] = o, l
                else:
                    new = torch.logaddexp(lse[a], l)
                    out[a] = out[a] * (lse[a] - new).exp()[..., None] + o * (l - new).exp()[..., None]
                    lse[a] = new
            for r in reqs:
                r.wait()
            kv = incoming
        # Backward: K/V travel the ring again; each block's dK/dV accumulator follows it one hop
        # behind and, after cp hops, arrives back at the block's owner.
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv)
        dq = torch.zeros_like(q4)
        for s in range(cp):
            reqs, incoming = rotate(kv) if s < cp - 1 else ([], None)
            kb, vb = expand(kv)
            for a, rows, cols, mask in blocks(s):
                gq, gk, gv = flash_bwd(g4[:, :, rows].contiguous(), q4[:, :, rows], kb[:, :, cols],
                                       vb[:, :, cols], out[a], lse[a], 0.0, False, attn_mask=mask)
                dq[:, :, rows] += gq
                for i, gt in enumerate((gk, gv)):  # [1, HQ, s, d] -> [s, HKV, d], summing GQA groups
                    dkv[i, cols] += gt[0].transpose(0, 1).reshape(-1, HKV, rep, D).sum(2)
            if cp > 1:
                d_reqs, dkv_next = rotate(dkv)
                reqs = reqs + d_reqs
                for r in reqs:
                    r.wait()
                kv, dkv = incoming, dkv_next
        full = torch.cat(out, dim=2)
        return full[0].transpose(0, 1), [dq[0].transpose(0, 1), dkv[0], dkv[1]]

    t, (o, grads) = _timed(step, repeats)
    return {"time": t, "out": o, "grads": grads}


def bytes_per_rank(seq_len, cp):
    """K/V bytes each rank receives in the forward (and dK/dV in the backward, same again)."""
    s_local = seq_len // cp
    return (cp - 1) * 2 * s_local * HKV * D * 4


def speed_table(pool, seqs, repeats):
    print(f"{'S':>6} {'mask':>9} {'cp=1 s':>8} {'cp=2 s':>8} {'speedup':>8} {'work max/min':>13} "
          f"{'ring s':>8} {'ring/ag':>8} {'ring~ag':>9} {'fwd MB':>7}")
    gen = torch.Generator().manual_seed(1)
    for s in seqs:
        for mask, cu in (("causal", [0, s]), ("documents", document_lengths(s, gen))):
            kernel = "cpu-flash"  # the CPU default; the ring uses the same torch CPU flash ops per block
            one = pool.run(all_gather_run, s, 1, cu, kernel, repeats, timeout=3600)
            two = pool.run(all_gather_run, s, 2, cu, kernel, repeats, timeout=3600)
            ring = pool.run(ring_run, s, 2, cu, repeats, timeout=3600)
            t1 = statistics.mean(r["time"] for r in one)
            t2 = max(r["time"] for r in two)
            tr = max(r["time"] for r in ring)
            work = rank_work(s, 2, cu)  # wall times are equal: ranks wait for each other in the collectives
            diff = max(float((a["out"] - b["out"]).abs().max()) for a, b in zip(two, ring))
            diff = max([diff] + [float((x - y).abs().max()) for a, b in zip(two, ring)
                                 for x, y in zip(a["grads"], b["grads"])])
            print(f"{s:>6} {mask:>9} {t1:>8.3f} {t2:>8.3f} {t1 / t2:>8.2f} {max(work) / min(work):>13.3f} "
                  f"{tr:>8.3f} {tr / t2:>8.2f} {diff:>9.1e} {bytes_per_rank(s, 2) / 1e6:>7.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="*", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per case (minimum is kept)")
    args = parser.parse_args(argv)
    print("== Load balance of the 2*cp chunk layout (analytic work per rank) ==")
    imbalance_table(args.seq)
    from l3plugin.testing.ranks import RankPool

    print("== Time per rank, fwd+bwd, fp32 (2 gloo ranks on this 2-core CPU) ==")
    with RankPool(2) as pool:
        speed_table(pool, args.seq, args.repeats)
    print("\nring/ag: ring time over all-gather time (cp=2), both on torch's CPU flash-attention ops with\n"
          "the same masks. ring~ag: max abs difference between ring and all-gather outputs and gradients\n"
          "(a correctness check). fwd MB: K/V bytes received per rank (the backward sends as much again).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
