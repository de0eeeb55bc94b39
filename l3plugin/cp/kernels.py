"""Local attention kernels for one chunk of queries against the gathered K/V prefix.

Every kernel has the same signature:
    kernel(q, k, v, meta: ChunkDocuments, *, causal, softmax_scale) -> out
    q: [end - start, heads_q, dim] (the chunk's queries), k/v: [meta.kv_len, heads_kv, dim]
and is differentiable through autograd. heads_kv must divide heads_q (GQA).

The CPU kernels (``reference``, ``cpu-flash``) do work proportional to the unmasked pairs: each block
of queries attends only the keys of the documents it touches, up to its last query when causal (see
``query_blocks``); fully masked keys are never computed.
- ``reference``: SDPA with the document (+ causal) mask per piece, recomputed in the backward
  (checkpointed), so memory stays O(block * kv_len) instead of O(chunk * kv_len). Runs anywhere torch
  runs; the ground truth in tests.
- ``varlen-reference``: loops over the varlen metadata exactly as a GPU varlen kernel reads it (per
  document, bottom-right causal alignment). Slow; it exists to prove the metadata on CPU.
- ``cpu-flash``: torch's CPU flash-attention ops (``aten::_scaled_dot_product_flash_attention_for_cpu``
  and its backward) per piece, with an additive mask only where a piece has masked pairs (a causal
  piece of one document: only its diagonal), GQA query heads stacked on their K/V head. Saves only
  the output and the log-sum-exp (masks are rebuilt in the backward), so it needs no recompute: the
  CPU default.
- ``flash``: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16), when importable.
- ``torch-varlen``: torch's own flash varlen attention, ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10,
  CUDA sm80+, fp16/bf16): the fast kernel of a CUDA machine with nothing but torch installed. Its keywords changed
  between releases (2.10: ``is_causal``; 2.11: ``window_size``, ``scale``; 2.13: also ``enable_gqa``): the kernel
  reads the installed signature and passes what it takes (on 2.10 the GQA K/V heads repeated and the scale folded
  into q).
- ``te``: Transformer Engine's fused attention (``DotProductAttention`` with qkv_format "thd" and a
  bottom-right-aligned padding-causal mask), when importable.
The GPU kernels consume exactly the metadata ``varlen-reference`` proves on CPU; CPU CI checks what they are
handed, and bench/gpu_check.py checks them against an fp32 reference on a GPU (docs/verified.md, "On a GPU").
``select_kernel("auto", q)`` (``auto_kernel``) picks, for CUDA fp16/bf16 tensors: flash-attn if installed, else
torch-varlen, else te, else the reference; cpu-flash for CPU tensors when torch has those ops, else the reference.
Adapters add kernels with ``register_kernel``.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from l3plugin.cp.sharding import ChunkDocuments

DEFAULT_BLOCK = 512
# A kernel call costs about as much as this many query-key pairs (torch's CPU flash ops, 8 heads of 64:
# ~40 us per call, ~100 ns per pair forward+backward, more per pair in calls of few rows), so adjacent
# runs of a query block share one call (and one mask) when that computes at most this many extra pairs.
CALL_PAIRS = 4096
# Causal pieces may be cut every RUN_ROWS rows: a piece of R rows computes ~R*R/2 masked pairs on its
# diagonal, so long documents are better served by several shorter pieces than one block-high one.
RUN_ROWS = 32


class QueryBlock(NamedTuple):
    """Chunk rows [q_lo, q_hi) attend keys [k_lo, k_hi) of the gathered K/V; ``docs`` documents meet."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    docs: int

    @property
    def pairs(self) -> int:
        return (self.q_hi - self.q_lo) * (self.k_hi - self.k_lo)


def query_blocks(meta: ChunkDocuments, rows: int, *, causal: bool, block_size: int | None = None,
                 call_pairs: int | None = None, run_rows: int | None = None) -> list[QueryBlock]:
    """The pieces the CPU kernels compute for a chunk of ``rows`` queries: work-proportional.

    Queries go in blocks of ``block_size`` (the memory bound: a block holds at most block_size x kv_len
    scores). A block is cut into runs at document borders and every ``run_rows`` rows; a run needs only
    the keys of its document, up to its last query (causal) or to the document's end (non-causal).
    Adjacent runs share one piece (one call, one mask) when that adds at most ``call_pairs`` masked
    pairs. So the masked work computed is the causal diagonal of each piece plus those merges.
    """
    block_size = block_size or DEFAULT_BLOCK
    call_pairs = CALL_PAIRS if call_pairs is None else call_pairs
    run_rows = run_rows or RUN_ROWS
    if rows != meta.end - meta.start or not 0 <= meta.start <= meta.end <= meta.kv_len:
        raise ValueError(f"q has {rows} rows but meta describes queries [{meta.start}, {meta.end}) of "
                         f"kv_len={meta.kv_len}: pass the chunk's queries with its own ChunkDocuments")
    cu = meta.cu_seqlens_kv.tolist()
    blocks = []
    for first in range(0, rows, block_size):
        last = min(first + block_size, rows)
        doc = bisect.bisect_right(cu, meta.start + first) - 1  # the document of the block's first query
        piece, piece_doc, lo = None, doc, first
        while lo < last:
            doc_end = cu[doc + 1] - meta.start
            hi = min(last, doc_end, lo + run_rows)
            run = QueryBlock(lo, hi, cu[doc], meta.start + hi if causal else cu[doc + 1], 1)
            if piece is not None:
                merged = QueryBlock(piece.q_lo, hi, piece.k_lo, run.k_hi, piece.docs + (doc != piece_doc))
                if merged.pairs <= piece.pairs + run.pairs + call_pairs:
                    run = merged
                else:
                    blocks.append(piece)
            piece, piece_doc, lo = run, doc, hi
            doc += hi == doc_end
        blocks.append(piece)
    return blocks


def _sdpa(q, k, v, mask, scale):
    """[s, h, d] layout in and out; boolean mask [sq, sk] (True = attend); GQA by head groups."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=k.size(1) != q.size(1))
    return out.transpose(0, 1)


def _document_ids(meta: ChunkDocuments, device) -> torch.Tensor:
    cu = meta.cu_seqlens_kv.to(torch.int64)
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1]).to(device)


def _block_mask(doc_k, start, block: QueryBlock, causal):
    """Boolean [rows, keys] mask of one piece (True = attend), or None when nothing in it is masked."""
    if block.docs == 1 and (not causal or block.k_hi <= start + block.q_lo + 1):
        return None
    pos_q = torch.arange(start + block.q_lo, start + block.q_hi, device=doc_k.device)
    pos_k = torch.arange(block.k_lo, block.k_hi, device=doc_k.device)
    mask = doc_k[pos_q][:, None] == doc_k[pos_k][None, :]
    if causal:
        mask &= pos_k[None, :] <= pos_q[:, None]
    return mask


def _plan(q, k, v, meta, causal, block_size):
    if k.size(0) < meta.kv_len:
        raise ValueError(f"k has {k.size(0)} rows but meta.kv_len={meta.kv_len}: pass the gathered K/V "
                         f"[0, kv_len) of this chunk")
    return query_blocks(meta, q.size(0), causal=causal, block_size=block_size), _document_ids(meta, q.device)


def _empty_output(q, v):
    # A chunk without queries (possible in layouts with uneven pieces): nothing to attend.
    return q.new_zeros((0, q.size(1), v.size(2)))


def reference_kernel(q, k, v, meta: ChunkDocuments, *, causal=True, softmax_scale=None, block_size=None):
    blocks, doc_k = _plan(q, k, v, meta, causal, block_size)
    if not blocks:
        return _empty_output(q, v)

    def piece(q_blk, k_, v_, block):
        return _sdpa(q_blk, k_, v_, _block_mask(doc_k, meta.start, block, causal), softmax_scale)

    outs = []
    for b in blocks:
        args = (q[b.q_lo:b.q_hi], k[b.k_lo:b.k_hi], v[b.k_lo:b.k_hi], b)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            outs.append(checkpoint(piece, *args, use_reentrant=False))  # recomputed in the backward
        else:
            outs.append(piece(*args))
    return torch.cat(outs)


def _tiles(blocks, start, causal):
    """The calls of the cpu-flash kernel: a causal one-document piece is split into the keys before its
    first query (no mask) and the rest (masked), so only its diagonal pays for a mask."""
    for b in blocks:
        first = start + b.q_lo
        if causal and b.docs == 1 and b.k_lo < first:
            yield b._replace(k_hi=first)
            yield b._replace(k_lo=first)
        else:
            yield b


def lse_merge(out_a, lse_a, out_b, lse_b):
    """Two attention results over disjoint keys of the same queries, merged by their log-sum-exp (as ring
    attention does): (output, log-sum-exp) over the union of the keys."""
    merged = torch.logaddexp(lse_a, lse_b)
    out = (out_a * (lse_a - merged).exp()[..., None].to(out_b.dtype)
           + out_b * (lse_b - merged).exp()[..., None].to(out_b.dtype))
    return out, merged


class _CPUFlash(torch.autograd.Function):
    """All pieces of a chunk through torch's CPU flash-attention forward and backward ops.

    GQA without copying K/V per query head: the queries of the ``rep`` heads that share a K/V head are
    stacked along the sequence ([1, heads_kv, rep * rows, d], the mask repeated), which also gives the
    ops taller calls (up to 35% faster per pair for pieces of 64 rows). Calls that share query rows are
    merged by log-sum-exp; the backward of each call then uses the merged output and log-sum-exp
    (which makes its gradients exact). Saves q, k, v, the output and the log-sum-exp (no scores);
    masks are rebuilt in the backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, tiles, doc_k, start, causal, scale):
        rep = q.size(1) // k.size(1)
        k4, v4 = (t.transpose(0, 1)[None].contiguous() for t in (k, v))  # [1, heads_kv, kv_len, d]
        out = q.new_zeros(q.shape[:2] + (v.size(2),))
        lse = None
        for rows, group in _by_rows(tiles):
            q_rows, o_rows, l_rows = pack_heads(q[rows], rep), None, None
            for t in group:
                o, l = _flash_forward()(q_rows, k4[:, :, t.k_lo:t.k_hi], v4[:, :, t.k_lo:t.k_hi],
                                        attn_mask=_tile_mask(doc_k, start, t, causal, q.dtype, rep), scale=scale)
                o_rows, l_rows = (o, l) if o_rows is None else lse_merge(o_rows, l_rows, o, l)
            if lse is None:
                lse = torch.full(q.shape[:2], float("-inf"), dtype=l_rows.dtype, device=q.device)
            out[rows], lse[rows] = unpack_heads(o_rows, rep), unpack_heads(l_rows, rep)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tiles, ctx.doc_k, ctx.start, ctx.causal, ctx.scale = tiles, doc_k, start, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return (*_flash_backward_pass(ctx, grad_out), None, None, None, None, None)


def _flash_backward_pass(ctx, grad_out):
    """dq, dk, dv of the tiles in ``ctx.tiles``, each call with the merged output and log-sum-exp saved."""
    q, k, v, out, lse = ctx.saved_tensors
    rep = q.size(1) // k.size(1)
    k4, v4 = (t.transpose(0, 1)[None].contiguous() for t in (k, v))
    dq, dk4, dv4 = torch.zeros_like(q), torch.zeros_like(k4), torch.zeros_like(v4)
    for rows, group in _by_rows(ctx.tiles):
        packed = [pack_heads(t[rows], rep) for t in (grad_out, q, out, lse)]
        for t in group:
            keys = slice(t.k_lo, t.k_hi)
            gq, gk, gv = _flash_backward()(
                packed[0], packed[1], k4[:, :, keys], v4[:, :, keys], packed[2], packed[3], 0.0, False,
                attn_mask=_tile_mask(ctx.doc_k, ctx.start, t, ctx.causal, q.dtype, rep), scale=ctx.scale)
            dq[rows] += unpack_heads(gq, rep)
            dk4[:, :, keys] += gk
            dv4[:, :, keys] += gv
    return dq, dk4[0].transpose(0, 1), dv4[0].transpose(0, 1)


def _by_rows(tiles):
    """(rows slice, its tiles): the calls of one piece share its rows and come one after the other."""
    for (lo, hi), group in itertools.groupby(tiles, key=lambda t: (t.q_lo, t.q_hi)):
        yield slice(lo, hi), list(group)


def pack_heads(x, rep):
    """[rows, heads_q, ...] -> [1, heads_kv, rep * rows, ...]: query head h = g * rep + j uses K/V head g
    (torch's GQA convention) and lands in group g at rows j * rows .. (j + 1) * rows."""
    rows, heads = x.shape[:2]
    x = x.reshape(rows, heads // rep, rep, *x.shape[2:]).movedim(0, 2)  # [heads_kv, rep, rows, ...]
    return x.reshape(1, heads // rep, rep * rows, *x.shape[3:])


def unpack_heads(y, rep):
    """The inverse of pack_heads."""
    heads_kv, rows = y.size(1), y.size(2) // rep
    y = y.reshape(heads_kv, rep, rows, *y.shape[3:]).movedim(2, 0)  # [rows, heads_kv, rep, ...]
    return y.reshape(rows, heads_kv * rep, *y.shape[3:])


def _tile_mask(doc_k, start, tile, causal, dtype, rep):
    """The additive mask of one call (rows repeated for the stacked query heads), or None."""
    mask = _block_mask(doc_k, start, tile, causal)
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf")).repeat(rep, 1)


def _flash_forward():  # looked up per call: tests wrap these to count the pairs computed
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _flash_backward():
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def cpu_flash_kernel(q, k, v, meta: ChunkDocuments, *, causal=True, softmax_scale=None, block_size=None):
    blocks, doc_k = _plan(q, k, v, meta, causal, block_size)
    if not blocks:
        return _empty_output(q, v)
    return _CPUFlash.apply(q, k, v, list(_tiles(blocks, meta.start, causal)), doc_k, meta.start, causal,
                           softmax_scale)


def phased_tiles(meta: ChunkDocuments, rows: int, causal: bool, arrival, block_size=None):
    """The cpu-flash calls of one range cut where the part its keys arrive in changes (``arrival``: per key
    position, the all-gather part bringing it, -1 for this rank's own), each trimmed to the rows that attend at
    least one of its keys, as (part, tile) ordered by part (stable): what can run before each part arrives."""
    tiles = _tiles(query_blocks(meta, rows, causal=causal, block_size=block_size), meta.start, causal)
    cu, parts, out = meta.cu_seqlens_kv.tolist(), arrival[:meta.kv_len].tolist(), []
    for t in tiles:
        lo = t.k_lo
        while lo < t.k_hi:
            hi = lo + 1
            while hi < t.k_hi and parts[hi] == parts[lo]:
                hi += 1
            # A row attends a key of [lo, hi) iff its document meets it (and, causal, it comes at or after lo).
            first_doc, last_doc = bisect.bisect_right(cu, lo) - 1, bisect.bisect_right(cu, hi - 1) - 1
            q_lo = max(t.q_lo, cu[first_doc] - meta.start, lo - meta.start if causal else t.q_lo)
            q_hi = min(t.q_hi, cu[last_doc + 1] - meta.start)
            if q_lo < q_hi:
                out.append((parts[lo], t._replace(q_lo=q_lo, q_hi=q_hi, k_lo=lo, k_hi=hi)))
            lo = hi
    return sorted(out, key=lambda pt: pt[0])


class PhasedFlash:
    """cpu-flash attention of one range computed part by part as its keys arrive, merged by log-sum-exp.

    ``run(part, k, v)`` computes the calls whose keys arrive in ``part`` (-1: this rank's own; k, v hold at
    least those keys at their positions), without a graph; ``finish(q, k, v)`` gives the output, differentiable
    (its backward is the cpu-flash kernel's, each call with the merged output and log-sum-exp). The same calls
    in the same order whether the parts arrived one by one or all before: bit-identical either way; another
    cut of the work than ``cpu_flash_kernel``'s, so equal to it within rounding, not bit for bit."""

    def __init__(self, q, meta: ChunkDocuments, *, causal, softmax_scale, arrival, block_size=None):
        self.q, self.meta, self.causal, self.scale = q.detach(), meta, causal, softmax_scale
        self.tiles = phased_tiles(meta, q.size(0), causal, arrival, block_size)
        self.doc_k = _document_ids(meta, q.device)
        self.out, self.lse = None, None

    def run(self, part, k, v):
        calls = [t for p, t in self.tiles if p == part]
        if not calls:
            return
        q, rep = self.q, self.q.size(1) // k.size(1)
        if self.out is None:
            self.out = q.new_zeros(q.shape[:2] + (v.size(2),))
        with torch.no_grad():
            k4, v4 = (t[:self.meta.kv_len].detach().transpose(0, 1)[None].contiguous() for t in (k, v))
            for t in calls:
                rows = slice(t.q_lo, t.q_hi)
                o, l = _flash_forward()(pack_heads(q[rows], rep), k4[:, :, t.k_lo:t.k_hi], v4[:, :, t.k_lo:t.k_hi],
                                        attn_mask=_tile_mask(self.doc_k, self.meta.start, t, self.causal, q.dtype,
                                                             rep), scale=self.scale)
                o, l = unpack_heads(o, rep), unpack_heads(l, rep)
                if self.lse is None:
                    self.lse = torch.full(q.shape[:2], float("-inf"), dtype=l.dtype, device=q.device)
                self.out[rows], self.lse[rows] = lse_merge(self.out[rows], self.lse[rows], o, l)

    def run_all(self, q, k, v):
        """Every part at once, with all keys already in ``k``, ``v``: the same calls in the same order as part
        by part (bit-identical to it); returns ``finish``'s output."""
        for part in sorted({p for p, _ in self.tiles}):
            self.run(part, k, v)
        return self.finish(q, k, v)

    def finish(self, q, k, v):
        if not self.tiles:
            return _empty_output(q, v)
        return _CPUFlashMerged.apply(q, k[:self.meta.kv_len], v[:self.meta.kv_len], self.out, self.lse,
                                     [t for _, t in self.tiles], self.doc_k, self.meta.start, self.causal, self.scale)


class _CPUFlashMerged(torch.autograd.Function):
    """The output and log-sum-exp PhasedFlash computed, attached to q, k, v; backward as _CPUFlash's."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, tiles, doc_k, start, causal, scale):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tiles, ctx.doc_k, ctx.start, ctx.causal, ctx.scale = tiles, doc_k, start, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return (*_flash_backward_pass(ctx, grad_out), None, None, None, None, None, None, None)


def _has_cpu_flash() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


def varlen_reference_kernel(q, k, v, meta: ChunkDocuments, *, causal=True, softmax_scale=None):
    cu_q, cu_k = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_kv.tolist()
    outs = []
    for j in range(len(cu_q) - 1):
        len_q, len_k = cu_q[j + 1] - cu_q[j], cu_k[j + 1] - cu_k[j]
        if len_q == 0:
            continue  # a document outside this chunk: the "leading zero" Q length
        mask = None
        if causal:  # bottom-right alignment: the last query sees the last key
            mask = (torch.arange(len_k, device=q.device)[None, :]
                    <= torch.arange(len_q, device=q.device)[:, None] + (len_k - len_q))
        outs.append(_sdpa(q[cu_q[j]:cu_q[j + 1]], k[cu_k[j]:cu_k[j + 1]], v[cu_k[j]:cu_k[j + 1]],
                          mask, softmax_scale))
    return torch.cat(outs)


@functools.lru_cache(maxsize=1)
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # ImportError, or a broken CUDA build raising something else
        return None
    return flash_attn_varlen_func


def flash_kernel(q, k, v, meta: ChunkDocuments, *, causal=True, softmax_scale=None):
    fn = _flash_varlen()
    if fn is None:
        raise RuntimeError("kernel 'flash' needs flash-attn (pip install flash-attn) on a CUDA machine")
    dev = q.device
    return fn(q, k, v, meta.cu_seqlens_q.to(dev), meta.cu_seqlens_kv.to(dev), meta.max_seqlen_q,
              meta.max_seqlen_kv, softmax_scale=softmax_scale, causal=causal)


@functools.lru_cache(maxsize=1)
def _torch_varlen():
    """(torch's varlen_attn, the names of its parameters), or None on a torch without it (< 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def torch_varlen_kernel(q, k, v, meta: ChunkDocuments, *, causal=True, softmax_scale=None):
    found = _torch_varlen()
    if found is None:
        raise RuntimeError(f"kernel 'torch-varlen' needs torch >= 2.10 (torch.nn.attention.varlen), this is torch "
                           f"{torch.__version__}: choose kernel='auto'")
    fn, takes = found
    options = {}
    if "window_size" in takes:  # (-1, 0): causal, bottom-right aligned like flash-attn's
        options["window_size"] = (-1, 0) if causal else (-1, -1)
    elif causal:
        options["is_causal"] = True
    if softmax_scale is not None:
        if "scale" in takes:
            options["scale"] = softmax_scale
        else:  # the default scale is 1/sqrt(d): fold the ratio into q (autograd carries it to dq)
            q = q * (softmax_scale * q.size(-1) ** 0.5)
    if k.size(1) != q.size(1):
        if "enable_gqa" in takes:
            options["enable_gqa"] = True
        elif "window_size" not in takes:  # torch 2.10 (not run here): query head h reads K/V head h // rep
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # torch 2.11 (window_size, no enable_gqa): its flash op takes fewer K/V heads as they are (measured on an
        # H200: outputs equal to repeated heads, 9% faster at 128K)
    dev = q.device
    return fn(q.contiguous(), k.contiguous(), v.contiguous(), meta.cu_seqlens_q.to(dev, torch.int32),
              meta.cu_seqlens_kv.to(dev, torch.int32), meta.max_seqlen_q, meta.max_seqlen_kv, **options)


@functools.lru_cache(maxsize=1)
def _te_attention_class():
    """TE's DotProductAttention, or None. Checked here, not through l3plugin.megatron.te_backend (an adapter:
    feature rooms never import adapters); a half-installed TE raises RuntimeError, not ImportError, at import."""
    try:
        import transformer_engine.pytorch as te
    except Exception:  # noqa: BLE001 - any failure means: no usable TE
        return None
    return te.DotProductAttention


@functools.lru_cache(maxsize=16)
def _te_module(heads_q, heads_kv, head_dim, softmax_scale, causal):
    mask = "padding_causal_bottom_right" if causal else "padding"
    return _te_attention_class()(heads_q, head_dim, num_gqa_groups=heads_kv, qkv_format="thd",
                                 attn_mask_type=mask, softmax_scale=softmax_scale)


def te_kernel(q, k, v, meta: ChunkDocuments, *, causal=True, softmax_scale=None):
    if _te_attention_class() is None:
        raise RuntimeError("kernel 'te' needs Transformer Engine (transformer-engine[pytorch]) on a CUDA machine")
    dev = q.device
    module = _te_module(q.size(1), k.size(1), q.size(2), softmax_scale, causal)
    out = module(q, k, v, qkv_format="thd", cu_seqlens_q=meta.cu_seqlens_q.to(dev),
                 cu_seqlens_kv=meta.cu_seqlens_kv.to(dev), max_seqlen_q=meta.max_seqlen_q,
                 max_seqlen_kv=meta.max_seqlen_kv)
    return out.view(q.size(0), q.size(1), q.size(2))


KERNELS = {"reference": reference_kernel, "varlen-reference": varlen_reference_kernel,
           "cpu-flash": cpu_flash_kernel, "flash": flash_kernel, "torch-varlen": torch_varlen_kernel, "te": te_kernel}


def register_kernel(name: str, fn) -> None:
    """Make ``fn`` selectable as ``kernel=name`` (how adapters add kernels; cp/ never imports them).

    ``fn(q, k, v, meta: ChunkDocuments, *, causal, softmax_scale) -> out``, differentiable (see the module
    docstring). Names are never replaced: a second registration under one name is an error.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"name={name!r} is invalid: must be a non-empty string other than 'auto'")
    if not callable(fn):
        raise ValueError(f"fn={fn!r} is not callable: a kernel is fn(q, k, v, meta, *, causal, softmax_scale)")
    if name in KERNELS:
        raise ValueError(f"name={name!r} is already registered (to {KERNELS[name].__qualname__}): "
                         f"choose another name")
    KERNELS[name] = fn


def auto_kernel(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> str:
    """The name of the kernel "auto" picks for tensors of ``device_type`` and ``dtype`` here; ``capability``: the
    CUDA device's (major, minor) (torch's flash kernels need sm80+; None: taken as able)."""
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if _flash_varlen() is not None:
            return "flash"
        if _torch_varlen() is not None and (capability is None or capability >= (8, 0)):
            return "torch-varlen"
        if _te_attention_class() is not None:
            return "te"
    if device_type == "cpu" and _has_cpu_flash():
        return "cpu-flash"
    return "reference"


def select_kernel(name: str | None, q: torch.Tensor):
    """The kernel called ``name``; "auto"/None: ``auto_kernel`` for q's device and dtype."""
    if name in (None, "auto"):
        capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
        return KERNELS[auto_kernel(q.device.type, q.dtype, capability)]
    if name not in KERNELS:
        raise ValueError(f"kernel={name!r} is unknown: choose 'auto' or one of {sorted(KERNELS)}")
    return KERNELS[name]
