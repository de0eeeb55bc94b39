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

A torch-function mode that leaves the stack here is watched too (issue 56, seen with a DeepSpeed script that
even called ``destroy_process_group``; core dumps: a ``pt_gloo_runloop`` thread in ``~AsyncBarrierWork`` ->
``~ThreadLocalState`` -> ``SafePyObject`` -> ``decref`` -> ``take_gil`` -> ``pthread_exit`` -> ``std::terminate``,
the object being our ``StaleReadGuard``). Every gloo work copies the caller's thread-local state, the mode stack
included: a ``shared_ptr`` to the ``SafePyObject`` made when the mode was pushed. A collective started while the
guard is on the stack (the script's ``dist.barrier()``, DeepSpeed's own) keeps that entry alive in the worker
until the worker drops the finished work. If the exit's pop leaves the worker the last holder, the worker's drop
decrefs the guard under the GIL, and when that falls into finalization the thread is ended and the rank aborts
(``destroy_process_group`` does not help: gloo's ``shutdown`` stops no worker). So after the hooks, each mode
that left the stack is watched until its Python reference count has fallen by the entries popped (the
``SafePyObject`` freed, by us or by the worker while the GIL is free here), at most ``RELEASE_CAP`` seconds.
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
    modes = _mode_stack()
    # Each entry's SafePyObject holds one reference; counted through the list only (no other local holds a
    # mode), the same way as in _modes_let_go.
    counts = [sys.getrefcount(modes[i]) for i in range(len(modes))]
    for hook in list(_hooks) if ok else []:  # after a failed wait a hook could wait again
        try:
            hook()
        except Exception as exc:  # noqa: BLE001
            ok = False
            _say(f"{getattr(hook, '__qualname__', hook)} failed ({type(exc).__name__}: {exc})")
    if not _modes_let_go(modes, counts):
        _say("a gloo worker thread still holds a torch-function mode that left the stack "
             f"(after {RELEASE_CAP:g} s); the exit goes on")
    if ok:
        _destroy_groups()
    return ok


def _mode_stack() -> list:
    """This thread's torch-function modes, bottom first ([] when torch is not imported or cannot list them)."""
    torch = sys.modules.get("torch")
    length, at = (getattr(getattr(torch, "_C", None), name, None)
                  for name in ("_len_torch_function_stack", "_get_function_stack_at"))
    try:
        return [] if length is None or at is None else [at(i) for i in range(length())]
    except Exception:  # noqa: BLE001 - nothing raises at exit
        return []


def _modes_let_go(modes: list, counts: list) -> bool:
    """Wait (GIL free) until every mode of ``modes`` that is no longer on the stack has lost one reference per
    entry popped since ``counts`` were taken: no thread then holds a popped entry, so none decrefs it later, in
    finalization (module docstring). The references of ``modes`` itself are in both counts. A second, older
    entry of the same mode still held by a worker (pushed and popped before the exit) is not told apart."""
    now = _mode_stack()
    targets = {}  # index in modes (first occurrence) -> the count it falls to once its popped entries are freed
    for i in range(len(modes)):
        if any(modes[j] is modes[i] for j in range(i)):
            continue
        gone = sum(m is modes[i] for m in modes) - sum(m is modes[i] for m in now)
        if gone > 0:
            targets[i] = counts[i] - gone
    del now
    deadline = time.monotonic() + RELEASE_CAP
    while any(sys.getrefcount(modes[i]) > target for i, target in targets.items()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)  # the GIL is free meanwhile: the worker that holds the entry takes it to let go
    return True


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
