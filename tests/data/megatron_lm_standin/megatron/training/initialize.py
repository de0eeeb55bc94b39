"""parse_args / initialize_megatron: Megatron-LM's flags that the CP route reads, with Megatron-LM's
names, types and defaults (core_v0.16.1 megatron/training/arguments.py)."""
import argparse
from types import SimpleNamespace

from megatron.training import global_vars


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add = parser.add_argument
    add("--num-layers", type=int, default=2)
    add("--hidden-size", type=int, default=32)
    add("--num-attention-heads", type=int, default=4)
    add("--num-query-groups", type=int, default=2)
    add("--seq-length", type=int, default=32)
    add("--micro-batch-size", type=int, default=1)
    add("--vocab-size", type=int, default=64)
    add("--seed", type=int, default=1234)
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--context-parallel-size", type=int, default=1)
    add("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    add("--sequence-parallel", action="store_true")
    add("--global-batch-size", type=int, default=1, help="stand-in: micro-batches per step (DP = 1)")
    add("--cp-comm-type", nargs="+", type=str, default=["p2p"])  # no choices, as in Megatron-LM
    add("--transformer-impl", default="transformer_engine", choices=["local", "transformer_engine"])
    add("--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"])
    add("--reset-position-ids", action="store_true")
    add("--reset-attention-mask", action="store_true")
    add("--eod-mask-loss", action="store_true")
    add("--no-create-attention-mask-in-dataloader", action="store_false",
        dest="create_attention_mask_in_dataloader")
    add("--sft", action="store_true")
    add("--hybrid-context-parallel", action="store_true")
    add("--use-legacy-models", action="store_true")
    add("--standin-result", default=None, help="stand-in only: where to torch.save the step's results")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
    else:
        args = parser.parse_args()
    return args


def initialize_megatron(extra_args_provider=None):
    args = parse_args(extra_args_provider)  # the module global, looked up at call time (as Megatron-LM)
    global_vars._GLOBAL_ARGS = args
    global_vars._GLOBAL_TOKENIZER = SimpleNamespace(eod=args.vocab_size - 1)
    return args
