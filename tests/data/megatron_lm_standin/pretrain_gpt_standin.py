"""Stand-in for Megatron-LM's pretrain_gpt.py (core_v0.16.1): the same functions imported by name at the
top, the same get_batch and forward_step, the model built as gpt_builders.py builds it. One forward and
backward of one packed sequence (documents ending in EOD, several crossing the CP chunk borders); the
loss, token count and gradients, summed over the CP group, are saved to --standin-result.
With TP or PP > 1: one training step of --global-batch-size micro-batches through
get_forward_backward_func(), as Megatron-LM's train_step runs it (data read on TP rank 0 of the first
and last stages only; middle stages' get_batch returns None), weights from their global names."""
import functools
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_attr_wrapped_model, get_thd_batch_on_this_cp_rank
from megatron.training import get_args, get_tokenizer
from megatron.training.initialize import initialize_megatron
from megatron.training.utils import (get_batch_on_this_cp_rank, get_batch_on_this_tp_rank,
                                     is_first_or_last_pipeline_stage)

EOD_POSITIONS = (4, 12, 13, 27)  # documents [0,5) [5,13) [13,14) [14,28) [28,32) at S = 32
# Pipelined runs: micro-batch i has EODs at MICROBATCH_EODS[i % 4] (documents cross the CP chunk borders).
MICROBATCH_EODS = (EOD_POSITIONS, (9, 10, 20), (2, 17, 25, 30), (15,))


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


def model_provider(args, pre_process=True, post_process=True, vp_stage=None):
    """gpt_builders.py's choice of spec (no --spec, no MoE)."""
    cp_comm_type = args.cp_comm_type[0] if len(args.cp_comm_type) == 1 else args.cp_comm_type
    vp = None if args.num_layers_per_virtual_pipeline_stage is None else (
        args.num_layers // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, context_parallel_size=args.context_parallel_size,
        cp_comm_type=cp_comm_type, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=args.tensor_model_parallel_size, sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32, calculate_per_token_loss=True)
    use_te = args.transformer_impl == "transformer_engine"
    spec = get_gpt_layer_with_transformer_engine_spec() if use_te else get_gpt_layer_local_spec()
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
                    max_sequence_length=args.seq_length, pre_process=pre_process, post_process=post_process,
                    parallel_output=True, position_embedding_type=args.position_embedding_type, vp_stage=vp_stage)


def packed_documents(args, per_microbatch=False):
    """GPTDataset's samples: tokens/labels of one packed sequence and Megatron-Core's own masks."""
    eod = get_tokenizer().eod
    gen = torch.Generator().manual_seed(args.seed)
    i = 0
    while True:
        text = torch.randint(0, eod, (args.seq_length + 1,), generator=gen)
        text[list(MICROBATCH_EODS[i % len(MICROBATCH_EODS)] if per_microbatch else EOD_POSITIONS)] = eod
        i += 1
        tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
            tokens, eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss,
            args.create_attention_mask_in_dataloader)
        yield {"tokens": tokens[None], "labels": labels[None], "loss_mask": loss_mask[None],
               "attention_mask": None if attention_mask is None else attention_mask[None],
               "position_ids": position_ids[None]}


def loss_func(loss_mask, output_tensor):
    """pretrain_gpt.py's loss_func: the token sum and count (--calculate-per-token-loss)."""
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def pipelined_forward_step(data_iterator, model):
    """pretrain_gpt.py's forward_step."""
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                          packed_seq_params=packed_seq_params)
    return output_tensor, functools.partial(loss_func, loss_mask)


def train_step(args):
    """One step as Megatron-LM's train_step runs it; returns this rank's results (grads summed over CP)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from l3plugin.megatron.model import deterministic_init, global_name

    vp = None if args.num_layers_per_virtual_pipeline_stage is None else (
        args.num_layers // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp, context_parallel_size=args.context_parallel_size)
    tp_rank, tp = parallel_state.get_tensor_model_parallel_rank(), args.tensor_model_parallel_size
    model, iterators = [], []
    for c in range(vp or 1):
        stage = c if vp else None
        model.append(model_provider(
            args, parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage), vp_stage=stage))
        deterministic_init(model[-1], tp, tp_rank)
        reads = is_first_or_last_pipeline_stage(stage) and tp_rank == 0  # is_dataset_built_on_rank
        iterators.append(packed_documents(args, per_microbatch=True) if reads else None)
    out = get_forward_backward_func()(
        forward_step_func=pipelined_forward_step, data_iterator=iterators if vp else iterators[0],
        model=model if vp else model[0], num_microbatches=args.global_batch_size, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)
    group = parallel_state.get_context_parallel_group()
    grads = {}
    for chunk in model:
        for name, p in chunk.named_parameters():
            dist.all_reduce(p.grad, group=group)  # Megatron reduces over DP x CP
            if getattr(p, "sequence_parallel", False):  # and these over TP (finalize_model_grads)
                dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
            grads[global_name(chunk, name)] = p.grad.clone()
    losses = []
    for reduced in out:  # [loss sum, tokens] of each micro-batch, on the last stage
        dist.all_reduce(reduced["lm loss"], group=group)
        losses.append(reduced["lm loss"])
    return {"losses": losses, "grads": grads, "tp_rank": tp_rank, "cp_rank": parallel_state.get_context_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "core_attention": type(model[0].decoder.layers[0].self_attention.core_attention).__name__}


def main(extra_args_provider=None):
    args = initialize_megatron(extra_args_provider)
    parallel_state.destroy_model_parallel()
    if args.pipeline_model_parallel_size > 1 or args.tensor_model_parallel_size > 1:
        torch.save(train_step(args), args.standin_result)
        return
    parallel_state.initialize_model_parallel(context_parallel_size=args.context_parallel_size)
    torch.manual_seed(args.seed)
    model = model_provider(args)
    loss, num_tokens, seen = forward_step(packed_documents(args), model)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    group = parallel_state.get_context_parallel_group()
    for tensor in [loss, num_tokens, *grads.values()]:  # Megatron reduces over DP x CP
        dist.all_reduce(tensor, group=group)
    torch.save({"loss": loss.detach(), "num_tokens": num_tokens, "grads": grads, "seen": seen,
                "core_attention": type(model.decoder.layers[0].self_attention.core_attention).__name__},
               args.standin_result)


if __name__ == "__main__":
    if os.environ.get("STANDIN_AS_PATCHED"):
        # What patches/megatron-lm-core_v0.16.1-pretrain_gpt.patch adds, after the imports above.
        import l3plugin.megatron
        l3plugin.megatron.install()
        main(extra_args_provider=l3plugin.megatron.chain_extra_args(None))
    else:
        main()
