"""CP attention under activation checkpointing: every CP rank posts the same collectives, and the result is the
run without checkpointing's, bit for bit (fp32, cp = 2).

A checkpointed layer is recomputed once per autograd graph task that unpacks its saved tensors; the overlapped CP
attention differentiates each of its local ranges in a graph task of its own (cp/overlap.py), so before the fix a
layer was recomputed once per range, with its K/V all-gathers, and ranks holding different numbers of ranges hung.
The document mixes give the ranks different numbers of ranges (balanced, per-document THD), documents longer than a
chunk and one-token documents.
"""

import pytest
import torch
import torch.distributed as dist

from l3plugin.cp.attention import all_gather_attention, thd_attention
from l3plugin.cp.layout import make_layout, per_document_layout

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 4, 2, 8, 2
# Documents of one packed row (272 tokens): the mix (2 tokens added so 2cp divides it), one document
# longer than every chunk, and many tiny ones with one-token documents.
MIXES = {
    "issue-55": [55, 50, 13, 35, 7, 53, 20, 37, 2],
    "longer-than-a-chunk": [3, 200, 1, 68],
    "tiny": [1, 1, 2, 1, 5, 1, 3, 1, 1, 9, 1] * 8 + [2] + [1] * 38,
}
CHECKPOINTS = ("none", "non-reentrant", "reentrant")


class Layer(torch.nn.Module):
    """Attention (QKV projection, CP attention, output projection) and an MLP, each with a residual."""

    def __init__(self, attend):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.out = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 64), torch.nn.GELU(), torch.nn.Linear(64, HIDDEN))
        self.attend = attend

    def forward(self, x):
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        shape = (x.size(0), -1, HEAD_DIM)
        x = x + self.out(self.attend(q.reshape(shape), k.reshape(shape), v.reshape(shape)).flatten(1))
        return x + self.mlp(x)


def _run(attend, x, checkpoint):
    torch.manual_seed(0)
    layers = [Layer(attend) for _ in range(LAYERS)]
    x = x.detach().clone().requires_grad_()
    h = x
    for layer in layers:
        if checkpoint == "none":
            h = layer(h)
        else:
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=checkpoint == "reentrant")
    (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
    return [h.detach(), x.grad] + [p.grad for layer in layers for p in layer.parameters()]


def checkpointed_against_plain(kind, mix, shared_recompute=True):
    """On every rank: for each checkpoint kind, whether every output and gradient equals the run without
    checkpointing bit for bit, and how many CP attention forwards ran (counted at the all-gathers' Function)."""
    from l3plugin.cp import overlap

    cp, rank = dist.get_world_size(), dist.get_rank()
    lengths = MIXES[mix]
    seq_len = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0)
    if kind == "thd":  # every document padded to a multiple of 2 x cp, as Megatron / TE / verl pad at CP > 1
        padded = torch.tensor([0] + [-(-n // (2 * cp)) * 2 * cp for n in lengths]).cumsum(0)
        seq_len, index = int(padded[-1]), per_document_layout(padded, cp).indices(rank)

        def attend(q, k, v):
            return thd_attention(q, k, v, cu, padded, group=dist.group.WORLD)
    else:
        index = make_layout(kind, seq_len, cp, cu).indices(rank)

        def attend(q, k, v):
            return all_gather_attention(q, k, v, cu, group=dist.group.WORLD, layout=kind)
    x = torch.randn(seq_len, HIDDEN, generator=torch.Generator().manual_seed(5))[index]
    calls = [0]
    forward = overlap.OverlappedAttention.forward

    def counted(*args):
        calls[0] += 1
        return forward(*args)

    overlap.OverlappedAttention.forward = staticmethod(counted)
    saved, overlap.SHARED_RECOMPUTE = overlap.SHARED_RECOMPUTE, shared_recompute and overlap.SHARED_RECOMPUTE
    try:
        results, counts = {}, {}
        for checkpoint in CHECKPOINTS:
            calls[0] = 0
            results[checkpoint] = _run(attend, x, checkpoint)
            counts[checkpoint] = calls[0]
    finally:
        overlap.OverlappedAttention.forward = staticmethod(forward)
        overlap.SHARED_RECOMPUTE = saved
    ranges = len(make_layout(kind, seq_len, cp, cu).rank_ranges(rank)) if kind != "thd" else len(
        per_document_layout(padded, cp).rank_ranges(rank))
    return {"equal": {c: all(torch.equal(a, b) for a, b in zip(results[c], results["none"])) for c in CHECKPOINTS},
            "forwards": counts, "ranges": ranges}


@pytest.mark.parametrize("kind, mix", [("balanced", "issue-55"), ("2cp", "issue-55"), ("thd", "issue-55"),
                                       ("balanced", "longer-than-a-chunk"), ("thd", "tiny"), ("balanced", "tiny")])
def test_checkpointed_cp_equals_plain_and_recomputes_once(ranks, kind, mix):
    results = ranks.run(2, checkpointed_against_plain, kind, mix, timeout=120)
    if kind == "balanced" and mix == "issue-55":  # the case: the ranks hold different numbers of ranges
        assert results[0]["ranges"] != results[1]["ranges"], [r["ranges"] for r in results]
    for rank, r in enumerate(results):
        assert all(r["equal"].values()), (rank, r)
        # One attention forward per layer, and one more per layer for the recompute: never one per range.
        assert r["forwards"] == {"none": LAYERS, "non-reentrant": 2 * LAYERS, "reentrant": 2 * LAYERS}, (rank, r)


def test_without_a_shared_recompute_the_ranges_keep_their_tensors(ranks):
    """torch < 2.10 (no graph-execution group): the ranges' graphs are built outside the checkpoint's hooks."""
    for rank, r in enumerate(ranks.run(2, checkpointed_against_plain, "balanced", "issue-55", False, timeout=120)):
        assert all(r["equal"].values()), (rank, r)
        assert r["forwards"]["non-reentrant"] == 2 * LAYERS, (rank, r)


@pytest.mark.parametrize("lengths", [[18, 9], [1, 7, 1], [5], [3, 0, 4]])
@pytest.mark.parametrize("padded_tails", [False, True])
def test_thd_at_cp1_takes_any_lengths(lengths, padded_tails):
    """verl pads nothing at CP 1 (cu_seqlens_padded == cu_seqlens, odd lengths): the attention is each document's
    own causal attention, padding tokens get zeros."""
    from test_attention import reference

    cu = torch.tensor([0] + lengths).cumsum(0)
    padded = torch.tensor([0] + [n + (2 if padded_tails else 0) for n in lengths]).cumsum(0)
    total = int(padded[-1])
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(total, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    for given in ((padded, None) if not padded_tails else (padded,)):
        out = thd_attention(q, k, v, cu, given, group=None, kernel="reference")
        bounds = torch.unique(torch.cat([padded, padded[:-1] + cu.diff()]))
        want = reference(q, k, v, bounds.tolist(), True)
        pad = (torch.arange(total) - torch.repeat_interleave(padded[:-1], padded.diff())) >= torch.repeat_interleave(
            cu.diff(), padded.diff())
        want[pad] = 0
        assert torch.allclose(out, want, atol=1e-12), (lengths, padded_tails, (out - want).abs().max())
