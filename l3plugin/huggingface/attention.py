"""l3plugin's all-gather CP attention as a transformers attention function, and the exact token-mean loss.

transformers (>= 4.48) looks attention functions up by ``config._attn_implementation`` in its
``AttentionInterface`` registry; registering ``ATTENTION_NAME`` there swaps the attention of every model
family that uses the registry (Llama, Qwen2, Mistral, ...) with no edit of the modeling files. The name is
not registered as a mask function, so transformers builds no [S, S] mask for it: documents come from the
``CPBatch`` the model's forward hook (context_parallel.py) passes down as a keyword argument.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from l3plugin.collective import comm
from l3plugin.collective.waits import resolve_timeout
from l3plugin.cp import all_gather_attention

ATTENTION_NAME = "l3plugin_all_gather_cp"
# Attention features the all-gather CP kernel does not have: refused when a model passes them set.
UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")


def cp_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         sliding_window=None, **kwargs):
    """query [B, H, s_local, D], key/value [B, H_kv, s_local, D] (after RoPE) -> ([B, s_local, H, D], None)."""
    batch = kwargs.get("l3plugin_cp")
    if batch is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} was called without l3plugin's context-parallel batch: "
            "the model must be called through the forward hook that l3plugin.huggingface.enable_context_parallel "
            "installs (on the model passed to it); to use the model without CP (e.g. generate), call "
            "l3plugin.huggingface.disable_context_parallel(model) first")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by the all-gather CP attention: set "
                         "config.attention_dropout = 0.0")
    if sliding_window is not None and sliding_window < batch.seq_len:
        raise ValueError(f"sliding_window={sliding_window} is shorter than the sequence ({batch.seq_len}); the "
                         "all-gather CP attention has no sliding window: disable it (e.g. use_sliding_window=False)")
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} is set by this model's attention; the all-gather CP attention does not "
                             f"support it ({type(module).__name__})")
    causal = bool(getattr(module, "is_causal", True))
    rows = []
    for r in range(query.size(0)):
        # [h, s_local, d] -> [s_local, h, d], one packed row at a time (each row has its own documents).
        q, k, v = (t[r].transpose(0, 1) for t in (query, key, value))
        rows.append(all_gather_attention(q, k, v, batch.cu_seqlens[r], group=batch.group, causal=causal,
                                         softmax_scale=scaling, layout=batch.layouts[r]))
    return torch.stack(rows), None


class _SumOverCP(torch.autograd.Function):
    """All-reduce (sum) over the CP group in the forward; the backward passes the gradient through unchanged.

    Every CP rank then holds the same (whole-sequence) loss, and each rank's gradient is that loss's gradient
    through the tokens it holds: summed over the CP ranks it is the whole gradient. That is DeepSpeed's
    sequence-parallel convention (its engine and ZeRO sum gradients over SP ranks, average over DP)."""

    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce_sum(x.clone(), group, resolve_timeout(), "CP loss")  # bounded wait

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_cp(x: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _SumOverCP.apply(x, group)


class CPLoss:
    """Wraps a model's ``loss_function``: the loss of the WHOLE sequence, on every CP rank.

    Each rank sums the token losses it holds; the sum (and, without ``num_items_in_batch``, the count of
    labelled tokens) is reduced over CP, so the value equals the cp = 1 loss and the gradients, summed over CP
    and averaged over DP as DeepSpeed does under sequence parallelism, equal cp = 1's averaged over DP."""

    def __init__(self, stock):
        self.stock = stock

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, **kwargs):
        batch = kwargs.get("l3plugin_cp")
        if batch is None:
            return self.stock(logits, labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch, **kwargs)
        shift = kwargs["shift_labels"]
        ignore = kwargs.get("ignore_index", -100)
        # num_items_in_batch=1 makes HF's loss a plain sum (its "sum" reduction divided by 1).
        local_sum = self.stock(logits, labels, vocab_size=vocab_size, num_items_in_batch=1, **kwargs)
        total = sum_over_cp(local_sum, batch.group)
        if num_items_in_batch is None:
            count = (shift != ignore).sum().to(total.dtype)
            num_items_in_batch = sum_over_cp(count, batch.group)
        elif torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
