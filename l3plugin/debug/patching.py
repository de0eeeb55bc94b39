"""The one place that replaces torch.distributed collectives: the patch list, the wrappers, and
``local_collectives`` (every collective replaced by a local copy, for benchmarks).

Two users share the machinery: ``record_collectives`` (recorder.py) observes each call and runs it;
``local_collectives`` (below) runs a local stand-in instead of communicating. Only one of them can be
active in a process at a time (entering a second raises ``RuntimeError``): the wrappers would otherwise
have to decide which of them owns a call, and a recorder nested in another would record half a step.

What is patched: the names in ``OPS`` on ``torch.distributed`` and ``torch.distributed.distributed_c10d``
(Megatron-Core and DeepSpeed call them that way; set COLLECTIVES, declared below ``collective_wrapper``), plus
``extra_targets``: ``[(object, attribute name,
op name), ...]`` for libraries that cached a function reference before we patched, e.g. DeepSpeed's
``deepspeed.comm.comm.cdb.reduce_scatter_function`` / ``all_gather_function`` (op names
``"reduce_scatter_tensor"`` / ``"all_gather_into_tensor"``). An extra target whose value is ``None``
(DeepSpeed's way of saying "this torch has no such function") is left alone. On exit, also on an
exception, every original is put back.

Not seen: references bound elsewhere before entering (``from torch.distributed import all_reduce`` at
import time), functional collectives / DTensor, direct ProcessGroup method calls. A collective made
*inside* another wrapped call (``send`` calls ``isend``, ``reduce_scatter_tensor`` calls
``reduce_scatter_single`` in torch >= 2.13) is handled once, as the outer call.

Op names are canonical, whatever the torch version calls the function: ``reduce_scatter_single`` and
``_reduce_scatter_base`` are ``reduce_scatter_tensor``; ``all_gather_single`` and ``_all_gather_base`` are
``all_gather_into_tensor``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from dataclasses import dataclass

from l3plugin.upstream.patchset import Patch, PatchSet


@dataclass(frozen=True)
class _OpSpec:
    kind: str                  # "coll", "send", "recv" or "batch"
    inputs: tuple = ()         # argument names of the buffers this rank sends
    outputs: tuple = ()        # ... and receives into
    always_async: bool = False


_GATHER = _OpSpec("coll", ("input_tensor",), ("output_tensor",))
_SCATTER = _OpSpec("coll", ("input",), ("output",))
_IN_PLACE = _OpSpec("coll", ("tensor",), ("tensor",))
OPS = {
    "all_reduce": _IN_PLACE,
    "all_reduce_coalesced": _OpSpec("coll", ("tensors",), ("tensors",)),
    "reduce": _IN_PLACE,
    "broadcast": _IN_PLACE,
    "all_gather": _OpSpec("coll", ("tensor",), ("tensor_list",)),
    "all_gather_into_tensor": _GATHER, "all_gather_single": _GATHER, "_all_gather_base": _GATHER,
    "reduce_scatter": _OpSpec("coll", ("input_list",), ("output",)),
    "reduce_scatter_tensor": _SCATTER, "reduce_scatter_single": _SCATTER, "_reduce_scatter_base": _SCATTER,
    "all_to_all": _OpSpec("coll", ("input_tensor_list",), ("output_tensor_list",)),
    "all_to_all_single": _SCATTER,
    "barrier": _OpSpec("coll"),
    "send": _OpSpec("send", ("tensor",)),
    "recv": _OpSpec("recv", (), ("tensor",)),
    "isend": _OpSpec("send", ("tensor",), (), always_async=True),
    "irecv": _OpSpec("recv", (), ("tensor",), always_async=True),
    "batch_isend_irecv": _OpSpec("batch"),
}
CANONICAL = {"reduce_scatter_single": "reduce_scatter_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
             "all_gather_single": "all_gather_into_tensor", "_all_gather_base": "all_gather_into_tensor"}


def canonical(name: str) -> str:
    return CANONICAL.get(name, name)


def tensors(x):
    """The tensors in an argument (a tensor, a list of them, or anything else: none)."""
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in tensors(item)]
    return [x] if hasattr(x, "numel") and hasattr(x, "element_size") else []


class Call:
    """One intercepted call, as a handler sees it."""

    __slots__ = ("op", "spec", "orig", "args", "kwargs", "_positions")

    def __init__(self, op, spec, positions, orig, args, kwargs):
        self.op, self.spec, self._positions, self.orig, self.args, self.kwargs = op, spec, positions, orig, args, kwargs

    def arg(self, key: str, default=None):
        i = self._positions.get(key)
        return self.args[i] if i is not None and i < len(self.args) else self.kwargs.get(key, default)

    def run(self):
        return self.orig(*self.args, **self.kwargs)


class _Depth(threading.local):
    value = 0  # > 0 while this thread is inside a handled call: nested calls go straight to torch


_depth = _Depth()
_active = None          # the handler of the active context: a function of one Call
_state_lock = threading.Lock()


def _make_wrapper(name: str, orig):
    spec, op = OPS[name], canonical(name)
    try:
        positions = {p: i for i, p in enumerate(inspect.signature(orig).parameters)}
    except (TypeError, ValueError):
        positions = {}

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        handler = _active
        # A reference kept past the context's exit (or a nested call) runs the original.
        if handler is None or _depth.value:
            return orig(*args, **kwargs)
        _depth.value += 1
        try:
            return handler(Call(op, spec, positions, orig, args, kwargs))
        finally:
            _depth.value -= 1

    wrapper._l3plugin_original = orig
    return wrapper


def check(extra_targets=()):
    """Raise what ``patched`` would raise at entry (call it before creating side effects)."""
    _check_inactive()
    _targets(extra_targets, ())


def _check_inactive():
    if _active is not None:
        raise RuntimeError("record_collectives or local_collectives is already active in this process; "
                           "they do not nest")


def _targets(extra_targets, kinds):
    """The extra targets of ``kinds``, checked."""
    targets = []
    for target in extra_targets:
        obj, attr, op = target
        if op not in OPS:
            raise ValueError(f"extra target {target!r}: unknown op {op!r} (one of {sorted(OPS)})")
        if not hasattr(obj, attr):
            raise AttributeError(f"extra target {target!r}: {obj!r} has no attribute {attr!r}")
        targets.append((obj, attr, op))
    return [t for t in targets if OPS[t[2]].kind in kinds]


_wrappers: dict = {}  # id(original) -> its wrapper, while a context is active


def collective_wrapper(orig, op: str):
    """The wrapper of ``orig`` (the registry's factory): one per original, so `dist.isend is c10d.isend`
    stays true (batch_isend_irecv and P2POp compare these functions by identity)."""
    if hasattr(orig, "_l3plugin_original"):  # already wrapped (an extra target naming a patched function)
        return orig
    if id(orig) not in _wrappers:
        _wrappers[id(orig)] = _make_wrapper(op, orig)
    return _wrappers[id(orig)]


COLLECTIVES = PatchSet("l3plugin.debug (record_collectives, local_collectives)", "torch", ">=2.13", [
    Patch(module, op, collective_wrapper, wraps=True, optional=True,
          why="while a recorder or the local stand-ins are active, each call goes to them (Megatron-Core and "
              "DeepSpeed call these functions through both modules)")
    for module in ("torch.distributed", "torch.distributed.distributed_c10d") for op in OPS])


@contextlib.contextmanager
def patched(handler, extra_targets=(), kinds=("coll", "send", "recv", "batch")):
    """Route every call of the patched functions whose op kind is in ``kinds`` to ``handler(Call)``."""
    global _active
    extras = _targets(extra_targets, kinds)
    with _state_lock:
        _check_inactive()
        try:
            COLLECTIVES.apply(lambda patch: OPS[patch.attribute].kind in kinds)
            for obj, attr, op in extras:
                if getattr(obj, attr) is not None:  # None: DeepSpeed's "this torch has no such function"
                    COLLECTIVES.apply_on(obj, attr, collective_wrapper, op)
        except BaseException:
            _restore()
            raise
        _active = handler
    try:
        yield
    finally:
        with _state_lock:
            _active = None
            _restore()


def _restore():
    COLLECTIVES.undo()
    _wrappers.clear()


# -- local stand-ins -------------------------------------------------------------------------------------

class DoneWork:
    """What an async local collective returns: a work that has already completed."""

    def __init__(self, outputs: list):
        self._outputs = outputs

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self):
        pass

    def result(self) -> list:
        return self._outputs

    def get_future(self):
        import torch

        future = torch.futures.Future()
        future.set_result(self._outputs)
        return future


def _group_rank(group) -> int:
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0  # one process, no process group: it is rank 0 of everything
    return dist.get_rank(group)


def _local_call(call: Call):
    """Do ``call`` as if every rank of the group held this rank's data, without communicating."""
    op, arg = call.op, call.arg
    outputs = [t for key in call.spec.outputs for t in tensors(arg(key))]
    rank = _group_rank(arg("group"))
    if rank >= 0:  # torch makes a collective on a group this rank is not in a no-op
        if op == "reduce_scatter_tensor":
            out = arg("output")
            n = out.numel()
            out.copy_(arg("input").reshape(-1)[rank * n:(rank + 1) * n].view(out.shape))
        elif op == "reduce_scatter":
            arg("output").copy_(arg("input_list")[rank])
        elif op == "all_gather_into_tensor":
            # DeepSpeed gathers in place (the input is this rank's slice of the output): copy it out first.
            source = arg("input_tensor").clone()
            arg("output_tensor").view(-1, source.numel()).copy_(source.reshape(1, -1))
        elif op == "all_gather":
            for out in arg("tensor_list"):
                out.copy_(arg("tensor"))
        elif op == "all_to_all_single":
            out, source = arg("output"), arg("input")
            if out.numel() == source.numel():  # uneven splits: the output is left as it is
                out.copy_(source.reshape(out.shape))
        elif op == "all_to_all":
            for out, source in zip(arg("output_tensor_list"), arg("input_tensor_list")):
                if out.numel() == source.numel():
                    out.copy_(source.reshape(out.shape))
        elif op in ("recv", "irecv"):  # only with p2p=True: the peer's data never comes; zeros stand in
            arg("tensor").zero_()
        # all_reduce, all_reduce_coalesced, reduce, broadcast, barrier: the tensors stay as they are;
        # send, isend: nothing leaves.
    if call.spec.always_async:
        return DoneWork(outputs)
    if op == "recv":
        return arg("src")
    return DoneWork(outputs) if arg("async_op", False) else None


@contextlib.contextmanager
def local_collectives(extra_targets=(), p2p: bool = False):
    """Replace every collective by a local copy with no communication, for "exposed communication" benchmarks.

        with local_collectives(extra_targets):
            t_local = time_a_step()      # step time minus this = the communication the step exposes

    Inside, as if every rank of the group held this rank's data (results are wrong for training, the
    memory traffic and shapes are right):
      * ``all_reduce``, ``all_reduce_coalesced``, ``reduce``, ``broadcast``, ``barrier``: no-op, tensors
        left as they are;
      * ``reduce_scatter_tensor`` (``_single``, ``_base``): ``output.copy_(`` this rank's slice of the
        input ``)``; list form ``reduce_scatter``: ``output.copy_(input_list[rank])``;
      * ``all_gather_into_tensor`` (``_single``, ``_base``): the input copied into every slice of the
        output; list form ``all_gather``: into every tensor of the list;
      * ``all_to_all(_single)``: each input copied to the output of the same index (equal sizes only; with
        uneven splits the output is left as it is).
    With ``async_op=True`` a call returns a ``DoneWork`` (``wait(timeout=None)`` -> True,
    ``is_completed()`` -> True, ``get_future()`` already set). Nothing blocks, so it works when only
    some ranks (or a single process without torch.distributed initialised) take part. The rank used for
    slicing is the rank within the call's group.

    P2P (send, recv, isend, irecv, batch_isend_irecv) is NOT replaced unless ``p2p=True``: it still goes to
    the backend, so a pipeline-parallel step keeps its pipeline communication. With ``p2p=True`` (for code
    that builds collectives from point-to-point messages, like l3plugin's ZeRO reduce-scatter on gloo) sends
    do nothing and receives fill their buffer with zeros; batch_isend_irecv is still not replaced.
    ``extra_targets``: as in the module doc. Cannot be nested with ``record_collectives``.
    """
    kinds = ("coll", "send", "recv") if p2p else ("coll",)
    with patched(_local_call, extra_targets, kinds=kinds):
        yield
