"""Checkpoints of the FP32-reducing ZeRO optimizer, in DeepSpeed's own ZeRO-1/2 layout.

In memory the fp32 master weights and optimizer states are sharded per bucket (``l3plugin.zero.buffers``). On
disk each rank of the W-rank reduction group writes what DeepSpeed's ZeRO-1/2 optimizer (``stage_1_and_2.py``)
writes for the same model and config, so DeepSpeed's tools and a stock engine read it:

- per optimizer param group, the group's trainable parameters back to back in param-group order (our buckets
  keep that order), padded at the end to a multiple of ``2 * W`` (DeepSpeed's ``nccl_start_alignment_factor``
  of 2 times W); rank r owns elements ``[r * P, (r + 1) * P)``, ``P = ceil(N / 2W) * 2``;
- ``single_partition_of_fp32_groups``: rank r's fp32 part *without* its padding; ``group_paddings``: how
  much padding was cut; ``partition_count``: W per group; ``param_alignment_paddings``: zeros (no per-param
  alignment); ``param_slice_mappings``: per group, ``name -> (start, numel)`` of each parameter fragment in
  this rank's part;
- ``base_optimizer_state``: a torch optimizer state dict with one flat parameter per group (the rigid form
  DeepSpeed writes unless ``elastic_checkpoint``): element-wise states (Adam's ``exp_avg``, ``exp_avg_sq``)
  are this rank's padded part, scalars (``step``) as saved by the optimizer, and the group hyper-parameters;
- ``KEY``: only what DeepSpeed has no place for, all checked on load: format number, parameter shapes, and
  what the partition must match: the rank that wrote it, the world size, the ZeRO stage, per group the
  numels of its fp32 part and padded states, a CRC32 of its tensors, and the CRC32 of every rank's
  partition (so a swapped, stale or foreign file is caught by its neighbours).

The DeepSpeed adapter (``l3plugin/deepspeed/optimizer.py``) adds DeepSpeed's own objects (``ds_version``, its
``LossScaler``, ``ZeroStageEnum``, ``fragment_address``) so a stock engine resumes the files.

Loading (``load_sharded_state_dict``) reads that layout from any W_old, whoever wrote it (l3plugin, stock
DeepSpeed rigid or elastic, or l3plugin's earlier format 1), using only each file's own metadata: a
parameter's fragments, taken rank by rank from ``param_slice_mappings``, concatenate to the whole parameter.
Each rank reads (memory-mapped, ``weights_only=True``) only the partitions overlapping its shards, and
verifies before touching the model (``partition_files.py``): every file's place (its recorded rank and
world size, and for any writer, that each fragment sits where its rank's range says), sizes against the
mappings, the checksums of the partitions it reads, and that the loaded values are finite
(``allow_nonfinite`` opts out). The ranks then agree (``verified_load.py``): an error on one rank is
an error on all of them, raised before the first collective, the final parameter all-gather.
Universal checkpoints (``ds_to_universal`` output) are read by ``deepspeed_universal.py``.

Saving is collective (one all-gather per bucket and state).
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch

from l3plugin.checkpoint.partition_files import (FORMAT, KEY, PartitionFiles, check_checksum, check_finite,
                                                 check_set, check_shapes, check_sizes, checksum, fragments)
from l3plugin.checkpoint.verified_load import Loaded, load_agreed
from l3plugin.collective import comm

ALIGNMENT_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor: each group is padded to a multiple of 2 * W


def _groups(zero):
    """Per optimizer param group: ([(bucket, start in the group's flat layout)], group numel)."""
    out = []
    for g in range(len(zero.optimizer.param_groups)):
        entries, total = [], 0
        for bucket in zero.buckets:
            if bucket.spec.group == g:
                entries.append((bucket, total))
                total += bucket.spec.numel
        out.append((entries, total))
    return out


def partition_numel(total: int, world: int) -> int:
    """Elements per rank of a param group of ``total`` elements over ``world`` ranks, as DeepSpeed pads."""
    alignment = ALIGNMENT_FACTOR * world
    return -(-total // alignment) * alignment // world


@torch.no_grad()
def sharded_state_dict(zero) -> dict:
    """This rank's partition of master weights and optimizer state in DeepSpeed's ZeRO-1/2 layout, with plain
    Python types (the DeepSpeed adapter swaps in DeepSpeed's classes). Collective over the group."""
    rank, world = zero.rank, zero.world_size
    masters, paddings, mappings, states, shapes, alignment = [], [], [], OrderedDict(), [], []
    for g, (entries, total) in enumerate(_groups(zero)):
        size = partition_numel(total, world)
        lo = rank * size
        lean = max(0, min(size, total - lo))
        keys = zero.elementwise_keys(entries[0][0]) if entries else []
        out = {None: torch.zeros(size, dtype=torch.float32)}
        group_scalars = OrderedDict()
        mapping = OrderedDict()
        for bucket, start in entries:
            state = zero.optimizer.state.get(bucket.master, {})
            if zero.elementwise_keys(bucket) != keys:
                raise RuntimeError(f"optimizer state keys differ between buckets of param group {g}")
            for key, value in state.items():
                if key not in keys and key not in group_scalars:
                    group_scalars[key] = copy.deepcopy(value.cpu() if torch.is_tensor(value) else value)
            for key in [None, *keys]:
                shard = bucket.master.detach() if key is None else state[key]
                if key not in out:
                    out[key] = torch.zeros(size, dtype=shard.dtype)
                full = comm.all_gather_shards(shard, zero.group, zero.wait_timeout)
                s, e = max(lo, start), min(lo + size, start + bucket.spec.numel)
                if s < e:
                    out[key][s - lo:e - lo] = full[s - start:e - start].cpu()
            for slot, p in zip(bucket.spec.slots, bucket.params):
                s, e = max(lo, start + slot.offset), min(lo + lean, start + slot.offset + slot.numel)
                if s < e:
                    mapping[zero.param_names[p]] = {"numel": e - s, "start": s - lo}
        masters.append(out.pop(None)[:lean].clone())
        paddings.append(size - lean)
        mappings.append(mapping)
        if out or group_scalars:
            states[g] = OrderedDict(**group_scalars, **{k: out[k] for k in keys})
        shapes.append([(zero.param_names[p], tuple(p.shape)) for b, _ in entries for p in b.params])
        alignment.append([0] * len(shapes[-1]))
    hyper = [{**{k: copy.deepcopy(v) for k, v in pg.items() if k != "params"}, "params": [g]}
             for g, pg in enumerate(zero.optimizer.param_groups)]
    mine = checksum(masters, [states.get(g, {}) for g in range(len(masters))])
    device = zero.buckets[0].master.device if zero.buckets else "cpu"
    every = comm.all_gather_shards(torch.tensor([mine], dtype=torch.int64, device=device), zero.group,
                                   zero.wait_timeout)
    return {
        "base_optimizer_state": {"state": states, "param_groups": hyper},
        "single_partition_of_fp32_groups": masters,
        "zero_stage": zero.settings.stage,
        "group_paddings": paddings,
        "param_alignment_paddings": alignment,
        "partition_count": [world] * len(masters),
        "param_slice_mappings": mappings,
        KEY: {"format": FORMAT, "param_shapes": shapes, "rank": rank, "world_size": world,
              "stage": zero.settings.stage, "numels": [[m.numel(), m.numel() + p] for m, p in zip(masters, paddings)],
              "checksum": mine, "checksums": every.tolist()},
    }


@torch.no_grad()
def read_partitions(zero, sources, optimizer_states: bool = True, allow_nonfinite: bool = False) -> Loaded:
    """Read and verify every partition this rank needs (see the module docstring), into new tensors.
    Touches neither the model nor the optimizer; no collective."""
    src = PartitionFiles(sources)
    check_set(src)
    first = src[0]
    groups = _groups(zero)
    names_by_group = [{zero.param_names[p]: p for b, _ in entries for p in b.params} for entries, _ in groups]
    offsets_by_group = [{zero.param_names[p]: start + slot.offset for b, start in entries
                         for slot, p in zip(b.spec.slots, b.params)} for entries, _ in groups]
    for q in range(len(src)):
        check_sizes(src, q)
    frags = fragments(src, names_by_group, offsets_by_group)
    _check_whole(frags, names_by_group)
    check_shapes(src, names_by_group)
    staged, used = [], set()
    for g, (entries, _) in enumerate(groups):
        keys = sorted(first[g].tensors) if optimizer_states else []
        for bucket, _start in entries:
            targets = _read_shard(zero, bucket, src, g, keys, frags, used, allow_nonfinite)
            state = None
            if optimizer_states:
                state = {key: targets[key] for key in keys}
                for key, value in first[g].scalars.items():
                    state[key] = (copy.deepcopy(value).to(bucket.master.device) if torch.is_tensor(value)
                                  else copy.deepcopy(value))
            staged.append((bucket, targets[None], state))
    for q in sorted(used):
        check_checksum(src, q)
    return Loaded(staged, [first[g].hyper if optimizer_states else None for g in range(len(groups))])


def _check_whole(frags, names_by_group) -> None:
    """The saved fragments of every model parameter add up to the whole parameter."""
    for names in names_by_group:
        for name, p in names.items():
            got = sum(f[2] for f in frags.get(name, []))
            if got != p.numel():
                raise ValueError(f"checkpoint does not match the model: parameter {name!r} has {p.numel()} "
                                 f"elements ({tuple(p.shape)}), the checkpoint holds {got}"
                                 + ("" if got else " (missing)"))


def _read_shard(zero, bucket, src, g, keys, frags, used, allow_nonfinite) -> dict:
    """This rank's shard of ``bucket`` (param group ``g``), {None: fp32 master, key: state}, copied from the
    saved fragments that overlap it (checked finite unless allowed); ``used`` gets the partitions read."""
    device = bucket.master.device
    targets = {None: torch.zeros_like(bucket.master.data)}
    for key in keys:
        targets[key] = torch.zeros_like(bucket.master.data, dtype=src[0][g].tensors[key].dtype)
    for p, a, b, at in zero.owned_ranges(bucket):
        name = zero.param_names[p]
        for q, start, numel, done in frags[name]:
            x, y = max(a, done), min(b, done + numel)  # in the parameter's flat elements
            if x >= y:
                continue
            saved = src[q][g]
            used.add(q)
            for key, target in targets.items():
                if key is not None and key not in saved.tensors:
                    raise ValueError(f"{src.label(q)}: optimizer state {key!r} of param group {g} is "
                                     f"missing (present in {src.label(0)})")
                piece = saved.source(key)[start + x - done:start + y - done]
                if not allow_nonfinite:
                    check_finite(piece, src, q, f"{'fp32 master weights' if key is None else key} of {name!r}")
                target[at + x - a:at + y - a] = piece.to(device)
    return targets


@torch.no_grad()
def load_sharded_state_dict(zero, sources, optimizer_states: bool = True, *, allow_nonfinite: bool = False,
                            agree=None) -> None:
    """Restore master weights (and, unless told not to, optimizer state and hyper-parameters) from the
    partitions saved by W_old ranks (paths or dicts, in rank order), for any W_old.

    Verifies everything first (see the module docstring), then the ranks agree: ``agree`` (default: one
    ``OneAgreement`` over the ZeRO group) is called with this rank's error or None before anything is
    changed. Collective."""
    load_agreed(zero, lambda: read_partitions(zero, sources, optimizer_states, allow_nonfinite), agree)
