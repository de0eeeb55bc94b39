"""Tiny transformers models built from configs (no downloads) and packed batches, for the HF CP tests."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

VOCAB = 96


def _deepspeed_has_sequence_parallel() -> bool:
    """Read from the installed files: importing deepspeed in pytest's own process would cost seconds."""
    spec = importlib.util.find_spec("deepspeed")
    return spec is not None and any(os.path.isdir(os.path.join(d, "runtime", "sequence_parallel"))
                                    for d in spec.submodule_search_locations or ())


# CP from the key needs DeepSpeed's sequence-parallel groups (DeepSpeed >= 0.17); on 0.16 the key's CP is refused
# with one message (test_hf_deepspeed_cp.py::test_cp_without_deepspeed_sequence_parallel_groups_is_refused).
NEEDS_DEEPSPEED_SP = pytest.mark.skipif(not _deepspeed_has_sequence_parallel(),
                                        reason="DeepSpeed < 0.17 has no sequence-parallel groups: "
                                               "context_parallel_size is refused on it (its own test)")


def tiny_model(family="llama", seed=0, dtype=torch.float32):
    """A 2-layer GQA causal LM (4 query heads, 2 K/V heads) of the given family, seeded."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  attention_dropout=0.0, tie_word_embeddings=False,
                  use_cache=False)  # with a cache, HF itself does not mask packed documents apart
    if family == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif family == "qwen2":
        config, cls = transformers.Qwen2Config(**common, use_sliding_window=False), transformers.Qwen2ForCausalLM
    else:
        raise ValueError(family)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return cls(config).to(dtype)


def documents(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def packed(docs_per_row):
    """HF's packed format through DataCollatorWithFlattening: input_ids, labels (-100 at each document's
    first token) and position_ids restarting at 0 per document; one row per list of documents."""
    from transformers import DataCollatorWithFlattening

    rows = [DataCollatorWithFlattening()([{"input_ids": d, "labels": d} for d in docs]) for docs in docs_per_row]
    return {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids")}


# Rows of 64 tokens: at cp=2 the 2cp chunks are 16 tokens, so these documents cross chunk borders.
ROW_A = [23, 27, 14]
ROW_B = [5, 40, 19]


def quiet_deepspeed():
    """deepspeed on the harness' gloo group, without its ~120 s shm-op JIT compile (inference only)."""
    import logging
    import sys

    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def step_rows(step, micro):
    """The two packed rows of one micro-batch (documents cross the cp=2 chunk borders)."""
    lengths = (ROW_A, ROW_B) if (step + micro) % 2 == 0 else (ROW_B[::-1], ROW_A[::-1])
    return [documents(1000 * step + 10 * micro + r, n) for r, n in enumerate(lengths)]
