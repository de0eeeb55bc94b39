"""A tiny packed pre-training corpus in Megatron's indexed format (.bin/.idx), written with Megatron-Core's own
IndexedDatasetBuilder, as tools/preprocess_data.py --append-eod writes it: random token ids in [0, V) per
document, each document followed by the EOD id V (NullTokenizer(V)'s eod up to Megatron-LM 0.17; from 0.18 its
default is V - 1, an ordinary token here: give --null-tokenizer-eod-id V, as check.sh does). Documents of 8..160 tokens,
so a 256-token sample holds several EOD tokens and documents cross the CP chunk borders.

    python make_data.py PREFIX [--vocab 1023] [--docs 2000] [--seed 1234]
"""
import argparse

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("prefix")
    parser.add_argument("--vocab", type=int, default=1023, help="NullTokenizer's --vocab-size; EOD is this id")
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=160)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    rng = numpy.random.default_rng(args.seed)
    builder = IndexedDatasetBuilder(get_bin_path(args.prefix), dtype=numpy.int32)
    total = 0
    for _ in range(args.docs):
        length = int(rng.integers(args.min_len, args.max_len + 1))
        doc = numpy.append(rng.integers(0, args.vocab, length), args.vocab)  # text, then EOD
        builder.add_document(doc, [doc.size])
        total += doc.size
    builder.finalize(get_idx_path(args.prefix))
    print(f"{args.prefix}: {args.docs} documents, {total} tokens, EOD id {args.vocab}")


if __name__ == "__main__":
    main()
