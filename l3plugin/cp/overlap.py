"""All-gather CP attention with its communication under the compute: the K/V all-gather and the dK/dV
reduce-scatter in parts, each waited only when a local range needs it.

A local range [a, b) attends the gathered keys [0, b) (causal; [0, S) otherwise). The K/V are gathered
in ``parts`` collectives (every rank's local tokens cut into equal slices, in local order, hence by
position), so a range runs as soon as the parts holding the positions before its end are in, while later
parts still travel. With the paper's layout at cp=2, rank 0's first chunk needs only its own keys, rank
1's first chunk only the first half of rank 0's tokens.

In the backward, ranges are differentiated last first. The dK/dV a range adds reach only positions
before its end, so once no range left reaches the other ranks' tokens of a part, that part's
reduce-scatter can start and travel while the earlier ranges are differentiated; every rank starts the
parts in the same order (the last first), as collectives matched by issue order (NCCL) need. This rank's gradient for
its own tokens is not sent: it is added after the reduce-scatter (which sums the others' with a zero for
this rank's own slice).

Exact: the same kernel calls on the same values, in the same order, as the plain path in attention.py;
dK/dV are summed in the same order, so at cp=2 every result is bit-identical to it (beyond cp=2 the
reduce-scatter's sum over ranks is ordered differently). Memory: about the same (one gathered K/V
buffer; in the backward one dK/dV buffer of the whole sequence, plus the parts being sent).

With ``regather`` (cp_kv="regather") the gathered buffer's storage is freed when the forward ends and
filled again by one K/V all-gather when the backward starts (every range's backward reads it, the last
range's first, and that one needs nearly all of it: nothing to overlap it with inside the call). With
``prefetch`` that all-gather is started ahead, during the backward of the call after it (regather_ahead.py).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from l3plugin.collective import comm
from l3plugin.cp.kv_gather import GatheredKV, alias
from l3plugin.cp.layout import CPLayout

# K/V collectives per attention call. The paper's layout at cp=2 cannot use more: its ranges wait for half
# or all of the other rank's tokens. (Not tuned for the balanced layout.)
PARTS = 2


@dataclass(frozen=True)
class PartPlan:
    """How this rank's attention call waits for the parts, for one (layout, rank, causal, parts)."""

    slices: tuple  # per part: (lo, hi) of every rank's local order
    positions: tuple  # per part: [cp, hi - lo] global positions of every rank's tokens in it
    rows: tuple  # per local range: its number of queries
    needs: tuple  # per local range: the last part it waits for (-1: its keys are all this rank's own)
    kv_lens: tuple  # per local range: the keys it attends, [0, kv_len)
    first_other: tuple  # per part: the first position of another rank's token in it
    order: torch.Tensor  # global positions of the rank-major concatenation of every rank's tokens (regather)
    arrival: torch.Tensor  # per position: the part bringing it, -1 for this rank's own (local-first)


@functools.lru_cache(maxsize=64)
def part_plan(layout: CPLayout, rank: int, causal: bool, parts: int) -> PartPlan:
    cp, seq_len = layout.cp_size, layout.seq_len
    s_local = seq_len // cp
    parts = max(1, min(parts, s_local))
    cuts = [round(j * s_local / parts) for j in range(parts + 1)]
    by_rank = layout.gathered_order().view(cp, s_local)
    others = [r for r in range(cp) if r != rank]
    positions = tuple(by_rank[:, lo:hi] for lo, hi in zip(cuts, cuts[1:]))
    arrival = torch.full((seq_len,), -1)  # the part each position arrives in; -1: own
    for p, pos in enumerate(positions):
        arrival[pos[others].reshape(-1)] = p
    arrived_by = torch.cummax(arrival, 0).values  # [x]: the last part needed for keys [0, x]
    ranges = layout.rank_ranges(rank)
    kv_lens = tuple(b if causal else seq_len for _, b in ranges)
    return PartPlan(slices=tuple(zip(cuts, cuts[1:])), positions=positions, rows=tuple(b - a for a, b in ranges),
                    needs=tuple(int(arrived_by[n - 1]) for n in kv_lens), kv_lens=kv_lens,
                    first_other=tuple(int(pos[others].min()) for pos in positions), order=layout.gathered_order(),
                    arrival=arrival)


class OverlappedAttention(torch.autograd.Function):
    """q [s_local, hq, d], k, v [s_local, hkv, d] (local order) -> out [s_local, hq, d]; ``attend(i, q_rows,
    k, v)`` runs the kernel of local range i on keys [0, kv_len). Gathers, attends, reduce-scatters."""

    @staticmethod
    def forward(ctx, q, k, v, attend, plan, group, timeout, track, regather, prefetch, phased):
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        local = torch.stack([k, v])  # [2, s_local, h, d]: one collective per part for both
        flights = [comm.start_all_gather(local[:, lo:hi], group,
                                         what=f"CP K/V part {p} {(2, hi - lo) + tuple(k.shape[1:])}")
                   for p, (lo, hi) in enumerate(plan.slices)]
        full = local.new_empty((2, cp * local.size(1)) + local.shape[2:])
        full[:, own_positions(plan, me, full.device)] = local
        others = [r for r in range(cp) if r != me]
        arrived, first = -1, 0
        ctx.ranges = []  # per range: (rows, its output with its graph, q leaf, K/V leaf)
        if phased is not None:  # local first: every range's own keys, then each part's as it arrives
            arrived = len(flights) - 1
            ctx.ranges = _local_first(q, full, flights, phased, plan, others, cp, timeout, track)
        for i, kv_len in enumerate(plan.kv_lens if phased is None else ()):
            while arrived < plan.needs[i]:
                arrived += 1
                _place(full, flights[arrived].wait(timeout), plan.positions[arrived], others, cp)
            rows = slice(first, first + plan.rows[i])
            first = rows.stop
            # A leaf aliasing full[:, :kv_len]: later parts are written into ``full`` in place after a kernel
            # saved it, but only at positions >= kv_len, so what the kernel saved never changes.
            q_leaf, kv_leaf = q[rows].detach().requires_grad_(), alias(full, kv_len).requires_grad_()
            with torch.set_grad_enabled(track), private_graphs():  # each range's graph, for our backward
                out = attend(i, q_leaf, kv_leaf[0], kv_leaf[1])
            ctx.ranges.append((rows, out, q_leaf, kv_leaf))
        for flight in flights[arrived + 1:]:  # parts no range here needs: still finish them
            flight.wait(timeout)
        ctx.plan, ctx.group, ctx.timeout, ctx.me, ctx.cp = plan, group, timeout, me, cp
        ctx.q_shape, ctx.local_shape = q.shape, local.shape
        ctx.buffer = None
        if regather and track:  # the ranges' graphs keep views of ``full``: free its memory until the backward
            ctx.buffer = GatheredKV(full, plan.order, group, timeout, k, v, prefetch)
            ctx.save_for_backward(k, v)  # (so a census of saved tensors counts them)
        return torch.cat([out.detach() for _, out, _, _ in ctx.ranges])

    @staticmethod
    def backward(ctx, grad_out):
        plan, me, cp = ctx.plan, ctx.me, ctx.cp
        if ctx.buffer is not None:
            ctx.buffer.begin_backward()
        dq = grad_out.new_zeros(ctx.q_shape)
        dfull = grad_out.new_zeros((2, cp * ctx.local_shape[1]) + ctx.local_shape[2:])
        flights = {}

        def start_parts(reach):  # parts no remaining range adds to (outside this rank's own tokens)
            # Every rank starts the parts in one order, the last first, each once it is ready here and every later
            # part has started: NCCL pairs the n-th reduce-scatter of each rank, and the parts have one size, so
            # ranks starting them in the order they became ready (it differs by rank) summed different parts.
            for p in reversed(range(len(plan.positions))):
                if p in flights:
                    continue
                if plan.first_other[p] < reach:
                    break
                # [cp, 2, n, h, d]: every rank's tokens of this part, rank-major
                send = dfull[:, plan.positions[p].to(dfull.device)].transpose(0, 1).contiguous()
                send[me] = 0  # this rank's own gradient is added after, not sent
                flights[p] = comm.start_reduce_scatter_sum(
                    send.view(-1), ctx.group, send.dtype, what=f"CP dK/dV part {p} {tuple(send.shape[1:])}", tag=p)

        start_parts(max(plan.kv_lens))
        for i in reversed(range(len(ctx.ranges))):
            rows, out, q_leaf, kv_leaf = ctx.ranges[i]
            if out.requires_grad:
                with one_recompute():
                    gq, gkv = torch.autograd.grad(out, (q_leaf, kv_leaf), grad_out[rows], allow_unused=True)
                if gq is not None:
                    dq[rows] = gq
                if gkv is not None:
                    dfull[:, :gkv.size(1)] += gkv
            ctx.ranges[i] = None  # free this range's graph
            start_parts(max(plan.kv_lens[:i], default=0))
        mine = dfull[:, own_positions(plan, me, dfull.device)]  # this rank's own gradient, local order
        for p, (lo, hi) in enumerate(plan.slices):
            mine[:, lo:hi] += flights[p].wait(ctx.timeout).view_as(mine[:, lo:hi])
        if ctx.buffer is not None:
            ctx.buffer.end_backward()
        return dq, mine[0], mine[1], None, None, None, None, None, None, None, None


def overlapped_attention(q, k, v, attend, plan: PartPlan, group, timeout, regather=False, prefetch=False,
                         phased=None):
    """OverlappedAttention; the ranges' graphs are built only when a backward can follow. ``regather``:
    keep only the local K/V for the backward and all-gather them again there (cp_kv="regather");
    ``prefetch``: that all-gather started ahead (regather_ahead.py). ``phased(i, q_rows)``: a kernels.PhasedFlash
    of range i (local first: each range's own keys before the other ranks' arrive), used instead of ``attend``."""
    track = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return OverlappedAttention.apply(q, k, v, attend, plan, group, timeout, track, regather, prefetch, phased)


def _local_first(q, full, flights, phased, plan, others, cp, timeout, track):
    """Every range's calls on this rank's own keys, then, part by part as it arrives, the calls on its keys;
    returns the ranges as OverlappedAttention keeps them."""
    ranges, first = [], 0
    for i, kv_len in enumerate(plan.kv_lens):
        rows = slice(first, first + plan.rows[i])
        first = rows.stop
        q_leaf, kv_leaf = q[rows].detach().requires_grad_(), alias(full, kv_len).requires_grad_()
        ranges.append((rows, phased(i, q_leaf), q_leaf, kv_leaf))
    for part in range(-1, len(flights)):
        if part >= 0:
            _place(full, flights[part].wait(timeout), plan.positions[part], others, cp)
        for _, kernel, _, kv_leaf in ranges:
            kernel.run(part, kv_leaf[0], kv_leaf[1])
    with torch.set_grad_enabled(track), private_graphs():
        return [(rows, kernel.finish(q_leaf, kv_leaf[0], kv_leaf[1]), q_leaf, kv_leaf)
                for rows, kernel, q_leaf, kv_leaf in ranges]


# Activation checkpointing (torch.utils.checkpoint, use_reentrant=False: transformers' default) recomputes a region
# once per autograd graph task that unpacks one of its saved tensors. Each range's torch.autograd.grad in the
# backward above is a graph task of its own, so a checkpointed layer would be recomputed once per range, with its
# K/V all-gathers, and ranks holding different numbers of ranges would post different collectives and hang.
# torch >= 2.10 lets backward calls share one recompute (a graph-execution group, the key the checkpoint files
# its recomputed tensors under): the ranges' backward joins the group of the backward that runs this node, so a
# layer is recomputed once per backward, as without CP. Older torch has no such group: there the ranges' graphs
# keep their saved tensors themselves (outside any saved-tensor hooks, as a fused kernel's internals are), so
# nothing is recomputed per range; the attention's activations (q, the output, the local K/V) then stay in memory
# under checkpointing instead of being recomputed.
SHARED_RECOMPUTE = hasattr(torch._C, "_set_graph_exec_group") and hasattr(torch._C, "_get_graph_exec_group")


@contextlib.contextmanager
def one_recompute():
    """Backward calls made inside share the recompute of the graph task running now (see above)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    if not SHARED_RECOMPUTE or torch._C._get_graph_exec_group() is not None or current is None or current() == -1:
        yield  # no group to join, or already in one (the caller's: it covers these calls too)
        return
    torch._C._set_graph_exec_group(current())
    try:
        yield
    finally:
        torch._C._set_graph_exec_group(None)


def private_graphs():
    """Where the ranges' graphs are built: without a shared recompute, outside the caller's saved-tensor hooks."""
    if SHARED_RECOMPUTE:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_keep, _keep)


def _keep(tensor):
    return tensor


def own_positions(plan: PartPlan, rank: int, device) -> torch.Tensor:
    """Global positions of ``rank``'s tokens in local order."""
    return torch.cat([pos[rank] for pos in plan.positions]).to(device)


def _place(full, gathered, positions, others, cp):
    """Write the other ranks' tokens of one gathered part ([cp * 2 * n * h * d], rank-major) into ``full``."""
    parts = gathered.view(cp, 2, positions.size(1), *full.shape[2:])
    full[:, positions[others].reshape(-1).to(full.device)] = parts[others].transpose(0, 1).reshape(
        2, -1, *full.shape[2:])
