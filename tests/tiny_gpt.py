"""A tiny Megatron-Core GPTModel on CPU (local layer spec + l3plugin's CP attention, learned positions)
with name-keyed weights (l3plugin/demo/model.py, as the demo's), so any CP/PP split holds the same
numbers as one piece.
"""

from __future__ import annotations

import functools

import torch

from l3plugin.demo.model import build_chunk, global_name

VOCAB = 64


def gpt_config(num_layers=4, hidden=32, heads=4, kv_heads=2, pp=1, vpp=None, cp=1, k=None, **kwargs):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv_heads,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, attention_dropout=0.0,
        hidden_dropout=0.0, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp, microbatch_group_size_per_vp_stage=k, batch_p2p_comm=False,
        deallocate_pipeline_outputs=True, **kwargs)


class SequenceParallelTorchNorm:
    """TEST-ONLY: torch's LayerNorm / RMSNorm for a sequence-parallel model on the CPU. Megatron's norms that
    allow sequence parallelism (TE's, apex's FusedLayerNorm) need a GPU; its torch wrapper refuses it. A norm
    is per token, so a sequence shard needs nothing else; like those norms, its weights are marked
    ``sequence_parallel`` (their gradients are partial per TP rank and summed over TP)."""

    def __new__(cls, config, hidden_size, eps=1e-5, **_unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def sequence_parallel_spec(config, vp_stage, pp_rank):
    """The local block spec (l3plugin's CP attention) with SequenceParallelTorchNorm for every norm."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock, TransformerBlockSubmodules, get_num_layers_to_build)

    from l3plugin.megatron.attention import gpt_layer_spec_with_cp_attention

    layer = gpt_layer_spec_with_cp_attention()
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    layers = [layer] * get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=layers, layer_norm=SequenceParallelTorchNorm))


def build_gpt(config, *, pre_process=True, post_process=True, vp_stage=None, seq_len=16, tp_size=1, tp_rank=0,
              share_embeddings_and_output_weights=False, pp_rank=0):
    """The demo's model builder with learned absolute positions and this module's small vocabulary
    (sequence parallel: with SequenceParallelTorchNorm)."""
    spec = sequence_parallel_spec(config, vp_stage, pp_rank) if config.sequence_parallel else None
    return build_chunk(config, vocab=VOCAB, seq_len=seq_len, pre_process=pre_process, post_process=post_process,
                       vp_stage=vp_stage, position_embedding_type="learned_absolute", tp_size=tp_size,
                       tp_rank=tp_rank, share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                       spec=spec)


def named_grads(chunks) -> dict[str, torch.Tensor]:
    return {global_name(ch, n): p.grad.clone() for ch in chunks for n, p in ch.named_parameters()}


def cp_loss_and_grads(model, per_token, loss_mask, den, dtype, cp_group) -> dict:
    """Backward of the masked token sum of ``per_token`` over ``den`` tokens; the loss and the gradients summed over
    the CP group (CP extends DP for parameters), as {"loss", "grads"}."""
    import torch.distributed as dist

    loss = (per_token.to(dtype) * loss_mask.to(dtype)).sum() / den
    loss.backward()
    total, grads = loss.detach().clone(), named_grads([model])
    if cp_group.size() > 1:
        dist.all_reduce(total, group=cp_group)
        for g in grads.values():
            dist.all_reduce(g, group=cp_group)
    return {"loss": total, "grads": grads}


def assert_equal_to_cp1(results, cp1, tol=1e-12):
    """Every rank's {"loss", "grads"} equals the CP 1 run's within ``tol`` (max abs), naming the first tensor off."""
    for r in results:
        assert abs(float(r["loss"] - cp1["loss"])) < tol
        assert r["grads"].keys() == cp1["grads"].keys()
        for name, ref in cp1["grads"].items():
            err = float((r["grads"][name] - ref).abs().max())
            assert err < tol, f"{name}: {err}"


def microbatches(m, micro_batch_size, seq_len, seed=11):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (micro_batch_size, seq_len + 1), generator=gen)
        mask = (torch.rand(micro_batch_size, seq_len, generator=gen) > 0.2).float()
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
                    "position_ids": torch.arange(seq_len).expand(micro_batch_size, seq_len)})
    return out


def loss_func(loss_mask, per_token_loss):
    loss = (per_token_loss.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """Megatron forward_step_func for the batches of ``microbatches``."""
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, functools.partial(loss_func, batch["loss_mask"])
