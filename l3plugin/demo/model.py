"""The demo's tiny Llama-style model: Megatron-Core GPTModel (local spec) with RMSNorm, SwiGLU, RoPE, GQA and
l3plugin's CP attention (``llama_config``), built in chunks whose weights depend only on each parameter's global
name (``build_chunk``), so a TP/CP/PP-split run starts from exactly the numbers of a single-process run (the
tests' tiny GPT is built here too). On a CPU-only machine RoPE is computed on the CPU (``rope_on_cpu``) and the
tied embedding copies are synchronised on the CPU (``tied_embeddings_on_cpu``).
"""

from __future__ import annotations

import zlib

import torch

from l3plugin.upstream.versions import MEGATRON_CHECKED
from l3plugin.upstream.patchset import Patch, PatchSet


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


TIED_COPY = "output_layer.weight"  # the last stage's copy of the word embedding, when they are tied


def global_name(chunk, name: str) -> str:
    """Parameter name in the whole model: local decoder layer index -> global layer number; the output layer
    tied to the word embedding is that embedding."""
    if name == TIED_COPY and getattr(chunk, "share_embeddings_and_output_weights", False):
        return "embedding.word_embeddings.weight"
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def _tp_slice(full, param, name, tp_size, tp_rank, gated):
    """This TP rank's part of a full (tp=1) tensor, in Megatron's layout."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if gated and name.endswith("linear_fc1.weight"):
        # SwiGLU fc1 is [gate; up]; each TP rank holds [its gate slice; its up slice].
        return torch.cat([half.chunk(tp_size, dim)[tp_rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(tp_size, dim)[tp_rank]


def deterministic_init(chunk, tp_size=1, tp_rank=0, scale=0.05):
    gated = getattr(chunk.config, "gated_linear_unit", False)
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            shape = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= tp_size
            gen = torch.Generator().manual_seed(zlib.crc32(global_name(chunk, name).encode()))
            full = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
            if "layernorm.weight" in name:  # norms start near 1
                full += 1.0
            param.copy_(_tp_slice(full, param, name, tp_size, tp_rank, gated))


def rope_on_cpu(self, max_seq_len, offset=0, packed_seq=False, cp_group=None):
    """RotaryEmbedding.forward on a CPU-only machine (set CPU_ROPE, below)."""
    # Megatron's RotaryEmbedding moves its frequencies to the current CUDA device and picks the CP
    # rank's positions with a pinned CUDA index tensor; on a CPU-only machine both raise. Same result
    # here: frequencies where inv_freq already is, and this CP rank's 2 of 2*cp chunks (the "2cp"
    # layout; rope_follows_cp_layout wraps this for the others).
    from l3plugin.cp.sharding import shard_indices

    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    cp_group = cp_group if cp_group is not None else self.cp_group
    if cp_group is not None and cp_group.size() > 1 and not packed_seq:
        emb = emb[shard_indices(max_seq_len, cp_group.size(), cp_group.rank()).to(emb.device)]
    return emb


def tied_embeddings_on_cpu(original, _name):
    """LanguageModule.setup_embeddings_and_output_layer on a CPU-only machine (set TIED_EMBEDDINGS, below)."""
    # With tied embeddings at pp > 1 Megatron copies the first stage's embedding into the last stage's
    # output layer by an all-reduce over the embedding group, after moving the weight to the CUDA device
    # (weight.data.cuda()), which raises without one. Same result here: upstream's setup with that copy
    # skipped, then the same all-reduce where the weight is (gloo on the CPU).
    import functools

    from l3plugin.collective.comm import all_reduce_sum
    from l3plugin.collective.waits import resolve_timeout

    @functools.wraps(original)
    def setup(self, *args, **kwargs):
        asked = []  # upstream asks _is_in_embd_group() exactly where it would make the copy
        self._is_in_embd_group = lambda: asked.append(True) and False
        try:
            original(self, *args, **kwargs)
        finally:
            del self._is_in_embd_group
        meta = getattr(self.config, "init_model_with_meta_device", False)
        if asked and self._is_in_embd_group() and not meta:
            all_reduce_sum(self.shared_embedding_or_output_weight().data, self.embd_group, resolve_timeout(),
                           "the tied embedding's initial copy")

    return setup


def build_chunk(config, *, vocab, seq_len, pre_process, post_process, vp_stage=None, tp_size=1, tp_rank=0,
                position_embedding_type="rope", cp_layout="2cp", share_embeddings_and_output_weights=False,
                spec=None):
    """One model chunk. ``share_embeddings_and_output_weights``: GPTModel's default is True (the demo's
    model); the tests' tiny GPT leaves them untied unless asked. ``spec``: the layer or block spec (default:
    Megatron's local layer spec with l3plugin's CP attention)."""
    import contextlib

    from megatron.core.models.gpt import GPTModel

    from l3plugin.megatron.attention import gpt_layer_spec_with_cp_attention, rope_follows_cp_layout

    cpu_only = not torch.cuda.is_available()
    with TIED_EMBEDDINGS.within() if cpu_only and share_embeddings_and_output_weights else contextlib.nullcontext():
        model = GPTModel(config, spec or gpt_layer_spec_with_cp_attention(cp_layout), vocab_size=vocab,
                         max_sequence_length=seq_len, pre_process=pre_process, post_process=post_process,
                         share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                         position_embedding_type=position_embedding_type, vp_stage=vp_stage)
    if cpu_only and getattr(model, "rotary_pos_emb", None) is not None:
        CPU_ROPE.apply_to(model.rotary_pos_emb, rope_on_cpu)
    rope_follows_cp_layout(model, cp_layout)  # "balanced": RoPE of the positions this rank holds
    deterministic_init(model, tp_size, tp_rank)
    return model


# -- Megatron's CUDA-only pieces, on a CPU-only machine -------------------------------------------------------
CPU_ROPE = PatchSet("l3plugin.demo (RoPE on CPU)", "megatron-core", MEGATRON_CHECKED, [
    Patch("megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding", "forward", rope_on_cpu,
          instance=True, signature=("self", "max_seq_len", "offset", "packed_seq", "cp_group"),
          why="on a CPU-only machine RotaryEmbedding moves its frequencies to the CUDA device and indexes with a "
              "pinned CUDA tensor; the same result computed where inv_freq is"),
])

# build_chunk builds GPTModel inside TIED_EMBEDDINGS.within().
TIED_EMBEDDINGS = PatchSet("l3plugin.demo (tied embeddings on CPU)", "megatron-core", MEGATRON_CHECKED, [
    Patch("megatron.core.models.common.language_module.language_module:LanguageModule",
          "setup_embeddings_and_output_layer", tied_embeddings_on_cpu, wraps=True, signature=("self",),
          why="with tied embeddings at pp > 1 the copy of the first stage's embedding into the last stage moves the "
              "weight to the CUDA device first; on a CPU-only machine the same all-reduce where the weight is"),
])
