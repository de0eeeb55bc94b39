"""Tokens that Megatron's / Transformer Engine's THD packing pads under CP, and l3plugin's layouts do not.

Megatron-Core's THD format with CP (``PackedSeqParams(qkv_format="thd", cu_seqlens_q_padded=...)``, TE's
per-document split; l3plugin/cp/layout.py ``per_document_layout``) pads EVERY document to a multiple of 2 x cp.
l3plugin's own layouts ("2cp", "balanced") cut the whole packed sequence, documents crossing chunk borders:
only the sequence length must be a multiple of 2 x cp (or cp), so a packed sequence holds no padding.

Documents are drawn from a log-normal length distribution and packed, in order, into sequences of ``--seq``
tokens the way a packing data loader fills them: documents are appended while they fit; the one that does not
is cut at the sequence end (its rest starts the next sequence). Under the THD packing each document occupies
its padded length, so fewer real tokens fit in the same sequence; the cut document is cut to a multiple of
2 x cp. Printed per cp: padding tokens per sequence (mean), their share of the sequence (the compute of the
whole layer spent on them, and the real tokens a step loses at a fixed sequence length), documents per sequence.

    python bench/cp_thd_padding.py [--seq 8192] [--cp 2 4 8] [--tokens 20000000] [--seed 0]

Two distributions by default: pre-training-like documents (log-normal, mu 6.4, sigma 1.0: median ~600
tokens, as bench/cp_attention.py) and short SFT/RL-like samples (mu 5.0, sigma 0.8: median ~150 tokens).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

DISTRIBUTIONS = {"pretraining (median ~600)": (6.4, 1.0), "short samples (median ~150)": (5.0, 0.8)}


def document_stream(total_tokens: int, mu: float, sigma: float, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    drawn = 0
    while drawn < total_tokens:
        batch = torch.empty(4096).log_normal_(mu, sigma, generator=gen).round().clamp(min=1).long().tolist()
        lengths.extend(batch)
        drawn += sum(batch)
    return lengths


def pack(lengths: list, seq_len: int, multiple: int) -> list:
    """Sequences of ``seq_len`` tokens, each a list of (real tokens, occupied tokens) per document piece.
    ``multiple``: every piece occupies its length rounded up to this (1: no padding)."""
    sequences, current, free = [], [], seq_len
    queue = list(reversed(lengths))
    while queue:
        n = queue.pop()
        occupied = math.ceil(n / multiple) * multiple
        if occupied <= free:
            current.append((n, occupied))
            free -= occupied
        else:
            take = (free // multiple) * multiple  # the cut piece fills the rest (a multiple of ``multiple``)
            if take:
                current.append((take, take))
                queue.append(n - take)
                free -= take
            sequences.append(current)
            current, free = [], seq_len
            if not take:
                queue.append(n)
        if free == 0:
            sequences.append(current)
            current, free = [], seq_len
    return sequences  # a last, partly filled sequence is dropped (as a loader drops an incomplete sample)


def measure(lengths: list, seq_len: int, cp: int) -> dict:
    thd = pack(lengths, seq_len, 2 * cp)
    ours = pack(lengths, seq_len, 1)
    pad = [sum(o - r for r, o in s) for s in thd]
    docs = [len(s) for s in thd]
    return {"cp": cp, "sequences": len(thd), "pad_tokens_per_seq": sum(pad) / len(pad),
            "pad_share": sum(pad) / (len(pad) * seq_len), "max_pad_tokens": max(pad),
            "docs_per_seq": sum(docs) / len(docs),
            "l3plugin_pad_tokens_per_seq": sum(sum(o - r for r, o in s) for s in ours) / len(ours)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, default=20_000_000, help="tokens of documents drawn per distribution")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON record on stdout (the table on stderr)")
    args = parser.parse_args(argv)
    for cp in args.cp:
        if args.seq % (2 * cp):
            parser.error(f"--seq {args.seq} is not a multiple of 2 x cp = {2 * cp}")
    record = {"seq": args.seq, "tokens": args.tokens, "seed": args.seed, "results": {}}
    out = __import__("sys").stderr if args.json else __import__("sys").stdout
    for name, (mu, sigma) in DISTRIBUTIONS.items():
        lengths = document_stream(args.tokens, mu, sigma, args.seed)
        median = sorted(lengths)[len(lengths) // 2]
        print(f"\n{name}: log-normal mu {mu} sigma {sigma}, {len(lengths)} documents, median {median}, mean "
              f"{sum(lengths) / len(lengths):.0f} tokens; packed into {args.seq}-token sequences", file=out)
        print(f"  {'cp':>3} {'docs/seq':>9} {'THD pad tokens/seq':>19} {'share':>7} {'max/seq':>8} "
              f"{'l3plugin pad/seq':>17}", file=out)
        rows = []
        for cp in args.cp:
            r = measure(lengths, args.seq, cp)
            rows.append(r)
            print(f"  {cp:>3} {r['docs_per_seq']:>9.1f} {r['pad_tokens_per_seq']:>19.1f} {100 * r['pad_share']:>6.2f}% "
                  f"{r['max_pad_tokens']:>8d} {r['l3plugin_pad_tokens_per_seq']:>17.1f}", file=out)
        record["results"][name] = {"mu": mu, "sigma": sigma, "median": median, "rows": rows}
    if args.json:
        print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
