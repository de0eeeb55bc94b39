"""What both pretrain_gpt.py stand-ins share (megatron_lm_standin for core_v0.16.1 / 0.17, megatron_lm_standin_0_18
for core_v0.18.2 / 0.19.0): the model as gpt_builders.py builds it, GPTDataset-like samples of one packed
sequence whose documents cross the CP chunk borders, and one step whose results are saved (tests only); and one
pipelined training step through get_forward_backward_func (TP / PP / virtual stages), as Megatron-LM's train_step.
"""
import functools

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.core.transformer import TransformerConfig

EOD_POSITIONS = (4, 12, 13, 27)  # documents [0,5) [5,13) [13,14) [14,28) [28,32) at S = 32
# Pipelined runs: micro-batch i has EODs at MICROBATCH_EODS[i % 4] (documents cross the CP chunk borders).
MICROBATCH_EODS = (EOD_POSITIONS, (9, 10, 20), (2, 17, 25, 30), (15,))


def virtual_stages(args):
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    return None if per_stage is None else args.num_layers // args.pipeline_model_parallel_size // per_stage


def model_provider(args, pre_process=True, post_process=True, vp_stage=None):
    """gpt_builders.py's choice of spec (no --spec, no MoE)."""
    cp_comm_type = args.cp_comm_type[0] if len(args.cp_comm_type) == 1 else args.cp_comm_type
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, context_parallel_size=args.context_parallel_size,
        cp_comm_type=cp_comm_type, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=getattr(args, "sequence_parallel", False),
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_stages(args), pipeline_dtype=torch.float32,
        calculate_per_token_loss=True)
    use_te = args.transformer_impl == "transformer_engine"
    spec = get_gpt_layer_with_transformer_engine_spec() if use_te else get_gpt_layer_local_spec()
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
                    max_sequence_length=args.seq_length, pre_process=pre_process, post_process=post_process,
                    parallel_output=True, position_embedding_type=args.position_embedding_type, vp_stage=vp_stage)


def packed_documents(args, per_microbatch=False):
    """GPTDataset's samples: tokens/labels of one packed sequence and Megatron-Core's own masks."""
    from megatron.training import get_tokenizer  # the stand-in imported now (each run imports it afresh)

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


def run_step(args, forward_step):
    """One forward and backward of the script's forward_step; loss, token count and gradients summed over the
    CP group (Megatron reduces over DP x CP) saved to --standin-result."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=args.context_parallel_size)
    torch.manual_seed(args.seed)
    model = model_provider(args)
    loss, num_tokens, seen = forward_step(packed_documents(args), model)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    group = parallel_state.get_context_parallel_group()
    for tensor in [loss, num_tokens, *grads.values()]:
        dist.all_reduce(tensor, group=group)
    torch.save({"loss": loss.detach(), "num_tokens": num_tokens, "grads": grads, "seen": seen,
                "core_attention": type(model.decoder.layers[0].self_attention.core_attention).__name__},
               args.standin_result)


def loss_func(loss_mask, output_tensor):
    """pretrain_gpt.py's loss_func: the token sum and count (--calculate-per-token-loss)."""
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def pipelined_forward_step(get_batch, data_iterator, model):
    """pretrain_gpt.py's forward_step with the script's ``get_batch``."""
    from megatron.core.utils import get_attr_wrapped_model

    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                          packed_seq_params=packed_seq_params)
    return output_tensor, functools.partial(loss_func, loss_mask)


def train_step(args, get_batch):
    """One step of --global-batch-size micro-batches as Megatron-LM's train_step runs it: data read on TP rank 0
    of the first and last stages only, weights from their global names; results (gradients summed over CP,
    and over TP for sequence-parallel ones, as finalize_model_grads does) saved to --standin-result."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from l3plugin.demo.model import deterministic_init, global_name

    vp = virtual_stages(args)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp, context_parallel_size=args.context_parallel_size)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    model, iterators = [], []
    for c in range(vp or 1):
        stage = c if vp else None
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        model.append(model_provider(args, first, last, vp_stage=stage))
        deterministic_init(model[-1], args.tensor_model_parallel_size, tp_rank)
        reads = (first or last) and tp_rank == 0  # Megatron-LM's is_dataset_built_on_rank
        iterators.append(packed_documents(args, per_microbatch=True) if reads else None)
    out = get_forward_backward_func()(
        forward_step_func=functools.partial(pipelined_forward_step, get_batch),
        data_iterator=iterators if vp else iterators[0], model=model if vp else model[0],
        num_microbatches=args.global_batch_size, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        forward_only=False)
    grads = {}
    for chunk in model:
        for name, p in chunk.named_parameters():
            dist.all_reduce(p.grad, group=parallel_state.get_context_parallel_group())  # over DP x CP
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
            grads[global_name(chunk, name)] = p.grad.clone()
    losses = []
    for reduced in out:  # [loss sum, tokens] of each micro-batch, on the last stage
        dist.all_reduce(reduced["lm loss"], group=parallel_state.get_context_parallel_group())
        losses.append(reduced["lm loss"])
    torch.save({"losses": losses, "grads": grads, "tp_rank": tp_rank,
                "cp_rank": parallel_state.get_context_parallel_rank(),
                "core_attention": type(model[0].decoder.layers[0].self_attention.core_attention).__name__},
               args.standin_result)
