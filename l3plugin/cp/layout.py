"""Which positions of the packed sequence each context-parallel rank holds: the CP layout. Pure: no
process group, no communication.

A layout gives every CP rank an ordered list of [start, end) ranges of the full sequence, sorted and
non-overlapping, with the same number of tokens on every rank (the K/V all-gather needs equal sizes;
nothing is padded). Because K and V are all-gathered, any partition of the queries is correct; the
layout only decides how the attention work is spread.

- ``"2cp"`` (the paper's, §4; the default): the sequence is cut into 2*cp equal chunks and rank i holds
  chunks i and 2*cp-1-i. That balances causal work for ONE document; with many documents it does not
  (log-normal lengths, median ~600 tokens: max/min attention work ~1.7 at cp=2, ~3 at cp=4).
- ``"per-document"`` (Megatron's and Transformer Engine's THD packing, ``per_document_layout``): every
  document padded to a multiple of 2*cp and split like "2cp" on its own. Not chosen by name: it comes with
  THD input (attention.thd_attention).
- ``"balanced"`` (beyond the paper): the sequence is cut into equal pieces and the pieces are dealt to
  ranks by attention work (largest first, to the least-loaded rank that still has room; every rank gets
  the same number of pieces, hence the same number of tokens). The piece count starts small and doubles
  until max/min work <= ``tolerance`` or pieces reach ``min_piece`` tokens, so a rank holds few ranges
  (each range is one kernel call); adjacent pieces on one rank are merged. It depends on the documents,
  so every rank computes it from the same GLOBAL cu_seqlens, deterministically.

Work model. Under the causal document mask the query at position q of a document starting at s sees
q - s + 1 keys, so a piece costs sum over its queries of (q - s + 1): late pieces of a long document
cost more. The rest of the layer (QKV/output projections, MLP, norms) costs the same per token
(``linear_pair_equivalents``: its FLOPs per token divided by attention's FLOPs per query-key pair).
Every rank holds S/cp tokens, so that term is the same on every rank: it never changes the assignment,
it only damps how much an attention imbalance matters for the whole layer (``rank_work``).
The planner (l3plugin/planner/) assumes balanced CP ranks; it models neither layout's imbalance.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from l3plugin.arguments.checks import check_int

LAYOUT_NAMES = ("2cp", "balanced")
PER_DOCUMENT = "per-document"  # Megatron's / TE's THD split (per_document_layout): comes with THD input, not chosen
TOLERANCE = 1.05  # balanced: stop refining once max/min attention work is within this
MIN_PIECE = 64  # balanced: smallest piece in tokens (a GPU kernel call on fewer is mostly overhead)


def check_bool(name: str, value) -> bool:
    # "no" or 0 would otherwise count as their truth value, silently (a non-empty string is true).
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: must be True or False")
    return value


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


@dataclass(frozen=True)
class CPLayout:
    """Per CP rank, the sorted [start, end) ranges of the full sequence it holds (its local order)."""

    name: str
    seq_len: int
    cp_size: int
    ranges: tuple  # ranges[rank] = ((start, end), ...)

    def __post_init__(self):
        # A hand-built layout that misses or repeats a position would silently attend to wrong tokens.
        check_int("seq_len", self.seq_len)
        check_int("cp_size", self.cp_size)
        ranges = tuple(tuple((int(a), int(b)) for a, b in mine) for mine in self.ranges)
        object.__setattr__(self, "ranges", ranges)
        problem = None
        if len(ranges) != self.cp_size:
            problem = f"{len(ranges)} ranks' ranges for cp_size={self.cp_size}"
        elif len({sum(b - a for a, b in mine) for mine in ranges}) != 1:
            problem = f"token counts per rank {[sum(b - a for a, b in mine) for mine in ranges]} differ"
        elif any(list(mine) != sorted(mine) or any(a >= b for a, b in mine) for mine in ranges):
            problem = "a rank's ranges are not sorted non-empty [start, end) pairs"
        else:
            cover = sorted(r for mine in ranges for r in mine)
            if cover[0][0] != 0 or cover[-1][1] != self.seq_len or any(
                    b != a for (_, b), (a, _) in zip(cover, cover[1:])):
                problem = f"the ranges do not cover [0, {self.seq_len}) exactly once"
        if problem:
            raise ValueError(f"layout {self.name!r} is invalid: {problem}; ranges={self.ranges!r}"[:400])

    def rank_ranges(self, cp_rank: int) -> tuple:
        check_int("cp_rank", cp_rank, 0, self.cp_size - 1)
        return self.ranges[cp_rank]

    def indices(self, cp_rank: int) -> torch.Tensor:
        """Positions of the full sequence this rank holds, in local order."""
        return torch.cat([torch.arange(a, b) for a, b in self.rank_ranges(cp_rank)])

    @functools.cached_property
    def _gathered_order(self) -> torch.Tensor:
        return torch.cat([self.indices(r) for r in range(self.cp_size)])

    def gathered_order(self) -> torch.Tensor:
        """Global positions of the rank-major concatenation of every rank's local tokens (all-gather order).
        Computed once per layout (attention asks for it in every layer); do not modify it."""
        return self._gathered_order

    def check(self, seq_len: int, cp_size: int) -> "CPLayout":
        """Refuse a layout built for another sequence length or CP size."""
        if (self.seq_len, self.cp_size) != (seq_len, cp_size):
            raise ValueError(f"layout={self.name!r} was built for seq_len={self.seq_len}, "
                             f"cp_size={self.cp_size} but is used with seq_len={seq_len}, cp_size={cp_size}: "
                             f"build it for this sequence and CP group (cp.layout.make_layout)")
        return self


@functools.lru_cache(maxsize=64, typed=True)  # built in every attention call; typed: True is not 1
def two_chunk_layout(seq_len: int, cp_size: int) -> CPLayout:
    """The paper's layout: rank i holds chunks i and 2*cp-1-i of 2*cp equal chunks."""
    check_int("seq_len", seq_len)
    check_int("cp_size", cp_size)
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2*cp_size = {2 * cp_size}: the sequence "
                         f"is cut into 2*cp equal chunks; pad it to a multiple of {2 * cp_size}")
    c = seq_len // (2 * cp_size)
    ranges = tuple(((i * c, (i + 1) * c), ((2 * cp_size - 1 - i) * c, (2 * cp_size - i) * c))
                   for i in range(cp_size))
    return CPLayout("2cp", seq_len, cp_size, ranges)


def token_work(cu_seqlens, seq_len: int, causal: bool = True) -> torch.Tensor:
    """Keys each query attends to under the document (+ causal) mask, per position (int64)."""
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    lengths = cu[1:] - cu[:-1]
    if not causal:
        return torch.repeat_interleave(lengths, lengths)
    return torch.arange(seq_len) - torch.repeat_interleave(cu[:-1], lengths) + 1


def rank_work(layout: CPLayout, cu_seqlens, causal: bool = True, linear_pair_equivalents: float = 0.0) -> list:
    """Work per rank: unmasked query-key pairs, plus ``linear_pair_equivalents`` per token for the rest of
    the layer (see the module docstring; 0 gives attention alone, the stricter balance measure)."""
    work = token_work(cu_seqlens, layout.seq_len, causal)
    prefix = torch.cat([torch.zeros(1, dtype=torch.int64), work.cumsum(0)]).tolist()
    out = []
    for r in range(layout.cp_size):
        ranges = layout.rank_ranges(r)
        pairs = sum(prefix[b] - prefix[a] for a, b in ranges)
        tokens = sum(b - a for a, b in ranges)
        out.append(pairs + linear_pair_equivalents * tokens)
    return out


def imbalance(work: list) -> float:
    """max/min over ranks (inf when a rank has no work)."""
    return max(work) / min(work) if min(work) > 0 else math.inf


def linear_pair_equivalents(hidden: int, ffn_hidden: int, heads: int, kv_heads: int,
                            gated_mlp: bool = True) -> float:
    """FLOPs per token of a layer's projections and MLP over attention's FLOPs per query-key pair.

    Per token: QKV (hidden x (hidden + 2*hidden*kv_heads/heads)), output (hidden x hidden) and the MLP
    (3 or 2 matrices of hidden x ffn_hidden) multiply-adds; per pair: Q.K and P.V, hidden each.
    Llama 3 405B (16384, 53248, 128, 8): ~97K, i.e. the rest of the layer weighs like 97K keys per token.
    """
    qkv = hidden * (hidden + 2 * hidden * kv_heads // heads)
    mlp = (3 if gated_mlp else 2) * hidden * ffn_hidden
    return (qkv + hidden * hidden + mlp) / (2 * hidden)


def _deal(piece_work: list, cp_size: int, per_rank: int) -> list:
    """Largest piece first, to the least-loaded rank with room (ties: lower rank); per rank its pieces."""
    load, owned = [0] * cp_size, [[] for _ in range(cp_size)]
    for piece in sorted(range(len(piece_work)), key=lambda p: (-piece_work[p], p)):
        rank = min((r for r in range(cp_size) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        load[rank] += piece_work[piece]
        owned[rank].append(piece)
    return owned


def _merged(starts: list, size: int) -> tuple:
    ranges = []
    for a in sorted(starts):
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], a + size)
        else:
            ranges.append((a, a + size))
    return tuple(ranges)


@functools.lru_cache(maxsize=64)
def _balanced(cu: tuple, seq_len: int, cp_size: int, tolerance: float, min_piece: int) -> CPLayout:
    prefix = [0] + torch.cumsum(token_work(torch.tensor(cu), seq_len), 0).tolist()
    per_rank_tokens = seq_len // cp_size
    # Pieces per rank: divisors of the rank's token count, fewest first, pieces no smaller than min_piece
    # (short sequences, as in tests and the demo, still get up to 8 pieces per rank).
    smallest = min(min_piece, max(1, per_rank_tokens // 8))
    counts = [n for n in range(1, per_rank_tokens + 1)
              if per_rank_tokens % n == 0 and per_rank_tokens // n >= smallest]
    best = None
    for n in _doubling(counts):
        size = per_rank_tokens // n
        work = [prefix[a + size] - prefix[a] for a in range(0, seq_len, size)]
        owned = _deal(work, cp_size, n)
        loads = [sum(work[p] for p in pieces) for pieces in owned]
        ratio = imbalance(loads)
        if best is None or ratio < best[0]:
            best = (ratio, tuple(_merged([p * size for p in pieces], size) for pieces in owned))
        if ratio <= tolerance:
            break
    return CPLayout("balanced", seq_len, cp_size, best[1])


def _doubling(counts: list) -> list:
    """From the sorted divisors, roughly doubling ones (1, 2, 4, ... where they divide), and the last."""
    out = []
    for n in counts:
        if not out or n >= 2 * out[-1]:
            out.append(n)
    if counts and out[-1] != counts[-1]:
        out.append(counts[-1])
    return out


def balanced_layout(cu_seqlens, seq_len: int, cp_size: int, *, tolerance: float = TOLERANCE,
                    min_piece: int = MIN_PIECE) -> CPLayout:
    """Document-balanced layout (module docstring). Needs seq_len divisible by cp_size."""
    check_int("seq_len", seq_len)
    check_int("cp_size", cp_size)
    check_int("min_piece", min_piece)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 1.0:
        raise ValueError(f"tolerance={tolerance!r} is out of range: must be a number >= 1.0 (max/min work)")
    if seq_len % cp_size:
        raise ValueError(f"seq_len={seq_len} is not divisible by cp_size={cp_size}: every CP rank holds the "
                         f"same number of tokens; pad the sequence to a multiple of {cp_size}")
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    return _balanced(tuple(cu.tolist()), seq_len, cp_size, float(tolerance), min_piece)


@functools.lru_cache(maxsize=64)
def _per_document(padded: tuple, cp_size: int) -> CPLayout:
    if cp_size == 1:  # nothing to cut (documents of any length, as Transformer Engine takes them at CP 1)
        return CPLayout(PER_DOCUMENT, padded[-1], 1, (((0, padded[-1]),) if padded[-1] else (),))
    ranges = [[] for _ in range(cp_size)]
    for a, b in zip(padded, padded[1:]):
        piece = (b - a) // (2 * cp_size)
        if piece == 0:
            continue  # an empty document
        for r in range(cp_size):
            for p in (r, 2 * cp_size - 1 - r):
                lo, hi = a + p * piece, a + (p + 1) * piece
                mine = ranges[r]
                if mine and mine[-1][1] == lo:  # adjacent: the middle pieces, or a document end and the next start
                    mine[-1] = (mine[-1][0], hi)
                else:
                    mine.append((lo, hi))
    return CPLayout(PER_DOCUMENT, padded[-1], cp_size, tuple(tuple(mine) for mine in ranges))


def per_document_layout(cu_seqlens_padded, cp_size: int) -> CPLayout:
    """The CP layout of Megatron's / Transformer Engine's THD split: at cp > 1 every document padded to a multiple
    of 2*cp (``cu_seqlens_padded``: where each padded document starts, [0, ..., S]) and cut into 2*cp equal
    pieces; rank r holds pieces r and 2*cp-1-r of EVERY document, document after document (what Megatron's THD
    RoPE, rope_utils._apply_rotary_pos_emb_thd, assumes). Adjacent pieces of one rank are merged into one
    range; empty documents hold nothing. At cp = 1 the whole sequence in order, any lengths. Cached: built in every
    attention call."""
    check_int("cp_size", cp_size)
    padded = torch.as_tensor(cu_seqlens_padded).detach().to("cpu").reshape(-1).to(torch.int64)
    lengths = padded[1:] - padded[:-1]
    if padded.numel() < 2 or padded[0].item() != 0 or bool((lengths < 0).any()) or (
            cp_size > 1 and bool((lengths % (2 * cp_size)).any())):
        raise ValueError(f"cu_seqlens_padded={padded.tolist()[:16]} is invalid: offsets from 0, not decreasing, "
                         f"every document's padded length a multiple of 2 x cp_size = {2 * cp_size}")
    return _per_document(tuple(padded.tolist()), cp_size)


def make_layout(layout, seq_len: int, cp_size: int, cu_seqlens=None) -> CPLayout:
    """The CPLayout for ``layout``: "2cp", "balanced" (needs the global ``cu_seqlens``) or a CPLayout
    already built (checked against seq_len and cp_size)."""
    if isinstance(layout, CPLayout):
        return layout.check(seq_len, cp_size)
    if layout == "2cp":
        return two_chunk_layout(seq_len, cp_size)
    if layout == "balanced":
        if cu_seqlens is None:
            raise ValueError("layout='balanced' needs cu_seqlens (the GLOBAL document boundaries [0, ..., S]): "
                             "the assignment of positions to ranks depends on the documents")
        return balanced_layout(cu_seqlens, seq_len, cp_size)
    raise ValueError(f"layout={layout!r} is unknown: choose one of {list(LAYOUT_NAMES)} or pass a CPLayout")
