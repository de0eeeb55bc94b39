"""The collectives of the FP32-reducing ZeRO optimizer, and a recorder of collectives for tests and benchmarks.

All calls look ``torch.distributed`` functions up at call time, so ``record_collectives`` (which patches
them) sees every call. Devices come from the tensors; nothing here assumes CUDA.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist


def reduce_scatter_sum(full: torch.Tensor, group, reduce_dtype: torch.dtype) -> torch.Tensor:
    """Sum ``full`` over ``group`` and return this rank's 1/W slice, computed in ``reduce_dtype``.

    ``full.numel()`` must be a multiple of the group size (buckets are padded for this).
    """
    world = dist.get_world_size(group)
    send = full if full.dtype == reduce_dtype else full.to(reduce_dtype)
    out = torch.empty(full.numel() // world, dtype=reduce_dtype, device=full.device)
    if world == 1:
        out.copy_(send)
    else:
        # torch >= 2.13 renames reduce_scatter_tensor to reduce_scatter_single (the old name warns).
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn(out, send, op=dist.ReduceOp.SUM, group=group)
    return out


def all_gather_shards(shard: torch.Tensor, group) -> torch.Tensor:
    """Concatenation of every rank's ``shard`` (same size everywhere), in rank order."""
    world = dist.get_world_size(group)
    out = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    if world == 1:
        out.copy_(shard)
    else:
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, shard.contiguous(), group=group)
    return out


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


# -- recording -----------------------------------------------------------------------------------------
RECORDED = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter",
            "_reduce_scatter_base", "all_gather_into_tensor", "all_gather_single", "all_gather", "_all_gather_base",
            "reduce", "broadcast", "all_to_all_single", "all_reduce_coalesced")
# One name per operation, whatever the torch version calls it.
CANONICAL = {"reduce_scatter_single": "reduce_scatter_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
             "all_gather_single": "all_gather_into_tensor", "_all_gather_base": "all_gather_into_tensor"}


# Bytes a rank sends with the usual ring algorithms, per byte of its input, for W ranks.
_RING_FACTOR = {"all_reduce": lambda w: 2 * (w - 1) / w, "reduce_scatter_tensor": lambda w: (w - 1) / w,
                "reduce_scatter": lambda w: (w - 1) / w, "all_gather_into_tensor": lambda w: w - 1,
                "all_gather": lambda w: w - 1, "broadcast": lambda w: 1.0, "reduce": lambda w: 1.0,
                "all_to_all_single": lambda w: (w - 1) / w, "all_reduce_coalesced": lambda w: 2 * (w - 1) / w}


@dataclass
class Collective:
    op: str
    dtype: torch.dtype
    numel: int  # elements of the input this rank contributes
    bytes: int  # bytes of that input
    world_size: int = 1

    @property
    def wire_bytes(self) -> float:
        """What this rank sends over the network with a ring algorithm (all-reduce: 2(W-1)/W x input)."""
        return self.bytes * _RING_FACTOR.get(self.op, lambda w: 1.0)(self.world_size)


class CollectiveLog(list):
    def of(self, op: str) -> list[Collective]:
        return [c for c in self if c.op == op]

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self)

    @property
    def wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self)


def _first_tensor(op, args, kwargs):
    """The tensor whose size says how much this rank sends."""
    if op in ("reduce_scatter_tensor", "all_gather_into_tensor"):
        t = kwargs.get("input", args[1] if len(args) > 1 else None)
        if t is None:
            t = kwargs.get("input_tensor")
        return [t]
    if op == "reduce_scatter":
        return list(args[1] if len(args) > 1 else kwargs.get("input_list", []))
    if op == "all_gather":
        return [args[1] if len(args) > 1 else kwargs.get("tensor")]
    if op == "all_to_all_single":
        return [args[1] if len(args) > 1 else kwargs.get("input")]
    if op == "all_reduce_coalesced":
        return list(args[0] if args else kwargs.get("tensors", []))
    return [args[0] if args else kwargs.get("tensor")]


@contextlib.contextmanager
def record_collectives(extra_targets=()):
    """Record every collective this process issues through ``torch.distributed`` while inside.

    Yields a ``CollectiveLog`` of ``Collective(op, dtype, numel, bytes)``; ``op`` is the canonical name
    (``reduce_scatter_tensor`` also for ``reduce_scatter_single``, and so on). ``extra_targets`` lists further
    (object, attribute name, op name) to patch, for libraries that cached a function reference.
    """
    log = CollectiveLog()
    patched = []

    def wrap(fn, op):
        def spy(*args, **kwargs):
            tensors = [t for t in _first_tensor(op, args, kwargs) if isinstance(t, torch.Tensor)]
            if tensors:
                numel = sum(t.numel() for t in tensors)
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                world = dist.get_world_size(group) if dist.is_initialized() else 1
                log.append(Collective(op, tensors[0].dtype, numel, numel * tensors[0].element_size(), world))
            return fn(*args, **kwargs)

        spy.__wrapped_collective__ = fn
        return spy

    targets = [(dist, name, CANONICAL.get(name, name)) for name in RECORDED] + list(extra_targets)
    seen = set()
    for obj, name, op in targets:
        fn = getattr(obj, name, None)
        if fn is None or (id(obj), name) in seen:
            continue
        seen.add((id(obj), name))
        patched.append((obj, name, fn))
        setattr(obj, name, wrap(fn, op))
    try:
        yield log
    finally:
        for obj, name, fn in reversed(patched):
            setattr(obj, name, fn)
