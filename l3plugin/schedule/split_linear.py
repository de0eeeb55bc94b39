"""A (tensor-parallel) linear layer whose input and weight gradients are separate autograd nodes, so that the
zero-bubble split (split_backward.py) leaves the weight products to W.

Why: a custom autograd Function computes every gradient it returns in one call, whatever the caller asked for.
Megatron-Core's local ``ColumnParallelLinear`` / ``RowParallelLinear`` run as one such Function, so with them
B computed the weight products too and the zero-bubble plan moved no work off the critical path. Here the same
arithmetic (the same torch calls, so the same numbers bit for bit) is two Functions:

    stand_in = _WeightSide(weight, bias, input)              # no work: a zero-stride tensor of the output's shape
    output = _InputSide(input, weight, bias, stand_in)       # input @ weight.T (+ bias)

``_InputSide``'s backward computes the input gradient (``grad @ weight``, then the tensor-parallel all-reduce
or, with sequence parallelism, the reduce-scatter) and hands the output gradient on, unchanged, as the stand-in's
gradient. ``_WeightSide``'s backward computes ``grad.T @ input`` (with sequence parallelism on the input
gathered again, as Megatron's backward does) and ``grad.sum(0)``, on 2-D views. One fused backward runs both;
B (``torch.autograd.grad`` to the input) runs only ``_InputSide``, since the weight side does not lead to the
input, and W runs ``_WeightSide`` from the gradient B handed on. The activations kept are Megatron's (the input,
once); from B to W the output gradient is kept too.

Plain torch: the caller passes the tensor-parallel process group (None: no tensor parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 (sequence parallelism's layout)."""
    size = list(tensor.shape)
    size[0] *= group.size()
    out = torch.empty(size, dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
    return out


def _two_d(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.contiguous()
    return tensor.view(-1, tensor.shape[-1]) if tensor.dim() == 3 else tensor


class _WeightSide(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, bias, input_, out_shape, sequence_parallel, group):
        ctx.save_for_backward(input_)
        ctx.use_bias, ctx.sequence_parallel, ctx.group = bias is not None, sequence_parallel, group
        return torch.empty((), dtype=input_.dtype, device=input_.device).expand(out_shape)

    @staticmethod
    def backward(ctx, grad_output):
        (input_,) = ctx.saved_tensors
        total_input = _gather_sequence(input_, ctx.group) if ctx.sequence_parallel else input_
        grad_output, total_input = _two_d(grad_output), _two_d(total_input)
        grad_weight = grad_output.t().matmul(total_input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        return grad_weight, grad_bias, None, None, None, None


class _InputSide(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, weight, bias, stand_in, allreduce_dgrad, sequence_parallel, group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.group = allreduce_dgrad, sequence_parallel, group
        total_input = _gather_sequence(input_, group) if sequence_parallel else input_
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        if not ctx.needs_input_grad[0]:  # a frozen prefix's output: no input product (the same on every TP rank)
            return None, None, None, grad_output, None, None, None
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            dist.all_reduce(grad_input, group=ctx.group)
        elif ctx.sequence_parallel:
            size = list(grad_input.shape)
            size[0] //= ctx.group.size()
            shard = torch.empty(size, dtype=grad_input.dtype, device=grad_input.device)
            dist.reduce_scatter_tensor(shard, grad_input.contiguous(), group=ctx.group)
            grad_input = shard
        return grad_input, None, None, grad_output, None, None, None


def split_linear(input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 allreduce_dgrad: bool = False, sequence_parallel: bool = False, group=None) -> torch.Tensor:
    """``input @ weight.T (+ bias)`` with its weight gradients in a node of their own (module docstring).

    ``allreduce_dgrad``: all-reduce the input gradient over ``group`` (a column-parallel layer's input is
    replicated over TP); ``sequence_parallel``: the input is this rank's sequence shard (dim 0), all-gathered
    over ``group`` for the product, and its gradient reduce-scattered back."""
    if allreduce_dgrad and sequence_parallel:
        raise ValueError("split_linear: allreduce_dgrad and sequence_parallel cannot both be True (the input "
                         "gradient is either all-reduced or reduce-scattered over the tensor-parallel group)")
    if (allreduce_dgrad or sequence_parallel) and group is None:
        raise ValueError("split_linear: allreduce_dgrad / sequence_parallel need the tensor-parallel group "
                         "(group=None)")
    out_rows = input_.shape[0] * (group.size() if sequence_parallel else 1)
    out_shape = (out_rows, *input_.shape[1:-1], weight.shape[0])
    stand_in = _WeightSide.apply(weight, bias, input_.detach(), out_shape, sequence_parallel, group)
    return _InputSide.apply(input_, weight.detach(), None if bias is None else bias.detach(), stand_in,
                            allreduce_dgrad, sequence_parallel, group)
