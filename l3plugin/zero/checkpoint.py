"""Checkpoints of the FP32-reducing ZeRO optimizer in a world-size-independent layout.

In memory the fp32 master weights and optimizer states are sharded per bucket (``buffers.py``). On disk we
write the *canonical* layout instead, which is DeepSpeed's ZeRO-1/2 layout: per optimizer param group, the
group's parameters back to back (bucket order), padded at the end to a multiple of W, and rank r of W saves
elements ``[r * P, (r + 1) * P)`` with ``P = ceil(group numel / W)``. Consequences:

- DeepSpeed's own ``zero_to_fp32`` (``get_fp32_state_dict_from_zero_checkpoint``) rebuilds a plain fp32
  state dict from our checkpoints, with no l3plugin installed (keys ``zero_stage``, ``partition_count``,
  ``single_partition_of_fp32_groups`` are what it reads);
- loading for any other W only copies ranges: each rank reads the few saved partitions overlapping its
  shards (memory-mapped) and needs no collective. Element-wise optimizer states (Adam's ``exp_avg``,
  ``exp_avg_sq``) are re-sharded the same way; per-tensor scalars (``step``) are identical for every bucket
  of a group and are copied.

Saving is collective (one all-gather per bucket and state), loading is local plus the final parameter
all-gather.
"""

from __future__ import annotations

import copy
import os

import torch

from l3plugin.zero import comm

FORMAT = 1
KEY = "l3plugin_zero"


def _groups(zero):
    """Per optimizer param group: ([(bucket, canonical start)], group numel)."""
    out = []
    for g in range(len(zero.optimizer.param_groups)):
        entries, total = [], 0
        for bucket in zero.buckets:
            if bucket.spec.group == g:
                entries.append((bucket, total))
                total += bucket.spec.numel
        out.append((entries, total))
    return out


def _part(total: int, world: int) -> int:
    return -(-total // world)


def _elementwise_keys(zero, bucket) -> list[str]:
    state = zero.optimizer.state.get(bucket.master, {})
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == bucket.master.shape)


@torch.no_grad()
def sharded_state_dict(zero) -> dict:
    """This rank's canonical partition of master weights and optimizer state (collective over the group)."""
    rank, world = zero.rank, zero.world_size
    masters, states, scalars, shapes = [], [], [], []
    for g, (entries, total) in enumerate(_groups(zero)):
        size = _part(total, world)
        lo = rank * size
        keys = _elementwise_keys(zero, entries[0][0]) if entries else []
        out = {None: torch.zeros(size, dtype=torch.float32)}
        group_scalars = {}
        for bucket, start in entries:
            state = zero.optimizer.state.get(bucket.master, {})
            if sorted(_elementwise_keys(zero, bucket)) != keys:
                raise RuntimeError(f"optimizer state keys differ between buckets of param group {g}")
            for key, value in state.items():
                if key not in keys:
                    group_scalars.setdefault(key, copy.deepcopy(value.cpu() if torch.is_tensor(value) else value))
            for key in [None, *keys]:
                shard = bucket.master.detach() if key is None else state[key]
                if key not in out:
                    out[key] = torch.zeros(size, dtype=shard.dtype)
                full = comm.all_gather_shards(shard, zero.group)
                s, e = max(lo, start), min(lo + size, start + bucket.spec.numel)
                if s < e:
                    out[key][s - lo:e - lo] = full[s - start:e - start].cpu()
        masters.append(out.pop(None))
        states.append(out)
        scalars.append(group_scalars)
        shapes.append([(zero.param_names[p], tuple(p.shape)) for b, _ in entries for p in b.params])
    hyper = [{k: copy.deepcopy(v) for k, v in pg.items() if k != "params"} for pg in zero.optimizer.param_groups]
    return {
        # What DeepSpeed's zero_to_fp32 reads:
        "zero_stage": zero.settings.stage,
        "partition_count": world,
        "single_partition_of_fp32_groups": masters,
        KEY: {"format": FORMAT, "world_size": world, "rank": rank,
              "group_numels": [total for _, total in _groups(zero)], "param_shapes": shapes,
              "optimizer_states": states, "optimizer_scalars": scalars, "param_groups": hyper,
              "stage": zero.settings.stage},
    }


class _Sources:
    """Lazy access to the saved partitions of every old rank (paths are memory-mapped on first use)."""

    def __init__(self, sources):
        self.sources = list(sources)
        self.cache = {}

    def __len__(self):
        return len(self.sources)

    def __getitem__(self, rank) -> dict:
        if rank not in self.cache:
            src = self.sources[rank]
            if isinstance(src, (str, os.PathLike)):
                src = torch.load(src, map_location="cpu", mmap=True, weights_only=False)
            if KEY not in src and isinstance(src.get("optimizer_state_dict"), dict):
                src = src["optimizer_state_dict"]  # a DeepSpeed zero_pp_rank_*_optim_states.pt file
            if KEY not in src:
                raise ValueError(f"partition {rank} is not an l3plugin FP32-reducing ZeRO checkpoint "
                                 f"(no {KEY!r} key; was it saved by stock DeepSpeed?)")
            self.cache[rank] = src
        return self.cache[rank]


@torch.no_grad()
def load_sharded_state_dict(zero, sources, optimizer_states: bool = True) -> None:
    """Restore master weights (and, unless told not to, optimizer state and hyper-parameters) from the
    partitions saved by W_old ranks, for any W_old."""
    src = _Sources(sources)
    meta = src[0][KEY]
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {meta.get('format')} is not supported (expected {FORMAT})")
    old_world = meta["world_size"]
    if len(src) != old_world:
        raise ValueError(f"the checkpoint was saved by {old_world} ranks but {len(src)} partitions were given")
    groups = _groups(zero)
    numels = [total for _, total in groups]
    shapes = [[tuple(p.shape) for b, _ in entries for p in b.params] for entries, _ in groups]
    saved_shapes = [[tuple(shape) for _, shape in group] for group in meta["param_shapes"]]
    if meta["group_numels"] != numels or saved_shapes != shapes:
        raise ValueError(f"checkpoint does not match the model (same parameters, param groups and chunks, in "
                         f"the same order, are needed): elements per param group {meta['group_numels']} saved, "
                         f"{numels} now; parameter shapes {saved_shapes} saved, {shapes} now")
    for g, (entries, total) in enumerate(groups):
        old_size = _part(total, old_world)
        keys = sorted(meta["optimizer_states"][g]) if optimizer_states else []
        for bucket, start in entries:
            lo, hi = bucket.spec.shard_range(zero.rank)
            hi = min(hi, bucket.spec.numel)  # the padding stays zero
            targets = {None: bucket.master.data}
            device = bucket.master.device
            new_state = {}
            for key in keys:
                dtype = src[0][KEY]["optimizer_states"][g][key].dtype
                new_state[key] = targets[key] = torch.zeros_like(bucket.master.data, dtype=dtype)
            bucket.master.data.zero_()
            c_lo, c_hi = start + lo, start + max(lo, hi)
            for q in range(c_lo // old_size if old_size else 0, -(-c_hi // old_size) if old_size else 0):
                part = src[q]
                s, e = max(c_lo, q * old_size), min(c_hi, (q + 1) * old_size)
                if s >= e:
                    continue
                for key, target in targets.items():
                    saved = (part["single_partition_of_fp32_groups"][g] if key is None
                             else part[KEY]["optimizer_states"][g][key])
                    target[s - c_lo:e - c_lo] = saved[s - q * old_size:e - q * old_size].to(device)
            if not optimizer_states:
                continue
            for key, value in meta["optimizer_scalars"][g].items():
                new_state[key] = copy.deepcopy(value).to(device) if torch.is_tensor(value) else copy.deepcopy(value)
            if new_state:
                zero.optimizer.state[bucket.master] = new_state
            else:
                zero.optimizer.state.pop(bucket.master, None)
        if optimizer_states:
            for key, value in meta["param_groups"][g].items():
                zero.optimizer.param_groups[g][key] = copy.deepcopy(value)
    zero.zero_grad()
    zero.all_gather_params()


@torch.no_grad()
def full_state_dict(zero, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """{name: whole parameter} from the fp32 master weights, on every rank (collective), on CPU."""
    out = {}
    for bucket in zero.buckets:
        full = comm.all_gather_shards(bucket.master.detach(), zero.group)
        for slot, p in zip(bucket.spec.slots, bucket.params):
            out[zero.param_names[p]] = full[slot.offset:slot.offset + slot.numel].view(slot.shape).to(
                dtype=dtype, device="cpu").clone()
    return out
