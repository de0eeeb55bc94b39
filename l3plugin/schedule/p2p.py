"""Point-to-point communication for executing a Schedule: activations forward, gradients backward.

The rule that keeps it correct: both ranks of every pair post their sends AND receives to each other in
one order they agree on, the order of the messages in a global, dependency-respecting replay of the plan
(``execution_order`` in plan.py). Messages that arrive before they are needed wait in a buffer.

- Matching: a pair of neighbours exchanges activations one way and gradients the other (with pp=2 even
  both kinds both ways). A receiver that posted in the order it *needs* tensors could match a gradient
  with an activation buffer (NVIDIA/Megatron-LM#750 is that bug with batched P2P upstream).
- Progress: NCCL runs a pair's sends and receives in posting order on one stream, so opposite orders on
  the two sides deadlock; the same order on both sides cannot. It is always possible to post in that
  order: when a rank needs message j, every message of its own that precedes j in the replay comes from
  an action that precedes its current one, so it has already been sent.
Frozen layers change the messages, not the rule: the plan (``Schedule.first_grad_stage``) drops the
gradient messages into a frozen prefix on both sides, and an activation carries a gradient
(requires_grad) only into a stage after the first trainable one.
Sends are non-blocking and their completion is checked lazily; a rank only ever blocks on a receive its
next compute step needs. Devices and dtypes come from the caller (the model), never hard-coded.
Every blocking wait is bounded (``wait_timeout``, see l3plugin/collective/waits.py): a peer that never sends or
receives gives a ``CommTimeout`` naming both ranks and the message instead of a 30-minute hang.

Early receives (``posts``, planned by l3plugin.schedule.receives): a transfer starts only once its receive is
posted, so on a transport where a pending receive does not hold back this rank's sends (gloo: CPU tensors)
the channels post each receive at its planned point (``before_action``), ahead of need within the budget, in
each peer's send order, and post sends at once. Without ``posts`` they keep the agreed pair order above,
which a transport running a pair's operations in posting order on one stream (NCCL) needs.
The channels time their own blocking (``waits``): seconds and count of the receive and send waits that found
their operation unfinished, and the most receive buffers posted at once (in-flight receive memory).
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from l3plugin.collective.waits import resolve_timeout, wait_work
from l3plugin.schedule.plan import Message, Schedule
from l3plugin.schedule.receives import RECV, SEND, ReceivePosts, pair_orders


RECEIVE_POSTINGS = ("auto", "early", "agreed")  # the executor's receive-posting modes


def posts_receives_early(group, device, posting: str = "auto") -> bool:
    """Whether receives are posted ahead of the pair order (``posts``). ``posting``: "early" or "agreed" (the
    pair order) as asked; "auto": early where ``group``'s transport for ``device`` tensors is gloo, where a
    pending receive holds back none of this rank's sends. NCCL runs a pair's operations in posting order on one
    stream, where an early receive could wait on a send queued behind it: "early" is for gloo only."""
    if posting not in RECEIVE_POSTINGS:
        raise ValueError(f"receive_posting={posting!r} is invalid: must be one of {', '.join(RECEIVE_POSTINGS)} "
                         f"(auto: early on gloo, the agreed pair order elsewhere)")
    if posting != "auto":
        return posting == "early"
    backend = str(dist.get_backend(group))
    if ":" in backend:  # one backend per device type, e.g. "cpu:gloo,cuda:nccl"
        backend = dict(item.split(":", 1) for item in backend.split(",")).get(torch.device(device).type, "")
    return backend == "gloo"


class PipelineChannels:
    """This pipeline rank's receives and sends for one execution of ``schedule``."""

    def __init__(self, schedule: Schedule, pp_rank: int, orders, pp_global_ranks: list[int], group, *,
                 shape, dtype, device, prefetch: bool = True, wait_timeout: float | None = None,
                 posts: ReceivePosts | None = None):
        """``orders``: ``pair_orders(schedule, pp_rank)`` (callers cache it; None computes it).
        ``wait_timeout``: seconds any send or receive may take (None: ``l3plugin.collective.waits.resolve_timeout``).
        ``posts``: ``receive_posts(schedule, pp_rank)`` to post receives early (module docstring); then
        ``orders`` and ``prefetch`` are not used."""
        self.pp_rank = pp_rank
        self.schedule = schedule
        self.global_ranks = list(pp_global_ranks)
        self.group = group
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.prefetch = prefetch
        self.wait_timeout = resolve_timeout(wait_timeout)
        self.posts = posts
        if posts is None:
            orders = pair_orders(schedule, pp_rank) if orders is None else orders
            self._ops = {peer: deque(ops) for peer, ops in orders.items()}
        else:  # receives only, each peer's in its send order; sends are posted when they are made
            self._ops, self._planned_at = {}, {}
            for planned in posts.receives:
                self._ops.setdefault(planned.peer, deque()).append((RECV, planned.message))
                self._planned_at.setdefault(planned.post_at, []).append(planned)
        self._posted: dict[Message, tuple] = {}  # message -> (work, buffer, peer)
        self._local: dict[Message, torch.Tensor] = {}
        self._sends: dict[Message, tuple] = {}  # message -> (work, tensor, on_complete, peer)
        self.waits = {"recv_s": 0.0, "recv_count": 0, "send_s": 0.0, "send_count": 0,
                      "peak_posted_receives": 0, "peak_posted_bytes": 0}

    def _needs_grad(self, msg: Message) -> bool:
        # Activations arrive as leaf inputs whose .grad the backward step reads, unless nothing trains
        # before their stage (a frozen prefix: no input gradient is wanted).
        return msg.kind == "activation" and self.schedule.input_needs_grad(msg.dst_stage)

    def _post_recv(self, peer: int, msg: Message):
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device, requires_grad=self._needs_grad(msg))
        self._posted[msg] = (dist.irecv(buf, src=self.global_ranks[peer], group=self.group), buf, peer)
        if len(self._posted) > self.waits["peak_posted_receives"]:
            self.waits["peak_posted_receives"] = len(self._posted)
            self.waits["peak_posted_bytes"] = len(self._posted) * buf.numel() * buf.element_size()

    def before_action(self, index: int):
        """Post the receives planned before this rank's action ``index`` (``posts``; else nothing)."""
        if self.posts is not None:
            for planned in self._planned_at.get(index, ()):
                if planned.message not in self._posted:
                    self._advance(planned.peer, planned.message)

    def _advance(self, peer: int, until: Message):
        """Post this pair's operations in the agreed order, receives up to ``until``, or up to the
        send of ``until`` (which the caller then posts)."""
        queue = self._ops.get(peer)
        while queue:
            kind, msg = queue[0]
            if kind == SEND and msg != until:
                raise RuntimeError(f"pipeline rank {self.pp_rank}: {until} would overtake the send of {msg} "
                                   f"to rank {peer}; the plan and the executor disagree")
            queue.popleft()
            if kind == RECV:
                self._post_recv(peer, msg)
            if msg == until:
                return
        raise RuntimeError(f"pipeline rank {self.pp_rank}: {until} is not planned between this rank and "
                           f"rank {peer}; the plan and the executor disagree")

    def recv(self, msg: Message, src_rank: int) -> torch.Tensor:
        """Block until ``msg`` (sent by pipeline rank ``src_rank``) is here and return it."""
        if src_rank == self.pp_rank:
            return self._local.pop(msg)
        if msg not in self._posted:
            self._advance(src_rank, msg)
        work, buf, _ = self._posted.pop(msg)
        self._wait(work, f"receive of {self._describe(msg)} from", src_rank)
        queue = self._ops.get(src_rank)
        if self.posts is None and self.prefetch and queue and queue[0][0] == RECV:
            kind, nxt = queue.popleft()  # overlap the next receive from this peer with our compute
            self._post_recv(src_rank, nxt)
        return buf

    def send(self, msg: Message, tensor: torch.Tensor, dst_rank: int, on_complete=None):
        """Start sending ``tensor``; ``on_complete(tensor)`` runs once the send is done (e.g. free it)."""
        if dst_rank == self.pp_rank:
            work = None
            self._local[msg] = tensor.detach().requires_grad_(self._needs_grad(msg))
        else:
            if self.posts is None:
                self._advance(dst_rank, msg)
            work = dist.isend(tensor.contiguous(), dst=self.global_ranks[dst_rank], group=self.group)
        self._sends[msg] = (work, tensor, on_complete, dst_rank)
        self._reap()

    def wait_sent(self, msg: Message):
        """Block until ``msg`` has left (its receiver has posted the matching receive)."""
        if msg in self._sends:
            self._complete(msg)

    def _describe(self, msg: Message) -> str:
        return f"the {msg.kind} of microbatch {msg.microbatch} (stage {msg.src_stage} -> {msg.dst_stage})"

    def _wait(self, work, operation: str, peer: int):
        blocks, start = not work.is_completed(), time.perf_counter()
        wait_work(work, timeout=self.wait_timeout,
                  what=f"pipeline rank {self.pp_rank}: {operation} pipeline rank {peer} (global rank "
                       f"{self.global_ranks[peer]})")
        if blocks:  # counted only when the operation had not finished yet: a wait that blocked
            kind = "recv" if operation.startswith("receive") else "send"
            self.waits[f"{kind}_s"] += time.perf_counter() - start
            self.waits[f"{kind}_count"] += 1

    def _complete(self, msg):
        work, tensor, on_complete, peer = self._sends.pop(msg)
        if work is not None:
            self._wait(work, f"send of {self._describe(msg)} to", peer)
        if on_complete is not None:
            on_complete(tensor)

    def _reap(self):
        for msg in [m for m, (work, *_) in self._sends.items() if work is None or work.is_completed()]:
            self._complete(msg)

    def finish(self):
        """Wait for every send; check that every planned receive happened."""
        for msg in list(self._sends):
            self._complete(msg)
        leftover = [m for q in self._ops.values() for _, m in q] + list(self._posted)
        if leftover or self._local:
            raise RuntimeError(f"pipeline rank {self.pp_rank}: messages never consumed: "
                               f"{leftover + list(self._local)}")
