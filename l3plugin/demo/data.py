"""Synthetic packed documents for the demo: every microbatch is one sequence of ``seq_len`` tokens made of
documents of random length, each ending with EOS. Deterministic in (step, global microbatch index), so
every rank and the single-process reference see the same tokens.
"""

from __future__ import annotations

import torch

EOS = 0


def packed_sequence(seq_len: int, vocab: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq_len:
        n = min(seq_len - total, int(torch.randint(3, max(4, seq_len // 2), (1,), generator=gen)))
        lengths.append(n)
        total += n
    # Within a document the next token depends on the current one: something a model can learn.
    tokens = torch.empty(seq_len + 1, dtype=torch.long)
    pos = 0
    for n in lengths:
        start = int(torch.randint(1, vocab, (1,), generator=gen))
        doc = (start + 3 * torch.arange(n)) % (vocab - 1) + 1
        doc[-1] = EOS
        tokens[pos:pos + n] = doc
        pos += n
    tokens[-1] = EOS
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return {"tokens": tokens[:-1][None], "labels": tokens[1:][None],
            "loss_mask": torch.ones(1, seq_len), "cu_seqlens": cu}


def step_microbatches(step: int, dp_rank: int, num_microbatches: int, seq_len: int, vocab: int) -> list[dict]:
    """The microbatches data-parallel rank ``dp_rank`` trains on at ``step``."""
    first = dp_rank * num_microbatches
    return [packed_sequence(seq_len, vocab, seed=1_000_003 * step + first + i) for i in range(num_microbatches)]
