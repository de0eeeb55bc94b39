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
their operation unfinished, and the most receive buffers posted at once (in-flight receive memory); and they
count what they send (``sent_messages``, ``sent_bytes``: a census of the tensors handed to ``isend``).

Variable shapes (``variable_shapes``, Megatron's ``variable_seq_lengths``: RL and SFT micro-batches of different
lengths): the receiver of every message knows its shape before it posts the receive, without a round trip.
- A gradient has the shape of the activation this rank sent for the same micro-batch and stage: its receive is
  posted with that shape; one planned before that activation left waits (per peer, in order) until it has.
- An activation is preceded by a small shape header (``SHAPE_TAG``), sent right before it, whose receive is
  posted where the activation's would be. On gloo (early receives) one thread per peer waits for the headers in
  order and posts each data receive the moment its header arrives, so the transfer still overlaps this rank's
  compute. In the agreed pair order (NCCL) the header is read where the next operation with that peer is posted.
- Headers, activations and gradients use their own tags, so gloo matches each kind in its own order; NCCL
  ignores tags and gets every pair's operations in one agreed order instead. Cost: one header of
  ``SHAPE_HEADER_LEN`` int64 per activation (measured: bench/pp_variable_lengths.py).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque

import torch
import torch.distributed as dist

from l3plugin.collective import at_exit
from l3plugin.collective.waits import CommTimeout, resolve_timeout, wait_work
from l3plugin.schedule.plan import Message, Schedule
from l3plugin.schedule.receives import RECV, SEND, ReceivePosts, pair_orders


RECEIVE_POSTINGS = ("auto", "early", "agreed")  # the executor's receive-posting modes
SHAPE_HEADER_LEN = 8  # int64s of a shape header: the number of dimensions, then up to 7 sizes
# Tags of variable-shape messages: gloo matches receives per peer and tag, so each kind keeps its own order.
ACTIVATION_TAG, SHAPE_TAG, GRAD_TAG = 1, 2, 3


def shape_header(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s shape as a fixed-size int64 header on its device: [ndim, size_0, ..., 0 padding]."""
    if tensor.dim() > SHAPE_HEADER_LEN - 1:
        raise ValueError(f"a pipeline message has {tensor.dim()} dimensions (shape {tuple(tensor.shape)}): "
                         f"variable shapes carry at most {SHAPE_HEADER_LEN - 1}")
    sizes = [tensor.dim(), *tensor.shape] + [0] * (SHAPE_HEADER_LEN - 1 - tensor.dim())
    return torch.tensor(sizes, dtype=torch.int64, device=tensor.device)


def header_shape(header: torch.Tensor) -> tuple[int, ...]:
    values = header.tolist()
    return tuple(values[1:1 + values[0]])


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
                 posts: ReceivePosts | None = None, variable_shapes: bool = False):
        """``orders``: ``pair_orders(schedule, pp_rank)`` (callers cache it; None computes it).
        ``wait_timeout``: seconds any send or receive may take (None: ``l3plugin.collective.waits.resolve_timeout``).
        ``posts``: ``receive_posts(schedule, pp_rank)`` to post receives early (module docstring); then
        ``orders`` and ``prefetch`` are not used. ``variable_shapes``: every message may have its own shape
        (module docstring); else every message has ``shape``, checked where it is sent."""
        self.pp_rank = pp_rank
        self.schedule = schedule
        self.global_ranks = list(pp_global_ranks)
        self.group = group
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.prefetch = prefetch
        self.wait_timeout = resolve_timeout(wait_timeout)
        self.posts = posts
        self.variable_shapes = variable_shapes
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
        self._sends: dict[Message, tuple] = {}  # message -> (works, tensor, on_complete, peer)
        # Variable shapes: headers posted, data not yet (message -> _PendingShape, per peer in order), gradient
        # receives waiting for their activation to leave (per peer, in order), shapes of the activations sent.
        self._pending: dict[Message, _PendingShape] = {}
        self._pending_by_peer: dict[int, deque] = {}
        self._deferred: dict[int, deque] = {}
        self._sent_shapes: dict[tuple[int, int], tuple[int, ...]] = {}
        self._shape_threads: dict[int, _ShapeReceiver] = {}
        self._lock = threading.Lock()  # the receive account, which shape threads update too
        self._posted_bytes = 0
        self.waits = {"recv_s": 0.0, "recv_count": 0, "send_s": 0.0, "send_count": 0,
                      "peak_posted_receives": 0, "peak_posted_bytes": 0, "sent_messages": 0, "sent_bytes": 0}

    def _needs_grad(self, msg: Message) -> bool:
        # Activations arrive as leaf inputs whose .grad the backward step reads, unless nothing trains
        # before their stage (a frozen prefix: no input gradient is wanted).
        return msg.kind == "activation" and self.schedule.input_needs_grad(msg.dst_stage)

    def _post_data(self, peer: int, msg: Message, shape, tag: int = 0):
        buf = torch.empty(shape, dtype=self.dtype, device=self.device, requires_grad=self._needs_grad(msg))
        work = dist.irecv(buf, src=self.global_ranks[peer], group=self.group, tag=tag)
        with self._lock:
            self._posted[msg] = (work, buf, peer)
            self._posted_bytes += buf.numel() * buf.element_size()
            self.waits["peak_posted_receives"] = max(self.waits["peak_posted_receives"],
                                                     len(self._posted) + len(self._pending))
            self.waits["peak_posted_bytes"] = max(self.waits["peak_posted_bytes"], self._posted_bytes)

    def _post_recv(self, peer: int, msg: Message):
        if not self.variable_shapes:
            self._post_data(peer, msg, self.shape)
        elif msg.kind == "grad":
            self._deferred.setdefault(peer, deque()).append(msg)
            self._post_deferred(peer)
            if self.posts is None and self._deferred[peer]:  # the pair's order cannot wait: never happens
                raise RuntimeError(f"pipeline rank {self.pp_rank}: {self._describe(msg)} is posted before this "
                                   f"rank sent its activation; the plan and the executor disagree")
        else:
            header = torch.empty(SHAPE_HEADER_LEN, dtype=torch.int64, device=self.device)
            pending = _PendingShape(peer, dist.irecv(header, src=self.global_ranks[peer], group=self.group,
                                                     tag=SHAPE_TAG), header)
            self._pending[msg] = pending
            if self.posts is None:  # the agreed order: read where the next operation with this peer is posted
                self._pending_by_peer.setdefault(peer, deque()).append(msg)
            else:  # early receives: the peer's thread posts the data once the header is in
                if peer not in self._shape_threads:
                    self._shape_threads[peer] = _ShapeReceiver(self, peer)
                self._shape_threads[peer].queue.put(msg)

    def _post_deferred(self, peer: int):
        """Post the gradient receives from ``peer`` whose activations have left, in order (module docstring)."""
        waiting = self._deferred.get(peer)
        while waiting:
            shape = self._sent_shapes.get((waiting[0].microbatch, waiting[0].dst_stage))
            if shape is None:
                return
            self._post_data(peer, waiting.popleft(), shape, GRAD_TAG)

    def _resolve_shapes(self, peer: int, until: Message | None = None):
        """Agreed order: read the pending headers from ``peer`` in order and post their data receives (all of
        them, or up to ``until``), so the next operation with that peer keeps the pair's order."""
        waiting = self._pending_by_peer.get(peer)
        while waiting:
            msg = waiting.popleft()
            pending = self._pending[msg]
            self._wait(pending.work, f"receive of the shape of {self._describe(msg)} from", peer)
            self._post_data(peer, msg, header_shape(pending.header), ACTIVATION_TAG)
            del self._pending[msg]
            if msg == until:
                return

    def _take_shaped(self, msg: Message, peer: int):
        """Variable shapes: make sure ``msg``'s data receive is posted (its header read) before it is waited."""
        if msg in self._pending:
            if self.posts is None:
                self._resolve_shapes(peer, msg)
            else:  # the peer's shape thread posts it (and raises its own bounded-wait error into ``error``)
                pending = self._pending[msg]
                blocks, start = not pending.done.is_set(), time.perf_counter()
                if not pending.done.wait(self.wait_timeout + 1.0):
                    raise CommTimeout(f"{self._what(f'receive of the shape of {self._describe(msg)} from', peer)} "
                                      f"never ended")
                if pending.error is not None:
                    raise pending.error
                if blocks:
                    self._count_wait("receive", start)
                del self._pending[msg]
        elif msg not in self._posted:
            raise RuntimeError(f"pipeline rank {self.pp_rank}: {self._describe(msg)} is needed before this rank "
                               f"sent the activation it is the gradient of; the plan and the executor disagree")

    def _is_posted(self, msg: Message) -> bool:
        """Its receive is posted (variable shapes: or its header, or it waits for its activation to leave)."""
        return (msg in self._posted or msg in self._pending
                or any(msg in waiting for waiting in self._deferred.values()))

    def before_action(self, index: int):
        """Post the receives planned before this rank's action ``index`` (``posts``; else nothing)."""
        if self.posts is not None:
            for planned in self._planned_at.get(index, ()):
                if not self._is_posted(planned.message):
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
            if self.variable_shapes and self.posts is None:
                self._resolve_shapes(peer)  # the pair's order: earlier data receives before this operation
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
        if not self._is_posted(msg):
            self._advance(src_rank, msg)
        if self.variable_shapes:
            self._take_shaped(msg, src_rank)
        with self._lock:
            work, buf, _ = self._posted.pop(msg)
            self._posted_bytes -= buf.numel() * buf.element_size()
        self._wait(work, f"receive of {self._describe(msg)} from", src_rank)
        queue = self._ops.get(src_rank)
        if self.posts is None and self.prefetch and queue and queue[0][0] == RECV:
            if self.variable_shapes:
                self._resolve_shapes(src_rank)  # the pair's order: earlier data receives first
            kind, nxt = queue.popleft()  # overlap the next receive from this peer with our compute
            self._post_recv(src_rank, nxt)
        return buf

    def send(self, msg: Message, tensor: torch.Tensor, dst_rank: int, on_complete=None):
        """Start sending ``tensor``; ``on_complete(tensor)`` runs once the send is done (e.g. free it)."""
        if not self.variable_shapes and tuple(tensor.shape) != self.shape:
            raise ValueError(
                f"pipeline rank {self.pp_rank}: {self._describe(msg)} has shape {tuple(tensor.shape)}, but this "
                f"step's messages are {self.shape} (from seq_length, micro_batch_size, hidden_size, CP and "
                f"sequence parallelism): for micro-batches of different lengths set "
                f"config.variable_seq_lengths=True")
        if dst_rank == self.pp_rank:
            works = ()
            self._local[msg] = tensor.detach().requires_grad_(self._needs_grad(msg))
        else:
            if self.posts is None:
                self._advance(dst_rank, msg)
            works = self._isend(msg, tensor, dst_rank)
        self._sends[msg] = (works, tensor, on_complete, dst_rank)
        self._reap()

    def _isend(self, msg: Message, tensor: torch.Tensor, dst_rank: int) -> tuple:
        """Start the transfer of ``msg`` (after its shape header where shapes vary); the works."""
        dst, works, tag = self.global_ranks[dst_rank], [], 0
        if self.variable_shapes:
            tag = GRAD_TAG
            if msg.kind == "activation":
                tag, header = ACTIVATION_TAG, shape_header(tensor)
                works.append(dist.isend(header, dst=dst, group=self.group, tag=SHAPE_TAG))
                self._count_sent(header)
        works.append(dist.isend(tensor.contiguous(), dst=dst, group=self.group, tag=tag))
        self._count_sent(tensor)
        if self.variable_shapes and msg.kind == "activation":
            self._sent_shapes[(msg.microbatch, msg.src_stage)] = tuple(tensor.shape)
            self._post_deferred(dst_rank)  # its gradient comes back from the same peer
        return tuple(works)

    def _count_sent(self, tensor: torch.Tensor):
        self.waits["sent_messages"] += 1
        self.waits["sent_bytes"] += tensor.numel() * tensor.element_size()

    def wait_sent(self, msg: Message):
        """Block until ``msg`` has left (its receiver has posted the matching receive)."""
        if msg in self._sends:
            self._complete(msg)

    def _describe(self, msg: Message) -> str:
        return f"the {msg.kind} of microbatch {msg.microbatch} (stage {msg.src_stage} -> {msg.dst_stage})"

    def _what(self, operation: str, peer: int) -> str:
        return f"pipeline rank {self.pp_rank}: {operation} pipeline rank {peer} (global rank {self.global_ranks[peer]})"

    def _wait(self, work, operation: str, peer: int):
        blocks, start = not work.is_completed(), time.perf_counter()
        wait_work(work, timeout=self.wait_timeout, what=self._what(operation, peer))
        if blocks:
            self._count_wait(operation, start)

    def _count_wait(self, operation: str, start: float):
        """A wait that blocked (the operation had not finished yet): its time into ``waits``."""
        kind = "recv" if operation.startswith("receive") else "send"
        self.waits[f"{kind}_s"] += time.perf_counter() - start
        self.waits[f"{kind}_count"] += 1

    def _complete(self, msg):
        works, tensor, on_complete, peer = self._sends.pop(msg)
        for work in works:
            self._wait(work, f"send of {self._describe(msg)} to", peer)
        if on_complete is not None:
            on_complete(tensor)

    def _reap(self):
        for msg in [m for m, (works, *_) in self._sends.items() if all(w.is_completed() for w in works)]:
            self._complete(msg)

    def finish(self):
        """Wait for every send; check that every planned receive happened."""
        for thread in self._shape_threads.values():
            thread.stop()
        for msg in list(self._sends):
            self._complete(msg)
        leftover = ([m for q in self._ops.values() for _, m in q] + list(self._posted) + list(self._pending)
                    + [m for q in self._deferred.values() for m in q])
        if leftover or self._local:
            raise RuntimeError(f"pipeline rank {self.pp_rank}: messages never consumed: "
                               f"{leftover + list(self._local)}")


class _PendingShape:
    """An activation whose shape header is posted and whose data receive is not yet."""

    def __init__(self, peer: int, work, header: torch.Tensor):
        self.peer, self.work, self.header = peer, work, header
        self.done = threading.Event()  # the data receive is posted (or ``error`` says why not)
        self.error: BaseException | None = None


class _ShapeReceiver:
    """Early receives with variable shapes: one thread per peer reads that peer's shape headers in order and
    posts each activation's data receive as soon as its header is in, so the transfer overlaps compute."""

    def __init__(self, channels: PipelineChannels, peer: int):
        self.channels, self.peer = channels, peer
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"l3plugin-shapes-from-{peer}", daemon=True)
        self.thread.start()
        _LIVE_RECEIVERS.add(self)
        at_exit.on_exit(_stop_receivers_at_exit)

    def _run(self):
        ch = self.channels
        while (msg := self.queue.get()) is not None:
            pending = ch._pending[msg]
            try:
                wait_work(pending.work, timeout=ch.wait_timeout,
                          what=ch._what(f"receive of the shape of {ch._describe(msg)} from", self.peer))
                ch._post_data(self.peer, msg, header_shape(pending.header), ACTIVATION_TAG)
            except BaseException as exc:  # handed to the main thread, which raises it where it needs msg
                pending.error = exc
            pending.done.set()

    def stop(self, bound: float | None = None):
        self.queue.put(None)
        self.thread.join(self.channels.wait_timeout + 1.0 if bound is None else bound)
        _LIVE_RECEIVERS.discard(self)


# Shape threads whose channels never reached finish() (a step raised and the caller caught it): stopped at exit,
# within the exit bound, so none wakes up during the interpreter's finalization (collective/at_exit.py). One
# blocked on a receive that never comes is left after the bound (a daemon thread: the exit goes on).
_LIVE_RECEIVERS: "weakref.WeakSet[_ShapeReceiver]" = weakref.WeakSet()


def _stop_receivers_at_exit() -> None:
    for receiver in list(_LIVE_RECEIVERS):
        receiver.stop(at_exit.exit_bound(receiver.channels.wait_timeout))
