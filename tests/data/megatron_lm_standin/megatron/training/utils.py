"""Megatron-LM's batch functions, for TP = 1 (the real ones broadcast over TP from TP rank 0)."""
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank as core_get_batch_on_this_cp_rank

from megatron.training.global_vars import get_args


def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank: bool = False):
    assert parallel_state.get_tensor_model_parallel_world_size() == 1, "the stand-in covers TP = 1"
    data = next(data_iterator)
    args = get_args()
    batch = {key: data[key] for key in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")}
    if not args.create_attention_mask_in_dataloader:
        batch["attention_mask"] = None
    batch.update(cu_seqlens=data.get("cu_seqlens"), max_seqlen=data.get("max_seqlen"), local_cp_size=None)
    return batch


def get_batch_on_this_cp_rank(batch):
    return core_get_batch_on_this_cp_rank(batch)


def is_first_or_last_pipeline_stage(vp_stage=None):
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
