"""Megatron-Core training loop with l3plugin's flexible pipeline schedule and CP attention.

    torchrun --nproc-per-node 4 examples/megatron/train_flexible_pp.py --pp 2 --cp 2 \
        --vpp 2 --microbatches 5 --group-size 3

The only l3plugin lines are marked "l3plugin:". Runs on CPU (gloo) as well as on GPUs (NCCL).
m=5 microbatches with k=3 is a configuration stock Megatron-Core refuses (last group of 2 < pp).
"""

import argparse
import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core import pipeline_parallel
from megatron.core.transformer import TransformerConfig

import l3plugin.megatron  # l3plugin: the schedule and the CP attention spec
from l3plugin.cp import sharding  # l3plugin: which tokens this CP rank holds
from l3plugin.megatron.attention import gpt_layer_spec_with_cp_attention
from l3plugin.mesh.groups import init_mesh  # l3plugin: parallel_state in the order TP, CP, PP, DP

VOCAB, SEQ = 128, 32


def parse():
    p = argparse.ArgumentParser()
    for name, default in (("tp", 1), ("cp", 1), ("pp", 2), ("vpp", 2), ("microbatches", 5),
                          ("group-size", 3), ("steps", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    return p.parse_args()


def batches(m, step, cp, cp_rank):
    """Packed documents: one sequence of SEQ tokens per microbatch, documents of random length."""
    gen = torch.Generator().manual_seed(1000 * step)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=gen)
        cut = sorted(torch.randperm(SEQ - 1, generator=gen)[:3].add(1).tolist())
        cu = torch.tensor([0, *cut, SEQ], dtype=torch.int32)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, SEQ),
                 "position_ids": sharding.position_ids_per_document(cu, SEQ)[None]}
        batch = sharding.shard_batch(batch, cp, cp_rank)  # l3plugin: this rank's 2 of 2*cp chunks
        batch["packed"] = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                          max_seqlen_q=SEQ, max_seqlen_kv=SEQ)
        out.append(batch)
    return out


def loss_func(loss_mask, per_token):
    total = (per_token.float() * loss_mask).sum()
    tokens = loss_mask.sum().to(torch.int)
    return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.float()])}


def forward_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], None, labels=b["labels"], packed_seq_params=b["packed"])
    return out, functools.partial(loss_func, b["loss_mask"])


def main():
    args = parse()
    # An explicit timeout: a hung peer fails the job in minutes, not the default 30. l3plugin's own
    # waits (pipeline P2P, CP collectives) are bounded separately by $L3PLUGIN_WAIT_TIMEOUT (600 s).
    timeout_minutes = 10
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=timeout_minutes))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_mesh(tp=args.tp, cp=args.cp, pp=args.pp, vpp=args.vpp, distributed_timeout_minutes=timeout_minutes)
    l3plugin.megatron.install("flexible")  # l3plugin: get_forward_backward_func -> flexible schedule
    config = TransformerConfig(
        num_layers=2 * args.pp * args.vpp, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=args.tp, context_parallel_size=args.cp,
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=args.vpp,
        microbatch_group_size_per_vp_stage=args.group_size, pipeline_dtype=torch.float32,
        calculate_per_token_loss=True)
    pp_rank = mesh.coords["pp"]
    chunks = [GPTModel(config, gpt_layer_spec_with_cp_attention(), vocab_size=VOCAB, max_sequence_length=SEQ,
                       pre_process=pp_rank == 0 and c == 0,
                       post_process=pp_rank == args.pp - 1 and c == args.vpp - 1, vp_stage=c)
              for c in range(args.vpp)]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    chunks = [c.to(device) for c in chunks]
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    # Read through the module: install() patches megatron's names, not copies bound before it ran.
    forward_backward = pipeline_parallel.get_forward_backward_func()
    for step in range(args.steps):
        data = batches(args.microbatches, step, args.cp, mesh.coords["cp"])
        optimizer.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=[iter(data) for _ in chunks],
                               model=chunks, num_microbatches=args.microbatches, seq_length=SEQ,
                               micro_batch_size=1)
        # Plain data/context-parallel gradient sum (a real job uses Megatron DDP or l3plugin's ZeRO).
        for p in params:
            dist.all_reduce(p.grad, group=mesh.dp_cp_group)
        optimizer.step()
        if out:  # the last pipeline stage has the losses
            total = torch.stack([d["lm loss"] for d in out]).sum(0)
            dist.all_reduce(total, group=mesh.cp_group)
            if mesh.coords["cp"] == 0 and mesh.coords["tp"] == 0 and mesh.coords["dp"] == 0:
                print(f"step {step}: loss {float(total[0] / total[1]):.4f} "
                      f"({forward_backward.__name__})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
