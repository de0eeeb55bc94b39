"""The K/V all-gather of CP attention and what it leaves for the backward (cp_kv, see attention.py).

``GatherKV``: one all-gather of this rank's K/V, placed at their sequence positions; its backward
reduce-scatters dK/dV. ``GatheredKV``: the gathered buffer, released after the forward and refilled in the
backward when cp_kv="regather". Both collectives come from l3plugin/collective/comm.py (bounded waits; on gloo the
reduce-scatter is a point-to-point exchange).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from l3plugin.collective import comm

CP_KV_MODES = ("regather", "keep")  # what CP keeps for the backward (the planner's --cp-kv, torch-free)


def check_cp_kv(cp_kv) -> str:
    if cp_kv not in CP_KV_MODES:
        raise ValueError(f"cp_kv={cp_kv!r} is invalid: choose one of {list(CP_KV_MODES)} ('regather' keeps only "
                         f"the local K/V for the backward and all-gathers them again there; 'keep' saves the "
                         f"gathered K/V)")
    return cp_kv


class GatheredKV:
    """The gathered K/V buffer [2, S, h, d] of one attention call, which the kernels' saved tensors view.

    ``release()`` frees its storage (every view stays a valid tensor object, holding no memory);
    ``refill(k, v)`` re-allocates it and all-gathers this rank's K/V (saved for the backward by the caller,
    so a census of saved tensors sees them) into it again. Writes go through an alias with its own version
    counter, so autograd's saved views do not count them as in-place changes (the values written are the
    ones they saved)."""

    def __init__(self, full, order, group, timeout):
        self.full, self.order, self.group, self.timeout = full, order, group, timeout
        self.nbytes = full.untyped_storage().nbytes()

    def release(self):
        self.full.untyped_storage().resize_(0)

    def refill(self, k, v):
        if self.full.untyped_storage().nbytes():  # already in place
            return
        self.full.untyped_storage().resize_(self.nbytes)
        gather_into(alias(self.full), torch.stack([k, v]), self.order, self.group, self.timeout, "again")


def alias(buffer, length=None):
    """``buffer[:, :length]`` (all of it by default) as a new tensor on the same memory with its own version
    counter: writing through one does not count as an in-place change of what autograd saved from the other."""
    shape = buffer.shape if length is None else (buffer.size(0), length) + buffer.shape[2:]
    return buffer.new_empty(0).set_(buffer.untyped_storage(), buffer.storage_offset(), shape, buffer.stride())


def gather_into(full, local, order, group, timeout, when=""):
    """All-gather every rank's ``local`` [2, s_local, h, d] and write each token at its sequence position
    in ``full`` [2, S, h, d]. ``order``: global positions of the rank-major concatenation of all ranks'
    tokens (the layout's)."""
    cp = dist.get_world_size(group)
    what = f"CP K/V {tuple(local.shape)}" + (f" ({when})" if when else "")
    gathered = comm.start_all_gather(local.contiguous(), group, what=what).wait(timeout)
    # The gather concatenates rank by rank: [cp * 2 * s_local * h * d], viewed as [cp, 2, ...].
    flat = gathered.view((cp,) + local.shape).transpose(0, 1).reshape(2, cp * local.size(1), *local.shape[2:])
    full[:, order.to(full.device)] = flat


class GatherKV(torch.autograd.Function):
    """k, v [s_local, h, d] in local order -> k, v [S, h, d] in sequence order; backward reduce-scatters.
    ``order``: global positions of the rank-major concatenation of every rank's tokens (the layout's)."""

    @staticmethod
    def forward(ctx, k, v, group, timeout, order, regather):
        cp = dist.get_world_size(group)
        local = torch.stack([k, v])  # [2, s_local, h, d]: one collective for both
        full = local.new_empty((2, cp * k.size(0)) + k.shape[1:])
        gather_into(full, local, order, group, timeout)
        ctx.buffer = None
        if regather:  # the caller releases it (node.buffer); a hook on its output refills it from the saved k, v
            ctx.buffer = GatheredKV(full, order, group, timeout)
            ctx.save_for_backward(k, v)
        ctx.group, ctx.order, ctx.cp, ctx.timeout = group, order.to(k.device), cp, timeout
        return full[0], full[1]

    @staticmethod
    def backward(ctx, dk_full, dv_full):
        if ctx.buffer is not None:  # every kernel's backward has read it: free it now, not when the graph goes
            ctx.buffer.release()
        grads = torch.stack([dk_full, dv_full])[:, ctx.order]  # rank-major order
        s_local = grads.size(1) // ctx.cp
        grads = grads.reshape(2, ctx.cp, s_local, *grads.shape[2:]).transpose(0, 1).contiguous()
        mine_shape = grads.shape[1:]
        mine = comm.start_reduce_scatter_sum(  # sum over ranks of dK/dV for my tokens
            grads.view(-1), ctx.group, grads.dtype, what=f"CP dK/dV {tuple(mine_shape)}").wait(ctx.timeout).view(mine_shape)
        return mine[0], mine[1], None, None, None, None
