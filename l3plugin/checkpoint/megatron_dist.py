"""The FP32-reducing ZeRO optimizer's state in Megatron-Core's dist_checkpointing (torch_dist format).

    model_sd = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": zero_sharded_state_dict(zero, model_sd)}, folder)
    loaded = dist_checkpointing.load({"optimizer": zero_sharded_state_dict(zero, model_sd, is_loading=True)},
                                     folder)
    load_zero_sharded_state_dict(zero, loaded["optimizer"])   # verified, agreed across the ranks, installed

Each parameter's master and element-wise states are placed like the model's own ShardedTensor for that
parameter, so the checkpoint does not depend on the data-parallel size or on the optimizer's buckets.
Imports only ``megatron.core`` (inside the functions), never the Megatron adapter.
"""

from __future__ import annotations

import torch

from l3plugin.checkpoint.verified_load import Loaded, load_agreed
from l3plugin.zero.full_tensors import copy_part_to_shard
from l3plugin.zero.optimizer import FP32ReduceZero

STATE_PREFIX = "optimizer.state"  # the keys Megatron's DistributedOptimizer uses in its fully_reshardable format


def _param_metadata(zero, model_sharded_state_dict):
    """{param: the model's ShardedTensor (or factory) for it}: keys, global shapes/offsets, replica ids."""
    if model_sharded_state_dict is None:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized() and ps.get_model_parallel_group().size() > 1:
            raise ValueError("model_sharded_state_dict is required with tensor/pipeline parallelism (pass the "
                             "model chunks' sharded_state_dict(): its keys and offsets place the optimizer state)")
        return None
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_storage = {}
    for sh in nested_values(tensors):
        by_storage[(sh.data.data_ptr(), tuple(sh.data.shape))] = sh
    out, missing = {}, []
    for p in zero.params:
        sh = by_storage.get((p.data_ptr(), tuple(p.shape)))
        if sh is None:
            missing.append(zero.param_names[p])
        out[p] = sh
    if missing:
        raise ValueError(f"model_sharded_state_dict has no entry for parameter(s) {missing[:5]} "
                         f"({len(missing)} in all): build it from the same model chunks, with keep_vars=True "
                         "or tensors sharing the parameters' storage")
    return out


def _full_states(zero, keys):
    """{key: {param: whole fp32 tensor of the param's local shape}} (one all-gather per bucket and key)."""
    return {key: zero.full_tensors(None if key == "param" else key) for key in ["param", *keys]}


def _state_values(zero, is_loading, state_keys):
    """(element-wise state keys, {"param" or key: {param: tensor}}): saving, the gathered master and states
    (collective); loading, empty tensors to fill (keys: ``state_keys``, else the optimizer's, else Adam's)."""
    if not is_loading:
        keys = zero.elementwise_keys()
        return keys, _full_states(zero, keys)
    keys = list(state_keys) if state_keys is not None else (
        zero.elementwise_keys() or (["exp_avg", "exp_avg_sq"] if "betas" in zero.optimizer.param_groups[0]
                                    else []))
    return keys, {k: {p: torch.empty(p.shape, dtype=torch.float32) for p in zero.params} for k in ["param", *keys]}


def zero_sharded_state_dict(zero: FP32ReduceZero, model_sharded_state_dict=None, *, is_loading=False,
                            state_keys=None) -> dict:
    """The optimizer's state for ``megatron.core.dist_checkpointing.save`` / ``load`` (torch_dist format).

    Per parameter, the fp32 master (``optimizer.state.param.<model key>``) and each element-wise optimizer
    state (``optimizer.state.exp_avg.<model key>``, ...) as a ShardedTensor with the parameter's own shape,
    global offsets and replica id, taken from the model's ShardedTensor for that parameter (the key scheme of
    Megatron's DistributedOptimizer ``fully_reshardable`` format): the checkpoint does not depend on the
    data-parallel size or on l3plugin's buckets, so it loads onto any DP size (and TP/PP layout the model's
    own checkpoint supports). Hyper-parameters and scalar states (Adam's ``step``) are common state.

    Saving gathers each bucket once over the DP group (collective). For loading, call with
    ``is_loading=True`` (empty tensors to fill; ``state_keys`` defaults to Adam's ``exp_avg``/``exp_avg_sq``
    when the optimizer has not stepped yet), pass it to ``dist_checkpointing.load`` and hand the result to
    ``load_zero_sharded_state_dict``.
    """
    meta = _param_metadata(zero, model_sharded_state_dict)
    keys, values = _state_values(zero, is_loading, state_keys)
    param_state = {i: _sharded_param_state(zero, p, values, None if meta is None else meta[p])
                   for i, p in enumerate(zero.params)}
    return {"param_state": param_state, "l3plugin_zero": {
        "format": 1, "state_keys": keys, "scalars": _scalar_states(zero, keys),
        "param_groups": [{k: v for k, v in pg.items() if k != "params"} for pg in zero.optimizer.param_groups]}}


def _sharded_param_state(zero, p, values, model_sharded) -> dict:
    """{key: ShardedTensor} of one parameter's master and states, placed like the model's ShardedTensor
    ``model_sharded`` (None: one process, keyed by the parameter's name)."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    entry = {}
    for key, by_param in values.items():
        data = by_param[p]
        if model_sharded is None:
            entry[key] = ShardedTensor.from_rank_offsets(f"{STATE_PREFIX}.{key}.{zero.param_names[p]}", data,
                                                         replica_id=zero.rank)
            continue
        kwargs = dict(key=f"{STATE_PREFIX}.{key}.{model_sharded.key}", data=data,
                      replica_id=model_sharded.replica_id)
        if not isinstance(model_sharded, ShardedTensorFactory):
            kwargs["dtype"] = data.dtype
        entry[key] = replace(model_sharded, **kwargs)
        if hasattr(entry[key], "validate_metadata_integrity"):
            entry[key].validate_metadata_integrity()
    return entry


def _scalar_states(zero, keys) -> list[dict]:
    """Per param group, the optimizer states that are not element-wise (Adam's ``step``): common state."""
    scalars = []
    for g in range(len(zero.optimizer.param_groups)):
        bucket = next((b for b in zero.buckets if b.spec.group == g), None)
        state = zero.optimizer.state.get(bucket.master, {}) if bucket is not None else {}
        scalars.append({k: v for k, v in state.items() if k not in keys})
    return scalars


@torch.no_grad()
def load_zero_sharded_state_dict(zero: FP32ReduceZero, state_dict: dict, *, allow_nonfinite: bool = False) -> None:
    """Restore from what ``dist_checkpointing.load(zero_sharded_state_dict(..., is_loading=True), dir)``
    returned (each rank copies its shard ranges; ends with the parameter all-gather). Checked before anything
    changes (shapes; finite values unless ``allow_nonfinite``); an error on one rank is raised on every rank
    of the ZeRO group before the first collective (``l3plugin.collective.fail_together``)."""
    load_agreed(zero, lambda: _read_dist_state(zero, state_dict, allow_nonfinite))


def _read_dist_state(zero: FP32ReduceZero, state_dict: dict, allow_nonfinite: bool) -> Loaded:
    if not isinstance(state_dict, dict) or "l3plugin_zero" not in state_dict or "param_state" not in state_dict:
        raise ValueError("state_dict must be the result of dist_checkpointing.load(zero_sharded_state_dict(zero, "
                         f"..., is_loading=True), dir); got keys {sorted(state_dict)[:8] if isinstance(state_dict, dict) else type(state_dict).__name__}")
    common = state_dict["l3plugin_zero"]
    keys = list(common["state_keys"])
    full = {}
    for i, p in enumerate(zero.params):
        entry = state_dict["param_state"][i]
        for key in ["param", *keys]:
            value = entry[key]
            if not torch.is_tensor(value) or tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"loaded optimizer state {key!r} of {zero.param_names[p]} is "
                                 f"{getattr(value, 'shape', type(value).__name__)}, expected {tuple(p.shape)}")
            full.setdefault(key, {})[p] = value
    staged = []
    for bucket in zero.buckets:
        targets = {key: torch.zeros_like(bucket.master.data) for key in ["param", *keys]}
        for p, *part in zero.owned_ranges(bucket):
            for key, target in targets.items():  # staging buffers: a refusal below leaves the optimizer as it was
                piece = copy_part_to_shard(target, full[key][p], part)
                if not allow_nonfinite and not bool(torch.isfinite(piece).all()):
                    raise ValueError(f"loaded optimizer state {key!r} of {zero.param_names[p]} holds non-finite "
                                     "values; refusing to resume from them (allow_nonfinite=True if intended)")
        state = {k: targets[k] for k in keys}
        for key, value in common["scalars"][bucket.spec.group].items():
            state[key] = value.clone().to(bucket.device) if torch.is_tensor(value) else value
        staged.append((bucket, targets["param"], state))
    hyper = [{k: v for k, v in saved.items() if k != "params"} for saved in common["param_groups"]]
    return Loaded(staged, hyper)
