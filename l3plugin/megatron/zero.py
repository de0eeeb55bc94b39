"""Drive l3plugin's FP32-reducing ZeRO optimizer from Megatron-Core model chunks and the flexible schedule.

    zero = megatron_zero(model_chunks, torch.optim.AdamW(params, lr=...), stage=2, clip_grad=1.0)
    attach_to_schedule(config, zero)      # ZeRO-2 reduce-scatters every round, ZeRO-1 the last: started
                                          # from the gradient hooks of the round's last backward
    forward_backward_pipelining_flexible(...)   # ends with finalize_model_grads_func = l3plugin's
    zero.step()                           # clip on the global fp32 norm, step, bf16 all-gather

Groups come from Megatron's parallel_state: gradients reduce over DP x CP; the clipping norm is summed
over the model-parallel group (TP x PP) counting TP-duplicated parameters (norms, biases) and the last
stage's copy of a tied embedding once. Megatron's own DDP wrapper is not used: l3plugin's hooks accumulate
the gradients, and what Megatron's ``finalize_model_grads`` does after its DP reduction (Megatron-Core
0.16.1 to 0.19.0) happens on l3plugin's reduced fp32 shards instead (``l3plugin/zero/grad_sums.py``):
- the word embedding tied to the output layer (GPTModel's default ``share_embeddings_and_output_weights``
  at pp > 1): summed over the embedding group (first and last stage); each copy has a bucket of its own so
  both stages own the same elements of it: the copies stay bit-identical;
- gradients of parameters marked ``sequence_parallel`` (with ``config.sequence_parallel``) and of
  ``q_layernorm`` / ``k_layernorm`` (with ``config.qk_layernorm``): summed over TP; parameters marked
  ``average_gradients_across_tp_domain``: averaged over TP;
- ``config.calculate_per_token_loss``: gradients are summed over DP x CP (not averaged) and scaled by
  1 / the global token count (the last stage's count, broadcast over PP and summed over DP x CP).
Refused with an error naming the config attribute (``UNSUPPORTED``): what needs more than these sums.
Checkpoints go through Megatron-Core's dist_checkpointing: ``l3plugin.checkpoint.megatron_dist``.
"""

from __future__ import annotations

from l3plugin.zero.optimizer import FP32ReduceZero
from l3plugin.zero.settings import DEEPSPEED_ONLY

# (config attribute, when it is refused, why): the parts of finalize_model_grads and of Megatron's DDP
# contract that l3plugin's ZeRO does not carry over.
UNSUPPORTED = (
    ("num_moe_experts", bool, "MoE: expert gradients reduce over the expert-data-parallel group and "
     "finalize_model_grads updates the routers' expert bias and aux-loss trackers"),
    ("mtp_num_layers", bool, "multi-token prediction keeps another embedding copy on the MTP stage"),
    ("has_cond_embedder", bool, "conditional embedders replicated on every pipeline stage are summed over PP"),
    ("flextron", bool, "Flextron routers' gradients are summed over PP"),
    ("gtp_weight_remat_size", lambda v: (v or 1) > 1, "replicated gradients are reduced over the gtp_remat group"),
    ("expert_gtp_weight_remat_size", lambda v: (v or 1) > 1,
     "replicated gradients are reduced over the expert gtp_remat group"),
    ("gradient_accumulation_fusion", bool, "weight gradients go into main_grad (Megatron DDP's buffers); "
     "l3plugin's hooks take .grad"),
    ("defer_embedding_wgrad_compute", bool, "the output layer's weight gradient goes into main_grad (Megatron "
     "DDP's buffers); l3plugin's hooks take .grad"),
)


def _model_config(model_chunks):
    from megatron.core.utils import get_attr_wrapped_model

    try:
        return get_attr_wrapped_model(model_chunks[0], "config")
    except RuntimeError:
        return None  # plain torch modules: nothing Megatron-specific to keep


def check_config(config) -> None:
    """Refuse a TransformerConfig asking for what megatron_zero does not carry over (``UNSUPPORTED``)."""
    for name, refused, why in UNSUPPORTED:
        value = getattr(config, name, None)
        if refused(value):
            raise ValueError(f"config.{name}={value!r} is not supported with l3plugin's ZeRO (megatron_zero): "
                             f"{why}; use Megatron's DistributedDataParallel and optimizer for this model, or "
                             f"unset {name}")


def _unwrapped(chunk):
    """The language model inside Megatron's wrappers (Float16Module, DDP), or None (not a language model)."""
    from megatron.core.utils import get_attr_wrapped_model

    try:
        return get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
    except RuntimeError:
        return None


def _tied_embedding(model_chunks):
    """(this rank's copy of the word embedding tied to the output layer or None, the embedding group), the
    group None when this rank has no copy to sum (pp = 1: one tensor serves both uses; middle stages)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_embedding_group(check_initialized=False)
    if group is None or group.size() == 1 or dist.get_rank() not in dist.get_process_group_ranks(group):
        return None, None
    pp = ps.get_pipeline_model_parallel_group()
    if pp.rank() not in (0, pp.size() - 1):
        raise ValueError(f"the embedding group {dist.get_process_group_ranks(group)} includes the middle pipeline "
                         f"stage {pp.rank()} (a custom get_embedding_ranks): megatron_zero sums the tied embedding "
                         f"of the first and the last stage only")
    module = _unwrapped(model_chunks[0] if pp.rank() == 0 else model_chunks[-1])
    if module is None or not getattr(module, "share_embeddings_and_output_weights", False):
        return None, group
    weight = module.shared_embedding_or_output_weight()
    return (weight if weight is not None and weight.requires_grad else None), group


def _check_position_embedding_group() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_position_embedding_group(check_initialized=False)
    if group is not None and group.size() > 1:
        raise ValueError(f"the position-embedding group has ranks {dist.get_process_group_ranks(group)} (a custom "
                         "get_position_embedding_ranks): megatron_zero does not sum position embeddings across "
                         "stages; GPTModel keeps them on the first stage only (the default)")


def _register_tp_sums(zero, model_chunks, config) -> None:
    """finalize_model_grads' TP reductions: sequence-parallel and qk-layernorm gradients summed, parameters
    marked ``average_gradients_across_tp_domain`` averaged (every TP rank registers both, in model order)."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    if tp_group.size() == 1:
        return
    summed, averaged = [], []
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            if getattr(p, "average_gradients_across_tp_domain", False):
                averaged.append(p)
            elif ((getattr(config, "sequence_parallel", False) and getattr(p, "sequence_parallel", False))
                  or (getattr(config, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name))):
                summed.append(p)
    zero.add_grad_sum(summed, tp_group, what="sequence-parallel / qk-layernorm gradients over TP")
    zero.add_grad_sum(averaged, tp_group, average=True, what="average_gradients_across_tp_domain gradients over TP")


def megatron_zero(model_chunks, optimizer, *, stage=1, clip_grad=0.0, gradient_scale=None, group=None,
                  **settings):
    """``group`` overrides the gradient-reduction group (default: parallel_state's DP x CP group).
    ``overlap_param_gather`` (a ZeroSettings field, default True): ``zero.step()`` only starts the parameter
    all-gathers; each chunk's layers wait for theirs in their forward pre-hooks (Megatron's
    --overlap-param-gather, for l3plugin's optimizer), any other read first in the guard of
    ``l3plugin/zero/param_gather.py``. With ``config.calculate_per_token_loss`` the
    gradients are summed over the group (``gradient_scale`` 1.0, Megatron's choice) and scaled by 1 / tokens
    in the finalize function ``attach_to_schedule`` installs."""
    from megatron.core import parallel_state as ps

    for name in DEEPSPEED_ONLY:
        if name in settings:
            raise ValueError(f"{name}={settings[name]!r} applies to the DeepSpeed engine only: under Megatron-Core "
                             f"ZeRO-2 reduce-scatters once per round of the flexible schedule and checkpoints go "
                             f"through dist_checkpointing; drop {name}")
    config = _model_config(model_chunks)
    tied, embedding_group = None, None
    if config is not None:
        check_config(config)
        if getattr(config, "calculate_per_token_loss", False):
            if gradient_scale not in (None, 1.0):
                raise ValueError(f"gradient_scale={gradient_scale!r} with config.calculate_per_token_loss: the "
                                 "gradients are summed over DP x CP and divided by the global token count; "
                                 "leave gradient_scale unset (or 1.0)")
            gradient_scale = 1.0
        _check_position_embedding_group()
        tied, embedding_group = _tied_embedding(model_chunks)
    tp_rank = ps.get_tensor_model_parallel_rank()
    names = {p: f"chunk{c}.{n}" for c, chunk in enumerate(model_chunks) for n, p in chunk.named_parameters()}
    zero = FP32ReduceZero(
        optimizer, group if group is not None else ps.get_data_parallel_group(with_context_parallel=True),
        chunks=[list(chunk.parameters()) for chunk in model_chunks],
        norm_group=ps.get_model_parallel_group(),
        counts_in_norm=lambda p: ((getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
                                  and not getattr(p, "shared", False)),
        param_names=names, stage=stage, clip_grad=clip_grad, gradient_scale=gradient_scale,
        own_bucket=[tied] if tied is not None else (), **settings)
    if config is not None:
        _register_tp_sums(zero, model_chunks, config)
        if embedding_group is not None:  # both stages register, with or without a copy: the check compares them
            zero.add_grad_sum([tied] if tied is not None else [], embedding_group,
                              what="tied embedding / output layer gradient over the embedding group")
    if zero.settings.overlap and zero.settings.overlap_param_gather:
        for chunk in model_chunks:
            zero.wait_params_in_forward(chunk)
    return zero


def attach_to_schedule(config, zero: FP32ReduceZero, *, reduce_in_backward: bool = True):
    """Make the flexible schedule call the optimizer around the last backward of every (chunk, round), and
    finish the gradients (``finalize_model_grads_func``) once the step's backward passes are done.

    ``reduce_in_backward`` (default): the round's bucket reduce-scatters start from the gradient hooks of its
    last backward, as each bucket is complete (with ``overlap``; ``zero.before_round_end``); False: all of
    them start after that backward (``zero.end_of_round``), so the step's last round is waited in full.
    With ``reduce_in_backward`` and ``overlap``, the round end waits for all of the round's reductions but those
    started last that fit in ``carry_bytes`` (default 1/32 of the fp32 gradient shard; ``carry_buckets=N``: the N
    started last, whatever their size), so between rounds ZeRO-2 holds the fp32 shards plus that, not the round's
    whole buffers."""
    carry = zero.settings.carried_buckets if reduce_in_backward else None
    config.round_grad_sync_start_func = (
        (lambda chunk, params, round_id, is_last_round: zero.before_round_end(params, is_last_round))
        if reduce_in_backward else None)
    config.round_grad_sync_func = lambda chunk, params, round_id, is_last_round: zero.end_of_round(
        params, is_last_round, carry)
    config.grad_sync_func = None
    config.no_sync_func = None
    config.finalize_model_grads_func = finalize_grads_func(zero)


def finalize_grads_func(zero: FP32ReduceZero):
    """Megatron's ``finalize_model_grads`` for l3plugin's ZeRO: the remaining reduce-scatters, the sums
    ``megatron_zero`` registered (TP, embedding group), then with a per-token loss the 1 / tokens scaling."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from l3plugin.collective import comm

    pp_group = ps.get_pipeline_model_parallel_group()

    def finalize(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        zero.finish_grad_sync()
        if num_tokens is None:
            return
        # The last stage counted the tokens; every stage scales by the global count.
        tokens = comm.broadcast_from(num_tokens.detach().clone(), pp_group.size() - 1, pp_group, zero.wait_timeout,
                                     "token count from the last stage")
        comm.all_reduce_sum(tokens, zero.group, zero.wait_timeout, "token count")
        if float(tokens) > 0:
            zero.scale_grads(1.0 / float(tokens))

    return finalize
