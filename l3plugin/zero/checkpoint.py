"""Checkpoints of the FP32-reducing ZeRO optimizer, in DeepSpeed's own ZeRO-1/2 layout.

In memory the fp32 master weights and optimizer states are sharded per bucket (``buffers.py``). On disk each
rank of the W-rank reduction group writes what DeepSpeed's ZeRO-1/2 optimizer (``stage_1_and_2.py``) writes
for the same model and config, so DeepSpeed's tools and a stock engine read it:

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
- ``KEY``: only what DeepSpeed has no place for (format number and parameter shapes, checked on load).

The DeepSpeed adapter (``deepspeed_engine.py``) adds DeepSpeed's own objects (``ds_version``, its
``LossScaler``, ``ZeroStageEnum``, ``fragment_address``) so a stock engine resumes the files.

Loading (``load_sharded_state_dict``) reads that layout from any W_old, whoever wrote it (l3plugin, stock
DeepSpeed rigid or elastic, or l3plugin's earlier format 1), using only each file's own metadata: a
parameter's fragments, taken rank by rank from ``param_slice_mappings``, concatenate to the whole parameter.
Each rank reads (memory-mapped, ``weights_only=True``) only the partitions overlapping its shards; no
collective until the final parameter all-gather. ``load_universal`` reads DeepSpeed universal checkpoints
(``ds_to_universal`` output: one folder per parameter holding ``fp32.pt``, ``exp_avg.pt``, ...).

Saving is collective (one all-gather per bucket and state).
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict

import torch

from l3plugin import comm

FORMAT = 2
KEY = "l3plugin_zero"
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


def _elementwise_keys(zero, bucket) -> list[str]:
    state = zero.optimizer.state.get(bucket.master, {})
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1 and v.shape == bucket.master.shape)


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
        keys = _elementwise_keys(zero, entries[0][0]) if entries else []
        out = {None: torch.zeros(size, dtype=torch.float32)}
        group_scalars = OrderedDict()
        mapping = OrderedDict()
        for bucket, start in entries:
            state = zero.optimizer.state.get(bucket.master, {})
            if _elementwise_keys(zero, bucket) != keys:
                raise RuntimeError(f"optimizer state keys differ between buckets of param group {g}")
            for key, value in state.items():
                if key not in keys and key not in group_scalars:
                    group_scalars[key] = copy.deepcopy(value.cpu() if torch.is_tensor(value) else value)
            for key in [None, *keys]:
                shard = bucket.master.detach() if key is None else state[key]
                if key not in out:
                    out[key] = torch.zeros(size, dtype=shard.dtype)
                full = comm.all_gather_shards(shard, zero.group)
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
    return {
        "base_optimizer_state": {"state": states, "param_groups": hyper},
        "single_partition_of_fp32_groups": masters,
        "zero_stage": zero.settings.stage,
        "group_paddings": paddings,
        "param_alignment_paddings": alignment,
        "partition_count": [world] * len(masters),
        "param_slice_mappings": mappings,
        KEY: {"format": FORMAT, "param_shapes": shapes},
    }


# -- reading ----------------------------------------------------------------------------------------------
def _allowed_globals() -> list:
    """Non-tensor classes DeepSpeed puts into its partition files (for ``weights_only=True`` loading)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # files without DeepSpeed's classes still load
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_file(path, what: str = "checkpoint file"):
    """``torch.load(path, weights_only=True)`` (memory-mapped when possible) with DeepSpeed's checkpoint
    classes allowed; any failure is a ValueError naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path} does not exist")
    with torch.serialization.safe_globals(_allowed_globals()):
        try:
            try:
                return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
        except Exception as exc:  # noqa: BLE001 - re-raised with the file name
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            if "Unsupported global" in str(exc) or "weights_only" in str(exc).lower():
                reason = next((line.strip() for line in str(exc).splitlines() if "Unsupported global" in line),
                              reason)
            raise ValueError(f"cannot read {what} {path} ({type(exc).__name__}: {reason[:300]}). It must be a "
                             "complete torch.save file holding only tensors, containers and DeepSpeed's "
                             "checkpoint classes (read with weights_only=True); is it truncated or "
                             "not a checkpoint?") from exc


def _address(value) -> tuple[int, int]:
    """(start, numel) of a param_slice_mappings entry: DeepSpeed's fragment_address or our dict."""
    if isinstance(value, dict):
        return int(value["start"]), int(value["numel"])
    return int(value.start), int(value.numel)


class _Group:
    """One saved rank's view of one param group, whatever wrote it."""

    def __init__(self, fp32, size, mapping, tensors, scalars, hyper):
        self.fp32, self.size, self.mapping = fp32, size, mapping
        self.tensors, self.scalars, self.hyper = tensors, scalars, hyper

    def source(self, key):
        return self.fp32 if key is None else self.tensors[key]


def _normalize(sd, label: str, rank: int) -> list[_Group]:
    if not isinstance(sd, dict):
        raise ValueError(f"{label} holds a {type(sd).__name__}, not a ZeRO-1/2 optimizer partition (a dict)")
    if isinstance(sd.get("optimizer_state_dict"), dict):
        sd = sd["optimizer_state_dict"]  # a DeepSpeed zero_pp_rank_*_optim_states.pt file
    if "single_partition_of_fp32_groups" not in sd:
        raise ValueError(f"{label} is not a ZeRO-1/2 optimizer partition: no 'single_partition_of_fp32_groups' "
                         f"(keys: {sorted(map(str, sd))[:12]}); ZeRO-3 and non-ZeRO checkpoints are not supported")
    fp32 = list(sd["single_partition_of_fp32_groups"])
    meta = sd.get(KEY)
    if isinstance(meta, dict) and meta.get("format") == 1:
        return _normalize_format1(sd, meta, fp32, label, rank)
    if isinstance(meta, dict) and meta.get("format") != FORMAT:
        raise ValueError(f"{label}: l3plugin checkpoint format {meta.get('format')} is not supported "
                         f"(this version reads 1 and {FORMAT})")
    if "param_slice_mappings" not in sd:
        raise ValueError(f"{label} has no 'param_slice_mappings' (written by a DeepSpeed older than 0.10?): "
                         "cannot tell which parameter is where")
    paddings = sd.get("group_paddings") or [0] * len(fp32)
    base = sd.get("base_optimizer_state")
    out = []
    for g, part in enumerate(fp32):
        size = part.numel() + int(paddings[g])
        mapping = OrderedDict((name, _address(v)) for name, v in sd["param_slice_mappings"][g].items())
        hyper, state = None, {}
        if isinstance(base, dict) and "state" in base:  # rigid: a torch optimizer state dict
            pid = base["param_groups"][g]["params"][0] if base.get("param_groups") else g
            state = base["state"].get(pid, {})
            hyper = {k: v for k, v in base["param_groups"][g].items() if k != "params"} if base.get(
                "param_groups") else None
        elif isinstance(base, (list, tuple)):  # elastic: per group, padding already cut
            state = dict(base[g])
            if "base_optimizer_state_step" in sd and "step" not in state:
                state["step"] = sd["base_optimizer_state_step"]
        tensors, scalars = {}, {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() in (part.numel(), size):
                tensors[key] = value
            else:
                scalars[key] = value
        out.append(_Group(part, size, mapping, tensors, scalars, hyper))
    return out


def _normalize_format1(sd, meta, fp32, label, rank) -> list[_Group]:
    """l3plugin before format 2: padded to a multiple of W, states under KEY, no slice mappings."""
    out = []
    for g, part in enumerate(fp32):
        size = part.numel()
        lo, offset, mapping = rank * size, 0, OrderedDict()
        for name, shape in meta["param_shapes"][g]:
            numel = 1
            for d in shape:
                numel *= d
            s, e = max(lo, offset), min(lo + size, offset + numel)
            if s < e:
                mapping[name] = (s - lo, e - s)
            offset += numel
        out.append(_Group(part, size, mapping, dict(meta["optimizer_states"][g]),
                          dict(meta["optimizer_scalars"][g]), dict(meta["param_groups"][g])))
    return out


class _Sources:
    """Lazy access to the saved partitions of every old rank (paths are memory-mapped on first use)."""

    def __init__(self, sources):
        self.sources = list(sources)
        if not self.sources:
            raise ValueError("no checkpoint partitions given")
        self.cache = {}
        self.meta = {}  # rank -> (partition_count, our KEY entry or None)

    def __len__(self):
        return len(self.sources)

    def label(self, rank) -> str:
        src = self.sources[rank]
        return f"checkpoint file {os.fspath(src)}" if isinstance(src, (str, os.PathLike)) else \
            f"partition {rank} of {len(self.sources)}"

    def raw(self, rank) -> dict:
        src = self.sources[rank]
        if isinstance(src, (str, os.PathLike)):
            src = load_file(src, "ZeRO checkpoint partition")
        return src

    def __getitem__(self, rank) -> list[_Group]:
        if rank not in self.cache:
            raw = self.raw(rank)
            self.cache[rank] = _normalize(raw, self.label(rank), rank)
            inner = raw.get("optimizer_state_dict") if isinstance(raw.get("optimizer_state_dict"), dict) else raw
            self.meta[rank] = (inner.get("partition_count"), inner.get(KEY))
        return self.cache[rank]


def _fragments(src: _Sources, names_by_group):
    """{name: [(old rank, start in its part, numel, offset in the parameter)]} from every file's mapping.

    Needs every file's (small) mapping; tensors are only touched later, for the ranges this rank owns."""
    frags = {}
    for q in range(len(src)):
        groups = src[q]
        if len(groups) != len(names_by_group):
            raise ValueError(f"checkpoint does not match the model: {src.label(q)} holds {len(groups)} param "
                             f"groups, the optimizer has "
                             f"{len(names_by_group)}")
        for g, group in enumerate(groups):
            for name, (start, numel) in group.mapping.items():
                if name not in names_by_group[g]:
                    where = [i for i, names in enumerate(names_by_group) if name in names]
                    raise ValueError(f"checkpoint does not match the model: {src.label(q)}: parameter {name!r} "
                                     f"of saved param group {g} is "
                                     + (f"in param group {where[0]} now" if where else "not in the model") +
                                     "; the same trainable parameters, names and param groups are needed")
                done = sum(f[2] for f in frags.get(name, []))
                frags.setdefault(name, []).append((q, start, numel, done))
    return frags


@torch.no_grad()
def load_sharded_state_dict(zero, sources, optimizer_states: bool = True) -> None:
    """Restore master weights (and, unless told not to, optimizer state and hyper-parameters) from the
    partitions saved by W_old ranks (paths or dicts, in rank order), for any W_old."""
    src = _Sources(sources)
    first = src[0]
    counts = src.meta[0][0]
    counts = counts[0] if isinstance(counts, (list, tuple)) and counts else counts
    if isinstance(counts, int) and counts != len(src):
        raise ValueError(f"the checkpoint was saved by {counts} ranks but {len(src)} partitions were given")
    groups = _groups(zero)
    names_by_group = [{zero.param_names[p]: p for b, _ in entries for p in b.params} for entries, _ in groups]
    frags = _fragments(src, names_by_group)
    for g, names in enumerate(names_by_group):
        for name, p in names.items():
            got = sum(f[2] for f in frags.get(name, []))
            if got != p.numel():
                raise ValueError(f"checkpoint does not match the model: parameter {name!r} has {p.numel()} "
                                 f"elements ({tuple(p.shape)}), the checkpoint holds {got}"
                                 + ("" if got else " (missing)"))
    _check_shapes(src, names_by_group)
    for g, (entries, _) in enumerate(groups):
        keys = sorted(first[g].tensors) if optimizer_states else []
        for bucket, _start in entries:
            lo, hi = bucket.spec.shard_range(zero.rank)
            hi = min(hi, bucket.spec.numel)  # the padding stays zero
            device = bucket.master.device
            targets = {None: bucket.master.data}
            new_state = {}
            for key in keys:
                new_state[key] = targets[key] = torch.zeros_like(bucket.master.data,
                                                                 dtype=first[g].tensors[key].dtype)
            bucket.master.data.zero_()
            for slot, p in zip(bucket.spec.slots, bucket.params):
                s, e = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if s >= e:
                    continue
                a, b = s - slot.offset, e - slot.offset  # in the parameter's flat elements
                for q, start, numel, done in frags[zero.param_names[p]]:
                    x, y = max(a, done), min(b, done + numel)
                    if x >= y:
                        continue
                    saved = src[q][g]
                    for key, target in targets.items():
                        if key is not None and key not in saved.tensors:
                            raise ValueError(f"{src.label(q)}: optimizer state {key!r} of param group {g} is "
                                             f"missing (present in {src.label(0)})")
                        piece = saved.source(key)[start + x - done:start + y - done]
                        target[slot.offset + x - lo:slot.offset + y - lo] = piece.to(device)
            if not optimizer_states:
                continue
            for key, value in first[g].scalars.items():
                new_state[key] = copy.deepcopy(value).to(device) if torch.is_tensor(value) else copy.deepcopy(value)
            if new_state:
                zero.optimizer.state[bucket.master] = new_state
            else:
                zero.optimizer.state.pop(bucket.master, None)
        if optimizer_states and first[g].hyper is not None:
            for key, value in first[g].hyper.items():
                zero.optimizer.param_groups[g][key] = copy.deepcopy(value)
    zero.zero_grad()
    zero.all_gather_params()


def _check_shapes(src: _Sources, names_by_group) -> None:
    """Files written by l3plugin carry parameter shapes: same element counts but other shapes is an error."""
    meta = src.meta[0][1]
    if not isinstance(meta, dict):
        return
    for g, group in enumerate(meta.get("param_shapes", [])):
        for name, shape in group:
            p = names_by_group[g].get(name)
            if p is not None and tuple(shape) != tuple(p.shape):
                raise ValueError(f"checkpoint does not match the model: parameter {name!r} was saved with shape "
                                 f"{tuple(shape)}, the model has {tuple(p.shape)}")


@torch.no_grad()
def load_universal(zero, folder, optimizer_states: bool = True) -> dict:
    """Restore from a DeepSpeed universal checkpoint folder (``ds_to_universal`` output, the tag folder that
    holds ``zero/``): ``zero/<param name>/{fp32,exp_avg,...}.pt`` hold whole parameters; every rank copies
    its shard ranges. Returns the saved global optimizer state (``zero/optimizer_state.pt``)."""
    root = os.path.join(os.fspath(folder), "zero")
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root} does not exist: not a universal checkpoint (convert with "
                                "python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state)")
    global_state = load_file(os.path.join(root, "optimizer_state.pt"), "universal checkpoint optimizer state")
    saved_groups = global_state.get("param_groups") or []
    if saved_groups and len(saved_groups) != len(zero.optimizer.param_groups):
        raise ValueError(f"{root}/optimizer_state.pt holds {len(saved_groups)} param groups, the optimizer has "
                         f"{len(zero.optimizer.param_groups)}")
    def pt_files(name):
        pdir = os.path.join(root, name)
        if not os.path.isdir(pdir):
            raise FileNotFoundError(f"{pdir} does not exist: the universal checkpoint has no parameter {name!r}")
        files = sorted(f[:-3] for f in os.listdir(pdir) if f.endswith(".pt"))
        if "fp32" not in files:
            raise FileNotFoundError(f"{pdir}/fp32.pt does not exist")
        return pdir, files

    # Element-wise state keys and the step are the same for every parameter: take them from the first one.
    _, keys = pt_files(zero.param_names[zero.params[0]])
    keys = [k for k in keys if k not in ("fp32", "step")] if optimizer_states else []
    step = None
    if optimizer_states and "step" in pt_files(zero.param_names[zero.params[0]])[1]:
        step = load_file(os.path.join(root, zero.param_names[zero.params[0]], "step.pt"), "universal checkpoint file")
    for bucket in zero.buckets:
        lo, hi = bucket.spec.shard_range(zero.rank)
        hi = min(hi, bucket.spec.numel)
        bucket.master.data.zero_()
        new_state = {key: None for key in keys}
        for slot, p in zip(bucket.spec.slots, bucket.params):
            s, e = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if s >= e:
                continue
            name = zero.param_names[p]
            pdir, files = pt_files(name)
            for key in ["fp32", *keys]:
                path = os.path.join(pdir, f"{key}.pt")
                loaded = load_file(path, "universal checkpoint file")
                full = loaded["param"] if isinstance(loaded, dict) else loaded
                if not torch.is_tensor(full) or full.numel() != p.numel():
                    raise ValueError(f"{path}: holds {getattr(full, 'shape', type(full).__name__)}, parameter "
                                     f"{name!r} has shape {tuple(p.shape)} (tensor-parallel slicing of universal "
                                     "checkpoints is not supported)")
                if key == "fp32":
                    target = bucket.master.data
                else:
                    if new_state[key] is None:
                        new_state[key] = torch.zeros_like(bucket.master.data, dtype=full.dtype)
                    target = new_state[key]
                target[s - lo:e - lo] = full.reshape(-1)[s - slot.offset:e - slot.offset].to(target.device)
        for key in keys:
            if new_state[key] is None:  # this rank owns only padding of the bucket
                new_state[key] = torch.zeros_like(bucket.master.data)
        if optimizer_states:
            if step is not None:
                new_state["step"] = (step.clone() if torch.is_tensor(step)
                                     else torch.tensor(float(step), dtype=torch.float32))
            if new_state:
                zero.optimizer.state[bucket.master] = new_state
    if optimizer_states:
        for g, saved in enumerate(saved_groups):
            for key, value in saved.items():
                if key != "params":
                    zero.optimizer.param_groups[g][key] = copy.deepcopy(value)
    zero.zero_grad()
    zero.all_gather_params()
    return global_state


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
