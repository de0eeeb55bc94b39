"""CP layouts, pure (no processes): invariants, the balanced layout's work target, bad input."""

import statistics

import pytest
import torch

from l3plugin.cp.layout import (CPLayout, balanced_layout, imbalance, linear_pair_equivalents, make_layout,
                                rank_work, token_work, two_chunk_layout)


def llama_documents(seq_len, gen):
    """cu_seqlens of Llama-like documents: log-normal lengths, median e^6.4 ~ 600 tokens, at least 16."""
    cu, pos = [0], 0
    while pos < seq_len:
        pos = min(seq_len, pos + int(torch.empty(1).log_normal_(6.4, 1.0, generator=gen).clamp(min=16)))
        cu.append(pos)
    return cu


def check_invariants(layout, seq_len, cp):
    assert (layout.seq_len, layout.cp_size, len(layout.ranges)) == (seq_len, cp, cp)
    counts = [sum(b - a for a, b in layout.rank_ranges(r)) for r in range(cp)]
    assert counts == [seq_len // cp] * cp  # equal tokens per rank, nothing padded
    for r in range(cp):
        ranges = layout.rank_ranges(r)
        assert all(a < b for a, b in ranges)
        assert all(b0 <= a1 for (_, b0), (a1, _) in zip(ranges, ranges[1:]))  # sorted, disjoint
        if layout.name == "balanced":
            assert all(b0 < a1 for (_, b0), (a1, _) in zip(ranges, ranges[1:]))  # adjacent ones merged
        assert layout.indices(r).tolist() == [p for a, b in ranges for p in range(a, b)]
    assert sorted(layout.gathered_order().tolist()) == list(range(seq_len))  # every position exactly once


def test_two_chunk_layout_is_the_papers():
    layout = two_chunk_layout(16, 2)
    assert layout.ranges == (((0, 4), (12, 16)), ((4, 8), (8, 12)))  # rank 1's chunks touch: kept as two
    assert layout.gathered_order().tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 3, 4):
        check_invariants(two_chunk_layout(48, cp), 48, cp)
    assert make_layout("2cp", 48, 3) == two_chunk_layout(48, 3)


@pytest.mark.parametrize("seq_len,cp", [(48, 2), (48, 3), (48, 4), (64, 2), (4096, 8), (24, 1)])
def test_balanced_layout_invariants(seq_len, cp):
    gen = torch.Generator().manual_seed(seq_len * 10 + cp)
    for draw in range(20):
        cuts = sorted(set(torch.randint(1, seq_len, (int(torch.randint(0, 12, (1,), generator=gen)),),
                                        generator=gen).tolist()))
        cu = [0] + cuts + [seq_len]
        layout = balanced_layout(cu, seq_len, cp)
        check_invariants(layout, seq_len, cp)
        assert make_layout("balanced", seq_len, cp, cu) == layout  # deterministic in cu_seqlens


def test_token_work_counts_the_unmasked_pairs():
    cu = [0, 3, 6, 14, 16]
    doc = torch.repeat_interleave(torch.arange(4), torch.diff(torch.tensor(cu)))
    same = doc[:, None] == doc[None, :]
    causal = same & (torch.arange(16)[None, :] <= torch.arange(16)[:, None])
    assert token_work(cu, 16).tolist() == causal.sum(1).tolist()
    assert token_work(cu, 16, causal=False).tolist() == same.sum(1).tolist()
    # Rank work = sum over its positions; the linear term adds the same to every rank (S/cp tokens).
    layout = two_chunk_layout(16, 2)
    pairs = [int(causal[layout.indices(r)].sum()) for r in range(2)]
    assert rank_work(layout, cu) == pairs
    assert rank_work(layout, cu, linear_pair_equivalents=10.0) == [p + 80.0 for p in pairs]


def test_linear_term_of_llama3_405b():
    # Projections and MLP per token over attention per pair: 11.875 h^2 / 2h with h = 16384.
    assert linear_pair_equivalents(16384, 53248, 128, 8) == 11.875 * 16384 / 2


@pytest.mark.parametrize("seq_len", [8192, 32768, 131072])
@pytest.mark.parametrize("cp", [4, 8])
def test_balanced_layout_meets_the_work_target(seq_len, cp):
    """max/min attention work (pairs alone, no linear term) <= 1.10 on every draw of Llama-like
    documents, where the paper's layout averages several times that."""
    gen = torch.Generator().manual_seed(seq_len + cp)
    balanced, paper = [], []
    for _ in range(10):
        cu = llama_documents(seq_len, gen)
        balanced.append(imbalance(rank_work(balanced_layout(cu, seq_len, cp), cu)))
        paper.append(imbalance(rank_work(two_chunk_layout(seq_len, cp), cu)))
    assert max(balanced) <= 1.10, balanced
    assert statistics.mean(paper) > 2.0, paper  # the problem the balanced layout solves
    # One document (plain causal): balanced too.
    assert imbalance(rank_work(balanced_layout([0, seq_len], seq_len, cp), [0, seq_len])) <= 1.10


def test_few_ranges_per_rank():
    """Each range is a kernel call: the piece count only grows until the work is balanced."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        cu = llama_documents(131072, gen)
        assert max(len(r) for r in balanced_layout(cu, 131072, 8).ranges) <= 32


@pytest.mark.parametrize("call,message", [
    (lambda: make_layout("zigzag", 16, 2), r"layout='zigzag' is unknown: choose one of \['2cp', 'balanced'\]"),
    (lambda: make_layout("balanced", 16, 2), r"layout='balanced' needs cu_seqlens"),
    (lambda: make_layout(two_chunk_layout(16, 2), 16, 4),
     r"layout='2cp' was built for seq_len=16, cp_size=2 but is used with seq_len=16, cp_size=4"),
    (lambda: make_layout(balanced_layout([0, 16], 16, 2), 32, 2),
     r"layout='balanced' was built for seq_len=16, cp_size=2 but is used with seq_len=32, cp_size=2"),
    (lambda: balanced_layout([0, 18], 18, 4), r"seq_len=18 is not divisible by cp_size=4"),
    (lambda: balanced_layout([1, 16], 16, 2), r"cu_seqlens must start at 0"),
    (lambda: balanced_layout([0, 15], 16, 2), r"cu_seqlens must end at the full sequence length S=16"),
    (lambda: balanced_layout([0, 9, 5, 16], 16, 2), r"cu_seqlens must be strictly increasing"),
    (lambda: balanced_layout([0, 16], 16, 0), r"cp_size=0 is out of range"),
    (lambda: balanced_layout([0, 16], 16, 2, tolerance=0.5), r"tolerance=0.5 is out of range"),
    (lambda: balanced_layout([0, 16], 16, 2, min_piece=0), r"min_piece=0 is out of range"),
    (lambda: two_chunk_layout(18, 2), r"seq_len=18 is not divisible by 2\*cp_size = 4"),
    (lambda: two_chunk_layout(16, 2).indices(2), r"cp_rank=2 is out of range: must be an integer in 0..1"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_layout_is_a_value():
    layout = CPLayout("balanced", 8, 2, (((0, 2), (6, 8)), ((2, 6),)))
    assert layout.gathered_order().tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


@pytest.mark.parametrize("ranges,message", [
    ((((0, 2),), ((2, 8),)), r"token counts per rank \[2, 6\] differ"),
    ((((0, 4),), ((2, 6),)), r"do not cover \[0, 8\) exactly once"),
    ((((4, 8), (0, 0)), ((0, 4),)), r"not sorted non-empty"),
    ((((0, 8),),), r"1 ranks' ranges for cp_size=2"),
])
def test_hand_built_layout_is_checked(ranges, message):
    with pytest.raises(ValueError, match=message):
        CPLayout("mine", 8, 2, ranges)
