"""What both pretrain_gpt.py stand-ins share (megatron_lm_standin for core_v0.16.1 / 0.17, megatron_lm_standin_0_18
for core_v0.18.2 / 0.19.0): the model as gpt_builders.py builds it, GPTDataset-like samples of one packed
sequence whose documents cross the CP chunk borders, and one step whose results are saved (tests only)."""
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.core.transformer import TransformerConfig

EOD_POSITIONS = (4, 12, 13, 27)  # documents [0,5) [5,13) [13,14) [14,28) [28,32) at S = 32


def model_provider(args):
    """gpt_builders.py's choice of spec (no --spec, no MoE)."""
    cp_comm_type = args.cp_comm_type[0] if len(args.cp_comm_type) == 1 else args.cp_comm_type
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, context_parallel_size=args.context_parallel_size,
        cp_comm_type=cp_comm_type, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    use_te = args.transformer_impl == "transformer_engine"
    spec = get_gpt_layer_with_transformer_engine_spec() if use_te else get_gpt_layer_local_spec()
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
                    max_sequence_length=args.seq_length, pre_process=True, post_process=True,
                    parallel_output=True, position_embedding_type=args.position_embedding_type)


def packed_documents(args):
    """GPTDataset's samples: tokens/labels of one packed sequence and Megatron-Core's own masks."""
    from megatron.training import get_tokenizer  # the stand-in imported now (each run imports it afresh)

    eod = get_tokenizer().eod
    gen = torch.Generator().manual_seed(args.seed)
    while True:
        text = torch.randint(0, eod, (args.seq_length + 1,), generator=gen)
        text[list(EOD_POSITIONS)] = eod
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
