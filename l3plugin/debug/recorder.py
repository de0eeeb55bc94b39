"""A light collective/P2P recorder for jobs that run without the PyTorch profiler.

    with l3plugin.debug.record_collectives("traces/step100", mesh=mesh):
        train_step()
    # then, on any machine:  l3plugin analyze-trace traces/step100

Inside the context the torch.distributed collectives and P2P calls listed in ``OPS`` (all_reduce,
all_gather(_into_tensor/_single), reduce_scatter(_tensor/_single), broadcast, all_to_all(_single), barrier,
send, recv, isend, irecv, batch_isend_irecv, and the legacy _base names) are replaced by thin wrappers
that write one JSON line per call to ``trace_dir/rank{R}.jsonl``; on exit, also on an exception, the
originals are put back.

What is seen: calls made through the names ``torch.distributed.X`` or ``torch.distributed.
distributed_c10d.X`` while the context is active (Megatron-Core and DeepSpeed call them that way). Not
seen: code that bound a direct reference before entering (``from torch.distributed import all_reduce`` at
import time), functional collectives / DTensor, and direct ProcessGroup method calls. A collective made
*inside* another wrapped call (``send`` calls ``isend``) is recorded once, as the outer call.

File format (version 1), one JSON object per line:
  1. ``{"kind": "meta", "format": "l3plugin-collectives", "version": 1, "rank": R, "world_size": W,
     "mesh": {"tp":..,"cp":..,"pp":..,"dp":..} | null, "groups": {"tp": [ranks], ...} | null,
     "clock": "unix_ns", "host": .., "pid": ..}`` -- mesh from ``mesh=`` or, if Megatron-Core's
     parallel_state is initialised, from it; ``groups`` lists this rank's TP/CP/PP/DP members so the
     analyser can verify the job really used the [TP, CP, PP, DP] rank order.
  2. per call: ``{"kind": "op", "op": name, "group": [global ranks of the process group], "pg": group
     name, "seq": n-th call on this channel, "bytes": size of the larger of the buffers this rank sends or
     receives, "start": ns, "end": ns | null, "async": bool}``, plus ``"src", "dst", "tag"`` for P2P
     (a channel is the process group for collectives, the (group, src, dst, tag) stream for P2P), and
     ``"error"`` when the call raised.
  3. ``{"kind": "end", "records": N}`` -- a file without it is truncated and the reader refuses it.
     It also carries "mesh"/"groups" when Megatron's parallel_state was only initialised inside.

Times: ``start`` is read just before the call from the wall clock (``time.time_ns``), which ranks on one
host share; across hosts the clock skew (with NTP, usually a millisecond or less) adds to the waits.
``end``: for a blocking call, when it returned; for an async one (``async_op=True``, isend/irecv,
batch_isend_irecv) when the returned work's ``wait()`` first returned (a batch: its last work) -- an
upper bound on completion, as callers may wait late -- or ``null`` if never waited inside the context.
The returned work is a proxy that forwards every attribute but is not a ``Work`` instance; P2POps made
inside the context must be used inside it. With CUDA/NCCL a call only enqueues a kernel: ``cuda_sync=
True`` synchronises the current stream at both timestamps so they mean "the GPU reached / finished the
collective" (slows the job: for debugging runs).

Overhead: a dictionary lookup, two clock reads and one buffered ``json.dumps`` line per call.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from l3plugin.debug.traces import RECORDER_FORMAT, RECORDER_VERSION
from l3plugin.mesh import DIMS


@dataclass(frozen=True)
class _OpSpec:
    kind: str                  # "coll", "send", "recv" or "batch"
    inputs: tuple = ()         # argument names of the buffers this rank sends
    outputs: tuple = ()        # ... and receives into
    always_async: bool = False


_GATHER = _OpSpec("coll", ("input_tensor",), ("output_tensor",))
_SCATTER = _OpSpec("coll", ("input",), ("output",))
OPS = {
    "all_reduce": _OpSpec("coll", ("tensor",), ("tensor",)),
    "all_gather": _OpSpec("coll", ("tensor",), ("tensor_list",)),
    "all_gather_into_tensor": _GATHER, "all_gather_single": _GATHER, "_all_gather_base": _GATHER,
    "reduce_scatter": _OpSpec("coll", ("input_list",), ("output",)),
    "reduce_scatter_tensor": _SCATTER, "reduce_scatter_single": _SCATTER, "_reduce_scatter_base": _SCATTER,
    "broadcast": _OpSpec("coll", ("tensor",), ("tensor",)),
    "all_to_all": _OpSpec("coll", ("input_tensor_list",), ("output_tensor_list",)),
    "all_to_all_single": _SCATTER,
    "barrier": _OpSpec("coll"),
    "send": _OpSpec("send", ("tensor",)),
    "recv": _OpSpec("recv", (), ("tensor",)),
    "isend": _OpSpec("send", ("tensor",), (), always_async=True),
    "irecv": _OpSpec("recv", (), ("tensor",), always_async=True),
    "batch_isend_irecv": _OpSpec("batch"),
}


class _Depth(threading.local):
    value = 0  # > 0 while this thread is inside a recorded call: nested calls are not recorded again


_depth = _Depth()
_active: "_Recorder | None" = None
_state_lock = threading.Lock()


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    try:
        return int(x.numel()) * int(x.element_size())
    except AttributeError:
        return 0


class _Completion:
    """The records of one async call; they are written when all of its works have been waited."""

    def __init__(self, recorder: "_Recorder", records: list, n_works: int):
        self.recorder, self.records, self.n_works, self.waited = recorder, records, n_works, set()

    def waited_one(self, work_id: int, error: BaseException | None = None):
        if error is not None:
            for rec in self.records:
                rec["error"] = f"{type(error).__name__}: {error}"
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
    def __init__(self, path: str, meta: dict, cuda_sync: bool):
        self.rank = meta["rank"]
        self.cuda_sync = cuda_sync
        self.lock = threading.Lock()
        self.seq: dict = {}
        self.groups: dict = {}        # id(group) -> (group, ranks, name); the group is kept alive
        self.pending: set = set()     # async completions not yet waited
        self.count = 0
        self.closed = False
        self.fh = open(path, "w", encoding="utf-8")
        self.fh.write(json.dumps(meta) + "\n")

    # -- helpers ---------------------------------------------------------------------------------
    def group_info(self, group):
        """(global ranks, name) of a process group, or None when this rank cannot use it."""
        hit = self.groups.get(id(group))
        if hit is None or hit[0] is not group:
            import torch.distributed as dist

            try:
                pg = group if group is not None else dist.distributed_c10d._get_default_group()
                ranks = [int(r) for r in dist.get_process_group_ranks(pg)]
                name = str(getattr(pg, "group_name", "") or "")
            except Exception:  # a NON_GROUP_MEMBER sentinel or a foreign object: let torch handle it
                return None
            hit = (group, ranks, name, pg)
            self.groups[id(group)] = hit
        return hit[1], hit[2], hit[3]

    def assign_seq(self, rec: dict):
        if rec.get("src", 0) is None:
            rec["seq"] = None  # a receive from any source: its channel is unknown
            return
        if "dst" in rec:
            key = ("p2p", rec["pg"], rec["src"], rec["dst"], rec["tag"])
        else:
            key = ("coll", rec["pg"], tuple(sorted(rec["group"])))
        with self.lock:
            rec["seq"] = self.seq.get(key, 0)
            self.seq[key] = rec["seq"] + 1

    def now(self) -> int:
        if self.cuda_sync:
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.current_stream().synchronize()
        return time.time_ns()

    def write(self, rec: dict):
        with self.lock:
            if self.closed:
                return
            self.fh.write(json.dumps(rec) + "\n")
            self.count += 1

    def finish(self, completion: _Completion):
        end = self.now()
        with self.lock:
            if completion not in self.pending:
                return  # already written (second wait, or written as unfinished at exit)
            self.pending.discard(completion)
        for rec in completion.records:
            rec["end"] = end
            self.write(rec)

    def close(self, end_extra: dict):
        with self.lock:
            leftovers, self.pending = list(self.pending), set()
        for completion in leftovers:
            for rec in completion.records:
                self.write(rec)  # "end" stays None: never waited inside the context
        with self.lock:
            self.fh.write(json.dumps({"kind": "end", "records": self.count, **end_extra}) + "\n")
            self.closed = True
            self.fh.close()

    # -- one call --------------------------------------------------------------------------------
    def call(self, name: str, spec: _OpSpec, positions: dict, orig, args, kwargs):
        if spec.kind == "batch":
            return self.call_batch(orig, args, kwargs)

        def arg(key, default=None):
            i = positions.get(key)
            return args[i] if i is not None and i < len(args) else kwargs.get(key, default)

        info = self.group_info(arg("group"))
        if info is None or self.rank not in info[0]:
            return orig(*args, **kwargs)
        ranks, pg_name, pg = info
        rec = {"kind": "op", "op": name, "group": ranks, "pg": pg_name}
        if spec.kind in ("send", "recv"):
            peer_key = "dst" if spec.kind == "send" else "src"
            peer, group_peer = arg(peer_key), arg("group_" + peer_key)
            if peer is None and group_peer is not None:
                import torch.distributed as dist

                peer = dist.get_global_rank(pg, group_peer)
            rec["src"], rec["dst"] = (self.rank, peer) if spec.kind == "send" else (peer, self.rank)
            rec["tag"] = int(arg("tag", 0) or 0)
        rec["bytes"] = max(sum(_nbytes(arg(k)) for k in spec.inputs), sum(_nbytes(arg(k)) for k in spec.outputs))
        is_async = spec.always_async or bool(arg("async_op", False))
        rec["async"] = is_async
        self.assign_seq(rec)
        rec["start"], rec["end"] = self.now(), None
        try:
            result = orig(*args, **kwargs)
        except BaseException as exc:
            rec["end"], rec["error"] = self.now(), f"{type(exc).__name__}: {exc}"
            self.write(rec)
            raise
        if is_async and result is not None:
            return self.track(result, [rec])
        if not is_async:
            rec["end"] = self.now()
        if spec.kind == "recv" and rec["src"] is None and isinstance(result, int) and result >= 0:
            rec["src"] = result  # a blocking receive from any source returns the sender's global rank
            self.assign_seq(rec)
        self.write(rec)
        return result

    def track(self, work, records: list):
        completion = _Completion(self, records, 1)
        with self.lock:
            self.pending.add(completion)
        return _TimedWork(work, completion)

    def call_batch(self, orig, args, kwargs):
        import torch.distributed.distributed_c10d as c10d

        ops = args[0] if args else kwargs.get("p2p_op_list")
        records, swapped = [], []
        try:
            for op in ops:
                kind = getattr(op.op, "__name__", "")
                ranks, pg_name, _ = self.group_info(op.group)
                send = kind == "isend"
                rec = {"kind": "op", "op": kind, "group": ranks, "pg": pg_name,
                       "src": self.rank if send else op.peer, "dst": op.peer if send else self.rank,
                       "tag": int(op.tag or 0), "bytes": _nbytes(op.tensor), "async": True}
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
            return orig(*args, **kwargs)  # not a list of P2POps we understand: torch will say why
        for rec in records:  # numbered only now, so a batch we could not read leaves no gaps
            self.assign_seq(rec)
        start = self.now()
        for rec in records:
            rec["start"], rec["end"], rec["batch"] = start, None, True
        try:
            works = orig(*args, **kwargs)
        except BaseException as exc:
            for rec in records:
                rec["end"], rec["error"] = self.now(), f"{type(exc).__name__}: {exc}"
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


def _make_wrapper(name: str, orig):
    spec = OPS[name]
    try:
        positions = {p: i for i, p in enumerate(inspect.signature(orig).parameters)}
    except (TypeError, ValueError):
        positions = {}

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        recorder = _active
        if recorder is None or _depth.value:
            return orig(*args, **kwargs)
        _depth.value += 1
        try:
            return recorder.call(name, spec, positions, orig, args, kwargs)
        finally:
            _depth.value -= 1

    wrapper._l3plugin_original = orig
    return wrapper


def _patch():
    """Replace the names on torch.distributed and its c10d module; returns what to put back."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    saved, wrappers = [], {}
    for name in OPS:
        for module in (dist, c10d):
            orig = getattr(module, name, None)
            if orig is None:
                continue
            # One wrapper per original, so `dist.isend is c10d.isend` stays true (batch_isend_irecv
            # and P2POp compare these functions by identity).
            if id(orig) not in wrappers:
                wrappers[id(orig)] = _make_wrapper(name, orig)
            wrapper = wrappers[id(orig)]
            saved.append((module, name, orig))
            setattr(module, name, wrapper)
    return saved


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
def record_collectives(trace_dir: str, mesh=None, *, cuda_sync: bool = False):
    """Record this rank's collectives and P2P calls to ``trace_dir/rank{R}.jsonl`` (see module doc).

    ``mesh``: a ``MeshShape`` or the ``Mesh`` from ``init_mesh`` (optional; recorded as metadata so
    ``analyze-trace`` needs no size flags). Yields the path of the trace file.
    """
    global _active
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
    with _state_lock:
        if _active is not None:
            raise RuntimeError("record_collectives is already active in this process; it does not nest")
        recorder = _Recorder(path, meta, cuda_sync)
        try:
            saved = _patch()
        except BaseException:
            recorder.close({})
            raise
        _active = recorder
    try:
        yield path
    finally:
        with _state_lock:
            _active = None
            for module, name, orig in reversed(saved):
                setattr(module, name, orig)
        late = {}
        if sizes is None:  # parallel_state may have been initialised inside the context
            with contextlib.suppress(ValueError):
                late = dict(zip(("mesh", "groups"), _mesh_metadata(None, world_size)))
        recorder.close({k: v for k, v in late.items() if v is not None})
