"""A light collective/P2P recorder for jobs that run without the PyTorch profiler, and for tests and
benchmarks that need to know which collectives a step made.

    with l3plugin.debug.record_collectives("traces/step100", mesh=mesh):   # to files
        train_step()
    # then, on any machine:  l3plugin analyze-trace traces/step100

    with l3plugin.debug.record_collectives() as log:                      # in memory
        train_step()
    log.of("reduce_scatter_tensor"), log.bytes

Inside the context the torch.distributed collectives and P2P calls (the patch list and what is and is not
seen: ``patching.py``) are replaced by thin wrappers that record one ``Collective`` per call; on exit, also
on an exception, the originals are put back. With ``trace_dir`` each record becomes one JSON line of
``trace_dir/rank{R}.jsonl``; without it the context yields a ``CollectiveLog`` (a list of ``Collective``
in call order). One recorder at a time per process: entering a second one (in memory or to files), or
one inside ``local_collectives``, raises ``RuntimeError``.

A ``Collective`` holds: ``op`` (canonical name: ``reduce_scatter_tensor`` also for ``reduce_scatter_single``
and ``_reduce_scatter_base``, ``all_gather_into_tensor`` also for ``all_gather_single`` and
``_all_gather_base``); ``dtype`` (the torch dtype of the first buffer this rank sends, or receives for a
``recv``; None for a barrier); ``numel`` and ``bytes`` of the buffers this rank hands to the call to send
(the input: for all_reduce / broadcast the tensor, for a list form the sum over the list, 0 for recv and
barrier), measured from the tensors passed; ``recv_bytes`` of the buffers it receives into;
``world_size`` and ``group`` (global ranks) of the process group; ``start``/``end`` in ns; ``async_op``;
``seq``; ``src``/``dst``/``tag`` for P2P; ``error`` when the call raised.

File format (version 1), one JSON object per line:
  1. ``{"kind": "meta", "format": "l3plugin-collectives", "version": 1, "rank": R, "world_size": W,
     "mesh": {"tp":..,"cp":..,"pp":..,"dp":..} | null, "groups": {"tp": [ranks], ...} | null,
     "clock": "unix_ns", "host": .., "pid": ..}`` -- mesh from ``mesh=`` or, if Megatron-Core's
     parallel_state is initialised, from it; ``groups`` lists this rank's TP/CP/PP/DP members so the
     analyser can verify the job really used the [TP, CP, PP, DP] rank order.
  2. per call: ``{"kind": "op", "op": name, "group": [global ranks of the process group], "pg": group
     name, "seq": n-th call on this channel, "bytes": size of the larger of the buffers this rank sends or
     receives, "dtype": "torch.float32" | null, "start": ns, "end": ns | null, "async": bool}``, plus
     ``"src", "dst", "tag"`` for P2P (a channel is the process group for collectives, the (group, src,
     dst, tag) stream for P2P), ``"batch": true`` for a call of a batch_isend_irecv, and ``"error"`` when
     the call raised. ``op`` is the canonical name (files written before the "dtype" field may hold the
     other names; the reader maps them all to one name). Readers ignore fields they do not know.
  3. ``{"kind": "end", "records": N}`` -- a file without it is truncated and the reader refuses it.
     It also carries "mesh"/"groups" when Megatron's parallel_state was only initialised inside.

Times: ``start`` is read just before the call from the wall clock (``time.time_ns``), which ranks on one
host share; across hosts the clock skew (with NTP, usually a millisecond or less) adds to the waits.
``end``: for a blocking call, when it returned; for an async one (``async_op=True``, isend/irecv,
batch_isend_irecv) when the returned work's ``wait()`` first returned (a batch: its last work) -- an
upper bound on completion, as callers may wait late -- or ``None`` if never waited inside the context.
The returned work is a proxy that forwards every attribute but is not a ``Work`` instance; P2POps made
inside the context must be used inside it. With CUDA/NCCL a call only enqueues a kernel: ``cuda_sync=
True`` synchronises the current stream at both timestamps so they mean "the GPU reached / finished the
collective" (slows the job: for debugging runs).

Overhead: a dictionary lookup, two clock reads and, to a file, one buffered ``json.dumps`` line per call.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from l3plugin.debug import patching
from l3plugin.debug.patching import Call, canonical, tensors
from l3plugin.debug.traces import RECORDER_FORMAT, RECORDER_VERSION
from l3plugin.mesh.shape import DIMS


@dataclass(eq=False)
class Collective:
    """One call as this rank made it (fields: module doc)."""

    op: str
    group: list
    pg: str
    dtype: object          # torch.dtype or None; str(dtype) == "torch.float32"
    numel: int
    bytes: int
    recv_bytes: int
    async_op: bool
    start: int | None = None
    end: int | None = None
    seq: int | None = None
    p2p: bool = False
    src: int | None = None
    dst: int | None = None
    tag: int = 0
    batch: bool = False
    error: str | None = None

    @property
    def world_size(self) -> int:
        return len(self.group)

    def to_json(self) -> dict:
        out = {"kind": "op", "op": self.op, "group": self.group, "pg": self.pg, "seq": self.seq,
               "bytes": max(self.bytes, self.recv_bytes), "dtype": None if self.dtype is None else str(self.dtype),
               "start": self.start, "end": self.end, "async": self.async_op}
        if self.p2p:
            out.update(src=self.src, dst=self.dst, tag=self.tag)
        if self.batch:
            out["batch"] = True
        if self.error is not None:
            out["error"] = self.error
        return out


class CollectiveLog(list):
    """The ``Collective`` records of an in-memory ``record_collectives``, in call order."""

    def of(self, op: str) -> list[Collective]:
        op = canonical(op)
        return [c for c in self if c.op == op]

    @property
    def bytes(self) -> int:
        """Bytes this rank handed to collectives and sends (measured from the tensors passed)."""
        return sum(c.bytes for c in self)


def _sizes(sent: list, received: list):
    """(dtype, numel, bytes, recv_bytes) of the tensors a call sends and receives into."""
    first = (sent or received or [None])[0]
    return (None if first is None else first.dtype, sum(int(t.numel()) for t in sent),
            sum(int(t.numel()) * int(t.element_size()) for t in sent),
            sum(int(t.numel()) * int(t.element_size()) for t in received))


class _Completion:
    """The records of one async call; they are finished when all of its works have been waited."""

    def __init__(self, recorder: "_Recorder", records: list, n_works: int):
        self.recorder, self.records, self.n_works, self.waited = recorder, records, n_works, set()

    def waited_one(self, work_id: int, error: BaseException | None = None):
        if error is not None:
            for rec in self.records:
                rec.error = f"{type(error).__name__}: {error}"
            self.recorder.finish(self)
            return
        self.waited.add(work_id)
        if len(self.waited) >= self.n_works:
            self.recorder.finish(self)


class _TimedWork:
    """Stands in for a torch.distributed Work so that we see when ``wait()`` returns."""

    __slots__ = ("_work", "_completion")

    def __init__(self, work, completion: _Completion):
        self._work, self._completion = work, completion

    def wait(self, *args, **kwargs):
        try:
            out = self._work.wait(*args, **kwargs)
        except BaseException as exc:
            self._completion.waited_one(id(self), exc)
            raise
        self._completion.waited_one(id(self))
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)

    def __repr__(self):
        return f"<recorded {self._work!r}>"


class _Recorder:
    """Turns calls into ``Collective`` records: appended to ``log`` as they start (in memory), or written
    to the trace file as they finish (``path`` given)."""

    def __init__(self, rank: int | None, cuda_sync: bool, path: str | None = None, meta: dict | None = None):
        self.rank = rank  # None until known (in memory, torch.distributed may be initialised inside)
        self.cuda_sync = cuda_sync
        self.lock = threading.Lock()
        self.seq: dict = {}
        self.groups: dict = {}        # id(group) -> (group, ranks, name, pg); the group is kept alive
        self.pending: set = set()     # async completions not yet waited
        self.count = 0
        self.closed = False
        self.log = CollectiveLog()
        self.fh = None
        if path is not None:
            self.fh = open(path, "w", encoding="utf-8")
            self.fh.write(json.dumps(meta) + "\n")

    # -- helpers ---------------------------------------------------------------------------------
    def group_info(self, group):
        """(global ranks, name, group) of a process group, or None when this rank cannot use it."""
        hit = self.groups.get(id(group))
        if hit is None or hit[0] is not group:
            import torch.distributed as dist

            try:
                pg = group if group is not None else dist.distributed_c10d._get_default_group()
                ranks = [int(r) for r in dist.get_process_group_ranks(pg)]
                name = str(getattr(pg, "group_name", "") or "")
                if self.rank is None:
                    self.rank = dist.get_rank()
            except Exception:  # not initialised, a NON_GROUP_MEMBER sentinel or a foreign object: torch says
                return None
            hit = (group, ranks, name, pg)
            self.groups[id(group)] = hit
        return hit[1], hit[2], hit[3]

    def assign_seq(self, rec: Collective):
        if rec.p2p and rec.src is None:
            rec.seq = None  # a receive from any source: its channel is unknown
            return
        key = ("p2p", rec.pg, rec.src, rec.dst, rec.tag) if rec.p2p else ("coll", rec.pg, tuple(sorted(rec.group)))
        with self.lock:
            rec.seq = self.seq.get(key, 0)
            self.seq[key] = rec.seq + 1

    def now(self) -> int:
        if self.cuda_sync:
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.current_stream().synchronize()
        return time.time_ns()

    def started(self, rec: Collective):
        with self.lock:
            if self.fh is None and not self.closed:
                self.log.append(rec)

    def write(self, rec: Collective):
        """The record is complete (or will not be): to the file; in memory it is already in the log."""
        with self.lock:
            if self.closed:
                return
            if self.fh is not None:
                self.fh.write(json.dumps(rec.to_json()) + "\n")
            self.count += 1

    def finish(self, completion: _Completion):
        end = self.now()
        with self.lock:
            if completion not in self.pending:
                return  # already written (second wait, or written as unfinished at exit)
            self.pending.discard(completion)
        for rec in completion.records:
            rec.end = end
            self.write(rec)

    def close(self, end_extra: dict):
        with self.lock:
            leftovers, self.pending = list(self.pending), set()
        for completion in leftovers:
            for rec in completion.records:
                self.write(rec)  # "end" stays None: never waited inside the context
        with self.lock:
            self.closed = True
            if self.fh is not None:
                self.fh.write(json.dumps({"kind": "end", "records": self.count, **end_extra}) + "\n")
                self.fh.close()

    # -- one call --------------------------------------------------------------------------------
    def call(self, call: Call):
        spec = call.spec
        if spec.kind == "batch":
            return self.call_batch(call)
        info = self.group_info(call.arg("group"))
        if info is None or self.rank not in info[0]:
            return call.run()
        ranks, pg_name, pg = info
        sent = [t for k in spec.inputs for t in tensors(call.arg(k))]
        received = [t for k in spec.outputs for t in tensors(call.arg(k))]
        dtype, numel, nbytes, recv_bytes = _sizes(sent, received)
        is_async = spec.always_async or bool(call.arg("async_op", False))
        rec = Collective(call.op, ranks, pg_name, dtype, numel, nbytes, recv_bytes, is_async)
        if spec.kind in ("send", "recv"):
            peer_key = "dst" if spec.kind == "send" else "src"
            peer, group_peer = call.arg(peer_key), call.arg("group_" + peer_key)
            if peer is None and group_peer is not None:
                import torch.distributed as dist

                peer = dist.get_global_rank(pg, group_peer)
            rec.p2p = True
            rec.src, rec.dst = (self.rank, peer) if spec.kind == "send" else (peer, self.rank)
            rec.tag = int(call.arg("tag", 0) or 0)
        self.assign_seq(rec)
        self.started(rec)
        rec.start = self.now()
        try:
            result = call.run()
        except BaseException as exc:
            rec.end, rec.error = self.now(), f"{type(exc).__name__}: {exc}"
            self.write(rec)
            raise
        if is_async and result is not None:
            return self.track(result, [rec])
        if not is_async:
            rec.end = self.now()
        if spec.kind == "recv" and rec.src is None and isinstance(result, int) and result >= 0:
            rec.src = result  # a blocking receive from any source returns the sender's global rank
            self.assign_seq(rec)
        self.write(rec)
        return result

    def track(self, work, records: list):
        completion = _Completion(self, records, 1)
        with self.lock:
            self.pending.add(completion)
        return _TimedWork(work, completion)

    def call_batch(self, call: Call):
        import torch.distributed.distributed_c10d as c10d

        ops = call.arg("p2p_op_list")
        records, swapped = [], []
        try:
            for op in ops:
                kind = getattr(op.op, "__name__", "")
                ranks, pg_name, _ = self.group_info(op.group)
                send = kind == "isend"
                dtype, numel, nbytes, recv_bytes = _sizes([op.tensor] if send else [], [] if send else [op.tensor])
                rec = Collective(kind, ranks, pg_name, dtype, numel, nbytes, recv_bytes, True, p2p=True,
                                 src=self.rank if send else op.peer, dst=op.peer if send else self.rank,
                                 tag=int(op.tag or 0), batch=True)
                records.append(rec)
                # The original tells sends from receives by identity (`op.op is isend`); an op built
                # before we patched holds the unpatched function, so point it at the current one.
                current = c10d.isend if send else c10d.irecv
                if op.op is not current:
                    swapped.append((op, op.op))
                    op.op = current
        except Exception:
            for op, fn in swapped:
                op.op = fn
            return call.run()  # not a list of P2POps we understand: torch will say why
        for rec in records:  # numbered only now, so a batch we could not read leaves no gaps
            self.assign_seq(rec)
            self.started(rec)
        start = self.now()
        for rec in records:
            rec.start = start
        try:
            works = call.run()
        except BaseException as exc:
            for rec in records:
                rec.end, rec.error = self.now(), f"{type(exc).__name__}: {exc}"
                self.write(rec)
            raise
        finally:
            for op, fn in swapped:
                op.op = fn
        works = list(works or [])
        if len(works) == len(records):  # gloo: one work per op
            return [self.track(w, [r]) for w, r in zip(works, records)]
        # NCCL coalesces the batch into fewer works: the batch completes when all of them are waited.
        completion = _Completion(self, records, len(works))
        with self.lock:
            self.pending.add(completion)
        return [_TimedWork(w, completion) for w in works]


def _mesh_metadata(mesh, world_size: int):
    """(sizes, this rank's groups) from ``mesh`` (MeshShape or Mesh) or from Megatron's parallel_state."""
    if mesh is not None:
        shape = getattr(mesh, "shape", mesh)
        sizes = {d: int(getattr(shape, d)) for d in DIMS}
        groups = {d: list(mesh.group_members(d)) for d in DIMS} if hasattr(mesh, "group_members") else None
    else:
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is None or not ps.model_parallel_is_initialized():
            return None, None
        try:
            import torch.distributed as dist

            sizes = {"tp": ps.get_tensor_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
                     "pp": ps.get_pipeline_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}
            pgs = {"tp": ps.get_tensor_model_parallel_group(), "cp": ps.get_context_parallel_group(),
                   "pp": ps.get_pipeline_model_parallel_group(), "dp": ps.get_data_parallel_group()}
            groups = {d: sorted(dist.get_process_group_ranks(g)) for d, g in pgs.items()}
        except Exception:  # an older parallel_state without some of these: record nothing rather than guess
            return None, None
    product = sizes["tp"] * sizes["cp"] * sizes["pp"] * sizes["dp"]
    if product != world_size:
        raise ValueError(f"mesh tp*cp*pp*dp = {product} but the world size is {world_size}")
    return sizes, groups


@contextlib.contextmanager
def record_collectives(trace_dir: str | os.PathLike | None = None, mesh=None, *, cuda_sync: bool = False,
                       extra_targets=()):
    """Record this rank's collectives and P2P calls (see the module doc).

    ``trace_dir=None``: in memory; yields a ``CollectiveLog`` (works without Megatron, and without
    torch.distributed initialised at entry). Else to ``trace_dir/rank{R}.jsonl``; yields that path.
    ``mesh``: with ``trace_dir``, a ``MeshShape`` or the ``Mesh`` from ``init_mesh`` (optional; recorded
    as metadata so ``analyze-trace`` needs no size flags). ``extra_targets``: ``[(object, attribute name,
    op name), ...]`` further cached function references to patch (``patching.py``), e.g.
    ``[(deepspeed.comm.comm.cdb, "reduce_scatter_function", "reduce_scatter_tensor"), (cdb,
    "all_gather_function", "all_gather_into_tensor")]``.
    """
    if trace_dir is not None and not isinstance(trace_dir, (str, os.PathLike)):
        raise TypeError(f"record_collectives: trace_dir must be a path or None, got {type(trace_dir).__name__} "
                        f"(pass extra_targets= by keyword)")
    if trace_dir is None and mesh is not None:
        raise ValueError("record_collectives: mesh= is metadata of trace files; it needs a trace_dir")
    extra_targets = list(extra_targets)  # read twice: checked here, patched below
    patching.check(extra_targets)  # before any side effect: a refused recorder leaves no file behind
    if trace_dir is None:
        recorder = _Recorder(None, cuda_sync)
        try:
            with patching.patched(recorder.call, extra_targets):
                yield recorder.log
        finally:
            recorder.close({})
        return

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("record_collectives needs torch.distributed to be initialised first")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sizes, groups = _mesh_metadata(mesh, world_size)
    meta = {"kind": "meta", "format": RECORDER_FORMAT, "version": RECORDER_VERSION, "rank": rank,
            "world_size": world_size, "mesh": sizes, "groups": groups, "clock": "unix_ns",
            "host": socket.gethostname(), "pid": os.getpid()}
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"rank{rank}.jsonl")
    recorder = _Recorder(rank, cuda_sync, path, meta)
    try:
        with patching.patched(recorder.call, extra_targets):
            yield path
    finally:
        late = {}
        if sizes is None:  # parallel_state may have been initialised inside the context
            with contextlib.suppress(ValueError):
                late = dict(zip(("mesh", "groups"), _mesh_metadata(None, world_size)))
        recorder.close({k: v for k, v in late.items() if v is not None})
