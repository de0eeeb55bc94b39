"""Drive l3plugin's FP32-reducing ZeRO optimizer from Megatron-Core model chunks and the flexible schedule.

    zero = megatron_zero(model_chunks, torch.optim.AdamW(params, lr=...), stage=2, clip_grad=1.0)
    attach_to_schedule(config, zero)      # ZeRO-2 reduce-scatters at every round end, ZeRO-1 at the last
    forward_backward_pipelining_flexible(...)
    zero.step()                           # clip on the global fp32 norm, step, bf16 all-gather

Groups come from Megatron's parallel_state: gradients reduce over DP x CP; the clipping norm is summed
over the model-parallel group (TP x PP) counting TP-duplicated parameters (norms, biases) once.
Megatron's own DDP wrapper is not used: l3plugin's hooks accumulate the gradients.
"""

from __future__ import annotations

import torch

from l3plugin.zero.checkpoint import Loaded, load_agreed
from l3plugin.zero.optimizer import FP32ReduceZero
from l3plugin.zero.settings import DEEPSPEED_ONLY


def megatron_zero(model_chunks, optimizer, *, stage=1, clip_grad=0.0, gradient_scale=None, group=None,
                  **settings):
    """``group`` overrides the gradient-reduction group (default: parallel_state's DP x CP group).
    ``overlap_param_gather=True`` (a ZeroSettings field): ``zero.step()`` only starts the parameter
    all-gathers; each chunk's layers wait for theirs in their forward pre-hooks (Megatron's
    --overlap-param-gather, for l3plugin's optimizer)."""
    from megatron.core import parallel_state as ps

    for name in DEEPSPEED_ONLY:
        if name in settings:
            raise ValueError(f"{name}={settings[name]!r} applies to the DeepSpeed engine only: under Megatron-Core "
                             f"ZeRO-2 reduce-scatters once per round of the flexible schedule and checkpoints go "
                             f"through dist_checkpointing; drop {name}")
    tp_rank = ps.get_tensor_model_parallel_rank()
    names = {p: f"chunk{c}.{n}" for c, chunk in enumerate(model_chunks) for n, p in chunk.named_parameters()}
    zero = FP32ReduceZero(
        optimizer, group if group is not None else ps.get_data_parallel_group(with_context_parallel=True),
        chunks=[list(chunk.parameters()) for chunk in model_chunks],
        norm_group=ps.get_model_parallel_group(),
        counts_in_norm=lambda p: getattr(p, "tensor_model_parallel", False) or tp_rank == 0,
        param_names=names, stage=stage, clip_grad=clip_grad, gradient_scale=gradient_scale, **settings)
    if zero.settings.overlap and zero.settings.overlap_param_gather:
        for chunk in model_chunks:
            zero.wait_params_in_forward(chunk)
    return zero


def attach_to_schedule(config, zero: FP32ReduceZero):
    """Make the flexible schedule call the optimizer at every (chunk, round) end."""
    config.round_grad_sync_func = lambda chunk, params, round_id, is_last_round: zero.end_of_round(
        params, is_last_round)
    config.grad_sync_func = None
    config.no_sync_func = None
    config.finalize_model_grads_func = None  # zero.step() finishes the gradient sync


# -- megatron.core.dist_checkpointing (torch_dist) ------------------------------------------------------------
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
    from dataclasses import replace

    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    meta = _param_metadata(zero, model_sharded_state_dict)
    if is_loading:
        keys = list(state_keys) if state_keys is not None else (
            zero.elementwise_keys() or (["exp_avg", "exp_avg_sq"] if "betas" in zero.optimizer.param_groups[0]
                                        else []))
        values = {k: {p: torch.empty(p.shape, dtype=torch.float32) for p in zero.params} for k in ["param", *keys]}
    else:
        keys = zero.elementwise_keys()
        values = _full_states(zero, keys)
    dp_rank = zero.rank
    param_state = {}
    for i, p in enumerate(zero.params):
        entry = {}
        for key, by_param in values.items():
            data = by_param[p]
            sh = None if meta is None else meta[p]
            if sh is None:
                entry[key] = ShardedTensor.from_rank_offsets(f"{STATE_PREFIX}.{key}.{zero.param_names[p]}", data,
                                                             replica_id=dp_rank)
                continue
            kwargs = dict(key=f"{STATE_PREFIX}.{key}.{sh.key}", data=data, replica_id=sh.replica_id)
            if not isinstance(sh, ShardedTensorFactory):
                kwargs["dtype"] = data.dtype
            entry[key] = replace(sh, **kwargs)
            if hasattr(entry[key], "validate_metadata_integrity"):
                entry[key].validate_metadata_integrity()
        param_state[i] = entry
    scalars = []
    for g in range(len(zero.optimizer.param_groups)):
        bucket = next((b for b in zero.buckets if b.spec.group == g), None)
        state = zero.optimizer.state.get(bucket.master, {}) if bucket is not None else {}
        scalars.append({k: v for k, v in state.items() if k not in keys})
    return {"param_state": param_state, "l3plugin_zero": {
        "format": 1, "state_keys": keys, "scalars": scalars,
        "param_groups": [{k: v for k, v in pg.items() if k != "params"} for pg in zero.optimizer.param_groups]}}


@torch.no_grad()
def load_zero_sharded_state_dict(zero: FP32ReduceZero, state_dict: dict, *, allow_nonfinite: bool = False) -> None:
    """Restore from what ``dist_checkpointing.load(zero_sharded_state_dict(..., is_loading=True), dir)``
    returned (each rank copies its shard ranges; ends with the parameter all-gather). Checked before anything
    changes (shapes; finite values unless ``allow_nonfinite``); an error on one rank is raised on every rank
    of the ZeRO group before the first collective (``l3plugin.fail_together``)."""
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
        lo, hi = bucket.spec.shard_range(zero.rank)
        hi = min(hi, bucket.spec.numel)
        targets = {key: torch.zeros_like(bucket.master.data) for key in ["param", *keys]}
        for slot, p in zip(bucket.spec.slots, bucket.params):
            s, e = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if s < e:
                for key, target in targets.items():
                    piece = full[key][p].reshape(-1)[s - slot.offset:e - slot.offset]
                    if not allow_nonfinite and not bool(torch.isfinite(piece).all()):
                        raise ValueError(f"loaded optimizer state {key!r} of {zero.param_names[p]} holds non-finite "
                                         "values; refusing to resume from them (allow_nonfinite=True if intended)")
                    target[s - lo:e - lo] = piece.to(target.device, target.dtype)
        state = {k: targets[k] for k in keys}
        for key, value in common["scalars"][bucket.spec.group].items():
            state[key] = value.clone().to(bucket.device) if torch.is_tensor(value) else value
        staged.append((bucket, targets["param"], state))
    hyper = [{k: v for k, v in saved.items() if k != "params"} for saved in common["param_groups"]]
    return Loaded(staged, hyper)
