"""Gradients summed (or averaged) over a second group, on the reduced fp32 shards.

Some parameters have copies on other ranks than their data-parallel peers, and each copy only sees part of
the gradient: a weight tied across pipeline stages (the input embedding and the output layer), or a weight
replicated over tensor-parallel ranks that see different tokens (sequence-parallel norms). The adapter names
those parameters and the group of their copies (``FP32ReduceZero.add_grad_sum``); the optimizer sums them
once per step, in ``finish_grad_sync``, after every reduce-scatter of the step has landed in the fp32 shards.

Why there, and not on the full fp32 buffers before the reduce-scatter: ZeRO-2 reduce-scatters at every round
end of the schedule, and a pipeline's round ends come at different times on different stages (a collective
between the first and the last stage there would wait for activations gradients it holds up itself). The sum
over the second group commutes with the data-parallel sum, so summing the shards of the step's reduced
gradient gives the same total.

Each rank adds its shard pieces of those parameters to the pieces its peers in the group hold, so the
pieces must cover the same elements on every peer. Replicas on ranks with the same model (TP) sit at the
same bucket offsets everywhere. A tied copy on another pipeline stage does not (other neighbours in its
bucket): tied parameters get a bucket of their own (``own_bucket``), whose shard ranges depend only on the
parameter's size and the reduction group size, as Megatron's DDP does for the same reason. ``add_grad_sum``
checks the pieces against every peer's once (collective) and refuses a mismatch, naming the parameters.
Afterwards the copies hold bit-identical fp32 gradients (each element is the same sum on every peer), and
with identical masters and element-wise optimizer states they stay bit-identical.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from l3plugin.collective import comm
from l3plugin.collective.fail_together import agree


@dataclass(frozen=True)
class Piece:
    """The part of one parameter this rank owns: bucket, shard-local [start, end), element offset in the param."""

    bucket: int
    start: int
    end: int
    param_offset: int


@dataclass(frozen=True)
class GradSum:
    params: tuple  # in the same order on every rank of ``group``
    group: object
    average: bool
    what: str
    pieces: tuple  # Piece per owned part of each param, in param order


def owned_pieces(zero, params) -> list[Piece]:
    out = []
    for p in params:
        slot = zero.slots[p]
        part = zero.buckets[slot.bucket].spec.shard_part(slot, zero.rank)
        if part:
            a, b, at = part
            out.append(Piece(slot.bucket, at, at + b - a, a))
    return out


def make_grad_sum(zero, params, group, *, average: bool, what: str) -> GradSum:
    """Check (collective over ``group``) that every peer owns the same elements of the same-shaped parameters."""
    params = tuple(params)
    missing = [zero.param_names.get(p, "?") for p in params if p not in zero.slots]
    error = None
    if missing:
        error = ValueError(f"{what}: parameter(s) {missing[:5]} are not trainable parameters of this optimizer")
        pieces = ()
    else:
        pieces = tuple(owned_pieces(zero, params))
    layout = [(tuple(p.shape), str(p.dtype)) for p in params] + [(x.end - x.start, x.param_offset) for x in pieces]
    # The outcome compared across the group holds no names: copies of one weight may be named differently.
    outcome = (f"{len(params)} parameters, reduction rank {zero.rank} of {zero.world_size}, shard layout CRC32 "
               f"{zlib.crc32(str(layout).encode()):#010x}")
    names = ", ".join(zero.param_names[p] for p in params[:4] if p in zero.param_names)
    agree(error, group, what=f"{what} (here {names}{', ...' if len(params) > 4 else ''}): the copies' shards",
          outcome=outcome, device=zero.device, timeout=zero.wait_timeout)
    return GradSum(params, group, average, what, pieces)


@torch.no_grad()
def apply_grad_sum(zero, grad_sum: GradSum) -> None:
    """Sum (or average) this rank's pieces of the reduced gradients over ``grad_sum.group``, in place
    (collective over the group)."""
    size = dist.get_world_size(grad_sum.group)
    if size == 1:
        return
    parts = []
    for x in grad_sum.pieces:
        bucket = zero.buckets[x.bucket]
        if bucket.shard_grad is None:  # never reduced: finish_grad_sync runs every reduction first
            raise RuntimeError(f"{grad_sum.what}: bucket {x.bucket} holds no reduced gradient")
        parts.append(bucket.shard_grad[x.start:x.end])
    if not parts:  # the layouts agreed: no peer owns a piece either
        return
    flat = torch.cat(parts)
    comm.all_reduce_sum(flat, grad_sum.group, zero.wait_timeout, grad_sum.what)
    if grad_sum.average:
        flat.div_(size)
    at = 0
    for part in parts:
        part.copy_(flat[at:at + part.numel()])
        at += part.numel()
