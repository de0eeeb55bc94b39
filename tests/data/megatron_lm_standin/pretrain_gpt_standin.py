"""Stand-in for Megatron-LM's pretrain_gpt.py (core_v0.16.1): the same functions imported by name at the
top, the same get_batch and forward_step, the model built as gpt_builders.py builds it. One forward and
backward of one packed sequence (documents ending in EOD, several crossing the CP chunk borders); the
loss, token count and gradients, summed over the CP group, are saved to --standin-result.
With TP or PP > 1: one training step of --global-batch-size micro-batches through
get_forward_backward_func(), as Megatron-LM's train_step runs it (data read on TP rank 0 of the first
and last stages only; middle stages' get_batch returns None), weights from their global names."""
import os
import sys

import torch
from megatron.core.utils import get_thd_batch_on_this_cp_rank
from megatron.training.initialize import initialize_megatron
from megatron.training.utils import (get_batch_on_this_cp_rank, get_batch_on_this_tp_rank,
                                     is_first_or_last_pipeline_stage)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/data: standin_gpt
from standin_gpt import run_step, train_step  # noqa: E402


def get_batch(data_iterator, vp_stage=None):
    """pretrain_gpt.py's get_batch (no MTP)."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None, None
    batch = get_batch_on_this_tp_rank(data_iterator)
    cu_seqlens = batch.pop('cu_seqlens', None)
    cu_seqlens_padded = batch.pop('cu_seqlens_padded', None)
    max_seqlen = batch.pop('max_seqlen', None)
    local_cp_size = batch.pop('local_cp_size', None)
    if cu_seqlens is None and local_cp_size is None:
        batch = get_batch_on_this_cp_rank(batch)
        packed_seq_params = None
    elif local_cp_size is None:
        assert max_seqlen.dim() == 1
        batch, packed_seq_params = get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded, max_seqlen)
    else:
        raise NotImplementedError("hybrid CP")
    return (*batch.values(), packed_seq_params)


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                          packed_seq_params=packed_seq_params)
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    seen = {"attention_mask": None if attention_mask is None else tuple(attention_mask.shape),
            "packed_seq_params": None if packed_seq_params is None else
            (packed_seq_params.qkv_format, packed_seq_params.cu_seqlens_q.reshape(-1).tolist())}
    return torch.sum(losses * loss_mask), loss_mask.sum(), seen


def main(extra_args_provider=None):
    args = initialize_megatron(extra_args_provider)
    if args.pipeline_model_parallel_size > 1 or args.tensor_model_parallel_size > 1:
        train_step(args, get_batch)
    else:
        run_step(args, forward_step)


if __name__ == "__main__":
    if os.environ.get("STANDIN_AS_PATCHED"):
        # What patches/megatron-lm-core_v0.16.1-pretrain_gpt.patch adds, after the imports above.
        import l3plugin.megatron
        l3plugin.megatron.install()
        main(extra_args_provider=l3plugin.megatron.chain_extra_args(None))
    else:
        main()
