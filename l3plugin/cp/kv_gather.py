"""The K/V all-gather of CP attention and what it leaves for the backward (cp_kv, see attention.py).

``GatherKV``: one all-gather of this rank's K/V, placed at their sequence positions; its backward
reduce-scatters dK/dV. ``GatheredKV``: the gathered buffer, released after the forward and refilled in the
backward when cp_kv="regather" (with ``prefetch``, refilled ahead: cp/regather_ahead.py). Both collectives
come from l3plugin/collective/comm.py (bounded waits; on gloo the reduce-scatter is a point-to-point exchange).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from l3plugin.collective import comm
from l3plugin.cp import regather_ahead

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
    ``refill()`` re-allocates it and all-gathers this rank's K/V (``k``, ``v``: also saved for the backward
    by the caller, so a census of saved tensors sees them) into it again. Writes go through an alias with its
    own version counter, so autograd's saved views do not count them as in-place changes (the values written
    are the ones they saved).

    ``prefetch``: the call joins this thread's chain of regather calls (regather_ahead.py): its buffer stays
    until the next call's forward, and ``begin_backward`` starts the previous call's all-gather ahead.
    Without it the buffer is released at once and ``begin_backward`` only refills it (one blocking gather).
    A forward run inside a backward (activation recomputation) keeps its buffer and joins no chain: its
    backward follows at once (reentrant checkpoints), or the backward of the call it recomputes reads the
    buffer through the recomputed saved tensors (non-reentrant ones); it goes when those are freed."""

    def __init__(self, full, order, group, timeout, k, v, prefetch=False):
        self.full, self.order, self.group, self.timeout = full, order, group, timeout
        self.k, self.v = k, v
        self.nbytes = full.untyped_storage().nbytes()
        recomputing = in_backward()
        self.slot = regather_ahead.join(self, group) if prefetch and not recomputing else None
        if self.slot is None and not recomputing:
            self.release()

    def release(self):
        self.full.untyped_storage().resize_(0)

    def local(self):
        return torch.stack([self.k, self.v])

    def refill(self, gathered=None):
        """Put the gathered K/V back (``gathered``: a finished all-gather of ``local()``, else one now)."""
        if self.full.untyped_storage().nbytes():  # already in place
            return
        if gathered is None:
            what = f"CP K/V {(2,) + tuple(self.k.shape)} (again)"
            gathered = comm.start_all_gather(self.local(), self.group, what=what).wait(self.timeout)
        self.full.untyped_storage().resize_(self.nbytes)
        place(alias(self.full), gathered, self.order, dist.get_world_size(self.group), self.k.shape)

    def begin_backward(self):
        """The gathered K/V in place before any kernel's backward reads them; the next call's gather started."""
        if self.slot is None:
            self.refill()
        else:
            regather_ahead.begin_backward(self.slot)

    def end_backward(self):
        """Every kernel's backward has read the buffer: free it now, not when the graph goes."""
        self.release()
        if self.slot is not None:
            regather_ahead.end_backward(self.slot)
        self.k = self.v = None


def in_backward() -> bool:
    """True while autograd runs a backward on this thread (as torch's FSDP2 asks it)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def alias(buffer, length=None):
    """``buffer[:, :length]`` (all of it by default) as a new tensor on the same memory with its own version
    counter: writing through one does not count as an in-place change of what autograd saved from the other."""
    shape = buffer.shape if length is None else (buffer.size(0), length) + buffer.shape[2:]
    return buffer.new_empty(0).set_(buffer.untyped_storage(), buffer.storage_offset(), shape, buffer.stride())


def place(full, gathered, order, cp, local_shape):
    """Write an all-gather of every rank's [2, s_local, h, d] K/V (flat, rank-major) into ``full`` [2, S, h, d]
    at each token's sequence position. ``order``: global positions of the rank-major concatenation of all
    ranks' tokens (the layout's)."""
    s_local = local_shape[0]
    flat = gathered.view((cp, 2) + tuple(local_shape)).transpose(0, 1).reshape(2, cp * s_local, *local_shape[1:])
    full[:, order.to(full.device)] = flat


def gather_into(full, local, order, group, timeout, when=""):
    """All-gather every rank's ``local`` [2, s_local, h, d] and write each token at its sequence position
    in ``full`` [2, S, h, d]."""
    what = f"CP K/V {tuple(local.shape)}" + (f" ({when})" if when else "")
    gathered = comm.start_all_gather(local.contiguous(), group, what=what).wait(timeout)
    place(full, gathered, order, dist.get_world_size(group), local.shape[1:])


class GatherKV(torch.autograd.Function):
    """k, v [s_local, h, d] in local order -> k, v [S, h, d] in sequence order; backward reduce-scatters.
    ``order``: global positions of the rank-major concatenation of every rank's tokens (the layout's)."""

    @staticmethod
    def forward(ctx, k, v, group, timeout, order, regather):
        cp = dist.get_world_size(group)
        local = torch.stack([k, v])  # [2, s_local, h, d]: one collective for both
        full = local.new_empty((2, cp * k.size(0)) + k.shape[1:])
        gather_into(full, local, order, group, timeout)
        # regather: once the kernels have run, the caller makes ``buffer`` a GatheredKV of ``full`` (released
        # or chained) and a hook on its output calls buffer.begin_backward()
        ctx.buffer, ctx.full = None, full if regather else None
        if regather:
            ctx.save_for_backward(k, v)
        ctx.group, ctx.order, ctx.cp, ctx.timeout = group, order.to(k.device), cp, timeout
        return full[0], full[1]

    @staticmethod
    def backward(ctx, dk_full, dv_full):
        if ctx.buffer is not None:
            ctx.buffer.end_backward()
        grads = torch.stack([dk_full, dv_full])[:, ctx.order]  # rank-major order
        s_local = grads.size(1) // ctx.cp
        grads = grads.reshape(2, ctx.cp, s_local, *grads.shape[2:]).transpose(0, 1).contiguous()
        mine_shape = grads.shape[1:]
        mine = comm.start_reduce_scatter_sum(  # sum over ranks of dK/dV for my tokens
            grads.view(-1), ctx.group, grads.dtype, what=f"CP dK/dV {tuple(mine_shape)}").wait(ctx.timeout).view(mine_shape)
        return mine[0], mine[1], None, None, None, None
