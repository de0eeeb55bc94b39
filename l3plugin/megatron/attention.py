"""The all-gather CP attention as Megatron-Core's ``core_attention`` (SelfAttentionSubmodules).

Use ``gpt_layer_spec_with_cp_attention()`` (Megatron's local GPT layer spec with this module swapped in)
or put ``AllGatherCPCoreAttention`` in your own spec. The CP group comes from ``pg_collection.cp`` (else
parallel_state). Document boundaries come from ``PackedSeqParams.cu_seqlens_q``: cumulative document
lengths over the FULL (un-sharded) sequence, [0, ..., S]; without packed_seq_params every sequence is
one document. Shard the batch with ``l3plugin.cp.shard_batch`` and the same ``cp_layout``:

- ``"2cp"`` (default, the paper's): rank i holds chunks i and 2cp-1-i, the layout Megatron's
  ``get_batch_on_this_cp_rank`` and RoPE's CP slicing use, so nothing else changes.
- ``"balanced"`` (documents dealt to ranks by attention work, l3plugin/cp/layout.py): pass
  ``gpt_layer_spec_with_cp_attention(cp_layout="balanced")``, shard with
  ``shard_batch(batch, cp, cp_rank, layout="balanced", cu_seqlens=...)``, and call
  ``rope_follows_cp_layout(model, "balanced")`` on every GPTModel chunk: Megatron's RotaryEmbedding
  would otherwise give this rank the positions of the paper's chunks. Every forward then needs
  ``packed_seq_params.cu_seqlens_q`` (the layout is derived from it, identically on every rank).
  l3plugin's planner (l3plugin/planner/) does not model the CP imbalance of either layout.

``PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=...)`` selects l3plugin's layouts above (nothing padded,
documents cross chunk borders; Megatron applies RoPE by global position, matching them).

``qkv_format="thd"`` is Megatron-Core's own packed format, taken as Megatron builds it: q/k/v [t, heads, dim]
(no batch dimension: micro-batch size 1), ``cu_seqlens_q`` the real document lengths, ``cu_seqlens_q_padded``
(optional) where each padded document starts, both over the whole packed sequence. With cp > 1 the local t
tokens are Megatron's / TE's per-document split (every document padded to a multiple of 2cp, rank i holding
its pieces i and 2cp-1-i), the split Megatron's THD RoPE (``_apply_rotary_pos_emb_thd``) assumes for the
offsets it is given (cu_seqlens_q_padded, else cu_seqlens_q): l3plugin attends that layout as it is
(l3plugin.cp.attention.thd_attention), padding tokens get zero output. Bad boundaries raise on every rank before any
communication, naming the parameter, its value and the rule.
"""

from __future__ import annotations

import functools

import torch

from l3plugin.cp.attention import all_gather_attention, check_cp_kv, thd_attention
from l3plugin.cp.layout import LAYOUT_NAMES, make_layout
from l3plugin.upstream.versions import MEGATRON_CHECKED
from l3plugin.upstream.patchset import Patch, PatchSet

CP_COMM_TYPE = "l3plugin_all_gather"  # Megatron's --cp-comm-type / TransformerConfig.cp_comm_type value


def check_layout_name(cp_layout) -> str:
    """A model serves many sequences, so it takes a layout NAME (a CPLayout fits one sequence)."""
    if not isinstance(cp_layout, str) or cp_layout not in LAYOUT_NAMES:
        raise ValueError(f"cp_layout={getattr(cp_layout, 'name', cp_layout)!r} is invalid: a model takes a "
                         f"layout name, one of {list(LAYOUT_NAMES)} (a CPLayout fits one sequence only)")
    return cp_layout


class AllGatherCPCoreAttention(torch.nn.Module):
    """Drop-in ``core_attention``: all-gather K/V over CP, document + causal mask, reduce-scatter dK/dV."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, kernel="auto", cp_layout="2cp",
                 cp_kv="regather", documents_required=False):
        super().__init__()
        from megatron.core import parallel_state

        check_layout_name(cp_layout)  # at model build, not mid-step
        check_cp_kv(cp_kv)

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout} is not supported by the all-gather CP "
                             f"attention (Llama 3 trains without it): set attention_dropout=0.0")
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.kernel = kernel
        self.cp_layout = cp_layout
        self.cp_kv = cp_kv
        # Set when the run has document masks: a forward without boundaries would attend across documents.
        self.documents_required = documents_required
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
        thd = getattr(packed_seq_params, "qkv_format", None) == "thd"
        if thd or query.dim() == 3:  # THD: [t, heads, dim], one packed sequence
            query, key, value = self._thd_inputs(query, key, value)
            cu, padded = self._thd_boundaries(packed_seq_params, query.size(0) * (group.size() if group else 1))
            out = thd_attention(query, key, value, cu, padded, group=group, causal=causal,
                                softmax_scale=self.softmax_scale, kernel=self.kernel, cp_kv=self.cp_kv)
            return out.reshape(out.size(0), -1)
        seq_len = query.size(0) * (group.size() if group is not None else 1)
        if packed_seq_params is not None and query.size(1) != 1:
            raise ValueError(f"packed sequences need micro-batch size 1 (got {query.size(1)}): "
                             f"cu_seqlens describes one packed sequence")
        cu = self._cu_seqlens(packed_seq_params, seq_len)
        outs = [all_gather_attention(query[:, b], key[:, b], value[:, b], cu, group=group, causal=causal,
                                     softmax_scale=self.softmax_scale, kernel=self.kernel,
                                     layout=self.cp_layout, cp_kv=self.cp_kv)
                for b in range(query.size(1))]
        out = torch.stack(outs, dim=1)  # [s, b, heads, dim]
        return out.reshape(out.size(0), out.size(1), -1)

    def _thd_inputs(self, query, key, value):
        """Megatron squeezes THD's batch dimension of size 1 (attention.py); a larger one arrives 4-D."""
        if query.dim() == 4:
            if query.size(1) != 1:
                raise ValueError(f"layer {self.layer_number}: qkv_format='thd' with micro-batch size "
                                 f"{query.size(1)} (query shape {tuple(query.shape)}): a THD batch is one packed "
                                 f"sequence, micro-batch size must be 1; pack the samples into one sequence")
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        return query, key, value

    def _thd_boundaries(self, packed, seq_len):
        """(cu_seqlens_q, cu_seqlens_q_padded) of a THD forward; self-attention: the kv ones must agree."""
        if packed is None or packed.cu_seqlens_q is None:
            return self._cu_seqlens(packed, seq_len), None
        for q_name, kv_name in (("cu_seqlens_q", "cu_seqlens_kv"), ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
            q_cu, kv_cu = getattr(packed, q_name), getattr(packed, kv_name)
            if kv_cu is not None and (q_cu is None or not torch.equal(
                    torch.as_tensor(q_cu).reshape(-1).cpu().long(), torch.as_tensor(kv_cu).reshape(-1).cpu().long())):
                raise ValueError(f"layer {self.layer_number}: packed_seq_params.{kv_name}="
                                 f"{torch.as_tensor(kv_cu).reshape(-1).tolist()[:16]} differs from {q_name}="
                                 f"{None if q_cu is None else torch.as_tensor(q_cu).reshape(-1).tolist()[:16]}: "
                                 f"self-attention has one set of documents (give the same, or leave {kv_name} None)")
        return packed.cu_seqlens_q, packed.cu_seqlens_q_padded

    def _cu_seqlens(self, packed_seq_params, seq_len):
        if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
            if self.documents_required:
                raise ValueError(
                    f"layer {self.layer_number}: document masks are on (--reset-attention-mask) but this forward "
                    f"got no packed_seq_params.cu_seqlens_q. Megatron-LM's get_batch gives the boundaries only "
                    f"to the first and last pipeline stages; l3plugin gives them to the others inside a "
                    f"schedule call (a forward_backward_func from get_forward_backward_func, after "
                    f"l3plugin.megatron.install()): run the model's forwards through it")
            return torch.tensor([0, seq_len])
        return packed_seq_params.cu_seqlens_q


def gpt_layer_spec_with_cp_attention(cp_layout="2cp", cp_kv="regather", **local_spec_kwargs):
    """Megatron-Core's local GPT layer spec (no TE) with ``AllGatherCPCoreAttention`` as core_attention,
    sharding by ``cp_layout`` ("2cp", the paper's, or "balanced"; see the module docstring) and keeping
    K/V for the backward by ``cp_kv`` ("regather", the default: only the local K/V, gathered again in the
    backward; or "keep": the gathered K/V; see l3plugin.cp.attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    check_layout_name(cp_layout)
    check_cp_kv(cp_kv)
    spec = get_gpt_layer_local_spec(**local_spec_kwargs)
    core = AllGatherCPCoreAttention
    options = {k: v for k, v, default in (("cp_layout", cp_layout, "2cp"), ("cp_kv", cp_kv, "regather"))
               if v != default}
    if options:  # Megatron calls core_attention(config=..., ...): a partial carries the options
        core = functools.partial(AllGatherCPCoreAttention, **options)
    spec.submodules.self_attention.submodules.core_attention = core
    return spec


def rope_follows_cp_layout(model, cp_layout: str):
    """Make ``model.rotary_pos_emb`` (Megatron's RotaryEmbedding) give this CP rank the rotary embedding
    of the positions it holds under ``cp_layout``, per microbatch. Megatron slices RoPE by the paper's
    2cp chunks, so for "2cp" nothing is changed. A forward pre-hook reads the microbatch's global
    ``packed_seq_params.cu_seqlens_q`` and computes the layout exactly as the core attention does.
    Call it on each GPTModel chunk itself, before wrapping it (DDP, Float16Module). The patch of the
    embedding's ``forward`` is declared below (set ROPE)."""
    rope = getattr(model, "rotary_pos_emb", None)
    check_layout_name(cp_layout)
    if cp_layout == "2cp" or rope is None:
        return model
    rope.l3plugin_positions = None  # this microbatch's positions on this rank, set by the hook
    ROPE.apply_to(rope, rope_of_held_positions)
    model.register_forward_pre_hook(functools.partial(_positions_of_microbatch, rope, cp_layout), with_kwargs=True)
    return model


def _positions_of_microbatch(rope, cp_layout, module, args, kwargs):
    packed = kwargs.get("packed_seq_params", args[6] if len(args) > 6 else None)
    cu = getattr(packed, "cu_seqlens_q", None)
    if cu is None:
        raise ValueError(f"cp_layout={cp_layout!r} needs packed_seq_params.cu_seqlens_q (the global "
                         f"document boundaries [0, ..., S]) in every forward: the layout depends on them")
    group = rope.cp_group
    cp = group.size() if group is not None else 1
    seq_len = int(torch.as_tensor(cu).reshape(-1)[-1])
    layout = make_layout(cp_layout, seq_len, cp, cu)  # cached: the core attention builds the same
    rope.l3plugin_positions = layout.indices(group.rank() if cp > 1 else 0)


def rope_of_held_positions(self, max_seq_len, offset=0, packed_seq=False, cp_group=None):
    """RotaryEmbedding.forward of the positions this rank holds (``rope_follows_cp_layout``)."""
    full_emb = ROPE.stock_of(self, rope_of_held_positions)  # stock (or a CPU replacement)
    positions = self.l3plugin_positions
    if packed_seq or positions is None:
        return full_emb(max_seq_len, offset, packed_seq, cp_group)
    cp = self.cp_group.size() if self.cp_group is not None else 1
    emb = full_emb(positions.numel() * cp, offset, packed_seq=True)  # [S, 1, 1, dim], no CP slicing
    return emb[positions.to(emb.device)]


ROPE = PatchSet("l3plugin.megatron (RoPE)", "megatron-core", MEGATRON_CHECKED, [
    Patch("megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding", "forward",
          rope_of_held_positions, instance=True, signature=("self", "max_seq_len", "offset", "packed_seq", "cp_group"),
          why="with a CP layout other than the paper's 2cp chunks, each rank's RoPE must follow the positions it "
              "holds (rope_follows_cp_layout)"),
])
