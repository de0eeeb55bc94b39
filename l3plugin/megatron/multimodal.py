"""Megatron-Core wiring of a text model with cross-attention layers reading image tokens, under the flexible
pipeline schedule, with the image encoder placed as ``l3plugin.encoder`` describes (paper, section 3.2).

- ``GatedCrossAttention`` and ``cross_attention_layer_spec``: a Megatron-Core TransformerLayer whose
  self-attention is replaced by a tanh-gated cross-attention to the image tokens (Llama 3 / mllama style:
  no self-attention in those layers), with the usual MLP.
- ``multimodal_block_spec``: the TransformerBlock spec of one pipeline chunk, each layer built by its kind
  ("S" self-attention, "X" cross-attention) at its global index, for any split (counts or
  ``--pipeline-model-parallel-layout``).
- ``MultimodalChunk``: a GPTModel chunk that takes the micro-batch's cross-attention input (``context``).
  With the ``pipeline`` placement the first chunk also holds the encoder, and every chunk carries the image
  tokens after the text activations in the tensor it sends ([text + image tokens, batch, hidden]).
- ``image_encoder_placement``: the ``broadcast`` / ``replicated`` placement objects on Megatron's process
  groups (encoder gradients summed over PP and DP x CP).

Cross-attention layers run without context parallelism (the image tokens are not sharded), and the carried
image tokens of the ``pipeline`` placement without sequence parallelism.
"""

from __future__ import annotations

import torch

from l3plugin.encoder import BroadcastEncoder, ReplicatedEncoder, check_placement, image_context

KINDS = {"S": "self-attention layer", "X": "cross-attention layer"}


def _cross_attention_class():
    from megatron.core.transformer.attention import CrossAttention

    class GatedCrossAttention(CrossAttention):
        """Megatron-Core's CrossAttention with its output scaled by tanh(gate) (a learnt scalar): a new
        cross-attention layer can start near the identity of a pre-trained text model. With no image in the
        micro-batch (``key_value_states`` None) it returns zeros: the layer passes its input through."""

        def __init__(self, config, *args, **kwargs):
            if config.add_bias_linear:
                raise ValueError("cross-attention layers need add_bias_linear=False: a sample without an image "
                                 "reads zero image tokens, which must give a zero output")
            super().__init__(config, *args, **kwargs)
            self.gate = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))

        def forward(self, hidden_states, attention_mask, key_value_states=None, **kwargs):
            if key_value_states is None:
                return torch.zeros_like(hidden_states), None
            out, bias = super().forward(hidden_states, None, key_value_states=key_value_states, **kwargs)
            return torch.tanh(self.gate) * out, bias

    return GatedCrossAttention


GatedCrossAttention = None  # built on first use (Megatron-Core is imported lazily)


def gated_cross_attention_class():
    global GatedCrossAttention
    if GatedCrossAttention is None:
        GatedCrossAttention = _cross_attention_class()
    return GatedCrossAttention


class CrossCoreAttention(torch.nn.Module):
    """Core attention of a cross-attention layer: every text token attends to every image token (no mask), by
    torch's scaled_dot_product_attention on whatever device the tensors are (Megatron's local
    DotProductAttention takes its scratch buffer from the current CUDA device)."""

    def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type="cross", softmax_scale=None,
                 **_unused):
        super().__init__()
        self.config, self.softmax_scale = config, softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """[sq, b, heads, d] queries and [sk, b, heads, d] keys / values -> [sq, b, heads * d]."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("cross-attention takes no attention_bias or packed_seq_params")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale)
        sq, b, heads, d = query.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)


def cross_attention_layer_spec(self_attention_spec):
    """An "X" layer: ``self_attention_spec``'s norms and MLP around a gated cross-attention (Megatron's local
    linear layers, ``CrossCoreAttention``)."""
    import copy

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import CrossAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(self_attention_spec)
    sub = spec.submodules
    sub.pre_cross_attn_layernorm = sub.input_layernorm
    sub.input_layernorm, sub.self_attention, sub.self_attn_bda = IdentityOp, IdentityOp, IdentityFuncOp
    sub.cross_attention = ModuleSpec(
        module=gated_cross_attention_class(), params={"attn_mask_type": AttnMaskType.no_mask},
        submodules=CrossAttentionSubmodules(linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear,
                                            core_attention=CrossCoreAttention, linear_proj=RowParallelLinear))
    sub.cross_attn_bda = get_bias_dropout_add
    return spec


def check_kinds(kinds: str) -> str:
    if not kinds or set(kinds) - set(KINDS):
        raise ValueError(f"kinds={kinds!r} is invalid: one letter per layer in model order, "
                         + ", ".join(f"{k} = {v}" for k, v in KINDS.items()))
    return kinds


def chunk_layer_ids(config, vp_stage, pp_rank) -> list[int]:
    """Global indices (0-based) of the decoder layers a chunk builds, as Megatron's TransformerBlock numbers them."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)))


def multimodal_block_spec(config, kinds: str, *, vp_stage=None, pp_rank=None, self_attention_spec=None):
    """The decoder block spec of one chunk: layer i is a self-attention ("S") or cross-attention ("X") layer
    as ``kinds[i]`` says (``kinds`` covers the whole model)."""
    from megatron.core.parallel_state import get_pipeline_model_parallel_rank
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from l3plugin.megatron.attention import gpt_layer_spec_with_cp_attention

    check_kinds(kinds)
    if len(kinds) != config.num_layers:
        raise ValueError(f"kinds has {len(kinds)} letters but the model has num_layers={config.num_layers}")
    if config.context_parallel_size > 1 and "X" in kinds:
        raise ValueError(f"context_parallel_size={config.context_parallel_size}: cross-attention layers run "
                         f"without context parallelism (use context_parallel_size=1)")
    pp_rank = get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    self_spec = self_attention_spec or gpt_layer_spec_with_cp_attention()
    cross_spec = cross_attention_layer_spec(self_spec)
    layers = [cross_spec if kinds[i] == "X" else self_spec for i in chunk_layer_ids(config, vp_stage, pp_rank)]
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=layers, layer_norm=self_spec.submodules.input_layernorm))


class MultimodalChunk(torch.nn.Module):
    """One pipeline chunk (a GPTModel built with ``multimodal_block_spec``) whose cross-attention layers read
    the micro-batch's image tokens.

    ``forward(input_ids, position_ids, attention_mask, labels=None, *, context=None, images=None,
    image_index=None)``: with the ``broadcast`` / ``replicated`` placements pass ``context`` (from
    ``l3plugin.encoder.image_context``). With ``carry_image_tokens=I`` (the ``pipeline`` placement) the chunk
    sends [text, image tokens] down the pipeline; the first chunk holds ``encoder`` and encodes the
    micro-batch's ``images``, sample i reading image ``image_index[i]`` of them (-1: none); later chunks
    take the image tokens from what they receive and need ``image_index`` only to know whether any sample
    has an image. Megatron's forward_step / set_input_tensor / decoder lookups reach the GPTModel through
    ``self.module``."""

    def __init__(self, module, *, carry_image_tokens: int = 0, encoder=None):
        super().__init__()
        from l3plugin.arguments.checks import check_int

        self.module, self.config = module, module.config
        self.carry = check_int("carry_image_tokens", carry_image_tokens, low=0)
        if encoder is not None and not (self.carry and module.pre_process):
            raise ValueError("encoder is given to a chunk that is not the first stage of a pipeline placement "
                             "(carry_image_tokens > 0 and pre_process): the other placements encode outside "
                             "the pipeline (l3plugin.encoder)")
        if self.carry and module.pre_process and encoder is None:
            raise ValueError("the first chunk of the pipeline placement needs the encoder")
        if self.carry and module.config.sequence_parallel:
            raise ValueError("carry_image_tokens with sequence_parallel: the carried image tokens are not "
                             "sharded over TP; use the replicated or broadcast placement")
        self.encoder = encoder
        self._carried = None

    @property
    def vp_stage(self):
        return getattr(self.module, "vp_stage", None)

    def set_input_tensor(self, input_tensor):
        tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        x = tensors[0]
        if self.carry and x is not None:
            text_len = x.shape[0] - self.carry
            x, self._carried = x[:text_len], x[text_len:]
        self.module.set_input_tensor([x])

    def forward(self, input_ids, position_ids, attention_mask, labels=None, *, context=None, images=None,
                image_index=None, **kwargs):
        carried = None
        if self.carry:
            context, carried = self._context_to_carry(images, image_index, input_ids)
        out = self.module(input_ids, position_ids, attention_mask, labels=labels,
                          extra_block_kwargs={"context": context, "context_mask": None}, **kwargs)
        if carried is not None and not self.module.post_process:
            out = torch.cat([out, carried], dim=0)
        return out

    def _context_to_carry(self, images, image_index, input_ids):
        """(cross-attention input or None, image tokens to send on) of the pipeline placement."""
        if image_index is None:
            raise ValueError("the pipeline placement needs image_index on every chunk (-1 for no image)")
        if self.module.pre_process:
            some = any(int(i) >= 0 for i in image_index)
            tokens = self.encoder(images) if some else None
            context = None if tokens is None else image_context(tokens, image_index, self.config.params_dtype)
            carried = context if context is not None else torch.zeros(
                (self.carry, len(image_index), self.config.hidden_size), dtype=self.config.pipeline_dtype,
                device=input_ids.device)
            return context, carried
        carried, self._carried = self._carried, None
        context = carried if any(int(i) >= 0 for i in image_index) else None
        return context, carried


def image_encoder_placement(placement: str, encoder, *, pp_group=None, grad_groups=None, device=None):
    """The object running the encoder before and after the pipeline step (``encode`` / ``finish``) for the
    ``replicated`` and ``broadcast`` placements, on Megatron-Core's process groups: the pipeline group, and
    encoder gradients also summed over data x context parallel (``grad_groups`` overrides). None for the
    ``pipeline`` placement (the encoder is part of the first chunk: ``MultimodalChunk``)."""
    from megatron.core import parallel_state as ps

    check_placement(placement)
    if placement == "pipeline":
        return None
    pp_group = ps.get_pipeline_model_parallel_group() if pp_group is None else pp_group
    if grad_groups is None:
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        grad_groups = (dp_cp,) if dp_cp.size() > 1 else ()
    if placement == "replicated":
        return ReplicatedEncoder(encoder, pp_group, grad_groups)
    return BroadcastEncoder(encoder if pp_group.rank() == 0 else None, pp_group, grad_groups, device=device)
