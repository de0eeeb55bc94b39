"""Stand-in for Megatron-LM's pretrain_gpt.py, core_v0.18.2 / core_v0.19.0: the same functions imported by
name at the top, the same get_batch (BATCH_KEYS, the batch read on TP rank 0, Megatron-Core's TP broadcast and
CP sharding) and forward_step (a "thd" PackedSeqParams when the batch has cu_seqlens), parse_and_validate_args
at __main__. No MTP, no SFT, no hybrid CP, one pipeline stage. See ../README.md."""
import os
import sys

import megatron.core
from megatron.core import parallel_state as mpu
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training import get_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import is_first_or_last_pipeline_stage

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/data: standin_gpt
from standin_gpt import run_step  # noqa: E402

V019 = not megatron.core.__version__.startswith("0.18.")
if V019:
    from megatron.core.utils import flatten_batch_for_packed_sequences

BATCH_KEYS = ["attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
              "loss_mask", "max_seqlen", "position_ids", "tokens"]


def get_batch(data_iterator, vp_stage=None):
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    has_cu_seqlens = args.sft or args.dataloader_inter_document_masking
    if not is_first_or_last_pipeline_stage(vp_stage) and not has_cu_seqlens:
        return [None for _ in BATCH_KEYS]
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        for key in BATCH_KEYS:
            batch[key] = batch.get(key)
    cu_flag = {"has_cu_seqlens": has_cu_seqlens} if V019 else {"is_sft": args.sft}
    batch = get_batch_on_this_tp_rank(
        batch, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), **cu_flag, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=args.context_parallel_size, tp_rank=tp_rank, micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=False, pipeline_model_parallel_size=1,
        is_pipeline_first_stage=True, is_pipeline_last_stage=True)
    if V019:
        batch = flatten_batch_for_packed_sequences(batch)
        balancing = {"use_per_sequence_balancing": args.dataloader_inter_document_masking and not args.sft}
    else:
        balancing = {}
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group(),
                                      hybrid_cp_group_func=None, **balancing)
    return [batch[key] for key in BATCH_KEYS]


def forward_step(data_iterator, model):
    (attention_mask, cu_seqlens, cu_seqlens_padded, hybrid_cp_group, labels, local_cp_size, loss_mask, max_seqlen,
     position_ids, tokens) = get_batch(data_iterator)
    packed_seq_params = None
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens[0]
        if cu_seqlens_padded is not None:
            cu_seqlens_padded = cu_seqlens_padded[0]
        cu_for_params = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
        packed_seq_params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_for_params, cu_seqlens_kv=cu_for_params,
            cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
            max_seqlen_q=int(max_seqlen.item()), max_seqlen_kv=int(max_seqlen.item()),
            local_cp_size=None, cp_group=hybrid_cp_group)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                          packed_seq_params=packed_seq_params)
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    seen = {"attention_mask": None if attention_mask is None else tuple(attention_mask.shape),
            "packed_seq_params": None if packed_seq_params is None else
            (packed_seq_params.qkv_format, packed_seq_params.cu_seqlens_q.reshape(-1).tolist())}
    return (losses * loss_mask).sum(), loss_mask.sum(), seen


def main(extra_args_provider=None):
    run_step(parse_and_validate_args(extra_args_provider=extra_args_provider,
                                     args_defaults={"tokenizer_type": "GPT2BPETokenizer"}), forward_step)


if __name__ == "__main__":
    if os.environ.get("STANDIN_AS_PATCHED"):
        # What patches/megatron-lm-core_v0.19.0-pretrain_gpt.patch adds, after the imports above.
        import l3plugin.megatron
        l3plugin.megatron.install()
        main(extra_args_provider=l3plugin.megatron.chain_extra_args(None))
    else:
        main()
