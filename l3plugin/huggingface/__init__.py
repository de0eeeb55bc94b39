"""Hugging Face transformers bridge to l3plugin's all-gather CP attention.

``enable_context_parallel(model, group)`` (context_parallel.py) swaps a transformers model's attention for the
all-gather CP attention through transformers' attention registry (attention.py), shards every batch over the
CP group (batch.py) and makes the loss the whole sequence's token mean. Nothing here needs DeepSpeed; with
``"l3plugin": {"context_parallel_size": N}`` in a DeepSpeed config, ``deepspeed.initialize`` (directly, from
accelerate or from the Trainer) builds the CP groups and calls it (l3plugin/deepspeed/sequence_parallel.py).
"""

from l3plugin.huggingface.attention import ATTENTION_NAME, cp_attention_forward, sum_over_cp
from l3plugin.huggingface.batch import cu_seqlens_from_position_ids
from l3plugin.huggingface.context_parallel import (context_parallel_group, disable_context_parallel,
                                                   enable_context_parallel, last_cp_batch, tokens_seen_once_per_replica)
from l3plugin.huggingface.outputs import full_rows

__all__ = ["ATTENTION_NAME", "context_parallel_group", "cp_attention_forward", "cu_seqlens_from_position_ids",
           "disable_context_parallel", "enable_context_parallel", "full_rows", "last_cp_batch", "sum_over_cp",
           "tokens_seen_once_per_replica"]
