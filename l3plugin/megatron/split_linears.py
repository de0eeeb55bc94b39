"""Megatron-Core's local linear layers with their weight products left to W, while flexible-zb runs.

``ColumnParallelLinear`` / ``RowParallelLinear`` compute through ``self._forward_impl``, Megatron's
``LinearWithGradAccumulationAndAsyncCommunication``: one autograd Function whose backward computes the input and
the weight gradient together, so under the zero-bubble schedule B did all the work and W only handed the weight
gradients on. :func:`splittable_linears` gives each such layer of the model chunks, for the duration of the
step, an instance ``_forward_impl`` that runs ``l3plugin.schedule.split_linear`` instead: the same torch calls
(``input @ weight.T``, ``grad @ weight``, ``grad.T @ input`` on 2-D views, ``grad.sum(0)``, the same
tensor-parallel all-reduce / sequence-parallel all-gather and reduce-scatter on the layer's own TP group), in two
autograd nodes, so gradients stay bit-identical and B leaves the weight products to W.

Calls it does not cover go to Megatron's own implementation unchanged (correct, but their weight products stay
in B): frozen weights, ``gradient_accumulation_fusion`` (refused by flexible-zb anyway), the deferred embedding
weight gradient (``grad_output_buffer``), GTP (``gtp_remat_size`` > 1), autocast, positional or unknown arguments.
:func:`check_split_config` refuses the settings under which a split cannot run or would move nothing.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch

from l3plugin.schedule.split_linear import split_linear

_KNOWN = {"bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel", "grad_output_buffer",
          "wgrad_deferral_limit", "tp_group", "gtp_remat_size", "async_grad_allreduce"}


def _covered(input_, weight, args, kwargs) -> bool:
    return (not args and weight.requires_grad and set(kwargs) <= _KNOWN
            and not kwargs.get("gradient_accumulation_fusion") and kwargs.get("grad_output_buffer") is None
            and (kwargs.get("gtp_remat_size") or 1) <= 1 and not torch.is_autocast_enabled(input_.device.type))


def _split_forward_impl(module, input, weight, *args, **kwargs):  # noqa: A002 (Megatron's keyword names)
    if not _covered(input, weight, args, kwargs):
        return type(module)._forward_impl(module, input, weight, *args, **kwargs)
    allreduce_dgrad, sequence_parallel = bool(kwargs.get("allreduce_dgrad")), bool(kwargs.get("sequence_parallel"))
    group = kwargs.get("tp_group")
    if group is None and (allreduce_dgrad or sequence_parallel):
        from megatron.core.parallel_state import get_tensor_model_parallel_group
        group = get_tensor_model_parallel_group()
    return split_linear(input, weight, kwargs.get("bias"), allreduce_dgrad=allreduce_dgrad,
                        sequence_parallel=sequence_parallel, group=group)


def _local_linear_classes() -> tuple[type, ...]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    return ColumnParallelLinear, RowParallelLinear


# chunk -> [(local linear, its split _forward_impl)], found at the chunk's first flexible-zb step: walking an
# 80-layer model's modules every step cost 2.7 ms of CPU here. Values hold submodules, not the chunk itself.
_LINEARS = weakref.WeakKeyDictionary()


def _linears_of(chunk) -> list:
    found = _LINEARS.get(chunk)
    if found is None:
        classes = _local_linear_classes()
        found = _LINEARS[chunk] = [(module, functools.partial(_split_forward_impl, module))
                                   for module in chunk.modules() if isinstance(module, classes)]
    return found


@contextlib.contextmanager
def splittable_linears(model_chunks):
    """Within the block, every local ``ColumnParallelLinear`` / ``RowParallelLinear`` of ``model_chunks`` (one
    module or a list; the linears a chunk held at its first such block) computes through ``split_linear`` (module
    docstring); yields how many. Layers that already carry an instance ``_forward_impl`` (someone else's
    override) are left alone; all are restored on exit."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    swapped = []
    try:
        for chunk in chunks:
            for module, impl in _linears_of(chunk):
                if "_forward_impl" not in vars(module):
                    vars(module)["_forward_impl"] = impl  # an instance attribute shadows the class's method
                    swapped.append(module)
        yield len(swapped)
    finally:
        for module in swapped:
            del vars(module)["_forward_impl"]


def check_split_config(config) -> None:
    """Refuse what a split backward cannot run (``pipeline_schedule="flexible-zb"``), naming the setting."""
    if getattr(config, "delay_wgrad_compute", False):
        raise NotImplementedError(
            "--pipeline-schedule flexible-zb with delay_wgrad_compute (Transformer Engine layers' own weight-"
            "gradient deferral, backward_dw()) is not implemented: the schedule splits the backward with autograd "
            "itself (l3plugin.schedule.split_backward); turn delay_wgrad_compute off")
    granularity = getattr(config, "recompute_granularity", None)
    with_weights = sorted(set(getattr(config, "recompute_modules", None) or ()) & {"mlp", "moe", "shared_experts"})
    if granularity == "full" or (granularity == "selective" and with_weights):
        what = "recompute_granularity='full'" if granularity == "full" else f"recompute_modules={with_weights}"
        raise ValueError(
            f"--pipeline-schedule flexible-zb with {what}: Megatron's recompute runs each recomputed module's "
            "whole backward, weight gradients included, inside one autograd Function, i.e. inside B, so the split "
            "would move nothing off the critical path there; use --recompute-granularity selective with modules "
            "that hold no weights (core_attn, the default) or --pipeline-schedule flexible")
    if getattr(config, "gradient_accumulation_fusion", False):
        raise ValueError(
            "--pipeline-schedule flexible-zb with gradient_accumulation_fusion=True: the fused linear layers add "
            "their weight gradient into main_grad inside the input-gradient backward (B), which a W step cannot "
            "take over; use --no-gradient-accumulation-fusion (or --pipeline-schedule flexible)")
