"""cp_kv="regather" with prefetch: the backward's K/V all-gather of one attention call travels while the call
differentiated before it computes, instead of blocking when its own backward starts.

Attention calls are differentiated in the reverse of their forward order (the next call's backward is the
previous layer's). So every regather call joins a chain, one per thread and CP group, in forward order:
- When a call's backward starts (``begin_backward``), its gathered K/V are put back (from the all-gather
  started for it ahead, else by one all-gather now), then the all-gather of the call before it in the chain
  is started, not waited: it travels while this call's backward computes, and that call's backward waits for
  it (bounded wait, l3plugin/collective/waits.py) and places it.
- The latest call's gathered buffer is not freed when its forward ends, but when the next call's forward
  ends (it is then not the latest): when the backward follows the forward, the first call differentiated
  needs no all-gather at all.

Memory: at most two gathered K/V buffers of a chain at a time, the current call's and one more: the latest
forward's (until the next forward or its backward), or the one in flight for the previous call (its receive
buffer, placed when that call's backward starts). One prefetch at most per chain: a new one first waits for
and drops an unused one (that call then gathers again itself).

Every CP rank issues the same collectives in the same order: whether a call's gather is started ahead
depends only on the order of forwards and of backward starts (the same on every rank of an SPMD program),
never on timing or on whether an autograd graph is still alive. A call whose graph was freed without a
backward (e.g. a forward with grad whose output was dropped) is still gathered if it comes before a
differentiated call (from zeros: nobody reads it); its link is cut when the next call joins, so chains of
dropped forwards are freed. Nothing joins a chain without a backward to follow (no_grad, eval: the caller
only builds a GatheredKV when autograd records the call), nor a forward run inside a backward (activation
recomputation: it keeps its buffer, see kv_gather.GatheredKV).
"""

from __future__ import annotations

import threading
import weakref

import torch

from l3plugin.collective import comm

# A call's state in its chain: buffer still filled after its forward / freed / gather in flight for it /
# in its backward / backward done.
HELD, RELEASED, PREFETCHING, IN_BACKWARD, DONE = "held", "released", "prefetching", "in backward", "done"


class Chain:
    """The regather calls of one thread and CP group, in forward order (only links, no data)."""

    def __init__(self):
        self.last = None  # the latest call to join
        self.prefetched = None  # the call whose all-gather was started ahead and not used yet


class Slot:
    """One call's place in its chain: small, outlives the call's buffer (``data`` is a weak reference)."""

    def __init__(self, buffer, chain):
        self.data = weakref.ref(buffer)
        self.chain, self.previous, self.state, self.flight = chain, None, HELD, None
        self.group, self.timeout = buffer.group, buffer.timeout
        self.local_shape, self.dtype, self.device = (2,) + tuple(buffer.k.shape), buffer.k.dtype, buffer.k.device


_chains = threading.local()


def chain_of(group) -> Chain:
    chains = getattr(_chains, "by_group", None)
    if chains is None:
        chains = _chains.by_group = {}
    return chains.setdefault(group, Chain())


def join(buffer, group) -> Slot:
    """``buffer`` (a GatheredKV whose forward just ended) becomes the latest call of its chain; the call
    before it, if still filled, is released."""
    chain = chain_of(group)
    slot, previous = Slot(buffer, chain), chain.last
    if previous is not None:
        if previous.state == HELD:
            data = previous.data()
            if data is not None:
                data.release()
            previous.state = RELEASED
        if previous.data() is None:  # its graph is gone: its backward can never start, its link is unused
            previous.previous = None
    slot.previous, chain.last = previous, slot
    return slot


def begin_backward(slot: Slot) -> None:
    """The call of ``slot`` starts its backward: its K/V in place, then the previous call's gather started."""
    buffer = slot.data()  # alive: its autograd node is running
    if slot.state == PREFETCHING:
        gathered = slot.flight.wait(slot.timeout)
        slot.flight, slot.chain.prefetched = None, None
        buffer.refill(gathered)
    else:
        buffer.refill()  # a no-op when still held
    slot.state = IN_BACKWARD
    previous, slot.previous = slot.previous, None
    if previous is not None and previous.state == RELEASED:
        _start_ahead(previous)


def end_backward(slot: Slot) -> None:
    slot.state = DONE
    slot.previous = None


def _start_ahead(slot: Slot) -> None:
    chain = slot.chain
    unused = chain.prefetched
    if unused is not None and unused.state == PREFETCHING:  # never used: wait for it, drop it
        unused.flight.wait(unused.timeout)
        unused.flight, unused.state = None, RELEASED
    buffer = slot.data()
    local = buffer.local() if buffer is not None else torch.zeros(slot.local_shape, dtype=slot.dtype,
                                                                   device=slot.device)
    what = f"CP K/V {slot.local_shape} (again, ahead of its backward)"
    slot.flight = comm.start_all_gather(local, slot.group, what=what)
    slot.state, chain.prefetched = PREFETCHING, slot


def reset() -> None:
    """Forget this thread's chains (tests; a process that rebuilds its CP groups)."""
    _chains.by_group = {}
