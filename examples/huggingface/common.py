"""What both examples share: a tiny GQA Llama built from a config (no download) and a toy corpus of documents.

Nothing here is needed on a real run: load your model with from_pretrained and tokenize your own data."""

import sys

import torch

VOCAB = 128


def tiny_llama():
    """A 2-layer Llama with grouped-query attention (8 query heads, 2 K/V heads), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         use_cache=False)  # training: with a KV cache transformers does not keep packed documents apart
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def documents(count, seed=0):
    """``count`` tokenized documents of 16..160 tokens, each counting up from a random start by a random stride
    (mod VOCAB): learnable, so the loss falls. As a dataset of {"input_ids", "labels"} examples."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(16, 161, (1,), generator=g))
        start, stride = (int(x) for x in torch.randint(1, VOCAB, (2,), generator=g))
        ids = [(start + stride * i) % VOCAB for i in range(n)]
        out.append({"input_ids": ids, "labels": ids})
    return out


def skip_cpu_shm_build():
    """On CPU, DeepSpeed JIT-compiles a shared-memory all-reduce op (~2 min, used only for inference) when it
    first initialises torch.distributed; training does not need it. No-op on GPUs."""
    import deepspeed  # noqa: F401

    if not torch.cuda.is_available():
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
