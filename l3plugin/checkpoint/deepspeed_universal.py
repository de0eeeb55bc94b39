"""DeepSpeed universal checkpoints (``ds_to_universal`` output): one folder per parameter holding its whole
tensors (``fp32.pt``, ``exp_avg.pt``, ...) and ``zero/optimizer_state.pt``; every rank copies its shard
ranges, verified (finite unless allowed) and agreed like the partitions (``verified_load.py``)."""

from __future__ import annotations

import os

import torch

from l3plugin.checkpoint.partition_files import load_file
from l3plugin.checkpoint.verified_load import Loaded, load_agreed
from l3plugin.zero.full_tensors import copy_part_to_shard


@torch.no_grad()
def read_universal(zero, folder, optimizer_states: bool = True, allow_nonfinite: bool = False) -> Loaded:
    """What this rank loads from a universal checkpoint, verified, in new tensors (as ``read_partitions``),
    with the saved global optimizer state."""
    root = os.path.join(os.fspath(folder), "zero")
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root} does not exist: not a universal checkpoint (convert with "
                                "python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state)")
    global_state = load_file(os.path.join(root, "optimizer_state.pt"), "universal checkpoint optimizer state")
    saved_groups = global_state.get("param_groups") or []
    if saved_groups and len(saved_groups) != len(zero.optimizer.param_groups):
        raise ValueError(f"{root}/optimizer_state.pt holds {len(saved_groups)} param groups, the optimizer has "
                         f"{len(zero.optimizer.param_groups)}")
    # Element-wise state keys and the step are the same for every parameter: take them from the first one.
    first = zero.param_names[zero.params[0]]
    _, keys = _universal_files(root, first)
    step = None
    if optimizer_states and "step" in keys:
        step = load_file(os.path.join(root, first, "step.pt"), "universal checkpoint file")
    keys = [k for k in keys if k not in ("fp32", "step")] if optimizer_states else []
    staged = []
    for bucket in zero.buckets:
        master, states = _read_universal_shard(zero, bucket, root, keys, allow_nonfinite)
        state = None
        if optimizer_states:
            state = {key: value if value is not None else torch.zeros_like(bucket.master.data)  # only padding here
                     for key, value in states.items()}
            if step is not None:
                state["step"] = (step.clone() if torch.is_tensor(step)
                                 else torch.tensor(float(step), dtype=torch.float32))
        staged.append((bucket, master, state))
    hyper = [{k: v for k, v in saved.items() if k != "params"} if optimizer_states else None
             for saved in saved_groups]
    return Loaded(staged, hyper, global_state)


def _universal_files(root, name):
    """(folder of parameter ``name``, the names of its .pt files): the folder and its fp32.pt must exist."""
    pdir = os.path.join(root, name)
    if not os.path.isdir(pdir):
        raise FileNotFoundError(f"{pdir} does not exist: the universal checkpoint has no parameter {name!r}")
    files = sorted(f[:-3] for f in os.listdir(pdir) if f.endswith(".pt"))
    if "fp32" not in files:
        raise FileNotFoundError(f"{pdir}/fp32.pt does not exist")
    return pdir, files


def _read_universal_shard(zero, bucket, root, keys, allow_nonfinite):
    """This rank's shard of ``bucket``: (fp32 master, {key: state, None where only padding is here}), copied
    from the whole parameters' files (checked finite unless allowed)."""
    master = torch.zeros_like(bucket.master.data)
    states = {key: None for key in keys}
    for p, *part in zero.owned_ranges(bucket):
        name = zero.param_names[p]
        pdir, _ = _universal_files(root, name)
        for key in ["fp32", *keys]:
            path = os.path.join(pdir, f"{key}.pt")
            full = _universal_tensor(path, name, p)
            if key == "fp32":
                target = master
            else:
                if states[key] is None:
                    states[key] = torch.zeros_like(bucket.master.data, dtype=full.dtype)
                target = states[key]
            piece = copy_part_to_shard(target, full, part)  # into fresh buffers: a refusal below changes nothing
            if not allow_nonfinite and piece.is_floating_point() and not bool(torch.isfinite(piece).all()):
                raise ValueError(f"{path}: holds non-finite values in the part rank {zero.rank} loads; refusing "
                                 "to resume from them (allow_nonfinite=True, or DeepSpeed's "
                                 '"l3plugin": {"checkpoint_allow_nonfinite": true}, if intended)')
    return master, states


def _universal_tensor(path, name, param) -> torch.Tensor:
    """The whole tensor of one universal checkpoint file, as many elements as ``param``."""
    loaded = load_file(path, "universal checkpoint file")
    full = loaded["param"] if isinstance(loaded, dict) else loaded
    if not torch.is_tensor(full) or full.numel() != param.numel():
        raise ValueError(f"{path}: holds {getattr(full, 'shape', type(full).__name__)}, parameter "
                         f"{name!r} has shape {tuple(param.shape)} (tensor-parallel slicing of universal "
                         "checkpoints is not supported)")
    return full


@torch.no_grad()
def load_universal(zero, folder, optimizer_states: bool = True, *, allow_nonfinite: bool = False,
                   agree=None) -> dict:
    """Restore from a DeepSpeed universal checkpoint folder (``ds_to_universal`` output, the tag folder that
    holds ``zero/``): ``zero/<param name>/{fp32,exp_avg,...}.pt`` hold whole parameters; every rank copies
    its shard ranges. Verified and agreed like ``load_sharded_state_dict``. Returns the saved global
    optimizer state (``zero/optimizer_state.pt``)."""
    return load_agreed(zero, lambda: read_universal(zero, folder, optimizer_states, allow_nonfinite),
                       agree).global_state
