"""One training step of the demo on every rank (state kept in this module between calls), and the
single-process reference that runs the same model, data and optimizer in one piece.
"""

from __future__ import annotations

import functools

import torch

from l3plugin.collective.waits import group_ranks, resolve_timeout, wait_work
from l3plugin.demo import data, model

_STATE: dict = {}

@functools.lru_cache(maxsize=None)
def _packed_params(cu_seqlens: tuple, seq_len: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=seq_len, max_seqlen_kv=seq_len)


def _loss_func(loss_mask, per_token):
    # Megatron's calculate_per_token_loss contract: the sum of this shard's token losses and its token
    # count; the gradients are summed over DP x CP and divided by the global count once, in the finalize
    # function megatron_zero's attach_to_schedule installs: exactly the gradient of the global mean loss.
    local = (per_token.float() * loss_mask).sum()
    return local, loss_mask.sum().to(torch.int), {"loss_sum": local.detach()}


def _forward_step(data_iterator, chunk):
    b = next(data_iterator)
    out = chunk(b["tokens"], b["position_ids"], None, labels=b["labels"],
                packed_seq_params=_packed_params(tuple(b["cu_seqlens"].tolist()), b["seq_len"]))
    return out, functools.partial(_loss_func, b["loss_mask"])


def _prepare(batches, cp, cp_rank, cp_layout="2cp"):
    from l3plugin.cp import sharding

    out = []
    for b in batches:
        seq_len = b["tokens"].size(1)
        b = dict(b, position_ids=torch.arange(seq_len)[None], seq_len=seq_len)
        # "balanced" deals this microbatch's documents to CP ranks by work (from its global cu_seqlens).
        out.append(sharding.shard_batch(b, cp, cp_rank, layout=cp_layout) if cp > 1 else b)
    return out


def setup(opts: dict) -> dict:
    """Build this rank's model chunks and the ZeRO optimizer; returns what it built (for the log)."""
    from megatron.core import parallel_state as ps

    from l3plugin.megatron.zero import attach_to_schedule, megatron_zero
    from l3plugin.mesh.groups import init_mesh

    # Process groups with an explicit timeout (the harness's world group has one too); ZeRO's waits are
    # bounded below it (the pipeline's and CP's by $L3PLUGIN_WAIT_TIMEOUT, which demo.run sets).
    mesh = init_mesh(tp=opts["tp"], cp=opts["cp"], pp=opts["pp"], dp=opts["dp"], vpp=opts["vpp"],
                     distributed_timeout_minutes=opts["timeout_s"] / 60)
    c = mesh.coords
    config = model.llama_config(tp=opts["tp"], cp=opts["cp"], pp=opts["pp"], vpp=opts["vpp"],
                                k=opts["group_size"], layout=opts["layout"], **opts["model"])
    chunks = [model.build_chunk(config, vocab=opts["vocab"], seq_len=opts["seq_len"],
                                pre_process=c["pp"] == 0 and v == 0,
                                post_process=c["pp"] == opts["pp"] - 1 and v == (opts["vpp"] or 1) - 1,
                                vp_stage=v if opts["vpp"] else None, tp_size=opts["tp"],
                                tp_rank=ps.get_tensor_model_parallel_rank(), cp_layout=opts["cp_layout"],
                                share_embeddings_and_output_weights=True)  # Megatron's default: tied
              for v in range(opts["vpp"] or 1)]
    params = [p for ch in chunks for p in ch.parameters()]
    zero = megatron_zero(chunks, torch.optim.AdamW(params, lr=opts["lr"], weight_decay=0.0),
                         stage=opts["zero_stage"], clip_grad=opts["clip"], wait_timeout=opts["timeout_s"] / 2)
    attach_to_schedule(config, zero)
    _STATE.update(mesh=mesh, config=config, chunks=chunks, zero=zero, opts=opts)
    return {"rank": mesh.rank, "coords": c, "layers": [len(ch.decoder.layers) for ch in chunks]}


def train_step(step: int) -> dict:
    import torch.distributed as dist

    from l3plugin.megatron import forward_backward_pipelining_flexible

    s = _STATE
    opts, mesh, chunks = s["opts"], s["mesh"], s["chunks"]
    c = mesh.coords
    mine = data.step_microbatches(step, c["dp"], opts["microbatches"], opts["seq_len"], opts["vocab"])
    global_tokens = opts["dp"] * sum(float(b["loss_mask"].sum()) for b in mine)  # same count on every DP rank
    batches = _prepare(mine, opts["cp"], c["cp"], opts["cp_layout"])
    out = forward_backward_pipelining_flexible(
        forward_step_func=_forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
        num_microbatches=opts["microbatches"], seq_length=opts["seq_len"], micro_batch_size=1)
    grad_norm = s["zero"].step()
    loss = torch.tensor(sum(float(d["loss_sum"]) for d in out), dtype=torch.float64)
    # Last pipeline stage holds the losses; sum them over CP and DP, then share along the pipeline.
    for group, name in ((mesh.dp_cp_group, "DP x CP"), (mesh.pp_group, "PP")):  # other stages contribute 0
        work = dist.all_reduce(loss, group=group, async_op=True)
        wait_work(work, timeout=resolve_timeout(),
                  what=f"loss all-reduce over the {name} group {group_ranks(group)}")
    return {"loss": float(loss) / global_tokens, "grad_norm": float(grad_norm)}


def reference_losses(opts: dict, steps: int) -> list[float]:
    """The same model, data and optimizer in one piece (tp = cp = pp = 1), all microbatches of all DP
    ranks in order. Runs on every rank of its pool independently (each rank is its own ZeRO group)."""
    import torch.distributed as dist

    from l3plugin.megatron.zero import megatron_zero
    from l3plugin.mesh.groups import init_mesh

    init_mesh()
    alone, _ = dist.new_subgroups(group_size=1)
    config = model.llama_config(**opts["model"])
    chunk = model.build_chunk(config, vocab=opts["vocab"], seq_len=opts["seq_len"], pre_process=True,
                              post_process=True, share_embeddings_and_output_weights=True)
    zero = megatron_zero([chunk], torch.optim.AdamW(list(chunk.parameters()), lr=opts["lr"], weight_decay=0.0),
                         stage=1, clip_grad=opts["clip"], gradient_scale=1.0, group=alone)
    losses = []
    for step in range(steps):
        batches = [b for r in range(opts["dp"])
                   for b in data.step_microbatches(step, r, opts["microbatches"], opts["seq_len"], opts["vocab"])]
        global_tokens = sum(float(b["loss_mask"].sum()) for b in batches)
        total = 0.0
        for b in _prepare(batches, 1, 0):
            out, reduce = _forward_step(iter([b]), chunk)
            loss, _, stats = reduce(out)
            (loss / global_tokens).backward()
            total += float(stats["loss_sum"])
        zero.step()
        losses.append(total / global_tokens)
    return losses
