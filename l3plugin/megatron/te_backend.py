"""Transformer Engine backend: Megatron's TEDotProductAttention with one more ``cp_comm_type``.

``te_attention_class()`` builds (lazily, once) a subclass of Megatron-Core's TEDotProductAttention that
behaves exactly like it, except that ``cp_comm_type="l3plugin_all_gather"`` routes attention to
l3plugin's all-gather CP attention with document masking (``l3plugin.megatron.attention``). Put it in a
TE layer spec (``submodules.core_attention``) and set ``--cp-comm-type l3plugin_all_gather``; its
``cp_layout`` parameter ("2cp" or "balanced", see ``l3plugin.cp.layout``; with "balanced" also call
``l3plugin.megatron.attention.rope_follows_cp_layout`` on the model) applies to that route only.

TE is optional and GPU-only. A half-installed TE raises RuntimeError (not ImportError) at import, and
without TE Megatron makes ``te`` a MagicMock (subclassing it silently yields a mock), so availability
is checked explicitly and failures are reported with the reason.

Verification status: on this project's CPU-only CI TE cannot be imported, so only the refusal path is
tested; the class itself has not been run against a real TE build.
"""

from __future__ import annotations

import functools

from l3plugin.megatron.attention import CP_COMM_TYPE


def te_unavailable_reason() -> str | None:
    """None when Transformer Engine and Megatron's TE extension import; otherwise why not."""
    try:
        import transformer_engine.pytorch  # noqa: F401
        from megatron.core.extensions import transformer_engine as mcore_te
    except Exception as exc:  # ImportError, or RuntimeError from a TE built for another CUDA/torch
        return f"Transformer Engine is not importable: {type(exc).__name__}: {exc}"
    if not getattr(mcore_te, "HAVE_TE", False):
        return "megatron.core.extensions.transformer_engine reports HAVE_TE=False"
    return None


@functools.lru_cache(maxsize=1)
def te_attention_class():
    reason = te_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"{reason}. Use l3plugin.megatron.attention.AllGatherCPCoreAttention "
                           f"(local spec) instead, or install transformer-engine on a GPU machine.")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    from l3plugin.megatron.attention import AllGatherCPCoreAttention

    class L3TEDotProductAttention(TEDotProductAttention):
        """TEDotProductAttention plus cp_comm_type='l3plugin_all_gather'."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type="p2p",
                     pg_collection=None, cp_layout="2cp", cp_kv="regather", documents_required=False,
                     **kwargs):
            ours = cp_comm_type == CP_COMM_TYPE
            if cp_layout != "2cp" and not ours:
                raise ValueError(f"cp_layout={cp_layout!r} needs cp_comm_type={CP_COMM_TYPE!r} (TE's own CP "
                                 f"attention uses the 2cp layout), got cp_comm_type={cp_comm_type!r}")
            # TE rejects unknown cp_comm_type values: give it a valid one it will never use.
            super().__init__(config, layer_number, attn_mask_type, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                             k_channels=k_channels, v_channels=v_channels,
                             cp_comm_type="p2p" if ours else cp_comm_type, pg_collection=pg_collection,
                             **kwargs)
            self.l3plugin_attention = (
                AllGatherCPCoreAttention(config, layer_number, attn_mask_type, attention_type,
                                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                                         pg_collection=pg_collection, cp_layout=cp_layout, cp_kv=cp_kv,
                                         documents_required=documents_required) if ours else None)

        def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            if self.l3plugin_attention is not None:
                return self.l3plugin_attention(query, key, value, attention_mask,
                                               attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                               packed_seq_params=packed_seq_params)
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                                   **kwargs)

    return L3TEDotProductAttention
