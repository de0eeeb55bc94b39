"""Flat gradient buckets and the sharding map of the FP32-reducing ZeRO optimizer.

Layout (pure arithmetic, no processes: ``plan_buckets``)
    Trainable parameters are taken in optimizer order: param group by param group, and inside a group
    stable-sorted by *chunk* (a model chunk / virtual pipeline stage). They are packed back to back into
    buckets. A bucket never mixes param groups (each group has its own hyper-parameters), chunks (a chunk's
    gradients must be reducible when that chunk's round ends, whatever the other chunks are doing) or
    parameter dtypes (the bucket's parameter all-gather runs in that dtype); it is closed when it reaches
    ``bucket_numel`` elements (a single larger parameter gets a bucket of its own). A parameter listed in
    ``alone`` gets a bucket of its own too: its shard ranges then depend only on its size and W, the same on
    every rank that holds a copy of it (a weight tied across pipeline stages, see ``grad_sums.py``).

Sharding map
    A bucket holding ``numel`` elements is padded with zeros to ``padded = ceil(numel / W) * W``, W being the
    size of the gradient-reduction group (DP, or DP x CP). Rank r of that group owns the bucket elements
    ``[r * padded / W, (r + 1) * padded / W)``: that slice of the reduced gradient, of the fp32 master
    weights and of every element-wise optimizer state. A parameter at bucket offset ``o`` with ``n``
    elements is therefore split over the ranks whose slices intersect ``[o, o + n)``;
    ``BucketSpec.owners(slot)`` lists them. Which elements belong to which bucket does not depend on W,
    only the padding does, so a checkpoint can be re-sharded for another W (``l3plugin.checkpoint`` does).

Runtime (``GradBucket``)
    ``full``: the unsharded gradient accumulated over micro-batches in ``accumulate_dtype`` (fp32 by
    default), allocated on the first gradient and freed after its reduce-scatter.
    ``shard_grad``: this rank's slice of the reduced gradient, accumulated across reduce-scatters (ZeRO-2
    reduces once per round; ZeRO-1 once per step).
    ``in_flight``: a started, not yet waited reduce-scatter reading ``full`` (``full`` is freed after it).
    ``master``: this rank's fp32 slice of the weights; the wrapped torch optimizer updates it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from l3plugin.arguments.checks import check_int


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives: its bucket and element offset there."""

    index: int  # position in the optimizer-ordered list of trainable parameters
    group: int  # optimizer param group
    chunk: int
    bucket: int
    offset: int  # first element inside the bucket
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BucketSpec:
    index: int
    group: int
    chunk: int
    dtype: torch.dtype  # parameter dtype (the all-gather dtype)
    world_size: int
    slots: tuple[ParamSlot, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        w = self.world_size
        return -(-self.numel // w) * w

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Bucket elements [start, end) owned by ``rank`` of the reduction group."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_part(self, slot: ParamSlot, rank: int) -> tuple[int, int, int] | None:
        """The part of ``slot`` in ``rank``'s shard: ``(a, b, at)``, the parameter's flat elements ``[a, b)`` sit
        at ``at`` in the shard; None when the shard holds none of it (a slot never covers padding)."""
        lo, hi = self.shard_range(rank)
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        return (start - slot.offset, end - slot.offset, start - lo) if start < end else None

    def owners(self, slot: ParamSlot) -> list[tuple[int, int, int]]:
        """(rank, start, end) in bucket coordinates for each rank holding part of ``slot``."""
        parts = [(rank, self.shard_part(slot, rank)) for rank in range(self.world_size)]
        return [(rank, slot.offset + part[0], slot.offset + part[1]) for rank, part in parts if part]


def plan_buckets(params: list[tuple[int, int, torch.dtype, tuple[int, ...]]], world_size: int,
                 bucket_numel: int, alone=frozenset()) -> tuple[list[ParamSlot], list[BucketSpec]]:
    """Pack parameters into buckets.

    ``params``: (group, chunk, dtype, shape) per trainable parameter, already in optimizer order.
    ``alone``: indices into ``params`` of parameters that get a bucket of their own.
    Returns the slots (same order as ``params``) and the buckets.
    """
    check_int("world_size", world_size)
    check_int("bucket_numel", bucket_numel)
    slots: list[ParamSlot] = []
    buckets: list[BucketSpec] = []
    current: list[ParamSlot] = []
    key = None

    def close():
        if current:
            first = current[0]
            dtype = params[first.index][2]
            buckets.append(BucketSpec(len(buckets), first.group, first.chunk, dtype, world_size, tuple(current)))
            current.clear()

    for index, (group, chunk, dtype, shape) in enumerate(params):
        numel = 1
        for d in shape:
            numel *= d
        used = sum(s.numel for s in current)
        single = index in alone
        if (group, chunk, dtype, single) != key or single or (current and used + numel > bucket_numel):
            close()
            key, used = (group, chunk, dtype, single), 0
        slot = ParamSlot(index, group, chunk, len(buckets), used, numel, tuple(shape))
        current.append(slot)
        slots.append(slot)
    close()
    return slots, buckets


class GradBufferMemory:
    """Bytes held by gradient buffers (full buckets + reduced shards) on this rank, and their peak."""

    def __init__(self):
        self.current = 0
        self.peak = 0

    def alloc(self, t: torch.Tensor) -> torch.Tensor:
        self.current += t.numel() * t.element_size()
        self.peak = max(self.peak, self.current)
        return t

    def free(self, t: torch.Tensor | None) -> None:
        if t is not None:
            self.current -= t.numel() * t.element_size()

    def reset_peak(self) -> None:
        self.peak = self.current


@dataclass
class GradBucket:
    spec: BucketSpec
    params: list  # the model parameters, in slot order
    master: torch.nn.Parameter  # fp32 shard of the weights, what the torch optimizer sees
    accumulate_dtype: torch.dtype
    memory: GradBufferMemory
    full: torch.Tensor | None = None
    shard_grad: torch.Tensor | None = None
    in_flight: object | None = None  # comm.InFlight: a started reduce-scatter of ``full``, not waited yet
    started: int = -1  # launch number of ``in_flight`` (counts every launch): which reductions started last
    armed: bool = False  # the current backward pass ends with this bucket's reduce-scatter
    seen: int = 0  # gradients accumulated since armed; == len(params): final, may start

    @property
    def device(self) -> torch.device:
        return self.master.device

    def full_buffer(self) -> torch.Tensor:
        if self.full is None:
            self.full = self.memory.alloc(torch.zeros(self.spec.padded_numel, dtype=self.accumulate_dtype,
                                                      device=self.device))
        return self.full

    def param_view(self, slot: ParamSlot) -> torch.Tensor:
        """The slice of ``full`` that accumulates ``slot``'s gradient."""
        return self.full_buffer()[slot.offset:slot.offset + slot.numel]

    def accumulate(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        # add_ of a bf16 tensor into an fp32 one upcasts element-wise: no bf16 rounding of the sum.
        self.param_view(slot).add_(grad.reshape(-1))

    def free_full(self) -> None:
        self.memory.free(self.full)
        self.full = None

    def add_reduced(self, shard: torch.Tensor) -> None:
        """Take the reduce-scatter output ``shard`` (already counted in ``memory``): keep it as the shard
        gradient, or add it into the existing one and release it."""
        if self.shard_grad is None and shard.dtype == self.accumulate_dtype:
            self.shard_grad = shard
            return
        if self.shard_grad is None:
            self.shard_grad = self.memory.alloc(shard.to(self.accumulate_dtype))
        else:
            self.shard_grad.add_(shard)
        self.memory.free(shard)

    def clear_grads(self) -> None:
        self.free_full()
        self.memory.free(self.shard_grad)
        self.shard_grad = None
        self.master.grad = None
