"""Megatron-LM's batch functions: TP rank 0 reads the data and broadcasts what this pipeline stage needs
(first stage: tokens, position ids; last stage: labels, loss mask; both with PP = 1), as core_v0.16.1 does;
the reader keeps everything it read."""
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank as core_get_batch_on_this_cp_rank

from megatron.training.global_vars import get_args

KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank: bool = False):
    args = get_args()
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    wanted = {"tokens": first, "position_ids": first, "labels": last, "loss_mask": last,
              "attention_mask": args.create_attention_mask_in_dataloader}
    shapes = {"attention_mask": (args.micro_batch_size, 1, args.seq_length, args.seq_length)}
    dtypes = {"loss_mask": torch.float32, "attention_mask": torch.bool}
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        batch = {key: data[key] for key in KEYS}
    else:
        batch = {key: torch.empty(shapes.get(key, (args.micro_batch_size, args.seq_length)),
                                  dtype=dtypes.get(key, torch.int64)) for key in KEYS}
    group = parallel_state.get_tensor_model_parallel_group()
    reader = parallel_state.get_tensor_model_parallel_rank() == 0
    for key in KEYS:
        if not wanted[key]:
            if not reader or key == "attention_mask":  # the reader keeps what it read (as Megatron-LM)
                batch[key] = None
        elif dist.get_world_size(group) > 1:
            dist.broadcast(batch[key], parallel_state.get_tensor_model_parallel_src_rank(), group=group)
    batch.update(cu_seqlens=None, max_seqlen=None, local_cp_size=None)
    return batch


def get_batch_on_this_cp_rank(batch):
    return core_get_batch_on_this_cp_rank(batch)


def is_first_or_last_pipeline_stage(vp_stage=None):
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
