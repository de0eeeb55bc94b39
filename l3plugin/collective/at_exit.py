"""What l3plugin leaves running when a script ends without ``destroy_process_group``: finished at exit.

Why a script could die after its work was done ("terminate called without an active exception", SIGABRT):
a gloo collective runs in one of the process group's C++ worker threads, which holds the tensors it was handed
until it lets go of the work, a moment after the waiting thread saw it complete. A tensor created in Python
keeps its Python object alive while C++ holds it, so that last release takes the GIL (torch 2.13,
``c10::intrusive_ptr``: a tensor's count going from 2 to 1 decrefs its Python object). Python 3.11 ends a
foreign thread that takes the GIL once finalization has begun (``pthread_exit``), and unwinding out of
that ``noexcept`` release calls ``std::terminate``. So a collective that completes or is released in the last
moments of the interpreter can abort the rank. Any script has such a window after its last collective (stock
DeepSpeed too, rarely); l3plugin made it wider: the parameter all-gathers the ZeRO step leaves for the next
forward (``overlap_param_gather``) are still running, and the checkpoint code's agreement all-gather is often a
script's very last collective.

Here, at exit (``atexit``, while the interpreter is still whole): every collective started through
``comm`` and not waited is waited, with a bound (``exit_bound``: the wait bound, at most ``EXIT_CAP``
seconds; a peer that died fails at once, one that hangs is given up on after the bound, never blocking the
exit longer); then the tensors handed to recent collectives are watched until the worker threads have let
them go (the GIL released meanwhile, so those releases happen now, not during finalization); then the hooks
rooms registered run (the ZeRO parameter guard leaves torch's mode stack), and the groups l3plugin created
are destroyed, unless a wait failed (a destroy could block on the stuck collective). A problem is one line on
stderr; nothing here raises at exit.
"""

from __future__ import annotations

import atexit
import collections
import sys
import time
import weakref

from l3plugin.collective.waits import resolve_timeout

EXIT_CAP = 30.0  # seconds: the most the exit waits for l3plugin's collectives, whatever the wait bound
RELEASE_CAP = 2.0  # seconds: the most it watches for worker threads to let go of tensors (normally microseconds)
RECENT = 64  # tensors of the latest collectives watched at exit (earlier ones were let go long before)

_pending: "weakref.WeakSet" = weakref.WeakSet()  # started collectives (comm.InFlight) not yet waited
_recent: collections.deque = collections.deque(maxlen=RECENT)  # (weak tensor, its use count before the start)
_hooks: list = []  # callables run at exit after the waits
_groups: list = []  # process groups l3plugin created, destroyed at exit
_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        atexit.register(finish)
        _registered = True


def use_counts(*tensors) -> list:
    """Taken just before ``tensors`` are handed to an async collective: (tensor, C++ references to it now)."""
    return [(t, t._use_count()) for t in tensors]


def track(flight, handed=()) -> None:
    """``flight`` (a started ``comm.InFlight``) is pending until ``waited(flight)``; ``handed`` (``use_counts``
    before its start) are watched at exit until the backend's worker thread has let them go."""
    _register()
    _pending.add(flight)
    _recent.extend((weakref.ref(t), count) for t, count in handed)


def waited(flight) -> None:
    _pending.discard(flight)


def on_exit(hook) -> None:
    """Run ``hook()`` at exit, after l3plugin's collectives are finished (once per hook)."""
    _register()
    if hook not in _hooks:
        _hooks.append(hook)


def destroy_at_exit(group) -> None:
    """Destroy ``group`` (made by l3plugin) at exit, if still alive then."""
    _register()
    if not any(g is group for g in _groups):
        _groups.append(group)


def exit_bound(timeout=None) -> float:
    return min(resolve_timeout(timeout), EXIT_CAP)


def _say(message: str) -> None:
    print(f"l3plugin at exit: {message}", file=sys.stderr, flush=True)


def _released(entry) -> bool:
    tensor = entry[0]()
    return tensor is None or tensor._use_count() <= entry[1]


def finish(timeout=None) -> bool:
    """Finish what l3plugin left running (module docstring); True if everything finished. Registered with
    ``atexit`` on first use; callable earlier (tests, a script that wants it before its own exit code)."""
    deadline = time.monotonic() + exit_bound(timeout)
    ok = True
    for flight in list(_pending):
        if not flight.works:
            continue
        try:
            flight.wait(max(0.001, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - reported, never raised at exit
            ok = False
            _say(f"{flight.description or 'a collective'} did not finish ({type(exc).__name__}: "
                 f"{str(exc).splitlines()[0]})")
            break  # one failed wait means the peers are gone or stuck: the others would fail the same way
    _pending.clear()
    if ok:
        release_deadline = time.monotonic() + RELEASE_CAP
        while not all(_released(entry) for entry in _recent) and time.monotonic() < release_deadline:
            time.sleep(0.001)  # the GIL is free meanwhile: the worker threads take it to let go of tensors
    _recent.clear()
    for hook in list(_hooks) if ok else []:  # after a failed wait a hook could wait again
        try:
            hook()
        except Exception as exc:  # noqa: BLE001
            ok = False
            _say(f"{getattr(hook, '__qualname__', hook)} failed ({type(exc).__name__}: {exc})")
    if ok:
        _destroy_groups()
    return ok


def _destroy_groups() -> None:
    import torch.distributed as dist

    groups, _groups[:] = list(_groups), []
    if not dist.is_initialized():
        return
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):
            pass  # destroyed already (by the script, or with the whole world)
