"""RL- and SFT-style post-training loops on Megatron-Core, as verl / NeMo-RL drive them, with l3plugin switched on.

    torchrun --nproc-per-node 4 examples/megatron/rl_post_training.py --pp 2 --vpp 2 --cp 2   # CP 2 x PP 2 x 2 virtual
    python examples/megatron/rl_post_training.py --pp 1 --vpp 1 --cp 1                # the same loop, one process

``--mode rl``: every step, like an RL framework's actor update,
1. a forward-only log-prob pass under no_grad (the "old" log-probabilities of the rollouts);
2. a training pass with a clipped policy-gradient loss (ratio exp(logp - old logp) times a per-document
   advantage), then an optimizer step.
``--mode sft``: every step one training pass with the token-mean cross-entropy of packed samples.
``--mode both`` (default): the RL loop, then the SFT loop from the RL loop's weights.
The number of micro-batches and their lengths change every step (token-balanced dynamic batches: m = 3..7, often not a
multiple of pp, and each micro-batch one packed sequence of 2-4 documents of 3-21 tokens). The schedule is called
as verl calls it: ``variable_seq_lengths=True`` and ``seq_length=1, micro_batch_size=1`` (shapes travel with the
messages). Sequences are packed in Megatron's THD form (``PackedSeqParams(qkv_format="thd")``, every document padded
to a multiple of 2 x cp and split per document, rank i holding pieces i and 2cp-1-i), which l3plugin's CP attention
takes as it is. Stock Megatron refuses this loop twice: interleaving needs m divisible by its group size (pp by
default), and THD needs Transformer Engine. The lines that are l3plugin's are marked "l3plugin:"; the rest is what
such a framework has.
Prints per step the log-prob sum of the rollouts (RL) and the loss, to compare against the one-process run
(tests/test_examples.py does, in ``make test``).
"""

import argparse
import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import pipeline_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig

import l3plugin.megatron  # l3plugin: the flexible schedule (any m, variable lengths) and the CP attention spec
from l3plugin.cp.layout import per_document_layout  # l3plugin: the tokens of Megatron's THD split on a CP rank
from l3plugin.demo.model import build_chunk  # l3plugin's demo model: GPTModel + the CP attention spec
from l3plugin.mesh.groups import init_mesh

VOCAB, LAYERS, CLIP = 128, 4, 0.2


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("cp", 2), ("pp", 2), ("vpp", 2), ("steps", 3), ("pad-cp", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--mode", choices=("rl", "sft", "both"), default="both")
    args = p.parse_args(argv)
    if LAYERS % (args.pp * args.vpp):
        p.error(f"--pp x --vpp = {args.pp * args.vpp} must divide the model's {LAYERS} layers")
    if args.pad_cp % args.cp:
        p.error(f"--pad-cp={args.pad_cp} must be a multiple of --cp={args.cp} (documents are padded for it)")
    return args


def rollouts(step: int, pad_cp: int):
    """This step's micro-batches, the same on every rank: (tokens [S], real-token mask [S], advantage [S],
    cu_seqlens (real), cu_seqlens_padded), documents padded to a multiple of 2 x pad_cp (the run with the
    largest CP pads so, and so does the one-process run: the padding is its own documents, masked out)."""
    gen = torch.Generator().manual_seed(7919 * step + 1)
    out = []
    for _ in range(int(torch.randint(3, 8, (), generator=gen))):
        lengths = torch.randint(3, 22, (int(torch.randint(2, 5, (), generator=gen)),), generator=gen).tolist()
        unit = 2 * pad_cp
        padded = [-(-n // unit) * unit for n in lengths]
        tokens, mask, adv = [], [], []
        for n, pn in zip(lengths, padded):
            tokens += torch.randint(1, VOCAB, (n,), generator=gen).tolist() + [0] * (pn - n)
            mask += [1.0] * (n - 1) + [0.0] * (pn - n + 1)  # no target past a document's last token
            adv += [float(torch.randn((), generator=gen))] * pn
        cum = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32)
        out.append((torch.tensor(tokens), torch.tensor(mask), torch.tensor(adv), cum(lengths), cum(padded)))
    return out


def this_rank(batch, cp: int, cp_rank: int):
    """The micro-batch as this CP rank's model input: its tokens of the per-document split, [1, t]."""
    tokens, mask, adv, cu, cu_padded = batch
    labels = torch.roll(tokens, -1)
    mine = per_document_layout(cu_padded, cp).indices(cp_rank) if cp > 1 else torch.arange(tokens.numel())
    longest = int((cu_padded[1:] - cu_padded[:-1]).max())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                             cu_seqlens_kv_padded=cu_padded, max_seqlen_q=longest, max_seqlen_kv=longest)
    return {"tokens": tokens[mine][None], "labels": labels[mine][None], "mask": mask[mine][None],
            "adv": adv[mine][None], "position_ids": torch.zeros(1, len(mine), dtype=torch.long), "packed": packed}


def logprob_loss(batch, per_token_ce):
    """Forward-only pass: the rollout's per-token log-probabilities (kept) and their masked sum (printed)."""
    logp = -per_token_ce.float()
    return (logp * batch["mask"]).sum(), batch["mask"].sum().to(torch.int), {"logp": logp.detach(),
                                                                           "sum": (logp * batch["mask"]).sum().detach()}


def policy_loss(num_real_tokens, batch, per_token_ce):
    """Training pass: PPO's clipped objective, summed over real tokens and divided by the step's real tokens."""
    logp = -per_token_ce.float()
    ratio = torch.exp(logp - batch["old_logp"])
    objective = torch.minimum(ratio * batch["adv"], ratio.clamp(1 - CLIP, 1 + CLIP) * batch["adv"])
    loss = -(objective * batch["mask"]).sum() / num_real_tokens
    return loss, batch["mask"].sum().to(torch.int), {"loss": loss.detach()}


def sft_loss(num_real_tokens, batch, per_token_ce):
    """SFT: the cross-entropy summed over real tokens, divided by the step's real tokens."""
    loss = (per_token_ce.float() * batch["mask"]).sum() / num_real_tokens
    return loss, batch["mask"].sum().to(torch.int), {"loss": loss.detach()}


def forward_step(loss_of, data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], None, labels=b["labels"], packed_seq_params=b["packed"])
    return out, functools.partial(loss_of, b)


def main():
    args = parse()
    if "RANK" not in os.environ:  # one process: a world of one, for the reference run
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=10))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    for line in train(args):
        print(line, flush=True)
    dist.destroy_process_group()


def train(args) -> list[str]:
    """The loops on this rank (torch.distributed initialised, world = cp x pp); the lines the last pipeline stage's
    first CP rank prints, one per step (none elsewhere)."""
    lines = []
    vpp = args.vpp if args.vpp > 1 else None
    mesh = init_mesh(cp=args.cp, pp=args.pp, vpp=vpp, distributed_timeout_minutes=10)
    l3plugin.megatron.install("flexible")  # l3plugin: what an RL framework adds before it builds its schedule
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True, context_parallel_size=args.cp,
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32, calculate_per_token_loss=True,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")  # as verl builds it
    # GPTModel chunks with l3plugin's CP attention spec, RoPE, and weights drawn per global parameter name (the
    # same model in every layout); build_chunk also runs Megatron's CUDA-only RoPE lines on a CPU-only machine.
    v, pp_rank = args.vpp, mesh.coords["pp"]
    chunks = [build_chunk(config, vocab=VOCAB, seq_len=256, pre_process=pp_rank == 0 and c == 0,
                          post_process=pp_rank == args.pp - 1 and c == v - 1, vp_stage=c if vpp else None)
              for c in range(v)]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    chunks = [c.to(device) for c in chunks]
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.5)
    step_fn = pipeline_parallel.get_forward_backward_func()  # read through the module, after install()
    if args.pp == 1 and not torch.cuda.is_available():  # stock's no-pipelining step allocates on "cuda"
        step_fn = l3plugin.megatron.forward_backward_pipelining_flexible  # l3plugin: one stage runs as well
    modes = ("rl", "sft") if args.mode == "both" else (args.mode,)
    for mode, step in ((mode, step) for mode in modes for step in range(args.steps)):
        data = rollouts(step + 1000 * (mode == "sft"), args.pad_cp)
        batches = [this_rank(b, args.cp, mesh.coords["cp"]) for b in data]
        real_tokens = float(sum(b[1].sum() for b in data))
        call = dict(model=chunks, num_microbatches=len(batches), seq_length=1, micro_batch_size=1)  # verl's call
        old = []
        if mode == "rl":
            with torch.no_grad():
                old = step_fn(forward_step_func=functools.partial(forward_step, logprob_loss),
                              data_iterator=[iter(batches) for _ in chunks], forward_only=True, **call)
            for b, o in zip(batches, old):  # the last stage keeps the old log-probabilities of its tokens
                b["old_logp"] = o["logp"]
        optimizer.zero_grad()
        loss_of = functools.partial(policy_loss if mode == "rl" else sft_loss, real_tokens)
        out = step_fn(forward_step_func=functools.partial(forward_step, loss_of),
                      data_iterator=[iter(batches) for _ in chunks], **call)
        for p in params:  # a plain CP gradient sum (a real job uses Megatron DDP or l3plugin's ZeRO)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=mesh.dp_cp_group)
        optimizer.step()
        if out:  # the last pipeline stage has the losses
            totals = torch.stack([sum((o["sum"] for o in old), torch.tensor(0.0)), sum(o["loss"] for o in out)])
            dist.all_reduce(totals, group=mesh.cp_group)
            if mesh.coords["cp"] == 0:
                lines.append(f"{mode} step {step}: microbatches {len(batches)} lengths "
                             f"{[int(b[0].numel()) for b in data]} logprob_sum {totals[0].item():.6f} "
                             f"loss {totals[1].item():.9f} ({step_fn.__name__})")
    return lines


if __name__ == "__main__":
    main()
