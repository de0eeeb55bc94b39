"""The all-gather CP attention as Megatron-Core's ``core_attention`` (SelfAttentionSubmodules).

Use ``gpt_layer_spec_with_cp_attention()`` (Megatron's local GPT layer spec with this module swapped in)
or put ``AllGatherCPCoreAttention`` in your own spec. The CP group comes from ``pg_collection.cp`` (else
parallel_state). Document boundaries come from ``PackedSeqParams.cu_seqlens_q``: cumulative document
lengths over the FULL (un-sharded) sequence, [0, ..., S]; without packed_seq_params every sequence is
one document. Shard the batch with ``l3plugin.cp.shard_batch`` (rank i holds chunks i and 2cp-1-i,
the same layout Megatron's ``get_batch_on_this_cp_rank`` and RoPE's CP slicing use).

Prefer ``PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=...)``: Megatron then applies RoPE by global
position, matching our layout. With ``qkv_format="thd"`` Megatron's RoPE assumes TE's per-document CP
split, which is not ours, so that combination is refused when cp > 1.
"""

from __future__ import annotations

import torch

from l3plugin.cp.attention import all_gather_attention


class AllGatherCPCoreAttention(torch.nn.Module):
    """Drop-in ``core_attention``: all-gather K/V over CP, document + causal mask, reduce-scatter dK/dV."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, kernel="auto"):
        super().__init__()
        from megatron.core import parallel_state

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout} is not supported by the all-gather CP "
                             f"attention (Llama 3 trains without it): set attention_dropout=0.0")
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.kernel = kernel
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()

    @staticmethod
    def _is_causal(mask_type) -> bool:
        return mask_type is None or "causal" in getattr(mask_type, "name", str(mask_type))

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the all-gather CP attention")
        causal = self._is_causal(attn_mask_type if attn_mask_type is not None else self.attn_mask_type)
        group = self.cp_group if self.cp_group.size() > 1 else None
        if query.dim() == 3:  # THD: [t, heads, dim], one packed sequence
            if group is not None:
                raise ValueError("qkv_format='thd' with cp > 1: Megatron's RoPE then uses TE's per-document "
                                 "CP layout; use PackedSeqParams(qkv_format='sbhd', cu_seqlens_q=...)")
            cu = self._cu_seqlens(packed_seq_params, query.size(0))
            out = all_gather_attention(query, key, value, cu, group=group, causal=causal,
                                       softmax_scale=self.softmax_scale, kernel=self.kernel)
            return out.reshape(out.size(0), -1)
        seq_len = query.size(0) * (group.size() if group is not None else 1)
        if packed_seq_params is not None and query.size(1) != 1:
            raise ValueError(f"packed sequences need micro-batch size 1 (got {query.size(1)}): "
                             f"cu_seqlens describes one packed sequence")
        cu = self._cu_seqlens(packed_seq_params, seq_len)
        outs = [all_gather_attention(query[:, b], key[:, b], value[:, b], cu, group=group, causal=causal,
                                     softmax_scale=self.softmax_scale, kernel=self.kernel)
                for b in range(query.size(1))]
        out = torch.stack(outs, dim=1)  # [s, b, heads, dim]
        return out.reshape(out.size(0), out.size(1), -1)

    @staticmethod
    def _cu_seqlens(packed_seq_params, seq_len):
        if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
            return torch.tensor([0, seq_len])
        return packed_seq_params.cu_seqlens_q


def gpt_layer_spec_with_cp_attention(**local_spec_kwargs):
    """Megatron-Core's local GPT layer spec (no TE) with ``AllGatherCPCoreAttention`` as core_attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(**local_spec_kwargs)
    spec.submodules.self_attention.submodules.core_attention = AllGatherCPCoreAttention
    return spec
