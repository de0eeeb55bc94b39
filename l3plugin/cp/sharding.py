"""Which tokens each context-parallel rank holds, and the varlen metadata of its documents (paper §4).

The packed sequence of length S is cut into 2*cp equal chunks; CP rank i holds chunks i and 2*cp-1-i,
which balances causal attention work (an early chunk is cheap, its mirror is expensive). Documents are
given by cumulative lengths over the FULL sequence (``cu_seqlens = [0, ..., S]``) and may cross chunk
borders.

For each local chunk [a, b) the attention after the K/V all-gather is a varlen problem that GPU kernels
(flash-attn varlen, TE fused THD) consume directly: K/V are the gathered tokens [0, b) (causal: nothing
later is needed) with their true document lengths, and Q is the chunk with each document's length cut
to its overlap with the chunk, so documents that end before the chunk get length 0 ("Q lengths padded
with leading zeros", paper §4). With bottom-right causal alignment (flash-attn >= 2.1), query j of a
document attends to keys up to its own position. Pure torch, no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def check_bool(name: str, value) -> bool:
    # "no" or 0 would otherwise count as their truth value, silently (a non-empty string is true).
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: must be True or False")
    return value


def _check_split(seq_len: int, cp_size: int, cp_rank: int) -> int:
    for name, value, low in (("seq_len", seq_len, 1), ("cp_size", cp_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} is out of range: must be an integer >= {low}")
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2*cp_size = {2 * cp_size}: the sequence "
                         f"is cut into 2*cp equal chunks; pad it to a multiple of {2 * cp_size}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank!r} is out of range: must be in 0..{cp_size - 1}")
    return seq_len // (2 * cp_size)


def local_chunks(seq_len: int, cp_size: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two [start, end) ranges of the full sequence this rank holds, in local order."""
    chunk = _check_split(seq_len, cp_size, cp_rank)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return (first * chunk, (first + 1) * chunk), (second * chunk, (second + 1) * chunk)


def shard_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions of the full sequence this rank holds, in local order (chunk i, then chunk 2*cp-1-i)."""
    (a0, b0), (a1, b1) = local_chunks(seq_len, cp_size, cp_rank)
    return torch.cat([torch.arange(a0, b0), torch.arange(a1, b1)])


def check_cu_seqlens(cu_seqlens, seq_len: int) -> torch.Tensor:
    """cu_seqlens as a 1-D int64 CPU tensor, after checking it describes documents covering [0, S)."""
    raw = torch.as_tensor(cu_seqlens).detach().to("cpu").reshape(-1)
    if raw.dtype == torch.bool or raw.is_complex():
        raise ValueError(f"cu_seqlens must hold integer token offsets, got dtype {raw.dtype}")
    if raw.is_floating_point():
        bad = [x for x in raw.tolist() if not math.isfinite(x) or x != int(x)]
        if bad:  # converting would truncate 7.5 to 7 and move a document border without a word
            raise ValueError(f"cu_seqlens must hold integer token offsets, got {bad[0]} in "
                             f"{raw.tolist()[:16]}")
    cu = raw.to(torch.int64)
    if cu.numel() < 2 or cu[0].item() != 0:
        raise ValueError(f"cu_seqlens must start at 0 and have at least 2 entries, got {cu.tolist()[:8]}")
    if cu[-1].item() != seq_len:
        raise ValueError(f"cu_seqlens must end at the full sequence length S={seq_len}, "
                         f"got last entry {cu[-1].item()}")
    if not bool((cu[1:] > cu[:-1]).all()):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty documents), got "
                         f"{cu.tolist()[:16]}")
    return cu


def document_ids(cu_seqlens, seq_len: int) -> torch.Tensor:
    """Document index of every position of the full sequence."""
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])


def position_ids_per_document(cu_seqlens, seq_len: int) -> torch.Tensor:
    """Position ids that restart at 0 at every document start (full sequence order)."""
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    return torch.arange(seq_len) - starts


def shard_batch(batch: dict, cp_size: int, cp_rank: int, seq_dim: int = 1) -> dict:
    """This rank's part of a Megatron batch (tokens, labels, loss_mask, position_ids, ...).

    Every tensor whose ``seq_dim`` has the full length S is sliced to this rank's positions; other
    entries (e.g. cu_seqlens, which stay global, or a size-1 broadcast dimension) are passed through
    unchanged. A tensor with any other length there is refused: passing it through would pair this
    rank's tokens with another rank's labels.
    """
    lengths = {key: v.size(seq_dim) for key, v in batch.items() if torch.is_tensor(v) and v.dim() > seq_dim}
    if not lengths:
        raise ValueError(f"no tensor in the batch has a sequence dimension {seq_dim}")
    longest = max(lengths, key=lengths.get)
    seq_len = lengths[longest]
    for key, n in lengths.items():
        if n not in (seq_len, 1):
            raise ValueError(f"batch[{key!r}] has length {n} along seq_dim={seq_dim} but batch[{longest!r}] "
                             f"has {seq_len}: every sequence tensor must have the full length S (shift "
                             f"labels inside the sequence and pad them, do not drop a position)")
    index = shard_indices(seq_len, cp_size, cp_rank)
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() > seq_dim and value.size(seq_dim) == seq_len:
            out[key] = value.index_select(seq_dim, index.to(value.device))
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class ChunkDocuments:
    """Varlen metadata of one local chunk [start, end) against the gathered K/V [0, kv_len)."""

    start: int
    end: int
    kv_len: int  # keys/values this chunk needs: [0, end) when causal, [0, S) otherwise
    cu_seqlens_q: torch.Tensor  # int32, per document of [0, kv_len): its overlap with the chunk
    cu_seqlens_kv: torch.Tensor  # int32, per document of [0, kv_len): its length there
    max_seqlen_q: int
    max_seqlen_kv: int


def document_metadata(cu_seqlens, seq_len: int, cp_size: int, cp_rank: int,
                      causal: bool = True) -> tuple[ChunkDocuments, ChunkDocuments]:
    """Per local chunk, the varlen metadata a GPU kernel needs (see the module docstring)."""
    check_bool("causal", causal)
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    out = []
    for start, end in local_chunks(seq_len, cp_size, cp_rank):
        kv_len = end if causal else seq_len
        # Documents within [0, kv_len), cut at kv_len.
        bounds = torch.cat([cu[cu < kv_len], torch.tensor([kv_len])])
        doc_start, doc_end = bounds[:-1], bounds[1:]
        q_len = (torch.minimum(doc_end, torch.tensor(end)) - torch.maximum(doc_start, torch.tensor(start)))
        q_len = q_len.clamp(min=0)
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), q_len.cumsum(0)])
        out.append(ChunkDocuments(
            start=start, end=end, kv_len=kv_len,
            cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_kv=bounds.to(torch.int32),
            max_seqlen_q=int(q_len.max()), max_seqlen_kv=int((doc_end - doc_start).max())))
    return out[0], out[1]
