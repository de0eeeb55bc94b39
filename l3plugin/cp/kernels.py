"""Local attention kernels for one chunk of queries against the gathered K/V prefix.

Every kernel has the same signature:
    kernel(q, k, v, meta: ChunkDocuments, *, causal, softmax_scale) -> out
    q: [end - start, heads_q, dim] (the chunk's queries), k/v: [meta.kv_len, heads_kv, dim]
and is differentiable through autograd. heads_kv must divide heads_q (GQA).

- ``reference``: SDPA with the document (+ causal) mask, in blocks of queries that are recomputed in
  the backward (checkpointed), so memory stays O(block * kv_len) instead of O(chunk * kv_len). Runs
  anywhere torch runs; the default on CPU and the ground truth in tests.
- ``varlen-reference``: loops over the varlen metadata exactly as a GPU varlen kernel reads it (per
  document, bottom-right causal alignment). Slow; it exists to prove the metadata on CPU.
- ``cpu-flash``: torch's CPU flash-attention ops (``aten::_scaled_dot_product_flash_attention_for_cpu``
  and its backward) with an additive document mask, per block of queries. Saves only the output and the
  log-sum-exp, so it needs no recompute: the CPU default.
- ``flash``: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16), when importable.
- ``te``: Transformer Engine's fused attention (``DotProductAttention`` with qkv_format "thd" and a
  bottom-right-aligned padding-causal mask), when importable.
The two GPU kernels consume exactly the metadata ``varlen-reference`` proves on CPU, but they are NOT
verified on this project's CPU-only CI (their tests skip there).
``select_kernel("auto", q)`` picks flash (else te) for CUDA fp16/bf16 tensors when installed, cpu-flash
for CPU tensors when torch has those ops, else the reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from l3plugin.cp.sharding import ChunkDocuments

DEFAULT_BLOCK = 512


def _sdpa(q, k, v, mask, scale):
    """[s, h, d] layout in and out; boolean mask [sq, sk] (True = attend); GQA by head groups."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=k.size(1) != q.size(1))
    return out.transpose(0, 1)


def _document_ids(meta: ChunkDocuments, device) -> torch.Tensor:
    cu = meta.cu_seqlens_kv.to(torch.int64)
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1]).to(device)


def _block_mask(doc_k, first, rows, causal):
    """Boolean [rows, kv_len] mask of queries first..first+rows-1 (True = attend)."""
    pos_q = torch.arange(first, first + rows, device=doc_k.device)
    mask = doc_k[pos_q][:, None] == doc_k[None, :]
    if causal:
        mask &= torch.arange(doc_k.numel(), device=doc_k.device)[None, :] <= pos_q[:, None]
    return mask


def reference_kernel(q, k, v, meta: ChunkDocuments, *, causal=True, softmax_scale=None, block_size=None):
    block_size = block_size or DEFAULT_BLOCK
    doc_k = _document_ids(meta, q.device)

    def block(q_blk, k_, v_, first):
        return _sdpa(q_blk, k_, v_, _block_mask(doc_k, first, q_blk.size(0), causal), softmax_scale)

    outs = []
    for first in range(0, q.size(0), block_size):
        q_blk = q[first:first + block_size]
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            outs.append(checkpoint(block, q_blk, k, v, meta.start + first, use_reentrant=False))
        else:
            outs.append(block(q_blk, k, v, meta.start + first))
    return torch.cat(outs)


class _CPUFlashBlock(torch.autograd.Function):
    """One block of queries through torch's CPU flash-attention forward and backward ops ([1, h, s, d])."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=ctx.scale)
        return dq, dk, dv, None, None


def cpu_flash_kernel(q, k, v, meta: ChunkDocuments, *, causal=True, softmax_scale=None, block_size=None):
    block_size = block_size or DEFAULT_BLOCK
    doc_k = _document_ids(meta, q.device)
    rep = q.size(1) // k.size(1)
    # [s, h, d] -> [1, h, s, d]; the CPU op wants as many K/V heads as query heads.
    k4, v4 = (t.repeat_interleave(rep, dim=1).transpose(0, 1)[None] for t in (k, v))
    outs = []
    for first in range(0, q.size(0), block_size):
        q_blk = q[first:first + block_size]
        allowed = _block_mask(doc_k, meta.start + first, q_blk.size(0), causal)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        out = _CPUFlashBlock.apply(q_blk.transpose(0, 1)[None].contiguous(), k4, v4, mask, softmax_scale)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


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
def _te_attention_class():
    """TE's DotProductAttention, or None. Checked here, not through l3plugin.te (an adapter: feature rooms
    never import adapters); a half-installed TE raises RuntimeError, not ImportError, at import."""
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
           "cpu-flash": cpu_flash_kernel, "flash": flash_kernel, "te": te_kernel}


def select_kernel(name: str | None, q: torch.Tensor):
    """The kernel called ``name``; "auto"/None picks flash where it can run, else the reference."""
    if name in (None, "auto"):
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            if _flash_varlen() is not None:
                return flash_kernel
            if _te_attention_class() is not None:
                return te_kernel
        if q.device.type == "cpu" and _has_cpu_flash():
            return cpu_flash_kernel
        return reference_kernel
    if name not in KERNELS:
        raise ValueError(f"kernel={name!r} is unknown: choose 'auto' or one of {sorted(KERNELS)}")
    return KERNELS[name]
