"""Document boundaries for every pipeline stage of l3plugin's CP route (``--reset-attention-mask``).

Megatron-LM's ``get_batch`` reads data on the first and last pipeline stages only: a middle stage (PP > 2, or a
middle virtual stage of any rank) returns ``None`` for everything, ``packed_seq_params`` included, and calls no
batch function at all, so no batch-function hook can reach it. Its attention still needs the micro-batch's
document boundaries. Here the first stage sends them to every other stage:

- The source is pipeline rank 0 (its first model chunk reads the data; with TP every TP rank of it has the
  boundaries, from ``tp_batch_with_documents``). Each other rank of the pipeline group receives every
  micro-batch's boundaries, whatever its chunks are: one rule for every layout, Megatron version and schedule.
  A chunk that got boundaries from its own batch (the last stage) checks they equal the received ones, so a
  stage that ran another micro-batch fails naming it instead of masking with the wrong documents.
- When: a forward pre-hook on every GPTModel chunk. The n-th forward of a chunk within one schedule call is
  micro-batch n in every schedule (stock 1F1B, stock interleaved, l3plugin's flexible; forward-only too). On
  the source the first chunk's forward of micro-batch n posts the sends before any stage can need them (every
  stage's forward of n depends on that chunk's output); a receiver receives at its first forward of n, in
  order, and waits with the bound of ``l3plugin.collective.waits`` (naming this rank, the source and the micro-batch).
  A chunk given no ``packed_seq_params`` gets ``PackedSeqParams(sbhd, cu_seqlens_q=<global boundaries>)``,
  exactly what the data-reading stages build (``sbhd_packed_params``).
- The source waits for its sends when the schedule call returns (``schedule_step``: around Megatron's stock
  pipelined schedules, through install.py's guard, and l3plugin's flexible schedule), when every stage has
  taken part in every micro-batch's forward; never mid-step, where waiting would serialise the pipeline or
  deadlock against a stage that is itself waiting for activations.
- Its own process group (same ranks as the pipeline group), made at the first schedule call, when every rank
  is there, with one small exchange that opens the source's connections: NCCL matches point-to-point messages
  per communicator in posting order, not by tag, so sharing the schedule's group could pair a boundary
  message with an activation.

Why not the alternatives: a broadcast over the pipeline group at ``get_batch`` time needs every stage to call
it, but middle stages skip get_batch's body (and 0.19 changes which batch functions exist); sending the
boundaries along with the activations needs a hook in every schedule's P2P code. This module needs only the
model's forward and the schedule call, both the same for every schedule and for Megatron-Core 0.16 to 0.19.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from l3plugin.collective.waits import resolve_timeout, wait_work
from l3plugin.megatron.arguments import parsed_options

BOUNDARY_TAG = 0x3CD0000  # point-to-point tags of the boundary messages (count, then boundaries)
_step = {"depth": 0, "channel": None}
_groups = {}  # (world process group, pipeline ranks) -> the boundary group


def sbhd_packed_params(cu: torch.Tensor):
    """PackedSeqParams for l3plugin's CP attention: the GLOBAL boundaries in the "sbhd" format. Megatron's
    RoPE sizes itself by max_seqlen whenever packed_seq_params is given (RotaryEmbedding.get_rotary_seq_len)
    and then takes this CP rank's part; in "sbhd" every token keeps its global position, so that length is
    the whole sequence, not the longest document."""
    from megatron.core.packed_seq_params import PackedSeqParams

    seq_len = int(cu[-1])
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=seq_len, max_seqlen_kv=seq_len)


def _boundary_group(pp_group, device, timeout):
    """A group of our own with ``pp_group``'s ranks (made once per world), and whether it is new.

    ``new_group`` is called by every rank of the world for every pipeline group, in one order learnt from
    an all-gather (torch's ``use_local_synchronization=True`` hangs in gloo's connect once other groups
    exist, measured on torch 2.13). Called at a schedule call, where every rank of the world is."""
    import torch.distributed as dist

    from l3plugin.collective import at_exit
    from l3plugin.collective.comm import start_all_gather

    ranks = tuple(dist.get_process_group_ranks(pp_group))
    key = (dist.group.WORLD, ranks)
    new = key not in _groups
    if new:
        for old in [k for k in _groups if k[0] is not dist.group.WORLD]:
            del _groups[old]  # from a world that was destroyed since
        mine = torch.tensor(ranks, dtype=torch.int64, device=device)
        every = start_all_gather(mine, None, what="pipeline groups' ranks, for the document boundaries")
        for group_ranks in sorted({tuple(row) for row in every.wait(timeout).view(-1, len(ranks)).tolist()}):
            group = dist.new_group(list(group_ranks))
            if group_ranks == ranks:
                _groups[key] = group
                at_exit.destroy_at_exit(group)
    return _groups[key], ranks, new


class BoundaryChannel:
    """The first pipeline stage's document boundaries, delivered to every stage; one schedule call."""

    def __init__(self, pp_group, device, timeout=None):
        import torch.distributed as dist

        self.timeout = resolve_timeout(timeout)
        self.group, self.ranks, new = _boundary_group(pp_group, device, self.timeout)
        self.me = dist.get_rank()
        self.source = self.ranks[0]
        self.is_source = self.me == self.source
        self.device = device
        self.store = {}  # micro-batch -> int32 boundaries [0, ..., S]
        self.forwards = {}  # id(chunk) -> forwards so far in this schedule call
        self.sends = []  # (work, what, tensor): waited at the end of the call
        self.received = 0
        if new:
            self._open()

    def _open(self):
        """One message from the source to each other stage, so (on NCCL) the connections exist before a
        stage could be busy waiting for activations."""
        import torch.distributed as dist

        hello = torch.ones(1, dtype=torch.int64, device=self.device)
        if self.is_source:
            works = [(dist.isend(hello, peer, group=self.group, tag=BOUNDARY_TAG - 1), peer)
                     for peer in self.ranks[1:]]
            for work, peer in works:
                wait_work(work, timeout=self.timeout, what=self._what("first message", peer))
        else:
            work = dist.irecv(hello, self.source, group=self.group, tag=BOUNDARY_TAG - 1)
            wait_work(work, timeout=self.timeout, what=self._what("first message", self.source))

    def _what(self, item, peer) -> str:
        direction = "send to" if self.is_source else "receive from"
        return (f"{direction} rank {peer} of the document boundaries ({item}) in pipeline group ranks "
                f"{list(self.ranks)}")

    def boundaries(self, chunk, given):
        """The boundaries of ``chunk``'s next micro-batch; ``given``: those of its own batch, or None."""
        n = self.forwards.get(id(chunk), 0)
        self.forwards[id(chunk)] = n + 1
        if n not in self.store:
            if self.is_source:
                if given is None:
                    raise ValueError(f"rank {self.me}: micro-batch {n} reached the first pipeline stage without "
                                     f"document boundaries (packed_seq_params.cu_seqlens_q): its get_batch must "
                                     f"give them there (--reset-attention-mask with l3plugin's CP route)")
                self._send(n, given)
            else:
                while self.received <= n:
                    self._receive(self.received)
        cu = self.store[n]
        if given is not None and not torch.equal(given.reshape(-1).to(cu.device, torch.int32), cu):
            raise ValueError(f"rank {self.me}: micro-batch {n}: the document boundaries of this stage's batch "
                             f"{given.reshape(-1).tolist()} differ from the first stage's {cu.tolist()}: the "
                             f"pipeline stages did not read the same micro-batches in the same order")
        return cu

    def _send(self, n, given):
        import torch.distributed as dist

        cu = given.reshape(-1).to(torch.int32).contiguous().clone()
        self.store[n] = cu
        count = torch.tensor([cu.numel()], dtype=torch.int64, device=cu.device)
        for peer in self.ranks[1:]:
            for tensor, tag, item in ((count, BOUNDARY_TAG, "count"), (cu, BOUNDARY_TAG + 1, "values")):
                work = dist.isend(tensor, peer, group=self.group, tag=tag)
                self.sends.append((work, self._what(f"micro-batch {n}, {item}", peer), tensor))

    def _receive(self, n):
        import torch.distributed as dist

        count = torch.empty(1, dtype=torch.int64, device=self.device)
        wait_work(dist.irecv(count, self.source, group=self.group, tag=BOUNDARY_TAG),
                  timeout=self.timeout, what=self._what(f"micro-batch {n}, count", self.source))
        cu = torch.empty(int(count), dtype=torch.int32, device=self.device)
        wait_work(dist.irecv(cu, self.source, group=self.group, tag=BOUNDARY_TAG + 1),
                  timeout=self.timeout, what=self._what(f"micro-batch {n}, values", self.source))
        self.store[n] = cu
        self.received = n + 1

    def finish(self):
        """Wait for the source's sends (every stage has received them by the end of the schedule call)."""
        sends, self.sends = self.sends, []
        for work, what, _tensor in sends:
            wait_work(work, timeout=self.timeout, what=what)


def _documents_route():
    route = parsed_options().cp_route
    return route is not None and route.documents


def _model_device(model):
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for param in chunk.parameters():
            return param.device
    return torch.device("cpu")


@contextlib.contextmanager
def boundaries_for_step(model=None, pg_collection=None):
    """One schedule call: with documents and PP > 1, a BoundaryChannel its chunks' forwards use."""
    if _step["depth"] > 0 or not _documents_route():
        _step["depth"] += 1
        try:
            yield _step["channel"]
        finally:
            _step["depth"] -= 1
        return
    pp_group = getattr(pg_collection, "pp", None)
    if pp_group is None:
        from megatron.core import parallel_state

        pp_group = parallel_state.get_pipeline_model_parallel_group()
    channel = None
    if pp_group is not None and pp_group.size() > 1:
        channel = BoundaryChannel(pp_group, _model_device(model))
    _step.update(depth=1, channel=channel)
    ok = False
    try:
        yield channel
        ok = True
    finally:
        _step.update(depth=0, channel=None)
        if channel is not None and ok:  # after a failure the sends may never be received: not waited
            channel.finish()


def schedule_step(schedule):
    """``schedule`` (a forward_backward_func, keyword arguments) run inside ``boundaries_for_step``."""
    @functools.wraps(schedule)
    def step(*args, **kwargs):
        with boundaries_for_step(kwargs.get("model"), kwargs.get("pg_collection")):
            return schedule(*args, **kwargs)
    return step


def _count_like_forward_step(cu):
    """Megatron-LM 0.19's forward_step adds each packed batch's document lengths to its FLOPs statistics,
    which every rank then all-reduces over the world once per iteration: a stage whose batch had no
    boundaries (here) must add them too, or that all-reduce waits forever for it."""
    training = sys.modules.get("megatron.training.training")
    update = getattr(training, "update_seqlen_stats_from_cu_seqlens", None)
    if update is not None:
        update(cu)


def fill_boundaries(module, args, kwargs):
    """GPTModel forward pre-hook: the micro-batch's boundaries for this chunk (see the module docstring)."""
    channel = _step["channel"]
    if channel is None:
        return None
    positional = len(args) > 6
    packed = args[6] if positional else kwargs.get("packed_seq_params")
    given = getattr(packed, "cu_seqlens_q", None)
    cu = channel.boundaries(module, given)
    if packed is not None:
        return None
    _count_like_forward_step(cu)
    packed = sbhd_packed_params(cu)
    if positional:
        return (*args[:6], packed, *args[7:]), kwargs
    return args, {**kwargs, "packed_seq_params": packed}
