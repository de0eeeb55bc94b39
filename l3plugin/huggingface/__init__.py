"""Hugging Face transformers / accelerate bridge to l3plugin's all-gather CP attention.

With ``"l3plugin": {"context_parallel_size": N}`` in the DeepSpeed config, ``deepspeed.initialize`` (directly,
from accelerate or from the Trainer) builds DeepSpeed's own sequence-parallel groups (CP groups of N
consecutive ranks inside DP; the engine and the ZeRO optimizer reduce over DP x CP), swaps the model's
attention for the all-gather CP attention through transformers' attention registry, shards every batch
over the CP group and makes the loss the whole sequence's token mean (deepspeed_cp.py). The pieces can
also be used alone: ``enable_context_parallel(model, group)`` (model.py).
"""

from l3plugin.huggingface.attention import ATTENTION_NAME, cp_attention_forward
from l3plugin.huggingface.batch import cu_seqlens_from_position_ids
from l3plugin.huggingface.context_parallel import context_parallel_group, disable_context_parallel, enable_context_parallel

__all__ = ["ATTENTION_NAME", "context_parallel_group", "cp_attention_forward", "cu_seqlens_from_position_ids",
           "disable_context_parallel", "enable_context_parallel"]
