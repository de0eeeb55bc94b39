"""Whole tensors from the FP32-reducing ZeRO's shards: the one place a parameter's full fp32 master weight,
optimizer state or reduced gradient is rebuilt from (or written into) the group's shards. Used by DeepSpeed's
safe_get_full_* accessors, exports and the checkpoint readers (``owned_ranges``). A mixin of
``FP32ReduceZero`` (optimizer.py): it reads its buckets, slots, group and optimizer."""

from __future__ import annotations

import torch

from l3plugin.collective import comm
from l3plugin.zero.buffers import GradBucket, ParamSlot


def copy_part_to_shard(shard: torch.Tensor, whole: torch.Tensor, part) -> torch.Tensor:
    """Copy a parameter's flat elements ``[a, b)`` from its ``whole`` tensor into ``shard`` at ``at`` (``part``
    = ``(a, b, at)``, from ``spec.shard_part`` or ``FullTensors.owned_ranges``), in the shard's dtype and device.
    Returns those elements as read from ``whole`` (for a caller's checks)."""
    a, b, at = part
    piece = whole.reshape(-1)[a:b]
    shard[at:at + b - a] = piece.to(shard.device, shard.dtype)
    return piece


class FullTensors:
    GRAD = "grad"  # ``what`` of the reduced gradient shard

    def elementwise_keys(self, bucket: GradBucket | None = None) -> list[str]:
        """The optimizer states sharded like the master weights (Adam's exp_avg, exp_avg_sq; not ``step``)."""
        if bucket is None and not self.buckets:
            return []  # nothing trainable here
        bucket = self.buckets[0] if bucket is None else bucket
        state = self.optimizer.state.get(bucket.master, {})
        return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == bucket.master.shape)

    def _shard(self, bucket: GradBucket, what: str | None) -> torch.Tensor:
        """This rank's shard of ``what``: None = fp32 master weights, GRAD = reduced gradient, else a state."""
        if what is None:
            return bucket.master.detach()
        if what == self.GRAD:
            return bucket.shard_grad
        state = self.optimizer.state.get(bucket.master, {})
        if what not in state:
            raise KeyError(f"optimizer state {what!r} not found; this optimizer has {self.elementwise_keys(bucket)}")
        return state[what]

    def full_tensors(self, what: str | None = None, params=None) -> dict:
        """{param: whole fp32 tensor of its shape} of ``what`` (see ``_shard``), on every rank (collective).
        All parameters (``params`` None): one all-gather per bucket. Some: per parameter, its elements summed
        over the group (each is non-zero on exactly one rank), so one parameter costs its own size, not its
        bucket's. Both are exact."""
        out = {}
        if params is None:
            for bucket in self.buckets:
                full = comm.all_gather_shards(self._shard(bucket, what), self.group)
                for slot, p in zip(bucket.spec.slots, bucket.params):
                    out[p] = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
            return out
        for param in params:
            slot: ParamSlot = self.slots[param]
            bucket = self.buckets[slot.bucket]
            shard = self._shard(bucket, what).float()
            full = torch.zeros(slot.numel, dtype=torch.float32, device=shard.device)
            part = bucket.spec.shard_part(slot, self.rank)
            if part:
                a, b, at = part
                full[a:b] = shard[at:at + b - a]
            comm.all_reduce_sum(full, self.group, self.wait_timeout)
            out[param] = full.view(slot.shape)
        return out

    @torch.no_grad()
    def export_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """{name: whole parameter} from the fp32 master weights, on every rank (collective), on CPU."""
        return {self.param_names[p]: t.to(dtype=dtype, device="cpu") for p, t in self.full_tensors().items()}

    def owned_ranges(self, bucket: GradBucket):
        """For each parameter of ``bucket`` overlapping this rank's shard (its padding left out, it stays zero):
        ``(param, a, b, at)``: the parameter's flat elements ``[a, b)`` sit at ``at`` in the shard."""
        for slot, p in zip(bucket.spec.slots, bucket.params):
            part = bucket.spec.shard_part(slot, self.rank)
            if part:
                yield (p, *part)

    def _local_part(self, param, shard: torch.Tensor, value: torch.Tensor) -> None:
        """Write this rank's part of the whole ``value`` of ``param`` into ``shard``."""
        slot: ParamSlot = self.slots[param]
        part = self.buckets[slot.bucket].spec.shard_part(slot, self.rank)
        if part:
            copy_part_to_shard(shard, value, part)

    def full_master(self, param, state_key: str | None = None) -> torch.Tensor:
        """The whole fp32 master weight (or optimizer state ``state_key``) of ``param`` (collective)."""
        return self.full_tensors(state_key, [param])[param]

    def set_full_master(self, param, value: torch.Tensor, state_key: str | None = None) -> None:
        self._local_part(param, self._shard(self.buckets[self.slots[param].bucket], state_key), value)

    def full_grad(self, param) -> torch.Tensor:
        """The reduced fp32 gradient of ``param`` (collective). Valid after the reduce-scatter, before step."""
        bucket = self.buckets[self.slots[param].bucket]
        if bucket.in_flight is not None:
            self._complete(bucket)
        if bucket.shard_grad is None or bucket.full is not None:
            raise RuntimeError("the reduced gradient is available after the reduce-scatter of the last "
                               "micro-batch (finish_grad_sync) and before step()")
        return self.full_tensors(self.GRAD, [param])[param]

    def set_full_grad(self, param, value: torch.Tensor) -> None:
        bucket = self.buckets[self.slots[param].bucket]
        if bucket.shard_grad is None:
            raise RuntimeError("no reduced gradient to overwrite: call after the reduce-scatter, before step()")
        self._local_part(param, bucket.shard_grad, value)
