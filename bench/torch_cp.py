"""torch's own all-gather CP as a contender of bench/cp_attention.py, on the same packed documents.

torch 2.13 ships an all-gather CP for FlexAttention (private: torch/distributed/tensor/experimental/_context_parallel/):
the sequence is rearranged by a load balancer and cut into cp equal slices; `flex_cp_allgather` all-gathers K and V
and waits before the attention (its backward reduce-scatters dK/dV); the block mask for the local queries comes
from `_create_cp_block_mask`. Its load balancers: `_HeadTailLoadBalancer` (the paper's 2cp chunks, what l3plugin's
"2cp" layout is), `_PerDocumentHeadTailLoadBalancer` (2cp pieces of every document: every document a multiple of 2cp
long) and `_PTRRLoadBalancer` (128-token query blocks dealt to ranks by their count of unmasked key blocks).

Here:
- work_table: max/min attention work per rank (query-key pairs inside the causal document mask, counted per token:
  simulated from work counts, nothing timed) of torch's three balancers and l3plugin's two layouts on the same
  documents: cp_attention's Llama-like draws with every length rounded to a multiple of 2cp (what torch's
  per-document balancer needs; l3plugin takes any lengths). The rearrangements are torch's own
  (`_generate_indices`); PTRR gets the document mask's non-empty block counts (block_counts: equal to
  `create_block_mask`'s at 1K tokens, checked by hand; tests/test_torch_cp_contender.py checks them against the dense
  mask, since create_block_mask's first call costs ~15 s) through a stand-in with the three fields it reads.
- timed contenders (cp_attention.py --torch-flex): the forward on 2 gloo ranks, torch's compiled FlexAttention with
  each balancer against l3plugin's all-gather attention (kernel cpu-flash, both layouts), outputs against an fp64
  reference. Forward only: FlexAttention has no backward on CPU in torch 2.13 (flex_attention.py `_validate_device`
  raises for inputs that require grad). The block mask and the compiled kernel are built once per worker and S
  (tens of seconds each, not timed).
"""

from __future__ import annotations

import os
import statistics
import time
from types import SimpleNamespace

import torch

BALANCERS = ("head-tail", "per-document head-tail", "ptrr")
AS_DRAWN = "per-document head-tail, as its docstring draws it"  # analytic only (see rearrangement)
BLOCK = 128  # FlexAttention's default sparse block (torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE)


def cp_documents(cu, cp):
    """``cu`` with every document length rounded to a multiple of 2cp (at least 2cp), the last one taking what is
    left of S (S a multiple of 2cp): documents torch's per-document balancer accepts."""
    unit, seq_len = 2 * cp, cu[-1]
    if seq_len % unit:
        raise ValueError(f"S={seq_len} is not a multiple of 2cp={unit}")
    out = [0]
    for a, b in zip(cu, cu[1:]):
        n = max(unit, round((b - a) / unit) * unit)
        if out[-1] + n >= seq_len:
            break
        out.append(out[-1] + n)
    out.append(seq_len)
    return out


def token_work(cu):
    """Per token: the keys it attends under the causal document mask (its position in its document + 1)."""
    lengths = torch.diff(torch.tensor(cu))
    starts = torch.repeat_interleave(torch.tensor(cu[:-1]), lengths)
    return torch.arange(cu[-1]) - starts + 1


def block_counts(cu, block=BLOCK):
    """Per query block: the key blocks holding a key some query of the block attends (causal document mask). The
    first query of block i attends from its document's start, the last query up to itself, and the documents
    between are contiguous: blocks start // block .. i."""
    seq_len = cu[-1]
    if seq_len % block:
        raise ValueError(f"S={seq_len} is not a multiple of the block {block}")
    firsts = torch.arange(0, seq_len, block)
    doc_of = torch.searchsorted(torch.tensor(cu), firsts, right=True) - 1
    starts = torch.tensor(cu)[doc_of]
    return torch.arange(seq_len // block) - starts // block + 1


def rearrangement(balancer, cu, cp):
    """Original token positions in the order torch's ``balancer`` puts them (rank r holds slice r of S/cp)."""
    from torch.distributed.tensor.experimental._context_parallel import (
        _HeadTailLoadBalancer, _PerDocumentHeadTailLoadBalancer, _PTRRLoadBalancer)

    seq_len = cu[-1]
    if balancer == "head-tail":
        return _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0]
    if balancer.startswith("per-document head-tail"):
        lengths = torch.diff(torch.tensor(cu)).tolist()
        order = _PerDocumentHeadTailLoadBalancer([lengths], cp, "cpu")._generate_indices()[0]
        if balancer == "per-document head-tail":
            return order
        # as its docstring draws it: rank r holds pieces r and 2cp-1-r of every document. The indices come document
        # by document (each document's L/cp positions per rank in turn), and torch's sharding cuts the rearranged
        # sequence into cp contiguous slices, so as shipped rank 0 gets the first documents whole.
        blocks = order.split(lengths)
        return torch.cat([block.chunk(cp)[r] for r in range(cp) for block in blocks])
    if balancer == "ptrr":  # it reads only these three fields of a BlockMask
        counts = block_counts(cu).view(1, 1, -1).to(torch.int32)
        mask = SimpleNamespace(kv_num_blocks=counts, full_kv_num_blocks=None, BLOCK_SIZE=(BLOCK, BLOCK))
        return _PTRRLoadBalancer(mask, cp)._generate_indices()[0]
    raise ValueError(f"balancer={balancer!r}: one of {BALANCERS}")


def torch_rank_work(balancer, cu, cp):
    work, order = token_work(cu), rearrangement(balancer, cu, cp)
    return [int(part.sum()) for part in work[order].chunk(cp)]


def work_table(seqs, draws, document_lengths):
    """Print max/min work per rank of l3plugin's layouts and torch's balancers on the same documents (cp_attention's
    draws, seeded as its own work table, lengths rounded by cp_documents); return the rows."""
    from l3plugin.cp.layout import imbalance, make_layout, rank_work

    names = ("l3plugin 2cp", "l3plugin balanced", *(f"torch {b}" for b in BALANCERS + (AS_DRAWN,)))
    print(f"== Attention work per CP rank: l3plugin's layouts and torch 2.13's load balancers, the same documents "
          f"(lengths rounded to a multiple of 2cp), {draws} draws per row (simulated from work counts) ==")
    print(f"{'S':>7} {'cp':>3} | " + " | ".join(n.split(",")[0] + (" (drawn)" if "," in n else "") for n in names))
    rows = []
    for s in seqs:
        for cp in (2, 4, 8):
            if s % (cp * BLOCK):
                continue  # torch's CP block mask needs S a multiple of cp x 128
            gen = torch.Generator().manual_seed(s + cp)
            ratios = {n: [] for n in names}
            for _ in range(draws):
                cu = cp_documents(document_lengths(s, gen), cp)
                for layout in ("2cp", "balanced"):
                    ratios[f"l3plugin {layout}"].append(imbalance(rank_work(make_layout(layout, s, cp, cu), cu)))
                for b in BALANCERS + (AS_DRAWN,):
                    ratios[f"torch {b}"].append(imbalance(torch_rank_work(b, cu, cp)))
            rows.append({"seq": s, "cp": cp, **{n: {"max_over_min_mean": statistics.mean(r),
                                                    "max_over_min_worst": max(r)} for n, r in ratios.items()}})
            print(f"{s:>7} {cp:>3} | " + " | ".join(f"{statistics.mean(r):.3f}, {max(r):.3f}".rjust(len(n.split(",")[0]) + 8 * ("," in n))
                                                  for n, r in ratios.items()))
    print("max/min work over ranks: mean, worst. torch's head-tail is the paper's 2cp layout (equal figures); "
          "per-document head-tail as torch 2.13 shards it (its indices document by document, cut into cp "
          "contiguous slices) and as its docstring draws it (pieces r and 2cp-1-r of every document on rank r); "
          "PTRR deals 128-token blocks.\n")
    return rows


# ---- timed forward on the rank pool -------------------------------------------------------------------------------
_BUILT = {}  # per worker: (S, cu, balancer) -> (block mask, order), and the compiled kernel


def reference(q, k, v, cu, rows=1024):
    """fp64 attention of the whole sequence under the causal document mask, [S, heads_q, D] (GQA by repeating K/V)."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, dim=1).transpose(0, 1) for t in (k, v))
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    pos, out = torch.arange(cu[-1]), []
    for a in range(0, cu[-1], rows):
        b = min(cu[-1], a + rows)
        mask = (doc[a:b, None] == doc[None, :]) & (pos[a:b, None] >= pos[None, :])
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1))
    return torch.cat(out)


def flex_forward_run(seq_len, cu, balancer, inputs, keep=False):
    """On each of the 2 ranks: torch's all-gather CP forward with ``balancer`` (its rearrangement, its block mask from
    `_create_cp_block_mask`, `flex_cp_allgather`, compiled `flex_attention`). ``inputs``: (seq_len) -> q, k, v
    [S, heads, D]. keep: also return (the rows' original positions, the output)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental._context_parallel import (
        _HeadTailLoadBalancer, _PerDocumentHeadTailLoadBalancer, _PTRRLoadBalancer, flex_cp_allgather)
    from torch.distributed.tensor.experimental._context_parallel._attention import _create_cp_block_mask
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import harness

    rank, cp = dist.get_rank(), dist.get_world_size()
    key = (seq_len, tuple(cu), balancer)
    if key not in _BUILT:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))

        def document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

        if balancer == "head-tail":
            lb = _HeadTailLoadBalancer(seq_len, cp, "cpu")
        elif balancer == "per-document head-tail":
            lb = _PerDocumentHeadTailLoadBalancer([torch.diff(torch.tensor(cu)).tolist()], cp, "cpu")
        else:  # PTRR reads the global block mask
            lb = _PTRRLoadBalancer(create_block_mask(document_causal, 1, 1, seq_len, seq_len, device="cpu"), cp)
        mask = _create_cp_block_mask(document_causal, 1, 1, seq_len, seq_len, mesh, lb)
        _BUILT[key] = (mask, lb._generate_indices()[0], c10d._get_process_group_name(dist.group.WORLD))
        _BUILT.setdefault("kernel", torch.compile(flex_attention, dynamic=False))
    mask, order, pg_name = _BUILT[key]
    kernel = _BUILT["kernel"]
    mine = order.chunk(cp)[rank]
    q, k, v = (t[mine].transpose(0, 1).unsqueeze(0).contiguous() for t in inputs(seq_len)[:3])  # [1, H, S/cp, D]

    def step():
        with torch.no_grad():
            full_k, full_v = flex_cp_allgather(k, v, 2, pg_name)
            return kernel(q, full_k, full_v, block_mask=mask, enable_gqa=True)

    timing, out = harness.barrier_timed(step)
    result = {"wall": timing["own"], "busy": timing["busy"]}
    if keep:
        result["rows"], result["out"] = mine, out[0].transpose(0, 1)
    return result


def l3plugin_forward_run(seq_len, cu, layout, inputs, kernel, keep=False):
    """The same forward with l3plugin's all-gather attention (overlapped, ``layout``), no grad."""
    import torch.distributed as dist

    from l3plugin.cp.attention import all_gather_attention
    from l3plugin.cp.sharding import shard_indices

    import harness

    rows = shard_indices(seq_len, dist.get_world_size(), dist.get_rank(), layout, cu)
    q, k, v = (t[rows] for t in inputs(seq_len)[:3])

    def step():
        with torch.no_grad():
            return all_gather_attention(q, k, v, torch.tensor(cu), group=dist.group.WORLD, causal=True, kernel=kernel,
                                        layout=layout, cp_kv="keep")

    timing, out = harness.barrier_timed(step)
    result = {"wall": timing["own"], "busy": timing["busy"]}
    if keep:
        result["rows"], result["out"] = torch.as_tensor(rows), out
    return result


def timed_table(pool, seqs, rounds, inputs, document_lengths, kernel):
    """Forward only, 2 gloo ranks, interleaved rounds (harness.interleaved_rounds, one warm-up round after the
    builds): l3plugin (2cp, balanced) and torch's FlexAttention CP with each balancer on the same documents (a draw
    per S rounded to multiples of 4); outputs against fp64. Prints the table; returns its rows."""
    import harness
    from l3plugin.cp.layout import imbalance, make_layout, rank_work

    print(f"== torch's all-gather CP (FlexAttention, compiled) beside l3plugin's: forward only (no CPU FlexAttention "
          f"backward in torch 2.13), fp32, 2 gloo ranks, median of {rounds} interleaved rounds ==", flush=True)
    rows = []
    for s in seqs:
        cu = cp_documents(document_lengths(s, torch.Generator().manual_seed(s)), 2)
        runs = {"l3plugin 2cp": (l3plugin_forward_run, (s, cu, "2cp", inputs, kernel)),
                "l3plugin balanced": (l3plugin_forward_run, (s, cu, "balanced", inputs, kernel)),
                **{f"torch {b}": (flex_forward_run, (s, cu, b, inputs)) for b in BALANCERS}}
        q, k, v = inputs(s)[:3]
        ref = reference(q, k, v, cu)
        errors, work, built = {}, {}, {}
        for name, (fn, args) in runs.items():  # builds masks and kernels (not timed), and the exactness check
            began = time.perf_counter()
            out = torch.zeros(s, *ref.shape[1:], dtype=torch.float64)
            for rank in pool.run(fn, *args, keep=True, timeout=3600):
                out[rank["rows"]] = rank["out"].double()
            built[name] = time.perf_counter() - began
            errors[name] = float((out - ref).abs().max())
            if name.startswith("l3plugin"):
                work[name] = imbalance(rank_work(make_layout(name.split()[1], s, 2, cu), cu))
            else:
                work[name] = imbalance(torch_rank_work(name.split(" ", 1)[1], cu, 2))
        times = harness.interleaved_rounds(list(runs), lambda n: pool.run(runs[n][0], *runs[n][1], timeout=3600),
                                           rounds, warmup=1)
        walls = {n: [max(rank["wall"] for rank in ranks) for ranks in times[n]] for n in runs}
        base = "l3plugin balanced"
        row = {"seq": s, "documents": len(cu) - 1, "contenders": {}}
        print(f"S={s} ({len(cu) - 1} documents; load average {os.getloadavg()[0]:.1f})")
        print(f"  {'contender':<30} {'wall s':>7} {'/ l3plugin balanced':>19} {'work max/min':>12} "
              f"{'max abs error vs fp64':>21} {'first call s':>12}")
        for n in runs:
            ratio = harness.ratio_stats(walls[n], walls[base])["median"]
            row["contenders"][n] = {"wall_s": statistics.median(walls[n]), "over_l3plugin_balanced": ratio,
                                    "work_max_over_min": work[n], "max_abs_error": errors[n], "first_call_s": built[n]}
            print(f"  {n:<30} {statistics.median(walls[n]):>7.3f} {ratio:>19.3f} {work[n]:>12.3f} {errors[n]:>21.1e} "
                  f"{built[n]:>12.1f}", flush=True)
        rows.append(row)
    print("first call: the exactness run, with torch's block mask and compiled kernel built in it (not timed above)\n")
    return rows
