"""Per-token outputs as whole rows on every CP rank, for frameworks that compute the loss themselves.

Under CP a model's per-token outputs cover this rank's tokens only. A framework that sums them itself (TRL's fused
LM head: ``-log_probs.sum() / num_items_in_batch``, times the process count) then gets one rank's share as its
loss, and the Trainer, averaging over ranks, logs 1 / cp of the loss (the gradients are right: DeepSpeed sums them
over CP). ``full_rows`` all-gathers a per-token tensor into whole rows in sequence order (the row length the caller
passed, the padding l3plugin adds cut off); its backward keeps the gradient of this rank's own tokens only. So
every CP rank computes the loss of the whole sequence, and the gradients, summed over CP as DeepSpeed does, are
one process's. The forward hook of context_parallel.py applies it to the per-token fields of TRL's
``FusedCausalLMOutput`` (``PER_TOKEN_FIELDS``); a custom loop applies it to what it sums (docs/huggingface.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from l3plugin.collective import comm
from l3plugin.collective.waits import resolve_timeout

# TRL's FusedCausalLMOutput (trl/trainer/utils.py, trl >= 1.0): the fields of shape [batch, tokens]
PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


class _FullRows(torch.autograd.Function):
    """local [rows, s_local, ...] -> [rows, length, ...]; ``index`` [cp, rows, s_local]: every rank's positions."""

    @staticmethod
    def forward(ctx, local, index, group, length):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        wire = local.detach().to(torch.float32) if local.dtype == torch.bool else local.detach()  # gloo: no bool
        everyone = comm.all_gather_shards(wire.contiguous(), group, resolve_timeout()).view(cp, *local.shape)
        full = wire.new_zeros((local.size(0), index.size(-1) * cp) + tuple(local.shape[2:]))
        for r in range(cp):
            full.scatter_(1, _expand(index[r], full), everyone[r])
        ctx.mine, ctx.seq_len = index[rank], full.size(1)
        return full[:, :length].to(local.dtype)

    @staticmethod
    def backward(ctx, grad):
        grad = torch.nn.functional.pad(grad, (0, 0) * (grad.dim() - 2) + (0, ctx.seq_len - grad.size(1)))
        return grad.gather(1, _expand(ctx.mine, grad)), None, None, None


def _expand(index, like):
    index = index.to(like.device)
    return index.view(index.shape + (1,) * (like.dim() - 2)).expand(index.shape + like.shape[2:])


def full_rows(local: torch.Tensor, batch, length: int | None = None) -> torch.Tensor:
    """``local`` [rows, s_local, ...] (this CP rank's tokens, local order) as [rows, length, ...] in sequence order,
    the same on every CP rank of ``batch`` (the ``CPBatch`` of the forward that produced it); ``length``: default the
    row length the caller passed (l3plugin's padding to 2 x cp cut off). Differentiable: the backward returns the gradient
    of this rank's tokens. Without CP (group None or size 1) ``local`` is already whole."""
    length = (batch.row_length or batch.seq_len) if length is None else length
    if batch.group is None or batch.cp_size == 1:
        return local[:, :length]
    if local.dim() < 2 or local.size(0) != len(batch.layouts) or local.size(1) * batch.cp_size != batch.seq_len:
        raise ValueError(f"full_rows takes a per-token tensor [rows={len(batch.layouts)}, "
                         f"s_local={batch.seq_len // batch.cp_size}, ...] of this CP rank; got {tuple(local.shape)}")
    index = torch.stack([torch.stack([layout.indices(r) for layout in batch.layouts]) for r in range(batch.cp_size)])
    return _FullRows.apply(local, index, batch.group, length)


def whole_sequence_outputs(output, batch, num_items_in_batch=None):
    """TRL's FusedCausalLMOutput with every per-token field as whole rows and its loss the whole sequence's (any
    other output: unchanged). The cross-entropy part of the loss is recomputed from the whole rows as TRL computes
    it (``-log_probs.sum()`` over ``num_items_in_batch``, else over the labelled tokens); the rest of the loss (an
    MoE auxiliary loss) is kept as the rank computed it."""
    fields = [name for name in PER_TOKEN_FIELDS if getattr(output, name, None) is not None]
    if "log_probs" not in fields or "label_mask" not in fields:
        return output
    loss = getattr(output, "loss", None)
    rest = None if loss is None else loss - _cross_entropy(output.log_probs, output.label_mask, num_items_in_batch)
    for name in fields:
        setattr(output, name, full_rows(getattr(output, name), batch))
    if loss is not None:
        output.loss = _cross_entropy(output.log_probs, output.label_mask, num_items_in_batch) + rest
    return output


def _cross_entropy(log_probs, mask, num_items_in_batch):
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return -log_probs.sum() / count
