"""The collectives of the FP32-reducing ZeRO optimizer: started asynchronously, waited with a bound.

Every collective is started with ``async_op=True`` and returns an ``InFlight``; ``wait`` gives its result.
The blocking helpers are start + wait. Waits are bounded (``l3plugin.waits``): a collective that does not
finish raises ``CommTimeout`` naming this rank, the group, the operation and what it carried, instead of
blocking until the process group's own timeout (30 minutes by default).

All calls look ``torch.distributed`` functions up at call time, so ``l3plugin.debug.record_collectives``
(which patches them) sees every call. Devices come from the tensors; nothing here assumes CUDA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from l3plugin.waits import DEFAULT_TIMEOUT, group_ranks, wait_work


def _describe(op: str, tensor: torch.Tensor, group, what: str) -> str:
    label = f" ({what})" if what else ""
    return (f"{op}{label} of {tensor.numel()} {str(tensor.dtype).replace('torch.', '')} elements "
            f"({tensor.numel() * tensor.element_size() / 2**20:.1f} MiB) in group ranks {group_ranks(group)}")


class InFlight:
    """One started collective: ``wait`` gives its result. Holds the input it reads until then."""

    def __init__(self, work, result, source: torch.Tensor | None, description: str):
        self.work, self.source, self.description = work, source, description
        self._result = result  # the output tensor, or a function computing it once the work is done

    def wait(self, timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
        if self.work is not None:
            wait_work(self.work, timeout=timeout, what=self.description)
            self.work = None
        if callable(self._result):
            self._result = self._result()
        self.source = None
        return self._result


def _reduce_scatter_by_all_reduce(group) -> bool:
    """gloo's reduce-scatter sends as much as its all-reduce, takes about twice as long (25M fp32 elements, 2
    ranks: 188 ms vs 93 ms) and its asynchronous work ignores wait timeouts and never reports completion:
    on gloo the bucket is all-reduced in place and this rank keeps its slice."""
    return dist.get_backend(group) == "gloo"


def start_reduce_scatter_sum(full: torch.Tensor, group, reduce_dtype: torch.dtype, what: str = "") -> InFlight:
    """Start summing ``full`` over ``group``; the result is this rank's 1/W slice, in ``reduce_dtype``.

    ``full.numel()`` must be a multiple of the group size (buckets are padded for this). On gloo ``full``
    is overwritten (when it already has ``reduce_dtype``): do not read it afterwards.
    """
    world = dist.get_world_size(group)
    send = full if full.dtype == reduce_dtype else full.to(reduce_dtype)
    n = full.numel() // world
    if world == 1:
        return InFlight(None, send.clone(), None, "")
    if _reduce_scatter_by_all_reduce(group):
        lo = dist.get_rank(group) * n
        work = dist.all_reduce(send, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return InFlight(work, lambda: send[lo:lo + n].clone(), send,
                        _describe("reduce-scatter (all-reduce on gloo)", send, group, what))
    out = torch.empty(n, dtype=reduce_dtype, device=full.device)
    # torch >= 2.13 renames reduce_scatter_tensor to reduce_scatter_single (the old name warns).
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = fn(out, send, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return InFlight(work, out, send, _describe("reduce-scatter", send, group, what))


def start_all_gather(shard: torch.Tensor, group, what: str = "") -> InFlight:
    """Start gathering every rank's ``shard`` (same size everywhere) into one tensor, in rank order."""
    world = dist.get_world_size(group)
    shard = shard.contiguous()
    out = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    if world == 1:
        out.copy_(shard)
        return InFlight(None, out, None, "")
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = fn(out, shard, group=group, async_op=True)
    return InFlight(work, out, shard, _describe("all-gather", shard, group, what))


def reduce_scatter_sum(full: torch.Tensor, group, reduce_dtype: torch.dtype,
                       timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    return start_reduce_scatter_sum(full, group, reduce_dtype).wait(timeout)


def all_gather_shards(shard: torch.Tensor, group, timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    return start_all_gather(shard, group).wait(timeout)


def all_reduce_sum(t: torch.Tensor, group, timeout: float = DEFAULT_TIMEOUT, what: str = "") -> torch.Tensor:
    """Sum ``t`` in place over ``group`` (bounded wait)."""
    if dist.get_world_size(group) > 1:
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)
        InFlight(work, t, t, _describe("all-reduce", t, group, what)).wait(timeout)
    return t
