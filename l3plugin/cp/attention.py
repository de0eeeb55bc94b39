"""All-gather context-parallel attention with document masking (paper §4).

Each CP rank holds some ranges of the packed sequence, all ranks the same number of tokens: its CP
layout (layout.py: the paper's two chunks by default, or document-balanced pieces). Forward: all-gather K and V over
the CP group (one collective for both; exposed by design: K/V are small under GQA and the gather is
O(S) while attention is O(S^2)), then attend this rank's queries to the gathered K/V with the document
and causal mask. Backward: dq locally; dK and dV of the full sequence are reduce-scattered so every rank
gets the summed gradient of the tokens it holds.

What stays in memory for the backward (``cp_kv``):
- ``"regather"`` (default): only this rank's K/V. The gathered buffer's storage is freed when the forward
  ends and refilled by a second K/V all-gather when the backward reaches the attention, as Transformer
  Engine's all-gather CP does; the paper's claim that CP divides activation memory holds only then. Cost:
  one more all-gather per layer, in the backward; with ``prefetch`` (the default) it is started during the
  backward of the call after it, and the latest call keeps its buffer until the next call's forward
  (cp/regather_ahead.py), so it travels under compute.
- ``"keep"``: the gathered K/V of the whole sequence (2 x S x heads_kv x head_dim per layer) stay until
  the backward; no second collective.
Both give bit-identical results: the kernels save views of the gathered buffer, and the same values are
put back at the same places before any of them runs its backward (``GatheredKV``).

Both collectives come from l3plugin/collective/comm.py, shared with ZeRO: started asynchronously and waited with a
bound (``wait_timeout``, see l3plugin/collective/waits.py), so a CP peer that never joins gives a ``CommTimeout``
naming this rank, the CP group and the operation; on gloo the dK/dV reduce-scatter is a point-to-point
exchange (gloo's own reduce-scatter cannot be waited with a bound).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from l3plugin.collective.waits import resolve_timeout
from l3plugin.cp.kernels import PhasedFlash, cpu_flash_kernel, select_kernel
from l3plugin.cp.kv_gather import GatherKV, GatheredKV, check_cp_kv
from l3plugin.cp.layout import check_bool, check_cu_seqlens, make_layout, per_document_layout
from l3plugin.cp.overlap import PARTS, overlapped_attention, part_plan
from l3plugin.cp.sharding import attention_boundaries, check_thd_boundaries, document_metadata, padding_positions


def _check_inputs(q, k, v):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [s_local, heads, head_dim] (THD, one packed sequence); got "
                         f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.size(0) != k.size(0) or q.size(2) != k.size(2):
        raise ValueError(f"mismatched shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
                         f"k and v must be equal and share s_local and head_dim with q")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}: "
                         f"cast them to one (e.g. k.to(q.dtype))")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got q {q.device}, k {k.device}, v {v.device}")
    if q.size(1) % k.size(1):
        raise ValueError(f"heads_kv={k.size(1)} does not divide heads_q={q.size(1)} (GQA needs "
                         f"heads_q to be a multiple of heads_kv)")


def all_gather_attention(q, k, v, cu_seqlens, *, group=None, causal=True, softmax_scale=None,
                         kernel="auto", wait_timeout=None, layout="2cp", overlap=True, cp_kv="regather",
                         prefetch=True, local_first=False):
    """Attention of this rank's queries over the whole packed sequence, with document masking.

    q: [s_local, heads_q, head_dim]; k, v: [s_local, heads_kv, head_dim], this rank's tokens in the
    local order of ``layout`` ("2cp": chunk i, then chunk 2*cp-1-i; "balanced"; or a CPLayout, see
    cp/layout.py; every rank must pass the same, and shard its batch with it); cu_seqlens: document
    boundaries over the FULL sequence ([0, ..., S]; [0, S] is one document; "balanced" derives the
    layout from it); group: the CP process group (None or size 1: no CP).
    wait_timeout: seconds the K/V all-gather and the dK/dV reduce-scatter may take (None:
    ``l3plugin.collective.waits.resolve_timeout``, i.e. $L3PLUGIN_WAIT_TIMEOUT or 600).
    overlap: gather K/V and reduce-scatter dK/dV in parts, each waited only when a local range needs it
    (cp/overlap.py; bit-identical to False at cp=2); False: one collective each way, waited at once.
    cp_kv: "regather" (keep only the local K/V for the backward, all-gather them again there) or "keep"
    (save the gathered K/V); see the module docstring. Results are bit-identical.
    prefetch: with cp_kv="regather", the backward's all-gather of this call starts during the backward of the
    call after it (and the latest call keeps its gathered K/V until the next call's forward), on this
    thread's chain of calls over ``group`` (cp/regather_ahead.py; at most one more gathered buffer held).
    False: each call gathers again when its own backward starts. Results are bit-identical.
    local_first: attend each range's keys held by this rank first, the other ranks' as they arrive, merged by
    log-sum-exp (kernel "cpu-flash" only; kernels.PhasedFlash). Another cut of the work: equal to False within
    rounding, not bit for bit; overlap=True and False give bit-identical results.
    Returns [s_local, heads_q, head_dim], differentiable in q, k and v.
    """
    _check_inputs(q, k, v)
    check_bool("causal", causal)
    check_bool("overlap", overlap)
    check_bool("prefetch", prefetch)
    check_bool("local_first", local_first)
    check_cp_kv(cp_kv)
    timeout = resolve_timeout(wait_timeout)
    cp = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    seq_len = q.size(0) * cp
    if layout == "2cp" and q.size(0) % 2:
        raise ValueError(f"s_local={q.size(0)} must be even: with layout='2cp' each rank holds two equal "
                         f"chunks (S must be divisible by 2*cp = {2 * cp})")
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    plan = make_layout(layout, seq_len, cp, cu)  # the same on every rank: built from the global cu_seqlens
    fn = select_kernel(kernel, q)
    metas = document_metadata(cu, seq_len, cp, rank, causal=causal, layout=plan)
    phased = None
    if local_first and cp > 1:
        if fn is not cpu_flash_kernel:
            raise ValueError(f"local_first=True needs kernel='cpu-flash' (it merges partial results by their "
                             f"log-sum-exp), got kernel={kernel!r} ({fn.__name__}): pass kernel='cpu-flash' or "
                             f"local_first=False")
        arrival = part_plan(plan, rank, causal, PARTS).arrival

        def phased(i, q_rows):
            return PhasedFlash(q_rows, metas[i], causal=causal, softmax_scale=softmax_scale, arrival=arrival)
    if cp > 1 and overlap:
        def attend(i, q_rows, k_prefix, v_prefix):
            return fn(q_rows, k_prefix, v_prefix, metas[i], causal=causal, softmax_scale=softmax_scale)

        return overlapped_attention(q, k, v, attend, part_plan(plan, rank, causal, PARTS), group, timeout,
                                    regather=cp_kv == "regather", prefetch=prefetch, phased=phased)
    regather = cp > 1 and cp_kv == "regather" and torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
    if cp > 1:
        k_full, v_full = GatherKV.apply(k, v, group, timeout, plan.gathered_order(), regather)
    else:
        # Without CP every layout holds the whole sequence in order.
        k_full, v_full = k, v
    outs, first = [], 0
    for i, meta in enumerate(metas):
        rows = meta.end - meta.start
        q_rows, k_prefix, v_prefix = q[first:first + rows], k_full[:meta.kv_len], v_full[:meta.kv_len]
        if phased is None:
            outs.append(fn(q_rows, k_prefix, v_prefix, meta, causal=causal, softmax_scale=softmax_scale))
        else:  # the same calls in the same order as the overlapped form, all keys here already
            outs.append(phased(i, q_rows).run_all(q_rows, k_prefix, v_prefix))
        first += rows
    out = torch.cat(outs)
    if regather:
        node = k_full.grad_fn  # GatherKV's ctx: the gathered buffer, now released (or chained)
        node.buffer, node.full = GatheredKV(node.full, plan.gathered_order(), group, timeout, k, v, prefetch), None
        # Runs when the gradient of ``out`` is known, before any kernel's backward reads the saved views.
        out.register_hook(lambda grad: node.buffer.begin_backward())
    return out


def thd_attention(q, k, v, cu_seqlens, cu_seqlens_padded=None, *, group=None, causal=True, **options):
    """All-gather CP attention of one THD packed sequence laid out as Megatron-Core / Transformer Engine shard
    it (layout.per_document_layout; the offsets' convention: sharding.py, "THD packing"). That split is one
    more CP layout, so the all-gather attention runs on it unchanged. Padding never reaches a real token: every
    document's padding tail is its own document of the attention (``attention_boundaries``), and padding
    tokens' outputs are zero, so their gradients are zero too.

    q: [t, heads_q, head_dim]; k, v: [t, heads_kv, head_dim]: this rank's t tokens, pieces r and 2cp-1-r of
    every document (per_document_layout); cu_seqlens / cu_seqlens_padded: over the whole packed sequence, the
    same on every rank (checked here, before any communication, so bad ones raise on every rank alike).
    ``options`` go to ``all_gather_attention`` (softmax_scale, kernel, cp_kv, overlap, ...; not ``layout``).
    Returns [t, heads_q, head_dim]; padding tokens get zeros (and so no gradient).
    """
    check_bool("causal", causal)
    if "layout" in options:
        raise ValueError("thd_attention takes no layout: THD input is laid out per document (per_document_layout)")
    cp = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    cu, padded = check_thd_boundaries(cu_seqlens, cu_seqlens_padded, q.size(0), cp)
    layout = per_document_layout(padded, cp)
    out = all_gather_attention(q, k, v, attention_boundaries(cu, padded), group=group, causal=causal,
                               layout=layout, **options)
    pad = padding_positions(cu, padded)
    if bool(pad.any()):
        real = ~pad[layout.indices(rank)]
        out = out * real.to(out.device, out.dtype)[:, None, None]
    return out
