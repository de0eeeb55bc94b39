"""A tiny pre-training corpus in Megatron-DeepSpeed's indexed format (.bin/.idx, "mmap"), written with the
checkout's own builder (megatron/data/indexed_dataset.py, as its tools/preprocess_data.py --append-eod writes
it): random token ids in [0, V) per document, each followed by the EOD id V (NullTokenizer(V)'s eod).

    python make_data.py MEGATRON_DEEPSPEED_CHECKOUT PREFIX [--vocab 1023] [--docs 400] [--seed 1234]
"""
import argparse
import sys

import numpy
import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("checkout")
    parser.add_argument("prefix")
    parser.add_argument("--vocab", type=int, default=1023, help="NullTokenizer's --vocab-size; EOD is this id")
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=160)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    sys.path.insert(0, args.checkout)
    from megatron.data.indexed_dataset import data_file_path, index_file_path, make_builder

    rng = numpy.random.default_rng(args.seed)
    builder = make_builder(data_file_path(args.prefix), impl="mmap", vocab_size=args.vocab + 1)
    total = 0
    for _ in range(args.docs):
        length = int(rng.integers(args.min_len, args.max_len + 1))
        builder.add_item(torch.from_numpy(numpy.append(rng.integers(0, args.vocab, length), args.vocab)))
        builder.end_document()
        total += length + 1
    builder.finalize(index_file_path(args.prefix))
    print(f"{args.prefix}: {args.docs} documents, {total} tokens, EOD id {args.vocab}")


if __name__ == "__main__":
    main()
