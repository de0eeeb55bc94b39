"""Which tokens each context-parallel rank holds, and the varlen metadata of its documents (paper §4).

Which positions a rank holds is its CP layout (layout.py): the paper's ``"2cp"`` (the default; the
sequence cut into 2*cp equal chunks, rank i holding chunks i and 2*cp-1-i, which balances causal work
of one document) or ``"balanced"`` (pieces dealt by document-masked work; needs the GLOBAL cu_seqlens),
or a ``CPLayout`` already built. Every function here takes ``layout=`` and must be given the same one.
Documents are given by cumulative lengths over the FULL sequence (``cu_seqlens = [0, ..., S]``) and may
cross range borders.

For each local range [a, b) the attention after the K/V all-gather is a varlen problem that GPU kernels
(flash-attn varlen, TE fused THD) consume directly: K/V are the gathered tokens [0, b) (causal: nothing
later is needed) with their true document lengths, and Q is the range with each document's length cut
to its overlap with the range, so documents that end before the range get length 0 ("Q lengths padded
with leading zeros", paper §4). With bottom-right causal alignment (flash-attn >= 2.1), query j of a
document attends to keys up to its own position. Pure torch, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from l3plugin.arguments.checks import check_int
from l3plugin.cp.layout import check_bool, check_cu_seqlens, make_layout, two_chunk_layout

__all__ = ["ChunkDocuments", "check_bool", "check_cu_seqlens", "cu_seqlens_from_eod", "document_ids",
           "document_metadata", "local_chunks", "position_ids_per_document", "shard_batch", "shard_indices"]


def local_chunks(seq_len: int, cp_size: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The paper's layout: the two [start, end) ranges of the full sequence this rank holds, in local order."""
    return two_chunk_layout(seq_len, cp_size).rank_ranges(cp_rank)


def shard_indices(seq_len: int, cp_size: int, cp_rank: int, layout="2cp", cu_seqlens=None) -> torch.Tensor:
    """Positions of the full sequence this rank holds, in local order (for "2cp": chunk i, then chunk
    2*cp-1-i). ``cu_seqlens`` (global) is needed by the "balanced" layout."""
    return make_layout(layout, seq_len, cp_size, cu_seqlens).indices(cp_rank)


def document_ids(cu_seqlens, seq_len: int) -> torch.Tensor:
    """Document index of every position of the full sequence."""
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])


def cu_seqlens_from_eod(tokens, eod: int) -> torch.Tensor:
    """Document boundaries [0, ..., S] (int32, on the tokens' device) of one packed sequence whose
    documents each end with the token ``eod``: a document ends right after its EOD, as Megatron's
    --reset-attention-mask masks it (gpt_dataset.py: no token after an EOD sees the EOD or anything before)."""
    tokens = torch.as_tensor(tokens)
    if tokens.dim() == 2 and tokens.size(0) == 1:
        tokens = tokens[0]
    if tokens.dim() != 1 or tokens.numel() == 0:
        raise ValueError(f"tokens must be one packed sequence, shape [S] or [1, S], got {tuple(tokens.shape)}: "
                         f"document boundaries describe one sequence (use micro-batch size 1)")
    seq_len = tokens.numel()
    ends = (tokens == eod).nonzero().flatten() + 1
    ends = ends[ends < seq_len]  # an EOD at the last position ends the sequence anyway
    edges = torch.tensor([0, seq_len], device=tokens.device)
    return torch.cat([edges[:1], ends, edges[1:]]).to(torch.int32)


def position_ids_per_document(cu_seqlens, seq_len: int) -> torch.Tensor:
    """Position ids that restart at 0 at every document start (full sequence order)."""
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    return torch.arange(seq_len) - starts


def shard_batch(batch: dict, cp_size: int, cp_rank: int, seq_dim: int = 1, layout="2cp",
                cu_seqlens=None) -> dict:
    """This rank's part of a Megatron batch (tokens, labels, loss_mask, position_ids, ...).

    Every tensor whose ``seq_dim`` has the full length S is sliced to this rank's positions (``layout``,
    see the module docstring; "balanced" takes the global ``cu_seqlens``, by default
    ``batch["cu_seqlens"]``); other entries (e.g. cu_seqlens, which stay global, or a size-1 broadcast
    dimension) are passed through unchanged. Position ids are sliced like the tokens, so per-document
    positions stay those of the full sequence. A tensor with any other length there is refused: passing
    it through would pair this rank's tokens with another rank's labels.
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
    if cu_seqlens is None and layout == "balanced":
        cu_seqlens = batch.get("cu_seqlens")
    index = shard_indices(seq_len, cp_size, cp_rank, layout, cu_seqlens)
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() > seq_dim and value.size(seq_dim) == seq_len:
            out[key] = value.index_select(seq_dim, index.to(value.device))
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class ChunkDocuments:
    """Varlen metadata of one local range [start, end) against the gathered K/V [0, kv_len)."""

    start: int
    end: int
    kv_len: int  # keys/values this chunk needs: [0, end) when causal, [0, S) otherwise
    cu_seqlens_q: torch.Tensor  # int32, per document of [0, kv_len): its overlap with the chunk
    cu_seqlens_kv: torch.Tensor  # int32, per document of [0, kv_len): its length there
    max_seqlen_q: int
    max_seqlen_kv: int


def document_metadata(cu_seqlens, seq_len: int, cp_size: int, cp_rank: int, causal: bool = True,
                      layout="2cp") -> tuple[ChunkDocuments, ...]:
    """Per local range of ``layout`` (two for "2cp"), the varlen metadata a GPU kernel needs (see the
    module docstring), in local order."""
    check_bool("causal", causal)
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    out = []
    for start, end in make_layout(layout, seq_len, cp_size, cu).rank_ranges(cp_rank):
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
    return tuple(out)


# ---- THD packing (Megatron-Core / Transformer Engine): real and padded document offsets ----
# One packed sequence is given as ``cu_seqlens``, the cumulative REAL lengths of its documents [0, l0, l0+l1,
# ...], and ``cu_seqlens_padded``, where each document starts in the packed tensor [0, p0, p0+p1, ...] with
# p_i >= l_i: document i's tokens are at [P_i, P_i + l_i), [P_i + l_i, P_(i+1)) is its padding (None: no
# padding, the padded offsets are cu_seqlens). Under CP, layout.per_document_layout says who holds what.
# Empty documents (repeated offsets, as fixed-size cu_seqlens buffers end) are allowed.

def _offsets(name: str, value) -> torch.Tensor:
    raw = torch.as_tensor(value).detach().to("cpu").reshape(-1)
    if raw.dtype == torch.bool or raw.is_floating_point() or raw.is_complex():
        raise ValueError(f"{name} must hold integer token offsets, got dtype {raw.dtype}")
    return raw.to(torch.int64)


def _shown(t: torch.Tensor) -> str:
    values = t.tolist()
    return str(values) if len(values) <= 16 else f"{values[:16]}... ({len(values)} entries)"


def check_thd_boundaries(cu_seqlens, cu_seqlens_padded, local_len: int, cp_size: int):
    """(cu_seqlens, cu_seqlens_padded) as int64 CPU tensors, after checking they describe one packed
    sequence whose local part on each of ``cp_size`` ranks has ``local_len`` tokens ("THD packing" above).
    Raises a ValueError naming the parameter, its value and the rule it breaks."""
    check_int("local_len", local_len, 0)
    check_int("cp_size", cp_size)
    cu = _offsets("cu_seqlens_q", cu_seqlens)
    given_padded = cu_seqlens_padded is not None
    padded = _offsets("cu_seqlens_q_padded", cu_seqlens_padded) if given_padded else cu
    pname = "cu_seqlens_q_padded" if given_padded else "cu_seqlens_q (no cu_seqlens_q_padded given)"
    seq_len = local_len * cp_size
    for name, t in (("cu_seqlens_q", cu), (pname, padded)):
        if t.numel() < 2 or t[0].item() != 0:
            raise ValueError(f"{name}={_shown(t)} is invalid: it must start at 0 and have at least 2 entries")
        if bool((t[1:] < t[:-1]).any()):
            raise ValueError(f"{name}={_shown(t)} is invalid: offsets must not decrease")
    if padded[-1].item() != seq_len:
        raise ValueError(
            f"{pname}={_shown(padded)} ends at {padded[-1].item()}, but the packed sequence has "
            f"{local_len} local tokens x cp {cp_size} = {seq_len}: the last (padded) offset must be the length of "
            f"the whole packed sequence, local tokens x CP size")
    if given_padded:
        if cu.numel() != padded.numel():
            raise ValueError(f"cu_seqlens_q has {cu.numel()} entries but cu_seqlens_q_padded has "
                             f"{padded.numel()}: both describe the same documents ({_shown(cu)} vs {_shown(padded)})")
        over = ((cu[1:] - cu[:-1]) > (padded[1:] - padded[:-1])).nonzero().flatten()
        if over.numel():
            i = int(over[0])
            raise ValueError(
                f"cu_seqlens_q={_shown(cu)} gives document {i} {int(cu[i + 1] - cu[i])} tokens but "
                f"cu_seqlens_q_padded={_shown(padded)} only {int(padded[i + 1] - padded[i])}: a document's padded "
                f"length must be at least its length")
    if cp_size > 1:
        lengths = padded[1:] - padded[:-1]
        bad = (lengths % (2 * cp_size)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            hint = ("" if given_padded else "; give cu_seqlens_q_padded (each document padded to a multiple of "
                    f"{2 * cp_size}) or use l3plugin's own layouts, which pad nothing (qkv_format 'sbhd')")
            raise ValueError(
                f"{pname}={_shown(padded)} gives document {i} a padded length of {int(lengths[i])}, not a multiple "
                f"of 2 x cp = {2 * cp_size}: with qkv_format 'thd' and CP every document is cut into 2 x cp equal "
                f"pieces{hint}")
    return cu, padded


def attention_boundaries(cu_seqlens, cu_seqlens_padded) -> torch.Tensor:
    """Document boundaries over the whole PADDED sequence for the attention: every document's tokens, and
    separately its padding tail (empty ones dropped). Padding then attends only padding, and no real token
    sees it."""
    cu = _offsets("cu_seqlens_q", cu_seqlens)
    padded = _offsets("cu_seqlens_q_padded", cu_seqlens_padded)
    ends = padded[:-1] + (cu[1:] - cu[:-1])
    edges = torch.unique(torch.cat([padded, ends]))  # sorted; empty documents and tails collapse
    return edges


def padding_positions(cu_seqlens, cu_seqlens_padded) -> torch.Tensor:
    """Boolean mask over the whole padded sequence: True at the padding tokens."""
    cu = _offsets("cu_seqlens_q", cu_seqlens)
    padded = _offsets("cu_seqlens_q_padded", cu_seqlens_padded)
    seq_len = int(padded[-1])
    lengths = padded[1:] - padded[:-1]
    starts = torch.repeat_interleave(padded[:-1], lengths)
    real = torch.repeat_interleave(cu[1:] - cu[:-1], lengths)
    return (torch.arange(seq_len) - starts) >= real
