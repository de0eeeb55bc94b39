"""CP sharding and varlen metadata, pure (no processes)."""

import pytest
import torch

from l3plugin.cp.sharding import (document_metadata, local_chunks, position_ids_per_document,
                                  shard_batch, shard_indices)


def test_shard_indices_load_balanced_layout():
    assert shard_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 3, 4):
        allpos = torch.cat([shard_indices(48, cp, r) for r in range(cp)])
        assert sorted(allpos.tolist()) == list(range(48))
        # Causal work (number of (q, k<=q) pairs) is equal on every rank.
        work = [int((shard_indices(48, cp, r) + 1).sum()) for r in range(cp)]
        assert len(set(work)) == 1


def test_paper_example_documents_3_3_8_2_cp2():
    cu = torch.tensor([0, 3, 6, 14, 16])
    r0c0, r0c3 = document_metadata(cu, 16, 2, 0)
    r1c1, r1c2 = document_metadata(cu, 16, 2, 1)
    # Rank 1, chunk 1 = tokens 4..7: K/V [0, 8); document 0 has no query here (leading zero),
    # tokens 4 and 5 belong to document 1 and attend to all three of its tokens.
    assert (r1c1.start, r1c1.end, r1c1.kv_len) == (4, 8, 8)
    assert r1c1.cu_seqlens_kv.tolist() == [0, 3, 6, 8]
    assert r1c1.cu_seqlens_q.tolist() == [0, 0, 2, 4]
    assert (r1c1.max_seqlen_q, r1c1.max_seqlen_kv) == (2, 3)
    # Rank 1, chunk 2 = tokens 8..11, all inside document 2 = [6, 14), cut at 12 for K/V.
    assert r1c2.cu_seqlens_kv.tolist() == [0, 3, 6, 12] and r1c2.cu_seqlens_q.tolist() == [0, 0, 0, 4]
    # Rank 0: chunk 0 = tokens 0..3, chunk 3 = tokens 12..15.
    assert r0c0.cu_seqlens_kv.tolist() == [0, 3, 4] and r0c0.cu_seqlens_q.tolist() == [0, 3, 4]
    assert (r0c0.max_seqlen_q, r0c0.max_seqlen_kv) == (3, 3)  # the first document is the longest here
    assert r0c3.cu_seqlens_kv.tolist() == [0, 3, 6, 14, 16]
    assert r0c3.cu_seqlens_q.tolist() == [0, 0, 0, 2, 4]
    assert r0c3.cu_seqlens_q.dtype == torch.int32
    assert (r0c3.max_seqlen_q, r0c3.max_seqlen_kv) == (2, 8)  # the last K/V document (2) is not the longest
    # Non-causal: K/V are the whole sequence, Q lengths have trailing zeros too.
    nc = document_metadata(cu, 16, 2, 1, causal=False)[0]
    assert nc.kv_len == 16 and nc.cu_seqlens_q.tolist() == [0, 0, 2, 4, 4]


def test_shard_batch_and_position_ids():
    cu = torch.tensor([0, 3, 6, 14, 16])
    pos = position_ids_per_document(cu, 16)
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    batch = {"tokens": torch.arange(32).view(2, 16), "position_ids": pos.expand(2, 16), "cu_seqlens": cu}
    local = shard_batch(batch, 2, 1)
    assert local["tokens"][1].tolist() == [20, 21, 22, 23, 24, 25, 26, 27]
    assert local["position_ids"][0].tolist() == [1, 2, 0, 1, 2, 3, 4, 5]
    assert local["cu_seqlens"] is cu


@pytest.mark.parametrize("cu", [[0, 5, 6, 7, 16], [0, 1, 2, 11, 12, 16], [0, 16], [0, 2, 4, 6, 8, 10, 12, 14, 16]])
def test_max_seqlens_are_the_maxima_over_documents(cu):
    """GPU varlen kernels size their work by max_seqlen_*: it must be the longest document's length in
    the chunk, wherever that document is (these layouts put it first, in the middle and alone)."""
    for rank in range(2):
        for causal in (True, False):
            for meta in document_metadata(torch.tensor(cu), 16, 2, rank, causal=causal):
                q_lens, kv_lens = torch.diff(meta.cu_seqlens_q), torch.diff(meta.cu_seqlens_kv)
                assert meta.max_seqlen_q == int(q_lens.max()), (rank, causal, meta)
                assert meta.max_seqlen_kv == int(kv_lens.max()), (rank, causal, meta)
    first = document_metadata(torch.tensor([0, 5, 6, 7, 16]), 16, 2, 1)[0]  # tokens 4..7: q lengths 1, 1, 1, 1
    assert (first.max_seqlen_q, first.max_seqlen_kv) == (1, 5)  # K/V [0, 8): lengths 5, 1, 1, 1


def test_shard_batch_refuses_a_shorter_sequence_tensor():
    batch = {"tokens": torch.arange(32).view(2, 16), "labels": torch.arange(30).view(2, 15),
             "attention_mask": torch.ones(2, 1, 16, 16, dtype=torch.bool)}
    with pytest.raises(ValueError, match=r"batch\['labels'\] has length 15 along seq_dim=1 but "
                                         r"batch\['tokens'\] has 16: every sequence tensor must have the full"):
        shard_batch(batch, 2, 0)
    del batch["labels"]  # a size-1 broadcast dimension is not a sequence: passed through
    assert shard_batch(batch, 2, 0)["attention_mask"] is batch["attention_mask"]


@pytest.mark.parametrize("call,message", [
    (lambda: document_metadata([0, 7.5, 16], 16, 2, 0), r"cu_seqlens must hold integer token offsets, got 7\.5"),
    (lambda: document_metadata(torch.tensor([0.0, 7.5, 16.0]), 16, 2, 0), r"integer token offsets, got 7\.5"),
    (lambda: document_metadata([0, float("nan"), 16], 16, 2, 0), r"integer token offsets, got nan"),
    (lambda: document_metadata(torch.tensor([False, True]), 16, 2, 0), r"integer token offsets, got dtype torch\.bool"),
    (lambda: document_metadata([0, 8, 16], 16, 2, 0, causal="no"), r"causal='no' is invalid: must be True or False"),
    (lambda: document_metadata([0, 8, 16], 16, 2, 0, causal=1), r"causal=1 is invalid: must be True or False"),
    (lambda: shard_indices(18, 2, 0), "seq_len=18 is not divisible by 2\\*cp_size = 4"),
    (lambda: shard_indices(16, 2, 2), "cp_rank=2 is out of range: must be an integer in 0..1"),
    (lambda: local_chunks(16, 0, 0), "cp_size=0 is out of range"),
    (lambda: document_metadata([1, 16], 16, 2, 0), "must start at 0"),
    (lambda: document_metadata([0, 15], 16, 2, 0), "must end at the full sequence length S=16"),
    (lambda: document_metadata([0, 8, 8, 16], 16, 2, 0), "strictly increasing"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("layout", ["2cp", "balanced"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_batch_round_trip(layout, cp):
    """All ranks' shards, concatenated in rank order and scattered back by the layout's gathered order,
    are the batch; position ids per document stay those of the full sequence."""
    from l3plugin.cp.layout import make_layout

    seq_len, cu = 48, torch.tensor([0, 3, 30, 41, 48], dtype=torch.int32)
    pos = position_ids_per_document(cu, seq_len)
    batch = {"tokens": torch.arange(2 * seq_len).view(2, seq_len), "labels": -torch.arange(seq_len)[None],
             "loss_mask": torch.rand(1, seq_len), "position_ids": pos[None], "cu_seqlens": cu}
    shards = [shard_batch(batch, cp, r, layout=layout) for r in range(cp)]
    order = make_layout(layout, seq_len, cp, cu).gathered_order()
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert len({s[key].size(1) for s in shards}) == 1  # equal shares
        back = torch.empty_like(batch[key])
        back[:, order] = torch.cat([s[key] for s in shards], dim=1)
        assert torch.equal(back, batch[key]), key
    for r, s in enumerate(shards):
        idx = shard_indices(seq_len, cp, r, layout, cu)
        assert s["position_ids"][0].tolist() == pos[idx].tolist()
        assert s["cu_seqlens"] is cu


def test_document_metadata_follows_the_layout():
    from l3plugin.cp.layout import CPLayout

    cu = torch.tensor([0, 3, 6, 14, 16])
    layout = CPLayout("mine", 16, 2, (((0, 2), (6, 9), (13, 16)), ((2, 6), (9, 13))))
    metas = document_metadata(cu, 16, 2, 0, layout=layout)
    assert [(m.start, m.end, m.kv_len) for m in metas] == [(0, 2, 2), (6, 9, 9), (13, 16, 16)]
    assert metas[1].cu_seqlens_kv.tolist() == [0, 3, 6, 9] and metas[1].cu_seqlens_q.tolist() == [0, 0, 0, 3]
    assert metas[2].cu_seqlens_kv.tolist() == [0, 3, 6, 14, 16] and metas[2].cu_seqlens_q.tolist() == [0, 0, 0, 1, 3]
    assert (metas[2].max_seqlen_q, metas[2].max_seqlen_kv) == (2, 8)
    nc = document_metadata(cu, 16, 2, 1, causal=False, layout=layout)
    assert [m.kv_len for m in nc] == [16, 16] and nc[0].cu_seqlens_q.tolist() == [0, 1, 4, 4, 4]
    # The balanced layout gives one metadata per (merged) range, covering this rank's tokens.
    for r in range(2):
        metas = document_metadata(cu, 16, 2, r, layout="balanced")
        assert sum(m.end - m.start for m in metas) == 8
        assert all(int(m.cu_seqlens_q[-1]) == m.end - m.start for m in metas)


def test_shard_batch_bad_layout():
    batch = {"tokens": torch.arange(16)[None]}
    with pytest.raises(ValueError, match=r"layout='balanced' needs cu_seqlens"):
        shard_batch(batch, 2, 0, layout="balanced")
    with pytest.raises(ValueError, match=r"layout='2CP' is unknown: choose one of \['2cp', 'balanced'\]"):
        shard_batch(batch, 2, 0, layout="2CP")
    with pytest.raises(ValueError, match=r"layout='2cp' was built for seq_len=32, cp_size=2 but is used "
                                         r"with seq_len=16, cp_size=2"):
        from l3plugin.cp.layout import two_chunk_layout
        shard_batch(batch, 2, 0, layout=two_chunk_layout(32, 2))
