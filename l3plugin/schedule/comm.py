"""Point-to-point communication for executing a Schedule: activations forward, gradients backward.

The rule that keeps it correct: on every directed channel (src rank -> dst rank) the receiver posts its
receives in exactly the order the sender sends (``Schedule.channel_messages``), no matter in which order
it needs them. Messages that arrive early wait in a buffer. This is what makes pp=2 safe, where one peer
gets both activations and gradients and a receiver that posted in its own order would match a gradient
with an activation buffer (NVIDIA/Megatron-LM#750 is that bug with batched P2P upstream).

Sends are non-blocking and their completion is checked lazily, so a rank only ever blocks on a receive
that its next compute step needs; ``validate`` in plan.py proves such a replay of the plan terminates.
Devices and dtypes come from the caller (take them from the model), never hard-coded.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from l3plugin.schedule.plan import Message, Schedule


class PipelineChannels:
    """This pipeline rank's receives and sends for one execution of ``schedule``."""

    def __init__(self, schedule: Schedule, pp_rank: int, pp_global_ranks: list[int], group, *,
                 shape, dtype, device, prefetch: bool = True):
        self.pp_rank = pp_rank
        self.global_ranks = list(pp_global_ranks)
        self.group = group
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.prefetch = prefetch
        channels = schedule.channel_messages()
        # Incoming messages per source rank, in the sender's order; receives are posted in this order.
        self._incoming = {src: deque(msgs) for (src, dst), msgs in channels.items()
                          if dst == pp_rank and src != pp_rank}
        self._posted: dict[Message, tuple] = {}  # message -> (work, buffer, source rank)
        self._local: dict[Message, torch.Tensor] = {}  # pp=1 with chunks: a rank hands tensors to itself
        self._sends: dict[Message, tuple] = {}  # message -> (work, tensor, on_complete)

    def _post_next(self, src: int) -> Message | None:
        queue = self._incoming.get(src)
        if not queue:
            return None
        msg = queue.popleft()
        # Activations arrive as leaf inputs whose .grad the backward step reads.
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device,
                          requires_grad=msg.kind == "activation")
        work = dist.irecv(buf, src=self.global_ranks[src], group=self.group)
        self._posted[msg] = (work, buf, src)
        return msg

    def recv(self, msg: Message, src_rank: int) -> torch.Tensor:
        """Block until ``msg`` (sent by pipeline rank ``src_rank``) is here and return it."""
        if src_rank == self.pp_rank:
            return self._local.pop(msg)
        while msg not in self._posted:
            if self._post_next(src_rank) is None:
                raise RuntimeError(f"pipeline rank {self.pp_rank}: {msg} is not in the plan's channel "
                                   f"from rank {src_rank}; the plan and the executor disagree")
        work, buf, _ = self._posted.pop(msg)
        work.wait()
        if self.prefetch and all(src != src_rank for _, _, src in self._posted.values()):
            self._post_next(src_rank)  # overlap the next receive from this peer with our compute
        return buf

    def send(self, msg: Message, tensor: torch.Tensor, dst_rank: int, on_complete=None):
        """Start sending ``tensor``; ``on_complete(tensor)`` runs once the send is done (e.g. free it)."""
        if dst_rank == self.pp_rank:
            work = None
            self._local[msg] = tensor.detach().requires_grad_(msg.kind == "activation")
        else:
            work = dist.isend(tensor.contiguous(), dst=self.global_ranks[dst_rank], group=self.group)
        self._sends[msg] = (work, tensor, on_complete)
        self._reap()

    def wait_sent(self, msg: Message):
        """Block until ``msg`` has left (its receiver has posted the matching receive)."""
        if msg in self._sends:
            self._complete(msg)

    def _complete(self, msg):
        work, tensor, on_complete = self._sends.pop(msg)
        if work is not None:
            work.wait()
        if on_complete is not None:
            on_complete(tensor)

    def _reap(self):
        for msg in [m for m, (work, _, _) in self._sends.items() if work is None or work.is_completed()]:
            self._complete(msg)

    def finish(self):
        """Wait for every send; check that every planned receive happened."""
        for msg in list(self._sends):
            self._complete(msg)
        leftover = [m for q in self._incoming.values() for m in q] + list(self._posted)
        if leftover or self._local:
            raise RuntimeError(f"pipeline rank {self.pp_rank}: messages never consumed: "
                               f"{leftover + list(self._local)}")
