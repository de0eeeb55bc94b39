"""Shared by the ZeRO tests: a chunked bf16 model, a pipeline-like round driver and an fp64 reference."""

from __future__ import annotations

import torch
import torch.distributed as dist

HIDDEN = 21  # odd sizes exercise the padding of buckets to a multiple of the group size


def make_chunks(num_chunks=4, hidden=HIDDEN, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh()).to(dtype)
            for _ in range(num_chunks)]


def chunk_params(chunks):
    return [list(c.parameters()) for c in chunks]


def all_params(chunks):
    return [p for c in chunks for p in c.parameters()]


def make_input(rank, step, mb, hidden=HIDDEN, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1000 * step + 100_000 * rank + mb)
    return torch.randn(4, hidden, generator=g).to(dtype)


def run_rounds(chunks, zero=None, *, rank=None, step=0, num_mb=32, k=8):
    """One step's backward like an all-forward-all-backward pipeline round by round: for each round of
    ``k`` micro-batches, forward them through every chunk, then back-propagate chunk by chunk (last chunk
    first), calling ``zero.end_of_round(chunk params, is_last_round)`` after each chunk's k backwards."""
    rank = dist.get_rank() if rank is None else rank
    rounds = [list(range(i, min(i + k, num_mb))) for i in range(0, num_mb, k)]
    for r, mbs in enumerate(rounds):
        saved = []
        for mb in mbs:
            h, acts = make_input(rank, step, mb, hidden=chunks[0][0].in_features), []
            for c in chunks:
                inp = h.detach().requires_grad_(True) if acts else h
                h = c(inp)
                acts.append((inp, h))
            saved.append((acts, h.float().pow(2).mean() / num_mb))
        grads = [None] * len(saved)
        for ci in reversed(range(len(chunks))):
            for j, (acts, loss) in enumerate(saved):
                inp, out = acts[ci]
                if ci == len(chunks) - 1:
                    loss.backward()
                else:
                    out.backward(grads[j])
                grads[j] = inp.grad if ci > 0 else None
            if zero is not None:
                zero.end_of_round(list(chunks[ci].parameters()), r == len(rounds) - 1)


class Fp64Reference:
    """Accumulates every micro-batch's gradient of ``params`` in fp64 (hooks free .grad like ours do)."""

    def __init__(self, params):
        self.params = list(params)
        self.acc = [torch.zeros(p.shape, dtype=torch.float64) for p in self.params]
        index = {p: i for i, p in enumerate(self.params)}

        def hook(p):
            self.acc[index[p]].add_(p.grad.double())
            p.grad = None

        self.handles = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    def mean_over_ranks(self, group=None):
        out = []
        for a in self.acc:
            a = a.clone()
            dist.all_reduce(a, group=group)
            out.append(a / dist.get_world_size(group))
        return out

    def reset(self):
        for a in self.acc:
            a.zero_()


def relative_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    g = torch.cat([t.double().reshape(-1) for t in got])
    r = torch.cat([t.double().reshape(-1) for t in ref])
    return ((g - r).norm() / r.norm()).item()


def collectives_by_kind(log, buckets) -> dict:
    """A recorded step's collectives: gradient reductions (a reduce-scatter; on gloo a point-to-point exchange,
    one isend per peer of a 1/W slice of the padded bucket, counted once per bucket and peer), parameter
    all-gathers, other all-reduces, anything else."""
    slice_sizes = {b.spec.shard_numel for b in buckets}

    def is_reduction(c):
        return c.op == "reduce_scatter_tensor" or (c.op == "isend" and c.numel in slice_sizes)

    return {"rs": [(str(c.dtype), c.numel) for c in log if is_reduction(c)],
            "ag": [(str(c.dtype), c.numel) for c in log.of("all_gather_into_tensor")],
            "ar": [c.numel for c in log.of("all_reduce")],
            "other": sorted({c.op for c in log} - {"reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce",
                                                   "isend", "irecv"})}
