"""The demo's tiny Llama-style model config: Megatron-Core GPTModel (local spec) with RMSNorm, SwiGLU, RoPE, GQA
and l3plugin's CP attention; its chunks are built by l3plugin/megatron/model.py ``build_chunk`` (weights that
depend only on each parameter's global name, so a TP/CP/PP-split run starts from a single-process run's numbers).
"""

from __future__ import annotations

import torch


def llama_config(*, num_layers, hidden, heads, kv_heads, ffn, tp=1, cp=1, pp=1, vpp=None, k=None,
                 layout=None, dtype=torch.bfloat16):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv_heads,
        ffn_hidden_size=ffn, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, tensor_model_parallel_size=tp, context_parallel_size=cp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        microbatch_group_size_per_vp_stage=k, pipeline_model_parallel_layout=layout,
        calculate_per_token_loss=True, batch_p2p_comm=False, deallocate_pipeline_outputs=True)
