"""Drive l3plugin's FP32-reducing ZeRO optimizer from Megatron-Core model chunks and the flexible schedule.

    zero = megatron_zero(model_chunks, torch.optim.AdamW(params, lr=...), stage=2, clip_grad=1.0)
    attach_to_schedule(config, zero)      # ZeRO-2 reduce-scatters at every round end, ZeRO-1 at the last
    forward_backward_pipelining_flexible(...)
    zero.step()                           # clip on the global fp32 norm, step, bf16 all-gather

Groups come from Megatron's parallel_state: gradients reduce over DP x CP; the clipping norm is summed
over the model-parallel group (TP x PP) counting TP-duplicated parameters (norms, biases) once.
Megatron's own DDP wrapper is not used: l3plugin's hooks accumulate the gradients.
"""

from __future__ import annotations

from l3plugin.zero.optimizer import FP32ReduceZero


def megatron_zero(model_chunks, optimizer, *, stage=1, clip_grad=0.0, gradient_scale=None, group=None,
                  **settings):
    """``group`` overrides the gradient-reduction group (default: parallel_state's DP x CP group)."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    names = {p: f"chunk{c}.{n}" for c, chunk in enumerate(model_chunks) for n, p in chunk.named_parameters()}
    return FP32ReduceZero(
        optimizer, group if group is not None else ps.get_data_parallel_group(with_context_parallel=True),
        chunks=[list(chunk.parameters()) for chunk in model_chunks],
        norm_group=ps.get_model_parallel_group(),
        counts_in_norm=lambda p: getattr(p, "tensor_model_parallel", False) or tp_rank == 0,
        param_names=names, stage=stage, clip_grad=clip_grad, gradient_scale=gradient_scale, **settings)


def attach_to_schedule(config, zero: FP32ReduceZero):
    """Make the flexible schedule call the optimizer at every (chunk, round) end."""
    config.round_grad_sync_func = lambda chunk, params, round_id, is_last_round: zero.end_of_round(
        params, is_last_round)
    config.grad_sync_func = None
    config.no_sync_func = None
    config.finalize_model_grads_func = None  # zero.step() finishes the gradient sync
